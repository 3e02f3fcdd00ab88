"""Engine sessions: a step-wise engine on instrumented built-in models, every step recorded.

A session applies the state machine's rules (`specaudit.contracts.engine_rules`: add a request,
step, abort, drain) to one engine, logs them as `EngineRules`, and keeps the evidence: the
instrumented target and draft calls, the engine's book of requests (prompt, tokens so far,
aborted or finished), and per request its exact history (prompt + the oracle's continuation)
and, on a tiny real model, that history's batch-size-1 K/V. The contract
and side-effect guard run here (`engine-*` rules, hooks, models unchanged); what each step means
is the judge's (`specaudit.checks.engine`), passed in, so that running stays below judging.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from specaudit.contracts.builtins import check_model
from specaudit.contracts.decoder import ContractError
from specaudit.contracts.engine import ENGINE_RULES, EngineBook, build_engine, declared, engine_error, load_engine
from specaudit.contracts.engine_rules import Abort, AddRequest, Drain, EngineRules, Op, Step
from specaudit.contracts.subjects import EVIDENCE_ENGINE
from specaudit.contracts.violation import Violation
from specaudit.fixtures.pairs import is_exact, target_model
from specaudit.fixtures.transparent import RequestScript, Script, ScriptedDraft, scripted_draft, transparent_target
from specaudit.numerics.tolerance import DTYPES
from specaudit.reference.oracle import OracleResult, greedy_oracle, kv_rows, reference_kv, truncate
from specaudit.running.guard import ModelGuard
from specaudit.running.instrument import CallRecord, breach, instrument
from specaudit.running.record import Entry, Record
from specaudit.running.runner import oracle_continuation

STEP_TIMEOUT_S = 30.0
DTYPE = "float64"
"""Every model runs in float64: the tiny real ones are then exact up to rounding far below any
greedy margin, so no tie can pass for a bug and I2 holds K/V to `KV_TOLERANCE`'s float64 bound."""


class StepJudge(Protocol):
    """What reads a session's evidence (`specaudit.checks.engine.EngineJudge`)."""

    def step(
        self,
        calls: list[CallRecord],
        eligible: set[int],
        committed: dict[int, int],
        crowded: bool,
        emitted: dict[int, list[int]],
    ) -> list[Violation]: ...

    def drained(self, budget: int) -> list[Violation]: ...

    def failure(self, violations: list[Violation], rules: EngineRules) -> BaseException: ...


@dataclass
class Tracked:
    """The harness's view of one request: its exact history, what I2 reads its rows against (its
    oracle answer and tokens so far are the record's `Entry`)."""

    request: AddRequest  # what the engine was asked for and what the draft gets right
    sequence: tuple[int, ...]  # prompt + EOS-blind oracle continuation (past max_new_tokens + K)


@functools.lru_cache(maxsize=8)
def session_models(model: str = "transparent") -> tuple[torch.nn.Module, ScriptedDraft]:
    """The session's target and a scripted draft, built once per process and model (building a
    model costs more than a short session); each session gives the draft its own script. A tiny
    real target is a copy of the shared one, so the oracle's and the K/V references' forwards on
    the shared model are never recorded as the engine's."""
    if is_exact(model):
        return transparent_target(), scripted_draft([])
    return copy.deepcopy(target_model(model, DTYPE)), scripted_draft([])


class KVReferences:
    """A tiny real target's batch-size-1 K/V, for I2 to read a row's past against: each tracked
    request's history (prompt + oracle continuation), and pad tokens (an idle row's) at least as
    long, run once on the shared, unhooked target when a request is added."""

    PAD_MARGIN = 16  # pad entries beyond the longest history: an idle row is at most one batch wide

    def __init__(self, model: str, pad_token_id: int) -> None:
        self.reference_model = target_model(model, DTYPE)
        self.work = DTYPES[DTYPE]
        self.pad_token_id = pad_token_id
        self.refs: dict[int, torch.Tensor] = {}  # request -> [Ls, F] entries of its history
        self.pads = torch.empty(0)  # [P, F] entries of P pad tokens at positions 0..P-1

    def reference(self, tokens: tuple[int, ...]) -> torch.Tensor:
        """[n, F] the batch-size-1 entries of `tokens` at positions 0..n-1."""
        with torch.no_grad():
            return kv_rows(reference_kv(self.reference_model, tokens)).to(self.work)

    def track(self, request: int, sequence: tuple[int, ...]) -> None:
        self.refs[request] = self.reference(sequence)
        if self.pads.shape[0] < len(sequence) + self.PAD_MARGIN:  # a causal model: a prefix's entries are the prefix
            self.pads = self.reference((self.pad_token_id,) * (len(sequence) + self.PAD_MARGIN))


@dataclass
class EngineSession:
    """Runs one engine on a built-in target (the transparent one, or a tiny real model in
    float64) and a scripted draft, recording every step; `judge` (built on the session) reads
    each step's evidence and says what broke. The models the judge needs, the oracle's
    continuation and a real model's batch-size-1 K/V of each request, are run here when the
    request is added, before any judging."""

    spec: str
    num_draft_tokens: int
    eos_token_id: int | None
    pad_token_id: int
    model: str = "transparent"
    ops: list[Op] = field(default_factory=list)  # the rules applied so far, in order
    on_event: Callable[[str], None] | None = None  # hypothesis.event inside the state machine
    timeout_s: float = STEP_TIMEOUT_S  # per engine call: a step() that hangs fails instead
    judge: Callable[[EngineSession], StepJudge] = field(kw_only=True)  # built on the session

    def __post_init__(self) -> None:
        check_model(self.model, dtype=DTYPE)
        self.target, self.draft = session_models(self.model)
        self.kv = None if is_exact(self.model) else KVReferences(self.model, self.pad_token_id)
        self.draft.script = Script([])
        self.stack = ExitStack()
        self.recording = self.stack.enter_context(instrument(self.target, self.draft))
        self.tracked: dict[int, Tracked] = {}
        self.record = Record(self.spec, EVIDENCE_ENGINE, "target calls", self.eos_token_id, self.recording.target_calls)
        self.seen_calls = 0
        self.unobserved = 0
        self.last_lengths: dict[int, int] = {}  # live request -> its tokens after the previous step
        self.failed = False
        self.events: Counter[str] = Counter()
        try:
            engine = build_engine(
                load_engine(self.spec),
                self.spec,
                self.target,
                self.draft,
                num_draft_tokens=self.num_draft_tokens,
                eos_token_id=self.eos_token_id,
                pad_token_id=self.pad_token_id,
            )
        except BaseException:
            self.stack.close()  # the shared models keep no hook of a session that never started
            raise
        self.book = EngineBook(engine, self.eos_token_id, self.timeout_s)
        self.models = ModelGuard({"target": self.target, "draft": self.draft}, session_models.cache_clear)
        self.max_batch_size = declared(engine, "max_batch_size")
        self.max_wait_steps = declared(engine, "max_wait_steps")
        self.verdict: StepJudge = self.judge(self)

    def close(self) -> None:
        self.stack.close()

    def oracle_from(self, prefix: tuple[int, ...], max_new_tokens: int) -> OracleResult:
        """The batch-size-1 oracle from `prefix` on the shared, unhooked target (a tie re-synced)."""
        with torch.no_grad():
            return greedy_oracle(target_model(self.model, DTYPE), prefix, max_new_tokens=max_new_tokens,
                                 eos_token_id=self.eos_token_id)  # fmt: skip

    def rules(self) -> EngineRules:
        """The rules applied so far: what replays this session (`specaudit.search.engine_replay`)."""
        return EngineRules(self.spec, self.num_draft_tokens, self.eos_token_id, self.pad_token_id, tuple(self.ops),
                           self.model)  # fmt: skip

    def fail(self, violations: list[Violation]) -> None:
        """Raise the violations, each noting the engine step it broke in (for the diagnosis)."""
        if violations:
            self.failed = True
            stepped = [replace(v, evidence={**v.evidence, "step": self.book.steps}) for v in violations]
            raise self.verdict.failure(stepped, self.rules())

    # -- rules -----------------------------------------------------------------------------

    def apply(self, op: Op) -> None:
        """One rule, logged and judged (a replayed sequence's, or one the machine drew)."""
        if isinstance(op, AddRequest):
            self.add(op)
        elif isinstance(op, Abort):
            self.abort(op.request_id)
        elif isinstance(op, Step):
            self.step()
        else:
            self.drain()

    def add(self, request: AddRequest) -> None:
        self.ops.append(request)
        if any(self.tracked[r].request.prompt == request.prompt for r in self.book.live_ids()):
            self.note("duplicate prompt among concurrent requests")
        horizon = request.max_new_tokens + self.num_draft_tokens + 2
        full = oracle_continuation(self.model, DTYPE, request.prompt, horizon)
        continuation = full.tokens
        expected, stop = truncate(continuation, max_new_tokens=request.max_new_tokens, eos_token_id=self.eos_token_id)
        oracle = OracleResult(expected, stop, full.margins[: len(expected)])
        self.tracked[request.request_id] = Tracked(request, request.prompt + continuation)
        admitted = len(self.record.calls)
        self.record.admit(Entry(request.request_id, request.prompt, request.max_new_tokens, oracle, admitted=admitted))
        if self.kv is not None:
            self.kv.track(request.request_id, request.prompt + continuation)
        self.draft.script = self.script()

        def run() -> None:
            self.book.add(request.request_id, request.prompt, request.max_new_tokens)
            self.book.check_unfinished()  # a waiting request counts

        self.fail(self.guard(run))

    def script(self) -> Script:
        """The draft's script: one per prompt, as the draft finds rows by content. Requests that
        share a prompt follow the first one's acceptance schedule over the longest history."""
        scripts: dict[tuple[int, ...], RequestScript] = {}
        for t in self.tracked.values():
            prompt, continuation = t.request.prompt, t.sequence[len(t.request.prompt) :]
            known = scripts.get(prompt)
            if known is None or len(continuation) > len(known.continuation):
                accept = t.request.accept if known is None else known.accept
                scripts[prompt] = RequestScript(prompt, continuation, accept)
        return Script(list(scripts.values()))

    def abort(self, request_id: int) -> None:
        self.ops.append(Abort(request_id))
        violations = self.guard(lambda: self.book.abort(request_id))
        self.settle()
        self.fail(violations)

    def settle(self) -> None:
        """The record's ledger after a rule: each request's tokens so far, and the target call at
        which it finished or was aborted."""
        for r, entry in self.record.entries.items():
            state = self.book.requests.get(r)
            if state is None:
                continue
            entry.tokens, entry.aborted = list(state.tokens), state.aborted
            if entry.retired is None and not state.live(self.eos_token_id):
                entry.retired = len(self.record.calls)

    def step(self, log: bool = True) -> dict[int, list[int]]:
        """One engine step, judged; raises the judge's failure on the first broken check."""
        if log:
            self.ops.append(Step())
        eligible = set(self.book.live_ids())
        committed = {r: len(self.book.requests[r].prompt) + len(self.book.requests[r].tokens) for r in eligible}
        crowded = self.max_batch_size is not None and len(eligible) > self.max_batch_size
        emitted: dict[int, list[int]] = {}

        def run() -> None:
            emitted.update(self.book.step())
            self.observed()
            self.models_unchanged()
            self.book.check_unfinished()

        violations = self.guard(run)
        self.settle()
        calls = self.new_calls()
        if not violations:
            violations = self.verdict.step(calls, eligible, committed, crowded, emitted)
        self.note_admissions(emitted)
        self.fail(violations)
        return emitted

    def drain(self, log: bool = True) -> None:
        """Step until the engine has nothing left; a request that never finishes is a liveness failure."""
        if log:
            self.ops.append(Drain())
        remaining = sum(t.request.max_new_tokens - len(self.book.requests[r].tokens) for r, t in self.tracked.items())
        budget = 2 * remaining + 2 * len(self.tracked) + 4
        for _ in range(budget):
            if not self.book.live_ids():
                break
            self.step(log=False)
        self.fail(self.verdict.drained(budget))
        self.fail(self.guard(self.book.check_unfinished))

    # -- the contract and side-effect guard ----------------------------------------------------------------------------

    @staticmethod
    def guard(action: Any) -> list[Violation]:
        """Run `action`; a contract breach becomes the step's violation."""
        try:
            action()
        except ContractError as exc:
            return [exc.violation()]
        return []

    def observed(self) -> None:
        """'unobserved-forward' / 'unsupported-input' for the forwards of this step."""
        problem = breach(self.recording)
        fresh_unobserved = len(self.recording.unobserved) > self.unobserved
        self.unobserved = len(self.recording.unobserved)
        if problem is not None and (problem.rule != "unobserved-forward" or fresh_unobserved):
            raise engine_error(problem.rule, problem.found, problem.evidence)

    def models_unchanged(self) -> None:
        """'models-unchanged' after a step (`specaudit.running.guard`, a decoder run's guard)."""
        error = self.models.breach(ENGINE_RULES["models-unchanged"])
        if error is not None:
            raise error

    def new_calls(self) -> list[CallRecord]:
        calls = self.recording.target_calls[self.seen_calls :]
        self.seen_calls = len(self.recording.target_calls)
        return calls

    def note(self, what: str) -> None:
        self.events[what] += 1
        if self.on_event is not None:
            self.on_event(what)

    def note_admissions(self, emitted: dict[int, list[int]]) -> None:
        """Hypothesis events: was a newcomer admitted while the running rows were ragged, i.e.
        had accepted different numbers of tokens so far (so their lengths differ)?"""
        newcomers = [r for r in emitted if len(self.book.requests[r].tokens) == len(emitted[r])]
        running = {r: n for r, n in self.last_lengths.items() if r in emitted and r not in newcomers}
        if newcomers:
            if len(set(running.values())) >= 2:
                self.note("admission into a batch with ragged acceptance")
            elif running:
                self.note("admission into a batch with even acceptance")
            else:
                self.note("admission into an idle engine")
        self.last_lengths = {r: len(s.tokens) for r, s in self.book.requests.items() if s.live(self.eos_token_id)}
