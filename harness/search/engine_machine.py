"""The engine state machine: an engine compared with the oracle after every step.

Zarr-style: a Hypothesis `RuleBasedStateMachine` whose rules add requests (prompt, limit and
an acceptance schedule the scripted draft follows), step the engine and abort requests, with
arrivals at any step. After every step the harness checks, in this order:

  contract     the engine contract's fixed points (`specaudit.contracts.engine`), hooks saw every forward
  I1           every target forward of the step is one rectangular batch (`checks.i1`); idle
               rows that attend nothing are allowed (`IDLE_ROW_RULES`)
  I2           every row of those forwards attends exactly one live request's own tokens at
               positions 0, 1, 2, ...; its first input is that request's next token (idle
               rows, attending the pad token only, excepted)
  equivalence  each request's tokens so far are a prefix of its oracle output (finished ones
               equal to it: EOS or max_new_tokens)
  liveness     a request waits at most the declared `max_wait_steps` for its first token and
               between two emissions while no more than `max_batch_size` requests are
               unfinished; every request finishes when the machine drains the engine

Rows are bound to requests by construction: the harness knows which requests are live and
their exact histories (prompt + oracle continuation). A row's candidates are the requests whose
history it holds longest; prompts are drawn either equal to a running request's (one arrival in
`DUPLICATE_SHARE` while others run; the event "duplicate prompt among concurrent requests",
in a third to two thirds of runs) or differing from every other within the shorter one, so
candidates share one history. Rows are
then matched one to one with live candidates (`bind_rows`), each preferring the request whose
previous call it continues and whose committed length is nearest its past: requests with one
history are told apart by progress, and where they cannot be, either binding judges the same.
On a tiny real model (float64) the past slots show K/V instead: each request's history is run
once at batch size 1 and a row's past slot holds entry i of a request when its K/V equal that
run's entry i within the dtype's tolerance (`EngineKV`); the current inputs are read as tokens.

A failure carries its diagnosis (`EngineDiagnosis`): the first violated check and rule, the
engine step, target call, request, row and slot, and the paper's signature, mapped from the
first violation by the registry as a decoder run's is. Every violation notes its step in
`evidence["step"]`, so `diagnose_engine(violations, reproducer)` rebuilds it after a replay.

The machine logs its rules as a JSON reproducer; `replay(reproducer)` runs one again without
Hypothesis and returns its violations.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from specaudit.checks.i1 import i1_call_violations
from specaudit.checks.registry import alone_signature, check_named
from specaudit.checks.rows import UNKNOWN, Observation, common_prefixes, flat_cache, observe
from specaudit.contracts.builtins import check_model
from specaudit.contracts.case import ENVELOPE_FORMAT
from specaudit.contracts.decoder import ContractError, model_changes, model_state, remove_new_hooks
from specaudit.contracts.engine import EngineBook, build_engine, declared, engine_error, load_engine
from specaudit.contracts.violation import Violation, render
from specaudit.fixtures import VOCAB_SIZE
from specaudit.fixtures.pairs import is_exact, target_model
from specaudit.fixtures.transparent import RequestScript, Script, ScriptedDraft, scripted_draft, transparent_target
from specaudit.numerics.tolerance import DTYPES, KV_TOLERANCE
from specaudit.reference.oracle import kv_rows, reference_kv, truncate
from specaudit.running.instrument import CallRecord, breach, instrument
from specaudit.running.runner import oracle_continuation
from specaudit.search.determinism import without_local_constants
from specaudit.search.strategies import SCHEDULE_DRAWS, pattern_from_rounds, rounds_for

DEFAULT_ENGINES = (
    "specaudit.reference.engines:EqSpecEngine",
    "specaudit.reference.engines:ExSpecEngine",
    "specaudit.reference.engines:LazySpecEngine",
)
ENGINE_CHECKS = ("contract", "I1", "I2", "equivalence", "liveness")
MAX_REQUESTS = 8
MAX_PROMPT = 5
MAX_NEW = 10
MAX_K = 3
STEP_TIMEOUT_S = 30.0
DTYPE = "float64"
"""Every model runs in float64: the tiny real ones are then exact up to rounding far below any
greedy margin, so no tie can pass for a bug and I2 holds K/V to `KV_TOLERANCE`'s float64 bound."""
IDLE_ROW_RULES = frozenset({"row-attends-nothing"})
"""I1 rules an engine may break on purpose: a fixed-size engine runs idle rows (empty slots,
CUDA-graph batches) that attend nothing, or only the pad token (`EngineSession.idle`). Such a
row is bound to no request; an engine that used its output would emit a wrong token
(equivalence) or starve its request (liveness)."""


@dataclass(frozen=True)
class Request:
    """One add_request rule: what the engine is asked for and what the draft will get right."""

    request_id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    accept: tuple[bool, ...]  # per generated index: the draft proposes the oracle's token


@dataclass
class Tracked:
    """The harness's view of one request: its exact history and the oracle's answer."""

    request: Request
    sequence: tuple[int, ...]  # prompt + EOS-blind oracle continuation (past max_new_tokens + K)
    expected: tuple[int, ...]  # the oracle's output: up to EOS (included) or max_new_tokens


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
            f"reproducer (specaudit.search.engine_machine.replay):\n{json.dumps(self.reproducer)}"
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


@functools.lru_cache(maxsize=8)
def session_models(model: str = "transparent") -> tuple[torch.nn.Module, ScriptedDraft]:
    """The session's target and a scripted draft, built once per process and model (building a
    model costs more than a short session); each session gives the draft its own script. A tiny
    real target is a copy of the shared one, so the oracle's and the K/V references' forwards on
    the shared model are never recorded as the engine's."""
    if is_exact(model):
        return transparent_target(), scripted_draft([])
    return copy.deepcopy(target_model(model, DTYPE)), scripted_draft([])


def machine_settings(max_examples: int, steps: int = 12, **overrides: Any) -> settings:
    """Settings for the engine machine: no deadline (torch), no explain phase (it replays the
    shrunk sequence hundreds of times), `steps` rules at most per run."""
    kwargs: dict[str, Any] = dict(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    kwargs.update(overrides)
    return settings(**kwargs)


# ---------------------------------------------------------------------------------------
# A tiny real model's past: K/V against each request's batch-size-1 entries


@dataclass(frozen=True)
class Stream:
    """What a request's row attended in one target call: for the chunk rule."""

    order: int  # the call's place among all calls
    tokens: list[int]  # attended tokens, past then current (UNKNOWN for a real model's past)
    kv: torch.Tensor | None  # [L, F] a real model's K/V of those entries
    step: int = 0  # the engine step it ran in: a round never spans two steps


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

    Each tracked request's history (prompt + oracle continuation) is run once at batch size 1
    on the shared, unhooked target; a row's past slot holds a request's entry at stream index i
    when its K/V equal that run's entry i within the dtype's fixed tolerance (float64 here, so
    a wrong token, position or request is off by orders of magnitude more).
    """

    def __init__(self, model: str) -> None:
        self.reference_model = target_model(model, DTYPE)
        self.rtol, self.atol = KV_TOLERANCE[DTYPES[DTYPE]]
        self.tolerance = f"tolerance rtol {self.rtol:g}, atol {self.atol:g}"
        self.work = DTYPES[DTYPE]
        self.refs: dict[int, torch.Tensor] = {}  # request -> [Ls, F] entries of its history
        self.pads: dict[int, torch.Tensor] = {}  # m -> [m, F] entries of m pad tokens (idle rows)
        self._call: tuple[int, torch.Tensor] | None = None

    def reference(self, tokens: tuple[int, ...]) -> torch.Tensor:
        """[n, F] the batch-size-1 entries of `tokens` at positions 0..n-1."""
        with torch.no_grad():
            return kv_rows(reference_kv(self.reference_model, tokens)).to(self.work)

    def track(self, request: int, sequence: tuple[int, ...]) -> None:
        self.refs[request] = self.reference(sequence)

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

    def holds_pads(self, call: CallRecord, row: int, slots: list[int], pad: int) -> bool:
        """Whether `slots` of `row` hold the pad token's entries at positions 0, 1, ... (an idle row)."""
        if len(slots) not in self.pads:
            self.pads[len(slots)] = self.reference((pad,) * len(slots))
        found = self.entries(call, row, slots)
        return found is not None and bool(self.same(found, self.pads[len(slots)]).all())

    def describe(
        self, call: CallRecord, row: int, slot: int, ref: torch.Tensor, index: int, request: int
    ) -> tuple[str, float]:
        """(what `slot` of `row` holds in words, its largest |K/V difference| from entry `index`
        of request `request`'s `ref`)."""
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


# ---------------------------------------------------------------------------------------
# One session: an engine on instrumented models, checked after every step


@dataclass
class EngineSession:
    """Runs one engine on a built-in target (the transparent one, or a tiny real model in
    float64) and a scripted draft, checking every step."""

    spec: str
    num_draft_tokens: int
    eos_token_id: int | None
    pad_token_id: int
    model: str = "transparent"
    ops: list[dict[str, Any]] = field(default_factory=list)
    on_event: Callable[[str], None] | None = None  # hypothesis.event inside the state machine
    timeout_s: float = STEP_TIMEOUT_S  # per engine call: a step() that hangs fails instead

    def __post_init__(self) -> None:
        check_model(self.model, dtype=DTYPE)
        self.target, self.draft = session_models(self.model)
        self.kv = None if is_exact(self.model) else EngineKV(self.model)
        self.draft.script = Script([])
        self.stack = ExitStack()
        self.recording = self.stack.enter_context(instrument(self.target, self.draft))
        self.tracked: dict[int, Tracked] = {}
        self.seen_calls = 0
        self.unobserved = 0
        self.last_lengths: dict[int, int] = {}  # live request -> its tokens after the previous step
        self.streams: dict[int, Stream] = {}  # request -> what its last target call attended
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
        self.fingerprints = {"target": model_state(self.target), "draft": model_state(self.draft)}
        self.max_batch_size = declared(engine, "max_batch_size")
        self.max_wait_steps = declared(engine, "max_wait_steps")

    def close(self) -> None:
        self.stack.close()

    def reproducer(self) -> dict[str, Any]:
        return {
            "engine": self.spec,
            "num_draft_tokens": self.num_draft_tokens,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "model": self.model,
            "ops": list(self.ops),
        }

    def fail(self, violations: list[Violation]) -> None:
        """Raise the violations, each noting the engine step it broke in (for the diagnosis)."""
        if violations:
            self.failed = True
            stepped = [replace(v, evidence={**v.evidence, "step": self.book.steps}) for v in violations]
            raise EngineFailure(stepped, self.reproducer())

    # -- rules -----------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.ops.append(
            {
                "op": "add",
                "id": request.request_id,
                "prompt": list(request.prompt),
                "max_new_tokens": request.max_new_tokens,
                "accept": "".join("1" if a else "0" for a in request.accept),
            }
        )
        if any(self.tracked[r].request.prompt == request.prompt for r in self.book.live_ids()):
            self.note("duplicate prompt among concurrent requests")
        horizon = request.max_new_tokens + self.num_draft_tokens + 2
        continuation = oracle_continuation(self.model, DTYPE, request.prompt, horizon).tokens
        expected, _ = truncate(continuation, max_new_tokens=request.max_new_tokens, eos_token_id=self.eos_token_id)
        self.tracked[request.request_id] = Tracked(request, request.prompt + continuation, expected)
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
        self.ops.append({"op": "abort", "id": request_id})
        self.fail(self.guard(lambda: self.book.abort(request_id)))

    def step(self, log: bool = True) -> dict[int, list[int]]:
        """One engine step and every check on it; raises EngineFailure on the first broken check."""
        if log:
            self.ops.append({"op": "step"})
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
        calls = self.new_calls()
        if not violations:
            violations = [v for call in calls for v in i1_call_violations(call) if v.rule not in IDLE_ROW_RULES]
        if not violations:
            violations = [v for call in calls for v in self.i2(call, eligible, committed)]
        if not violations:
            violations = self.equivalence()
        if not violations:
            violations = self.liveness(eligible, emitted, crowded)
        self.note_admissions(emitted)
        self.fail(violations)
        return emitted

    def drain(self) -> None:
        """Step until the engine has nothing left; a request that never finishes is a liveness failure."""
        remaining = sum(t.request.max_new_tokens - len(self.book.requests[r].tokens) for r, t in self.tracked.items())
        budget = 2 * remaining + 2 * len(self.tracked) + 4
        for _ in range(budget):
            if not self.book.live_ids():
                break
            self.step(log=False)
        live = self.book.live_ids()
        if live:
            r = live[0]
            got = len(self.book.requests[r].tokens)
            self.fail(
                [
                    Violation(
                        "liveness",
                        "finishes",
                        f"request {r} unfinished after {budget} more steps"
                        f" ({got} of {len(self.tracked[r].expected)} tokens)",
                        "every request finishing (EOS or max_new_tokens)",
                        request=r,
                        evidence={"steps": budget, "tokens": got},
                    )
                ]
            )
        self.fail(self.guard(self.book.check_unfinished))

    # -- checks ----------------------------------------------------------------------------

    @staticmethod
    def guard(action: Any) -> list[Violation]:
        """Run `action`; a contract breach becomes the step's violation."""
        try:
            action()
        except ContractError as exc:
            return [Violation("contract", exc.rule, exc.found, exc.expected, evidence=exc.evidence)]
        return []

    def observed(self) -> None:
        """'unobserved-forward' / 'unsupported-input' for the forwards of this step."""
        problem = breach(self.recording)
        fresh_unobserved = len(self.recording.unobserved) > self.unobserved
        self.unobserved = len(self.recording.unobserved)
        if problem is not None and (problem.rule != "unobserved-forward" or fresh_unobserved):
            raise engine_error(problem.rule, problem.found, problem.evidence)

    def models_unchanged(self) -> None:
        """'models-unchanged' after a step; the shared models are repaired (hooks removed) or,
        if changed otherwise, rebuilt for the next session."""
        changes = []
        for role, model in (("target", self.target), ("draft", self.draft)):
            found = model_changes(role, self.fingerprints[role], model)
            if found:
                remove_new_hooks(self.fingerprints[role], model)
                if any(" left on " not in change for change in found):
                    session_models.cache_clear()
            changes += found
        if changes:
            raise engine_error("models-unchanged", "; ".join(changes[:6]), {"changes": changes})

    def new_calls(self) -> list[CallRecord]:
        calls = self.recording.target_calls[self.seen_calls :]
        self.seen_calls = len(self.recording.target_calls)
        return calls

    def i2(self, call: CallRecord, eligible: set[int], committed: dict[int, int]) -> list[Violation]:
        """I2 on one target call: each row bound to a request whose history it holds longest
        (`bind_rows`: one row per request, told apart by progress where histories coincide)."""
        if call.input_ids is None or call.input_ids.dim() != 2:
            return []
        if call.past_length and not call.cache_after:
            return [Violation("I2", "cache-readable", "a target call whose output has no cache", "a cache", call.index)]
        ids = list(self.tracked)
        sequences = [self.tracked[r].sequence for r in ids]
        width = max(len(s) for s in sequences)
        table = torch.tensor([list(s) + [-2] * (width - len(s)) for s in sequences])  # [R, Ls]
        lengths = torch.tensor([len(s) for s in sequences])  # [R]
        exact = self.kv is None
        obs = observe(call, exact=exact)
        # bound by content: tokens in order, positions judged apart (a wrong position is not a wrong request)
        by_content = replace(obs, positions=torch.arange(obs.tokens.shape[1]).expand_as(obs.tokens))
        prefix = common_prefixes(by_content, table, lengths, exact=exact)  # [B, R]
        if self.kv is not None:  # a real model's past counts only as far as its K/V are the request's entries
            held = self.kv.prefixes(call, obs, [self.kv.refs[r] for r in ids])  # [B, R]
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
        stream = Stream(call.order, tokens[:length], kv, self.book.steps)
        matched = int(prefix.max()) if len(ids) else 0
        tied = [ids[i] for i in range(len(ids)) if int(prefix[i]) == matched] if matched else []

        def preference(r: int) -> tuple[bool, bool, int, int]:
            done = committed.get(r, len(self.tracked[r].request.prompt) + len(self.book.requests[r].tokens))
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
                found, distance = self.kv.describe(call, row, slots[index], self.kv.refs[request], index, request)
                evidence.update(found_token=None, found_position=None, kv_distance=distance)
            return Violation("I2", rule, found, expected, call.index, row, slots[index], request, evidence)

        if request is None:
            return bad("row-identity", 0, "the first token of a live request's prompt", None, 0)
        if request not in eligible:
            state = self.book.requests.get(request)
            why = "aborted" if state is not None and state.aborted else "finished"
            found_more = f"; the row holds request {request}, {why} before this step"
            v = bad("retired-row", 0, "rows of live requests only", None, None)
            return Violation(
                "I2", v.rule, v.found + found_more, v.expected, call.index, row, v.slot, request, v.evidence
            )
        if holder != row:
            return bad("duplicate-row", 0, f"request {request} in one row only (also row {holder})", None, None)
        sequence = self.tracked[request].sequence
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
        pad, stream, past = self.pad_token_id, read.stream.tokens, read.slots[: read.past]
        if any(t != pad for t in stream[len(past) :]):
            return False
        if self.kv is None:
            return all(t == pad for t in stream[: len(past)])
        return not past or read.matched == 0 or self.kv.holds_pads(call, read.row, past, pad)

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
        return same and not any(earlier.order < c.order < call.order for c in self.recording.draft_calls)

    def equivalence(self) -> list[Violation]:
        """Each request's tokens so far are a prefix of the oracle's output."""
        out = []
        for r, t in self.tracked.items():
            got = self.book.requests[r].tokens
            if tuple(got) != t.expected[: len(got)]:
                i = next(i for i, (a, b) in enumerate(zip(got, t.expected + (None,) * len(got))) if a != b)
                want = t.expected[i] if i < len(t.expected) else "nothing (the oracle stopped)"
                out.append(
                    Violation(
                        "equivalence",
                        "oracle-prefix",
                        f"request {r} token {i} = {got[i]} (tokens so far {got[:12]})",
                        f"{want} (oracle output {list(t.expected)[:12]})",
                        request=r,
                        evidence={"index": i, "found_token": got[i], "expected": list(t.expected)},
                    )
                )
        return out

    def liveness(self, eligible: set[int], emitted: dict[int, list[int]], crowded: bool) -> list[Violation]:
        """The declared wait bound, counted over steps with room for every unfinished request."""
        out = []
        for r in sorted(eligible):
            state = self.book.requests[r]
            if r in emitted:
                state.waited = 0
            elif not crowded and not state.aborted:
                state.waited += 1
                if self.max_wait_steps is not None and state.waited > self.max_wait_steps:
                    out.append(
                        Violation(
                            "liveness",
                            "wait-bound",
                            f"request {r} passed over {state.waited} steps in a row"
                            f" ({len(state.tokens)} tokens so far)",
                            f"at most max_wait_steps = {self.max_wait_steps} with room for every request"
                            f" (max_batch_size {self.max_batch_size})",
                            request=r,
                            evidence={"waited": state.waited, "max_wait_steps": self.max_wait_steps},
                        )
                    )
        return out

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


# ---------------------------------------------------------------------------------------
# Replay


def replay(reproducer: dict[str, Any] | str | Path) -> list[Violation]:
    """Run a logged rule sequence again; returns the violations of the first failing rule ([] if none)."""
    if isinstance(reproducer, (str, Path)):
        text = Path(reproducer).read_text() if Path(str(reproducer)).exists() else str(reproducer)
        reproducer = json.loads(text)
    if reproducer.get("format") == ENVELOPE_FORMAT:  # a reproducer file: the rules are its subject and payload
        reproducer = {**reproducer["subject"], **reproducer["payload"]}
    session = EngineSession(
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


# ---------------------------------------------------------------------------------------
# The Hypothesis state machine


def distinct_prompt(prompt: tuple[int, ...], others: list[tuple[int, ...]]) -> tuple[int, ...]:
    """`prompt`, its first token moved on until it differs from every other prompt within the
    shorter of the two (so a row's leading tokens name its request, or its duplicates)."""
    first = prompt[0]
    for _ in range(VOCAB_SIZE):
        candidate = (first,) + prompt[1:]
        if all(candidate[: min(len(candidate), len(o))] != o[: min(len(candidate), len(o))] for o in others):
            return candidate
        first = (first + 1) % VOCAB_SIZE
    raise ValueError("no distinct prompt left")  # unreachable with MAX_REQUESTS << VOCAB_SIZE


DUPLICATE_SHARE = 4
"""One request in DUPLICATE_SHARE, drawn while others run, repeats a running request's prompt
(and its acceptance schedule: the draft cannot tell the two apart either)."""


def draw_request(
    data: st.DataObject, request_id: int, k: int, others: list[Request], running: list[Request]
) -> Request:
    """A request: prompt, limit and an acceptance schedule from the batch strategies' kinds;
    sometimes a running request's prompt again (rows are bound by progress, not by prompt),
    else a prompt that differs from every other within the shorter one."""
    max_new = data.draw(st.integers(1, MAX_NEW), label="max_new_tokens")
    if running and data.draw(st.integers(0, DUPLICATE_SHARE - 1), label="repeat a running prompt") == 1:
        original = data.draw(st.sampled_from(running), label="the running request repeated")
        return Request(request_id, original.prompt, max_new, original.accept)
    prompt = data.draw(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=MAX_PROMPT), label="prompt")
    kind = data.draw(st.sampled_from(SCHEDULE_DRAWS), label="schedule")
    first = data.draw(st.booleans(), label="draft right at index 0")
    rounds = data.draw(rounds_for(kind, k), label="accepted per round")
    horizon = max_new + k + 2
    prompts = sorted({o.prompt for o in others})
    return Request(
        request_id, distinct_prompt(tuple(prompt), prompts), max_new, pattern_from_rounds(first, rounds, horizon)
    )


class EngineMachine(RuleBasedStateMachine):
    """Rules: add a request (arriving at any step), step the engine, abort a request."""

    engine_spec: str = DEFAULT_ENGINES[0]
    model: str = "transparent"
    tally: Counter[str] = Counter()  # per class (see machine_for): runs, and runs that had each event

    def __init__(self) -> None:
        super().__init__()
        self.session: EngineSession | None = None

    @initialize(
        k=st.integers(1, MAX_K),
        pad=st.integers(0, VOCAB_SIZE - 1),
        eos_at=st.one_of(st.none(), st.integers(0, MAX_NEW - 1)),
        initial=st.integers(1, 4),
        data=st.data(),
    )
    def start(self, k: int, pad: int, eos_at: int | None, initial: int, data: st.DataObject) -> None:
        """Build the engine with 1 to 3 requests waiting; EOS, if any, is a token the first
        request's oracle emits."""
        first = draw_request(data, 0, k, [], [])
        eos = None
        if eos_at is not None:
            eos = oracle_continuation(self.model, DTYPE, first.prompt, MAX_NEW).tokens[eos_at]
        self.session = EngineSession(self.engine_spec, k, eos, pad, self.model, on_event=event)
        self.session.add(first)
        for _ in range(initial - 1):
            self.add_request(data)

    @precondition(lambda self: self.session is not None and len(self.session.tracked) < MAX_REQUESTS)
    @rule(data=st.data())
    def add_request(self, data: st.DataObject) -> None:
        session = self.session
        assert session is not None
        others = [t.request for t in session.tracked.values()]
        running = [session.tracked[r].request for r in session.book.live_ids()]
        session.add(draw_request(data, len(session.tracked), session.num_draft_tokens, others, running))

    @precondition(
        lambda self: (
            self.session is not None
            and len(self.session.book.live_ids()) >= 2
            and len(self.session.tracked) < MAX_REQUESTS
        )
    )
    @rule(data=st.data())
    def arrive_mid_flight(self, data: st.DataObject) -> None:
        """add_request while at least two requests run: arrivals into a (possibly ragged) batch,
        twice as likely as through add_request alone."""
        self.add_request(data)

    @precondition(
        lambda self: (
            self.session is not None
            and (bool(self.session.book.live_ids()) or len(self.session.tracked) >= MAX_REQUESTS)
        )
    )
    @rule()
    def step(self) -> None:
        """Step the engine (while it has work: an idle engine waits for the next arrival)."""
        assert self.session is not None
        self.session.step()

    @precondition(lambda self: self.session is not None and bool(self.session.book.live_ids()))
    @rule(which=st.integers(0, MAX_REQUESTS))
    def abort(self, which: int) -> None:
        """Abort a request: a live one mostly, else a finished or unknown id (which must do nothing)."""
        session = self.session
        assert session is not None
        live = session.book.live_ids()
        session.abort(live[which % len(live)] if which < MAX_REQUESTS else len(session.tracked) + 7)

    def teardown(self) -> None:
        session = self.session
        if session is None:
            return
        tally = type(self).tally
        tally.update(["runs", *session.events])  # each event once per run
        if session.failed and not tally["runs to first failure"]:
            tally["runs to first failure"] = tally["runs"]
        try:
            if not session.failed:
                session.ops.append({"op": "drain"})
                session.drain()
        finally:
            session.close()


def machine_for(spec: str, model: str = "transparent") -> type[EngineMachine]:
    """The state machine class for one engine spec on one built-in model."""
    name = "EngineMachine_" + "".join(c if c.isalnum() else "_" for c in f"{spec}_{model}")
    return type(name, (EngineMachine,), {"engine_spec": spec, "model": model, "tally": Counter()})


def event_shares(machine: type[EngineMachine]) -> dict[str, float]:
    """Share of the machine's runs so far that had each event (Hypothesis's statistics do
    not cover `run_state_machine_as_test`)."""
    runs = machine.tally["runs"]
    counts = {what: n for what, n in machine.tally.items() if what.startswith(("admission", "duplicate"))}
    return {what: n / runs for what, n in sorted(counts.items()) if runs}


# ---------------------------------------------------------------------------------------
# Running the machine for the CLI, the gate and the kill table


@dataclass
class MachineRun:
    """One engine through the state machine: how many runs and rules it took to the first
    failure (if any), the shrunk failure, and the admission events' shares."""

    spec: str
    runs: int = 0
    rules: int = 0  # rules (ops) over every run, the failing one included
    seconds: float = 0.0
    failure: EngineFailure | None = None
    runs_to_failure: int | None = None
    rules_to_failure: int | None = None
    first_failing_rules: int | None = None  # length of the first failing run, before shrinking
    seconds_to_failure: float | None = None
    events: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.failure is None

    @property
    def shrunk_rules(self) -> int | None:
        return None if self.failure is None else len(self.failure.reproducer["ops"])


def engine_failure_in(exc: BaseException) -> EngineFailure | None:
    """The EngineFailure an exception is or holds (Hypothesis may group or wrap it as flaky)."""
    if isinstance(exc, EngineFailure):
        return exc
    for inner in getattr(exc, "exceptions", ()):  # an exception group
        found = engine_failure_in(inner)
        if found is not None:
            return found
    cause = exc.__cause__ or exc.__context__
    return engine_failure_in(cause) if cause is not None and cause is not exc else None


def machine_failure(exc: BaseException, spec: str, model: str) -> EngineFailure | None:
    """The EngineFailure an exception out of the state machine stands for (None: not the
    engine's failure, so raise it): an engine whose constructor raises, in the machine's first
    rule, fails the contract's 'engine-builds' with no rules."""
    if not isinstance(exc, ContractError):
        return engine_failure_in(exc)
    violation = Violation("contract", exc.rule, exc.found, exc.expected, evidence=exc.evidence)
    reproducer = {"engine": spec, "num_draft_tokens": 1, "eos_token_id": None, "pad_token_id": 0, "model": model}
    return EngineFailure([violation], dict(reproducer, ops=[]))


def run_machine(
    spec: str,
    max_examples: int,
    steps: int = 12,
    *,
    seed: int = 0,
    shrink: bool = True,
    model: str = "transparent",
) -> MachineRun:
    """The state machine on `spec` and a built-in `model` with `seed` deciding the runs (no
    database, quiet): the shrunk failure (unshrunk with `shrink=False`, a fraction of the time)
    or a pass. An engine whose constructor raises fails the contract's 'engine-builds' with no rules."""
    from hypothesis import Verbosity
    from hypothesis import seed as hseed
    from hypothesis.stateful import get_state_machine_test

    result = MachineRun(spec)
    start = time.perf_counter()
    base = machine_for(spec, model)

    def timed_teardown(machine: EngineMachine) -> None:
        session = machine.session
        try:
            EngineMachine.teardown(machine)  # drains the engine: the run may fail here
        finally:
            count(session)

    def count(session: EngineSession | None) -> None:
        if session is None or result.runs_to_failure is not None:
            return
        result.rules += len(session.ops)
        if session.failed:
            result.runs_to_failure = base.tally["runs"]
            result.rules_to_failure = result.rules
            result.first_failing_rules = len(session.ops)
            result.seconds_to_failure = time.perf_counter() - start

    machine = type(base.__name__, (base,), {"teardown": timed_teardown})
    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]
    test = get_state_machine_test(
        machine,
        settings=machine_settings(
            max_examples, steps, derandomize=False, database=None, phases=phases, verbosity=Verbosity.quiet
        ),
    )
    try:
        with without_local_constants():
            hseed(seed)(test)()
    except Exception as exc:
        result.failure = machine_failure(exc, spec, model)
        if result.failure is None:
            raise
    result.runs = base.tally["runs"]
    result.seconds = time.perf_counter() - start
    result.events = event_shares(base)
    if result.failure is not None and result.runs_to_failure is None:
        result.runs_to_failure, result.seconds_to_failure = max(result.runs, 1), result.seconds
    return result


# ---------------------------------------------------------------------------------------
# Minimizing a reproducer: delta debugging over its rules, keeping the failure class


__all__ = [
    "DEFAULT_ENGINES",
    "ENGINE_CHECKS",
    "EngineDiagnosis",
    "EngineFailure",
    "EngineMachine",
    "EngineSession",
    "MachineRun",
    "Request",
    "diagnose_engine",
    "engine_signature",
    "event_shares",
    "machine_failure",
    "machine_for",
    "replay",
    "run_machine",
]
