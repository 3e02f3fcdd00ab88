"""The engine state machine: an engine compared with the oracle after every step.

Zarr-style: a Hypothesis `RuleBasedStateMachine` whose rules add requests (prompt, limit and
an acceptance schedule the scripted draft follows), step the engine and abort requests, with
arrivals at any step. Each run is one engine session (`specaudit.running.engine_session`),
judged after every step by the engine checks (`specaudit.checks.engine`: contract, I1, I2,
equivalence, liveness).

Prompts are drawn either equal to a running request's (one arrival in `DUPLICATE_SHARE` while
others run; the event "duplicate prompt among concurrent requests", in a third to two thirds
of runs) or differing from every other within the shorter one, so a row's candidates share one
history and the binder tells duplicates apart by progress.

The machine logs its rules as `EngineRules` (`specaudit.contracts.engine_rules`);
`specaudit.search.engine_replay.replay_rules` runs them again without Hypothesis and returns
their violations.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from specaudit._moved import forward as _forward
from specaudit.checks.coverage import Coverage, coverage_of_session
from specaudit.checks.engine import EngineFailure
from specaudit.contracts.decoder import ContractError
from specaudit.contracts.engine_rules import AddRequest, EngineRules
from specaudit.fixtures import VOCAB_SIZE
from specaudit.running.engine_session import DTYPE, EngineSession
from specaudit.running.runner import oracle_continuation
from specaudit.search.determinism import without_local_constants
from specaudit.search.engine_replay import diagnose_engine, engine_session
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
# The Hypothesis state machine


def distinct_prompt(prompt: tuple[int, ...], others: list[tuple[int, ...]], pad: int) -> tuple[int, ...]:
    """`prompt`, its first token moved on until it differs from every other prompt within the
    shorter of the two (so a row's leading tokens name its request, or its duplicates) and is
    not the pad token alone (a row attending only pads is an idle row, `EngineJudge.idle`: such a
    request's rows would go unjudged)."""
    first = prompt[0]
    for _ in range(VOCAB_SIZE):
        candidate = (first,) + prompt[1:]
        distinct = all(candidate[: min(len(candidate), len(o))] != o[: min(len(candidate), len(o))] for o in others)
        if distinct and set(candidate) != {pad}:
            return candidate
        first = (first + 1) % VOCAB_SIZE
    raise ValueError("no distinct prompt left")  # unreachable with MAX_REQUESTS << VOCAB_SIZE


DUPLICATE_SHARE = 4
"""One request in DUPLICATE_SHARE, drawn while others run, repeats a running request's prompt
(and its acceptance schedule: the draft cannot tell the two apart either)."""


def draw_request(
    data: st.DataObject, request_id: int, k: int, others: list[AddRequest], running: list[AddRequest], pad: int
) -> AddRequest:
    """A request: prompt, limit and an acceptance schedule from the batch strategies' kinds;
    sometimes a running request's prompt again (rows are bound by progress, not by prompt),
    else a prompt that differs from every other within the shorter one."""
    max_new = data.draw(st.integers(1, MAX_NEW), label="max_new_tokens")
    if running and data.draw(st.integers(0, DUPLICATE_SHARE - 1), label="repeat a running prompt") == 1:
        original = data.draw(st.sampled_from(running), label="the running request repeated")
        return AddRequest(request_id, original.prompt, max_new, original.accept)
    prompt = data.draw(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=MAX_PROMPT), label="prompt")
    kind = data.draw(st.sampled_from(SCHEDULE_DRAWS), label="schedule")
    first = data.draw(st.booleans(), label="draft right at index 0")
    rounds = data.draw(rounds_for(kind, k), label="accepted per round")
    horizon = max_new + k + 2
    prompts = sorted({o.prompt for o in others})
    return AddRequest(
        request_id, distinct_prompt(tuple(prompt), prompts, pad), max_new, pattern_from_rounds(first, rounds, horizon)
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
        first = draw_request(data, 0, k, [], [], pad)
        eos = None
        if eos_at is not None:
            eos = oracle_continuation(self.model, DTYPE, first.prompt, MAX_NEW).tokens[eos_at]
        self.session = engine_session(self.engine_spec, k, eos, pad, self.model, on_event=event)
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
        pad = session.pad_token_id
        session.add(draw_request(data, len(session.tracked), session.num_draft_tokens, others, running, pad))

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
    coverage: Coverage = field(default_factory=Coverage)  # the runs' sessions, up to the first failure

    @property
    def passed(self) -> bool:
        return self.failure is None

    @property
    def shrunk_rules(self) -> int | None:
        return None if self.failure is None else len(self.failure.reproducer.ops)


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
    rules = EngineRules(spec, num_draft_tokens=1, eos_token_id=None, pad_token_id=0, ops=(), model=model)
    return EngineFailure([exc.violation()], rules, diagnose_engine)


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
        result.coverage = result.coverage.merge(coverage_of_session(session))
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
# Old paths


# replay and engine_signature moved to specaudit.search.engine_replay (ceb6d45, 966f2dc);
# their old path still resolves here, with a DeprecationWarning (specaudit._moved).
__getattr__ = _forward(__name__)
