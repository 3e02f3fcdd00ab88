"""The engine checks: an engine session's evidence judged after every step.

After every step, in the registry's order:

  contract     the engine contract's fixed points and the side-effect guard (the session's)
  I1           every target forward of the step is one rectangular batch (`checks.i1`); idle
               rows that attend nothing are allowed (`IDLE_ROW_RULES`)
  I2           every row of those forwards attends exactly one live request's own tokens at
               positions 0, 1, 2, ...; its first input is that request's next token (idle
               rows, attending the pad token only, excepted)
  equivalence  each request's tokens so far (the session's record) are a prefix of its oracle
               output (finished ones equal to it: EOS or max_new_tokens)
  liveness     a request waits at most the declared `max_wait_steps` for its first token and
               between two emissions while no more than `max_batch_size` requests are
               unfinished; every request finishes when the engine is drained (the rules
               of `checks.liveness`, over the judge's ledger, counted in steps)

Rows are bound to requests by content: a row's candidates are the requests whose history it
holds longest (`checks.rows.common_prefixes`, as for a decoder's rows); requests that share a
history (duplicate prompts) are told apart by progress, each row preferring the request whose
previous call it continues and whose committed length is nearest its past, then matched one to
one (`bind_rows`); where they cannot be told apart, either binding judges the same. On a tiny
real model (float64) the past slots show K/V: a row's past slot holds entry i of a request when
its K/V equal that request's batch-size-1 entry i within the dtype's tolerance (the decoder's
`checks.rows.KVReader`, reading the session's `KVReferences`: `engine_reader`).

A failure carries its diagnosis, a `checks.diagnosis.Finding` as a decoder run's diagnosis has:
the first violated check and rule, the engine step, target call, request, row and slot, and the
paper's signature, mapped from the first violation by the registry as a decoder run's is. Every
violation notes its step in `evidence["step"]`, so `diagnose_engine(violations, reproducer)`
rebuilds it after a `replay`. Both live a layer up (`specaudit.search.engine_replay`): a wrong
token's signature replays its request alone, and checks run no model; the judge is handed the
diagnosis to attach.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from specaudit.checks.diagnosis import Finding
from specaudit.checks.equivalence import compare_request, divergence, margin_witness
from specaudit.checks.i1 import i1_call_violations
from specaudit.checks.i2 import violation
from specaudit.checks.liveness import Ledger, Tenure, overdue, settle, unfinished
from specaudit.checks.rows import (
    UNKNOWN,
    Fault,
    KVReader,
    Observation,
    assign,
    common_prefixes,
    draft_between,
    observe,
)
from specaudit.contracts.violation import Violation, render
from specaudit.numerics.tolerance import DTYPES
from specaudit.running.engine_session import DTYPE, Stream
from specaudit.running.instrument import CallRecord

if TYPE_CHECKING:  # the judge reads a session; running one is the caller's
    from specaudit.running.engine_session import EngineSession

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
    among their candidates by the decoder's matching (`checks.rows.assign`: each row's
    candidates scored by how long a prefix it holds, then by its order of preference), so two
    requests with one history (duplicate prompts) take one row each, whichever way round: their
    histories are identical, so either binding judges the same. A row left over holds a retired
    candidate if it can, else its first candidate again (held by `holder`: a duplicate row)."""
    ids = sorted({r for read in reads for r in read.candidates})
    column = {r: j for j, r in enumerate(ids)}
    score = torch.full((len(reads), len(ids)), -1.0)  # [B, R] -1: not a live candidate of the row
    for b, read in enumerate(reads):
        live = [r for r in read.candidates if r in eligible]
        for rank, r in enumerate(live):  # a longer held prefix first, then the row's preference
            score[b, column[r]] = read.matched * (len(ids) + 1) + len(live) - rank
    owner = {ids[j]: reads[b].row for b, j in assign(score)}  # request -> row
    bound = {row: r for r, row in owner.items()}
    for read in reads:
        if read.row not in bound:
            retired = [r for r in read.candidates if r not in eligible and r not in owner]
            request = retired[0] if retired else read.candidates[0]
            owner.setdefault(request, read.row)
            bound[read.row] = request
    return [(read, bound[read.row], owner[bound[read.row]]) for read in reads]


def engine_reader(session: EngineSession) -> KVReader:
    """I2's reader for a tiny real target, whose past slots show K/V, not (token, position): the
    decoder's (`checks.rows.KVReader`) over the session's `KVReferences`, made when each request
    was added (its history's batch-size-1 entries, and pad tokens'), held to the dtype's fixed
    tolerance (float64 here, so a wrong token, position or request is off by orders of magnitude
    more)."""
    references = session.kv
    assert references is not None
    ids = list(session.tracked)
    sequences = [session.tracked[r].sequence for r in ids]
    pads = ((session.pad_token_id,) * references.pads.shape[0], references.pads)
    sources = [*zip(sequences, (references.refs[r] for r in ids)), pads]
    return KVReader(DTYPES[DTYPE], sequences, sources, references.reference, session.pad_token_id)


class EngineJudge:
    """Reads one session's evidence after each step. Its own memory across steps (what each
    request's last target call attended, how many steps in a row it waited) is the judge's,
    never written into the session."""

    def __init__(self, session: EngineSession, diagnose: Diagnose) -> None:
        self.session = session
        self.diagnose = diagnose
        self.real = session.kv is not None  # a tiny real target: past slots are read by their K/V
        self.kv: KVReader | None = None  # the reader of the call being judged (real targets)
        self.draft_orders: list[int] = []  # the draft calls' places so far, ascending (`draft_between`)
        self.streams: dict[int, Stream] = {}  # request -> what its last target call attended
        self.ledger = Ledger("steps", session.max_wait_steps, "max_wait_steps")  # served: steps it emitted in

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
        """'request-finishes' (`checks.liveness`): a request still live after the drain's `budget` of steps."""
        settle(self.ledger, self.session.record)
        return [replace(v, evidence={**v.evidence, "steps": budget}) for v in unfinished(self.ledger)]

    def tenure(self, request: int) -> Tenure:
        return self.ledger.tenure(request, self.session.record.entries[request].max_new_tokens)

    def failure(self, violations: list[Violation], reproducer: dict[str, Any]) -> EngineFailure:
        return EngineFailure(violations, reproducer, self.diagnose)

    def i2(self, call: CallRecord, eligible: set[int], committed: dict[int, int]) -> list[Violation]:
        """I2 on one target call: each row bound to a request whose history it holds longest
        (`bind_rows`: one row per request, told apart by progress where histories coincide)."""
        if call.input_ids is None or call.input_ids.dim() != 2:
            return []
        if call.past_length and not call.cache_after:
            return [violation(Fault("cache-readable", call.index), self.session.pad_token_id)]
        ids = list(self.session.tracked)
        sequences = [self.session.tracked[r].sequence for r in ids]
        width = max(len(s) for s in sequences)
        table = torch.tensor([list(s) + [-2] * (width - len(s)) for s in sequences])  # [R, Ls]
        lengths = torch.tensor([len(s) for s in sequences])  # [R]
        exact = not self.real
        self.kv = None if exact else engine_reader(self.session)
        self.draft_orders = sorted(c.order for c in self.session.recording.draft_calls)
        obs = observe(call, exact=exact)
        # bound by content: tokens in order, positions judged apart (a wrong position is not a wrong request)
        by_content = replace(obs, positions=torch.arange(obs.tokens.shape[1]).expand_as(obs.tokens))
        prefix = common_prefixes(by_content, table, lengths, exact=exact)  # [B, R]
        if self.kv is not None:  # a real model's past counts only as far as its K/V are the request's entries
            held = self.kv.past_prefixes(call, obs)  # [B, R], the requests in `ids` order
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
        kv = None if self.kv is None else self.kv.at(call, row, slots[:length])
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
        first row is `holder`, or None; phrased as a decoder row's (`checks.i2.violation`)."""
        fault = self.first_fault(call, read, request, holder, eligible)
        return None if fault is None else violation(fault, self.session.pad_token_id)

    def first_fault(
        self, call: CallRecord, read: RowRead, request: int | None, holder: int | None, eligible: set[int]
    ) -> Fault | None:
        length, past, matched, row = read.length, read.past, read.matched, read.row

        def fault_at(rule: str, index: int, want: int | None, position: int | None, **more: Any) -> Fault:
            token, found_position = read.tokens[index], read.positions[index]
            distance = None
            if token == UNKNOWN:  # a real past slot: judged by its K/V
                token = found_position = None
                if request is not None:
                    distance = self.kv_distance(call, row, read.slots[index], index, request)
            return Fault(
                rule,
                call.index,
                row,
                request,
                read.slots[index],
                token,
                found_position,
                want,
                position,
                kv_difference=distance,
                input=index - past if index >= past else None,
                **more,
            )

        if request is None:
            return fault_at("row-identity", 0, None, 0)
        if request not in eligible:
            state = self.session.book.requests.get(request)
            return fault_at(
                "retired-row", 0, None, None, left="aborted" if state is not None and state.aborted else "finished"
            )
        if holder != row:
            return fault_at("duplicate-row", 0, None, None, holder=holder)
        sequence = self.session.tracked[request].sequence
        chunk = self.continues_round(request, call, read.stream, past)
        self.streams[request] = read.stream
        for i in range(length):  # the past, then the request's next token, must be its history
            if not chunk and matched <= i <= past:
                want = sequence[i] if i < len(sequence) else None
                return fault_at("input-token" if i == past else "attends-wrong-slot", i, want, i)
            if i < past and self.kv is not None:
                continue  # a real model's past positions are judged through its K/V (above)
            if read.positions[i] != i:  # drafts may be anything, but at the next positions
                return fault_at("position-ids", i, sequence[i] if i < matched else None, i)
        return None

    def kv_distance(self, call: CallRecord, row: int, slot: int, index: int, request: int) -> float:
        """The largest |K/V difference| of `slot` of `row` from entry `index` of the request's
        batch-size-1 history (inf: past its end)."""
        kv = self.kv
        assert kv is not None
        want = kv.kept(self.session.tracked[request].sequence, index)  # [F]
        if want is None:
            return math.inf
        return float((kv.flat(call)[row, slot] - want).abs().max())

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
        return not past or read.matched == 0 or self.kv.holds(call, read.row, past, (pad,) * len(past))

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
            same = (
                earlier.kv is not None
                and now.kv is not None
                and bool(self.kv.same_slots(now.kv[None, :past], earlier.kv).all())
            )
        return same and not draft_between(self.draft_orders, earlier.order, call.order)

    def equivalence(self) -> list[Violation]:
        """Each request's tokens so far are a prefix of the oracle's output, compared as a
        decoder's row is (`checks.equivalence.compare_request` over the session's record; in
        float64 a tie is all but impossible, and a re-synced request's history would still be
        the oracle's for I2)."""
        out = []
        for entry in self.session.record.entries.values():
            compared = compare_request(
                entry,
                self.session.eos_token_id,
                lambda prefix, index, found, want, margin: margin_witness(index, margin, DTYPE),
                self.session.oracle_from,
            )
            if compared.found != compared.reference[: len(compared.found)]:
                out.append(divergence(compared))
        return out

    def liveness(self, eligible: set[int], emitted: dict[int, list[int]], crowded: bool) -> list[Violation]:
        """The declared wait bound over the session's ledger (`checks.liveness`, a decoder's rules
        counted in steps): a live request is served in a step it emits in, and waits in one with
        room for every unfinished request (not crowded), unless aborted."""
        step = self.session.book.steps
        for r in sorted(eligible):
            tenure = self.tenure(r)
            if r in emitted:
                tenure.served.append(step)
            elif not crowded and not self.session.book.requests[r].aborted:
                tenure.waiting.add(step)
        return overdue(self.ledger)


Diagnose = Callable[[list[Violation], dict[str, Any]], Finding]
"""How a failure is diagnosed (`specaudit.search.engine_replay.diagnose_engine`): a wrong token's
signature replays its request alone, a model run this layer leaves to the one above."""


class EngineFailure(AssertionError):
    """A step broke a check: the violations, the JSON reproducer of the rules so far, and the
    diagnosis (made by `diagnose` when first asked for: a wrong token re-runs its request alone)."""

    def __init__(self, violations: list[Violation], reproducer: dict[str, Any], diagnose: Diagnose) -> None:
        self.violations = violations
        self.reproducer = reproducer
        self.diagnose = diagnose
        super().__init__(violations, reproducer)

    def __str__(self) -> str:
        return (
            f"engine {self.reproducer['engine']} after {len(self.reproducer['ops'])} rules:\n"
            f"{self.diagnosis.render()}\n{render(self.violations)}\n"
            f"reproducer (specaudit.search.engine_replay.replay):\n{json.dumps(self.reproducer)}"
        )

    def __reduce__(self) -> tuple[type[EngineFailure], tuple[list[Violation], dict[str, Any], Diagnose]]:
        """Pickled by its arguments: `specaudit audit` sends verdicts back from worker processes."""
        return EngineFailure, (self.violations, self.reproducer, self.diagnose)

    @property
    def first_check(self) -> str:
        return self.violations[0].check

    @functools.cached_property
    def diagnosis(self) -> Finding:
        return self.diagnose(self.violations, self.reproducer)
