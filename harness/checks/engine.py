"""The engine checks: an engine session's evidence judged after every step.

After every step, in the registry's order:

  contract     the engine contract's fixed points and the side-effect guard (the session's)
  I1           every target forward of the step is one rectangular batch (`checks.i1`); idle
               rows that attend nothing are allowed (`IDLE_ROW_RULES`)
  I2           every row of those forwards attends exactly one live request's own tokens at
               positions 0, 1, 2, ...; its first input is that request's next token (idle
               rows, attending the pad token only, excepted)
  equivalence  each request's tokens so far are a prefix of its oracle output (finished ones
               equal to it: EOS or max_new_tokens)
  liveness     a request waits at most the declared `max_wait_steps` for its first token and
               between two emissions while no more than `max_batch_size` requests are
               unfinished; every request finishes when the engine is drained

Rows are bound to requests by content: a row's candidates are the requests whose history it
holds longest (`checks.rows.common_prefixes`, as for a decoder's rows); requests that share a
history (duplicate prompts) are told apart by progress, each row preferring the request whose
previous call it continues and whose committed length is nearest its past, then matched one to
one (`bind_rows`); where they cannot be told apart, either binding judges the same. On a tiny
real model (float64) the past slots show K/V: a row's past slot holds entry i of a request when
its K/V equal that request's batch-size-1 entry i within the dtype's tolerance (`EngineKV`,
reading the session's `KVReferences`).

A failure carries its diagnosis (`EngineDiagnosis`): the first violated check and rule, the
engine step, target call, request, row and slot, and the paper's signature, mapped from the
first violation by the registry as a decoder run's is. Every violation notes its step in
`evidence["step"]`, so `diagnose_engine(violations, reproducer)` rebuilds it after a `replay`.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specaudit.checks.equivalence import margin_witness, tie_aware
from specaudit.checks.i1 import i1_call_violations
from specaudit.checks.registry import alone_signature, check_named
from specaudit.checks.rows import UNKNOWN, Observation, common_prefixes, flat_cache, observe
from specaudit.contracts.case import ENVELOPE_FORMAT
from specaudit.contracts.violation import Violation, render
from specaudit.numerics.tolerance import DTYPES, KV_TOLERANCE
from specaudit.running.engine_session import DTYPE, EngineSession, KVReferences, Request, Stream
from specaudit.running.instrument import CallRecord

IDLE_ROW_RULES = frozenset({"row-attends-nothing"})
"""I1 rules an engine may break on purpose: a fixed-size engine runs idle rows (empty slots,
CUDA-graph batches) that attend nothing, or only the pad token (`EngineJudge.idle`). Such a
row is bound to no request; an engine that used its output would emit a wrong token
(equivalence) or starve its request (liveness)."""


@dataclass(frozen=True)
class RowRead:
    """One row of a target call: what it attends, and the requests its content cannot tell apart."""

    row: int
    length: int  # attended entries, past then current
    past: int
    tokens: list[int]
    positions: list[int]
    slots: list[int]
    stream: Stream
    matched: int  # the longest prefix of a tracked request's history the row holds (0: none)
    candidates: tuple[int, ...]  # the requests holding that prefix, most likely first


def bind_rows(reads: list[RowRead], eligible: set[int]) -> list[tuple[RowRead, int, int]]:
    """(read, request, holder row) for each row: rows matched one to one with live requests
    among their candidates (augmenting paths, each row trying its candidates in order), so two
    requests with one history (duplicate prompts) take one row each, whichever way round: their
    histories are identical, so either binding judges the same. A row left over holds a retired
    candidate if it can, else its first candidate again (held by `holder`: a duplicate row)."""
    by_row = {read.row: read for read in reads}
    owner: dict[int, int] = {}  # request -> row

    def augment(read: RowRead, seen: set[int]) -> bool:
        for r in read.candidates:
            if r in eligible and r not in seen:
                seen.add(r)
                if r not in owner or augment(by_row[owner[r]], seen):
                    owner[r] = read.row
                    return True
        return False

    for read in reads:
        augment(read, set())
    bound = {row: r for r, row in owner.items()}
    for read in reads:
        if read.row not in bound:
            retired = [r for r in read.candidates if r not in eligible and r not in owner]
            request = retired[0] if retired else read.candidates[0]
            owner.setdefault(request, read.row)
            bound[read.row] = request
    return [(read, bound[read.row], owner[bound[read.row]]) for read in reads]


class EngineKV:
    """I2's reader for a tiny real target, whose past slots show K/V, not (token, position).

    A row's past slot holds a request's entry at stream index i when its K/V equal entry i of
    that request's batch-size-1 run (`KVReferences`, made by the session) within the dtype's
    fixed tolerance (float64 here, so a wrong token, position or request is off by orders of
    magnitude more).
    """

    def __init__(self, references: KVReferences) -> None:
        self.rtol, self.atol = KV_TOLERANCE[DTYPES[DTYPE]]
        self.tolerance = f"tolerance rtol {self.rtol:g}, atol {self.atol:g}"
        self.work = DTYPES[DTYPE]
        self.references = references
        self._call: tuple[int, torch.Tensor] | None = None

    def flat(self, call: CallRecord) -> torch.Tensor:
        """[B, S, F] the call's cache after it (kept for the call's other rows)."""
        if self._call is None or self._call[0] != call.order:
            self._call = (call.order, flat_cache(call.cache_after, self.work))
        return self._call[1]

    def entries(self, call: CallRecord, row: int, slots: list[int]) -> torch.Tensor | None:
        """[L, F] the K/V the call left in `slots` of `row` (None: a cache-free call)."""
        if not call.cache_after:
            return None
        return self.flat(call)[row, torch.tensor(slots, dtype=torch.long)]

    def same(self, found: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
        """[...] whether entries [..., F] equal `expected` [..., F] within the tolerance."""
        return torch.isclose(found, expected, rtol=self.rtol, atol=self.atol).all(-1)

    def prefixes(self, call: CallRecord, obs: Observation, refs: list[torch.Tensor]) -> torch.Tensor:
        """[B, R] how many leading past slots of each row hold request r's entries 0, 1, ..."""
        batch, width = obs.past.shape[0], int(obs.past.max()) if obs.past.numel() else 0
        if width == 0 or not call.cache_after:
            return torch.zeros(batch, len(refs), dtype=torch.long)
        flat = self.flat(call)  # [B, S, F]
        slots = obs.slots[:, :width].clamp(0, flat.shape[1] - 1)  # [B, P]
        found = flat.gather(1, slots[..., None].expand(-1, -1, flat.shape[2]))  # [B, P, F]
        table = torch.full((len(refs), width, flat.shape[2]), math.nan, dtype=self.work)  # [R, P, F]
        for r, ref in enumerate(refs):
            table[r, : min(width, ref.shape[0])] = ref[:width]
        bad = ~self.same(found[:, None], table[None])  # [B, R, P]
        bad &= (torch.arange(width)[None, :] < obs.past[:, None])[:, None, :]
        first = torch.where(bad.any(-1), bad.int().argmax(-1), width)
        return torch.minimum(first, obs.past[:, None])

    def holds_pads(self, call: CallRecord, row: int, slots: list[int]) -> bool:
        """Whether `slots` of `row` hold the pad token's entries at positions 0, 1, ... (an idle row)."""
        pads = self.references.pads[: len(slots)]
        found = self.entries(call, row, slots)
        return found is not None and len(pads) == len(slots) and bool(self.same(found, pads).all())

    def describe(self, call: CallRecord, row: int, slot: int, index: int, request: int) -> tuple[str, float]:
        """(what `slot` of `row` holds in words, its largest |K/V difference| from entry `index`
        of request `request`'s history)."""
        ref = self.references.refs[request]  # [Ls, F]
        if index >= ref.shape[0]:
            return f"slot {slot}, past the end of request {request}'s history", math.inf
        found = self.flat(call)[row, slot]  # [F]
        distance = float((found - ref[index]).abs().max())
        if bool(self.same(found, ref[index])):
            return (
                f"slot {slot} holding request {request}'s entry at position {index} (K/V within {self.tolerance})",
                distance,
            )
        entry = f"request {request}'s batch-size-1 entry at position {index}"
        return f"slot {slot} whose K/V are off {entry} by up to {distance:.3g} ({self.tolerance})", distance


class EngineJudge:
    """Reads one session's evidence after each step. Its own memory across steps (what each
    request's last target call attended, how many steps in a row it waited) is the judge's,
    never written into the session."""

    def __init__(self, session: EngineSession) -> None:
        self.session = session
        self.kv = None if session.kv is None else EngineKV(session.kv)
        self.streams: dict[int, Stream] = {}  # request -> what its last target call attended
        self.waited: dict[int, int] = {}  # live request -> steps in a row without an emission

    def step(
        self,
        calls: list[CallRecord],
        eligible: set[int],
        committed: dict[int, int],
        crowded: bool,
        emitted: dict[int, list[int]],
    ) -> list[Violation]:
        """The step's violations of the first check that has any (I1, I2, equivalence, liveness)."""
        violations = [v for call in calls for v in i1_call_violations(call) if v.rule not in IDLE_ROW_RULES]
        if not violations:
            violations = [v for call in calls for v in self.i2(call, eligible, committed)]
        if not violations:
            violations = self.equivalence()
        if not violations:
            violations = self.liveness(eligible, emitted, crowded)
        return violations

    def drained(self, budget: int) -> list[Violation]:
        """'request-finishes' (a decoder's rule): a request still live after the drain's `budget` of steps."""
        book, live = self.session.book, self.session.book.live_ids()
        if not live:
            return []
        r = live[0]
        got = len(book.requests[r].tokens)
        return [
            Violation(
                "liveness",
                "request-finishes",
                f"request {r} unfinished after {budget} more steps"
                f" ({got} of {len(self.session.tracked[r].expected)} tokens)",
                "every request finishing (EOS or max_new_tokens)",
                request=r,
                evidence={"steps": budget, "tokens": got},
            )
        ]

    def failure(self, violations: list[Violation], reproducer: dict[str, Any]) -> EngineFailure:
        return EngineFailure(violations, reproducer)

    def i2(self, call: CallRecord, eligible: set[int], committed: dict[int, int]) -> list[Violation]:
        """I2 on one target call: each row bound to a request whose history it holds longest
        (`bind_rows`: one row per request, told apart by progress where histories coincide)."""
        if call.input_ids is None or call.input_ids.dim() != 2:
            return []
        if call.past_length and not call.cache_after:
            return [Violation("I2", "cache-readable", "a target call whose output has no cache", "a cache", call.index)]
        ids = list(self.session.tracked)
        sequences = [self.session.tracked[r].sequence for r in ids]
        width = max(len(s) for s in sequences)
        table = torch.tensor([list(s) + [-2] * (width - len(s)) for s in sequences])  # [R, Ls]
        lengths = torch.tensor([len(s) for s in sequences])  # [R]
        exact = self.kv is None
        obs = observe(call, exact=exact)
        # bound by content: tokens in order, positions judged apart (a wrong position is not a wrong request)
        by_content = replace(obs, positions=torch.arange(obs.tokens.shape[1]).expand_as(obs.tokens))
        prefix = common_prefixes(by_content, table, lengths, exact=exact)  # [B, R]
        if self.kv is not None:  # a real model's past counts only as far as its K/V are the request's entries
            held = self.kv.prefixes(call, obs, [self.kv.references.refs[r] for r in ids])  # [B, R]
            prefix = torch.where(held < obs.past[:, None], held, prefix)
        reads = [self.read_row(call, obs, row, prefix[row], ids, eligible, committed) for row in range(prefix.shape[0])]
        judged = [r for r in reads if r.length and not self.idle(call, r)]
        out: list[Violation] = []
        for read, request, holder in bind_rows([r for r in judged if r.matched], eligible):
            fault = self.row_fault(call, read, request, holder, eligible)
            if fault is not None:
                out.append(fault)
        out += [v for r in judged if not r.matched if (v := self.row_fault(call, r, None, None, eligible)) is not None]
        return sorted(out, key=lambda v: v.row if v.row is not None else -1)

    def read_row(
        self,
        call: CallRecord,
        obs: Observation,
        row: int,
        prefix: torch.Tensor,
        ids: list[int],
        eligible: set[int],
        committed: dict[int, int],
    ) -> RowRead:
        """What `row` attends, and the requests whose histories it holds longest, most likely first:
        live, continuing its own previous call (a chunked round), nearest its committed length."""
        length, past = int(obs.length[row]), int(obs.past[row])
        tokens, slots = obs.tokens[row].tolist(), obs.slots[row].tolist()
        kv = None if self.kv is None else self.kv.entries(call, row, slots[:length])
        stream = Stream(call.order, tokens[:length], kv, self.session.book.steps)
        matched = int(prefix.max()) if len(ids) else 0
        tied = [ids[i] for i in range(len(ids)) if int(prefix[i]) == matched] if matched else []

        def preference(r: int) -> tuple[bool, bool, int, int]:
            done = committed.get(
                r, len(self.session.tracked[r].request.prompt) + len(self.session.book.requests[r].tokens)
            )
            return r not in eligible, not self.continues_round(r, call, stream, past), abs(past - done), r

        candidates = tuple(sorted(tied, key=preference))
        return RowRead(row, length, past, tokens, obs.positions[row].tolist(), slots, stream, matched, candidates)

    def row_fault(
        self, call: CallRecord, read: RowRead, request: int | None, holder: int | None, eligible: set[int]
    ) -> Violation | None:
        """The first I2 breach of one row bound to `request` (None: no request's history), whose
        first row is `holder`, or None."""
        length, past, matched = read.length, read.past, read.matched
        tokens, positions, slots, row = read.tokens, read.positions, read.slots, read.row

        def bad(rule: str, index: int, expected: str, exp_token: int | None, exp_pos: int | None) -> Violation:
            found = f"slot {slots[index]} holding token {tokens[index]} at position {positions[index]}"
            evidence: dict[str, Any] = {
                "found_token": tokens[index],
                "found_position": positions[index],
                "expected_token": exp_token,
                "expected_position": exp_pos,
                "index": index,
            }
            if tokens[index] == UNKNOWN and self.kv is not None and request is not None:  # a real past slot: K/V
                found, distance = self.kv.describe(call, row, slots[index], index, request)
                evidence.update(found_token=None, found_position=None, kv_distance=distance)
            return Violation("I2", rule, found, expected, call.index, row, slots[index], request, evidence)

        if request is None:
            return bad("row-identity", 0, "the first token of a live request's prompt", None, 0)
        if request not in eligible:
            state = self.session.book.requests.get(request)
            why = "aborted" if state is not None and state.aborted else "finished"
            found_more = f"; the row holds request {request}, {why} before this step"
            v = bad("retired-row", 0, "rows of live requests only", None, None)
            return Violation(
                "I2", v.rule, v.found + found_more, v.expected, call.index, row, v.slot, request, v.evidence
            )
        if holder != row:
            return bad("duplicate-row", 0, f"request {request} in one row only (also row {holder})", None, None)
        sequence = self.session.tracked[request].sequence
        chunk = self.continues_round(request, call, read.stream, past)
        self.streams[request] = read.stream
        for i in range(length):  # the past, then the request's next token, must be its history
            if not chunk and matched <= i <= past:
                want = sequence[i] if i < len(sequence) else None
                rule = "input-token" if i == past else "attends-wrong-slot"
                what = "the request's next token " if i == past else ""
                return bad(rule, i, f"{what}token {want} at position {i}", want, i)
            if i < past and self.kv is not None:
                continue  # a real model's past positions are judged through its K/V (above)
            if positions[i] != i:  # drafts may be anything, but at the next positions
                want = sequence[i] if i < matched else None
                return bad("position-ids", i, f"position {i}", want, i)
        return None

    def idle(self, call: CallRecord, read: RowRead) -> bool:
        """An idle row, the empty slot of a fixed-size engine: it attends the pad token only (on a
        real model: its inputs are the pad token and its past holds pads or no request's history).
        An engine that used its output would emit a wrong token (equivalence) or starve a request
        (liveness)."""
        pad, stream, past = self.session.pad_token_id, read.stream.tokens, read.slots[: read.past]
        if any(t != pad for t in stream[len(past) :]):
            return False
        if self.kv is None:
            return all(t == pad for t in stream[: len(past)])
        return not past or read.matched == 0 or self.kv.holds_pads(call, read.row, past)

    def continues_round(self, request: int, call: CallRecord, now: Stream, past: int) -> bool:
        """A verification split over several forwards: the row's past is exactly what the request's
        previous target call of this step attended (its tokens, or on a real model its K/V), with no
        draft call since, so its unverified drafts belong to this round and are no fault; positions are
        still judged. A call of a later step (a newcomer's prefill on top of the row) is judged afresh."""
        earlier = self.streams.get(request)
        if earlier is None or earlier.step != now.step or len(earlier.tokens) != past:
            return False
        if self.kv is None:
            same = earlier.tokens == now.tokens[:past]
        else:
            same = earlier.kv is not None and now.kv is not None and bool(self.kv.same(now.kv[:past], earlier.kv).all())
        return same and not any(earlier.order < c.order < call.order for c in self.session.recording.draft_calls)

    def equivalence(self) -> list[Violation]:
        """Each request's tokens so far are a prefix of the oracle's output, compared as a
        decoder's row is (`checks.equivalence.tie_aware`; in float64 a tie is all but impossible,
        and a re-synced request's history would still be the oracle's for I2)."""
        out = []
        for r, t in self.session.tracked.items():
            got = tuple(self.session.book.requests[r].tokens)
            request = t.request
            reference, judged, i = tie_aware(
                got,
                t.oracle,
                request.prompt,
                request.max_new_tokens,
                self.session.eos_token_id,
                lambda prefix, index, found, want, margin: margin_witness(index, margin, DTYPE),
                self.session.oracle_from,
            )
            if got == reference[: len(got)]:
                continue
            ties = [w.index for w in judged if w.numerical]
            want = reference[i] if i < len(reference) else "nothing (the oracle stopped)"
            after = f" after numerical tie(s) at {ties}" if ties else ""
            out.append(
                Violation(
                    "equivalence",
                    "first-divergence",
                    f"request {r} token {i} = {got[i]}{after} (tokens so far {list(got[:12])})",
                    f"{want} (oracle output {list(reference)[:12]})",
                    request=r,
                    evidence={"index": i, "found_token": got[i], "expected": list(reference), "ties": ties},
                )
            )
        return out

    def liveness(self, eligible: set[int], emitted: dict[int, list[int]], crowded: bool) -> list[Violation]:
        """The declared wait bound, counted over steps with room for every unfinished request. The
        rules are a decoder's (`checks.scheduling`), counted in steps instead of target calls: a
        request waiting for its first token breaks 'bounded-queue', one waiting between two
        emissions 'bounded-wait'."""
        out = []
        for r in sorted(eligible):
            state = self.session.book.requests[r]
            if r in emitted:
                self.waited[r] = 0
            elif not crowded and not state.aborted:
                self.waited[r] = waited = self.waited.get(r, 0) + 1
                if self.session.max_wait_steps is not None and waited > self.session.max_wait_steps:
                    out.append(
                        Violation(
                            "liveness",
                            "bounded-wait" if state.tokens else "bounded-queue",
                            f"request {r} passed over {waited} steps in a row ({len(state.tokens)} tokens so far)",
                            f"at most max_wait_steps = {self.session.max_wait_steps} with room for every request"
                            f" (max_batch_size {self.session.max_batch_size})",
                            request=r,
                            evidence={"waited": waited, "max_wait_steps": self.session.max_wait_steps},
                        )
                    )
        return out


def engine_session(
    spec: str,
    num_draft_tokens: int,
    eos_token_id: int | None,
    pad_token_id: int,
    model: str = "transparent",
    **options: Any,
) -> EngineSession:
    """A session judged by `EngineJudge` (the state machine's and replay's)."""
    return EngineSession(spec, num_draft_tokens, eos_token_id, pad_token_id, model, judge=EngineJudge, **options)


@dataclass(frozen=True)
class EngineDiagnosis:
    """An engine failure as a decoder run's diagnosis puts it: the first violated check and rule,
    where (engine step, target call, request, row, slot), and the paper's signature, which the
    registry maps from the first violation (`specaudit.checks.registry`, as for decoder runs)."""

    first_check: str
    rule: str
    step: int | None  # the engine's step() calls so far, the failing one included (0: before any)
    call: int | None  # target call
    request: int | None
    row: int | None
    slot: int | None
    signature: str
    reason: str

    def render(self) -> str:
        where = [
            f"{name} {value}"
            for name, value in (
                ("step", self.step),
                ("target call", self.call),
                ("request", self.request),
                ("row", self.row),
                ("slot", self.slot),
            )
            if value is not None
        ]
        at = f" at {', '.join(where)}" if where else ""
        return (
            f"first violated check: {self.first_check} ({self.rule}){at}; signature: {self.signature} ({self.reason})"
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def engine_signature(first: Violation, reproducer: dict[str, Any]) -> tuple[str, str]:
    """The registry's signature of an engine's first violation. Every check but equivalence maps
    from the violation's fields; a wrong token is judged as a decoder's is (`alone_signature`):
    the request re-run alone on the same engine, an invariant broken there names it, a wrong
    token there is a bonus error, none is bookkeeping."""
    if first.check != "equivalence":
        return check_named(first.check).signature(first, None)
    add = next((op for op in reproducer["ops"] if op["op"] == "add" and op["id"] == first.request), None)
    alone = [] if add is None else replay(dict(reproducer, ops=[add, {"op": "drain"}]))
    seen = alone[0] if alone else None
    return alone_signature(first.request or 0, seen, seen is not None and seen.check == "equivalence")


def diagnose_engine(violations: list[Violation], reproducer: dict[str, Any]) -> EngineDiagnosis:
    """The diagnosis of an engine failure from its violations and the rules that gave them."""
    first = violations[0]
    signature, reason = engine_signature(first, reproducer)
    step = first.evidence.get("step")
    return EngineDiagnosis(
        first.check, first.rule, step, first.call, first.request, first.row, first.slot, signature, reason
    )


class EngineFailure(AssertionError):
    """A step broke a check: the violations, the JSON reproducer of the rules so far, and the
    diagnosis (computed when first asked for: a wrong token re-runs its request alone)."""

    def __init__(self, violations: list[Violation], reproducer: dict[str, Any]) -> None:
        self.violations = violations
        self.reproducer = reproducer
        super().__init__(violations, reproducer)

    def __str__(self) -> str:
        return (
            f"engine {self.reproducer['engine']} after {len(self.reproducer['ops'])} rules:\n"
            f"{self.diagnosis.render()}\n{render(self.violations)}\n"
            f"reproducer (specaudit.checks.engine.replay):\n{json.dumps(self.reproducer)}"
        )

    def __reduce__(self) -> tuple[type[EngineFailure], tuple[list[Violation], dict[str, Any]]]:
        """Pickled by its arguments: `specaudit audit` sends verdicts back from worker processes."""
        return EngineFailure, (self.violations, self.reproducer)

    @property
    def first_check(self) -> str:
        return self.violations[0].check

    @functools.cached_property
    def diagnosis(self) -> EngineDiagnosis:
        return diagnose_engine(self.violations, self.reproducer)


def replay(reproducer: dict[str, Any] | str | Path) -> list[Violation]:
    """Run a logged rule sequence again; returns the violations of the first failing rule ([] if none)."""
    if isinstance(reproducer, (str, Path)):
        text = Path(reproducer).read_text() if Path(str(reproducer)).exists() else str(reproducer)
        reproducer = json.loads(text)
    if reproducer.get("format") == ENVELOPE_FORMAT:  # a reproducer file: the rules are its subject and payload
        reproducer = {**reproducer["subject"], **reproducer["payload"]}
    session = engine_session(
        reproducer["engine"],
        int(reproducer["num_draft_tokens"]),
        reproducer["eos_token_id"],
        int(reproducer["pad_token_id"]),
        str(reproducer.get("model", "transparent")),  # written before engines ran on tiny real models
    )
    try:
        for op in reproducer["ops"]:
            if op["op"] == "add":
                accept = tuple(c == "1" for c in op["accept"])
                session.add(Request(int(op["id"]), tuple(op["prompt"]), int(op["max_new_tokens"]), accept))
            elif op["op"] == "abort":
                session.abort(int(op["id"]))
            elif op["op"] == "step":
                session.step()
            elif op["op"] == "drain":
                session.ops.append(op)
                session.drain()
    except EngineFailure as failure:
        return failure.violations
    finally:
        session.close()
    return []
