"""The engine checks: an engine session's evidence judged after every step.

After every step, in the registry's order, each check through its ENGINE implementation
(`checks.engine_step`, dispatched by `registry.evaluate(ENGINE, step)`):

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

Rows are bound and judged by a decoder's row follower (`checks.rows.RowFollower`), one for the
session, the requests joining it as they are added: the engine's book tells it, per step, which
requests are live and their committed lengths (what a decoder's calls only imply), and no round
spans two steps. So a row binds one to one to a live request whose history it holds by content
(requests that share a history, duplicate prompts, told apart by progress and continuity as a
decoder's are), its idle rows (a fixed-size engine's empty slots) are skipped, and a row left
over is a fault of its own: a retired request's history (`retired-row`), a live request's held
by another row (`duplicate-row`), no request's history (`row-identity`). On a tiny real model
(float64) the past slots show K/V, read against each request's batch-size-1 entries within the
dtype's tolerance (the decoder's `checks.kv.KVReader`, over the session's `KVReferences`:
`engine_reader`).

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
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from specaudit.checks.diagnosis import Finding
from specaudit.checks.engine_step import IDLE_ROW_RULES, EngineStep
from specaudit.checks.equivalence import compare_request, divergence, margin_witness
from specaudit.checks.i2 import violation
from specaudit.checks.kv import KVReader
from specaudit.checks.liveness import Tenure, WaitLedger, overdue, settle, unfinished
from specaudit.checks.registry import ENGINE, evaluate, order_for
from specaudit.checks.rows import Book, Fault, RowFollower
from specaudit.contracts.engine_rules import EngineRules, as_rules
from specaudit.contracts.violation import Violation, render
from specaudit.numerics.tolerance import DTYPES
from specaudit.running.engine_session import DTYPE
from specaudit.running.instrument import CallRecord

if TYPE_CHECKING:  # the judge reads a session; running one is the caller's
    from specaudit.running.engine_session import EngineSession

ENGINE_ORDER = tuple(name for name in order_for(ENGINE) if name != "contract")
"""The registry's checks of an engine after every step (the contract is the session's own)."""

__all__ = ["ENGINE_ORDER", "IDLE_ROW_RULES", "EngineFailure", "EngineJudge", "engine_reader"]


def engine_reader(session: EngineSession) -> KVReader:
    """I2's reader for a tiny real target, whose past slots show K/V, not (token, position): the
    decoder's (`checks.kv.KVReader`) over the session's `KVReferences`, made when each request
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
        self.rows = RowFollower(
            not self.real, session.num_draft_tokens, session.pad_token_id, session.recording.target_calls
        )  # a decoder's row binder and I2 judge, told the engine's live requests and committed lengths
        self.ids: list[int] = []  # the follower's request index -> the engine's request id
        self.index: dict[int, int] = {}  # the engine's request id -> the follower's index
        self.step_starts: list[float] = []  # where each step began: no round spans two steps
        self.ledger = WaitLedger("steps", session.max_wait_steps, "max_wait_steps")  # served: steps it emitted in

    def step(
        self,
        calls: list[CallRecord],
        eligible: set[int],
        committed: dict[int, int],
        crowded: bool,
        emitted: dict[int, list[int]],
    ) -> list[Violation]:
        """The step's violations of the first check that has any, in the registry's order for an
        engine (`registry.evaluate(ENGINE, step)`: each check's ENGINE implementation,
        `checks.engine_step`; the contract is the session's, before any of these)."""
        step = EngineStep(self, tuple(calls), frozenset(eligible), committed, crowded, emitted)
        first = evaluate(ENGINE, step).first_failure
        return [] if first is None else list(first.violations)

    def drained(self, budget: int) -> list[Violation]:
        """'request-finishes' (`checks.liveness`): a request still live after the drain's `budget` of steps."""
        settle(self.ledger, self.session.record)
        return [replace(v, evidence={**v.evidence, "steps": budget}) for v in unfinished(self.ledger)]

    def tenure(self, request: int) -> Tenure:
        return self.ledger.tenure(request, self.session.record.entries[request].max_new_tokens)

    def failure(self, violations: list[Violation], reproducer: EngineRules) -> EngineFailure:
        return EngineFailure(violations, reproducer, self.diagnose)

    def i2(self, calls: list[CallRecord], eligible: set[int], committed: dict[int, int]) -> list[Violation]:
        """I2 on the step's target calls, judged by a decoder's row follower (`checks.rows`):
        rows bound one to one to the live requests whose histories they hold (twins, requests
        with one history, told apart by progress), idle rows skipped, rows left over faulted."""
        self.follow_requests()
        if calls:
            self.step_starts.append(calls[0].order - 0.5)
        draft_orders = [c.order for c in self.session.recording.draft_calls]
        self.rows.draft_orders = sorted([*draft_orders, *self.step_starts])
        index = self.index
        book = Book(frozenset(index[r] for r in eligible), {index[r]: n for r, n in committed.items()})
        return [v for call in calls for v in self.call_faults(call, book)]

    def follow_requests(self) -> None:
        """The requests added since the last step join the follower, read against their histories."""
        new = [r for r in self.session.tracked if r not in self.index]
        if new:
            tracked = [self.session.tracked[r] for r in new]
            self.rows.add([t.request.prompt for t in tracked], [t.sequence for t in tracked])
            self.index.update((r, len(self.ids) + i) for i, r in enumerate(new))
            self.ids += new
            if self.real:
                self.rows.kv = engine_reader(self.session)

    def call_faults(self, call: CallRecord, book: Book) -> list[Violation]:
        if call.input_ids is None or call.input_ids.dim() != 2:
            return []  # I1 reports a malformed call
        pad = self.session.pad_token_id
        if call.past_length and not call.cache_after:
            return [violation(Fault("cache-readable", call.index), pad)]
        before = len(self.rows.faults)
        self.rows.visit(call, book)
        faults = sorted(self.rows.faults[before:], key=lambda f: -1 if f.row is None else f.row)
        return [violation(self.named(f), pad) for f in faults]

    def named(self, fault: Fault) -> Fault:
        """A fault with the engine's request ids, and how a retired request left."""
        request = None if fault.request is None else self.ids[fault.request]
        other = None if fault.other is None else self.ids[fault.other]
        left = None
        if fault.rule == "retired-row" and request is not None:
            state = self.session.book.requests.get(request)
            left = "aborted" if state is not None and state.aborted else "finished"
        return replace(fault, request=request, other=other, left=left)

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


Diagnose = Callable[[list[Violation], EngineRules], Finding]
"""How a failure is diagnosed (`specaudit.search.engine_replay.diagnose_engine`): a wrong token's
signature replays its request alone, a model run this layer leaves to the one above."""


class EngineFailure(AssertionError):
    """A step broke a check: the violations, the rules so far (`EngineRules`; a dict in any of
    their JSON forms is read as one), and the diagnosis (made by `diagnose` when first asked for:
    a wrong token re-runs its request alone)."""

    def __init__(
        self, violations: list[Violation], reproducer: EngineRules | dict[str, Any], diagnose: Diagnose
    ) -> None:
        self.violations = violations
        self.reproducer: EngineRules = as_rules(reproducer)
        self.diagnose = diagnose
        super().__init__(violations, reproducer)

    def __str__(self) -> str:
        return (
            f"engine {self.reproducer.engine} after {len(self.reproducer.ops)} rules:\n"
            f"{self.diagnosis.render()}\n{render(self.violations)}\n"
            f"reproducer (specaudit.search.engine_replay.replay_rules):\n{json.dumps(self.reproducer.to_json())}"
        )

    def __reduce__(self) -> tuple[type[EngineFailure], tuple[list[Violation], EngineRules, Diagnose]]:
        """Pickled by its arguments: `specaudit audit` sends verdicts back from worker processes."""
        return EngineFailure, (self.violations, self.reproducer, self.diagnose)

    @property
    def first_check(self) -> str:
        return self.violations[0].check

    @functools.cached_property
    def diagnosis(self) -> Finding:
        return self.diagnose(self.violations, self.reproducer)
