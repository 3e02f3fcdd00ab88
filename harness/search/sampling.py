"""Hypothesis over the sampling space, and the search a sampling decoder's verdict comes from.

A sampling case (`contracts.sampling.SamplingCase`) is drawn whole: temperature below and above
1, top-k, top-p, K, a batch of a few prompts each repeated (many rows of one prompt give samples
and pairs for the independence test; several prompts make rounds ragged), pads, EOS, a draft
that disagrees with the target at a chosen rate, and how many seeded runs are pooled. A failing
case shrinks, as Hypothesis shrinks, to fewer rows, prompts, tokens and runs at which the
verdict still rejects at its stated rate: the reproducer carries its sample size.

As the greedy search (`search.driver`), one failure does not hide the rest: a failure class
(check, rule, and for a role's fit the role) found and shrunk is set aside and the search goes on
from a derived seed with what is left of the budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st

from specaudit.checks.registry import SAMPLER, Evaluation, evaluate
from specaudit.contracts.case import Case
from specaudit.contracts.decoder import load_decoder
from specaudit.contracts.sampling import Sampling, SamplingCase
from specaudit.contracts.violation import Violation
from specaudit.fixtures import VOCAB_SIZE
from specaudit.running.sampling import SampledRun, run_sampling_case
from specaudit.search.determinism import without_local_constants
from specaudit.search.driver import derived_seed

TEMPERATURES = (1.0, 0.7, 0.4, 1.5, 2.0)
TOP_K = (None, 20, 5, 60)
TOP_P = (None, 0.9, 0.6, 0.3)
DISAGREE = (0.5, 0.8, 0.2, 1.0, 0.0)
"""Each shrinks toward its first value: plain settings, a draft that disagrees half the time."""

SAMPLE_SIZES = (256, 512, 1024, 2048)
"""Tokens a case pools (through its runs), smallest first: a shift of 0.1 in total variation (the weakest
planted bug's) needs about 2000 of one role; the smaller sizes keep most cases, and the shrunk ones, cheap."""

SHRINK_BUDGET = 20
"""Sampled cases Hypothesis's shrinker may run after the first failure (each case is `runs` decoder runs)."""
MINIMIZE_BUDGET = 30
"""Sampled cases the greedy minimizer (`minimize`) may run on the shrunk case."""


@st.composite
def sampling_cases(draw: st.DrawFn, max_prompts: int = 3, max_copies: int = 6, max_runs: int = 32) -> SamplingCase:
    """A sampling case over the transparent target and the mixture draft."""
    distinct = draw(st.integers(1, max_prompts), label="distinct prompts")
    token = st.integers(0, VOCAB_SIZE - 1)
    prompts = draw(st.lists(st.lists(token, min_size=1, max_size=6).map(tuple), min_size=distinct,
                            max_size=distinct, unique=True), label="prompts")  # fmt: skip
    copies = [draw(st.integers(1, max_copies), label=f"rows of prompt {i}") for i in range(distinct)]
    rows = [p for p, c in zip(prompts, copies) for _ in range(c)]
    order = draw(st.permutations(range(len(rows))), label="row order")
    case = Case(
        tuple(rows[i] for i in order),
        tuple(() for _ in rows),
        num_draft_tokens=draw(st.integers(1, 4), label="K"),
        max_new_tokens=draw(st.integers(2, 16), label="max_new_tokens"),
        eos_token_id=draw(st.none() | token, label="eos_token_id"),
        pad_token_id=draw(token, label="pad_token_id"),
        extra_pad_columns=draw(st.integers(0, 2), label="extra pad columns"),
        model="transparent",
        draft="mixture",
    )
    sampling = Sampling(
        draw(st.sampled_from(TEMPERATURES), label="temperature"),
        draw(st.sampled_from(TOP_K), label="top_k"),
        draw(st.sampled_from(TOP_P), label="top_p"),
    )
    disagree = draw(st.sampled_from(DISAGREE), label="disagree")
    tokens = draw(st.sampled_from(SAMPLE_SIZES), label="sample size")
    runs = min(max_runs, -(-tokens // (case.batch_size * case.max_new_tokens)))  # runs to pool about `tokens`
    return SamplingCase(case, sampling, disagree, runs, draw(st.integers(0, 2**16), label="seed"))


FailureClass = tuple[str, str, str]
"""(check, rule, role): a role's fit failing is another failure than another role's."""


def failure_class(v: Violation) -> FailureClass:
    return v.check, v.rule, str(v.evidence.get("role", ""))


@dataclass(frozen=True)
class SamplingFound:
    """One distinct failure: its class, its shrunk case and its verdict there."""

    failure_class: FailureClass
    minimal: SamplingCase
    evaluation: Evaluation
    examples: int
    seconds_to_find: float
    shrink_runs: int

    @property
    def violation(self) -> Violation:
        """The first violation of its class on the minimal case."""
        return next(v for v in self.evaluation.violations if failure_class(v) == self.failure_class)


@dataclass
class SamplingSearch:
    """How many cases were run, and the failures found (`on_run` sees every generated case)."""

    cases_run: int = 0
    seconds: float = 0.0
    failures: list[SamplingFound] = field(default_factory=list)

    @property
    def found(self) -> bool:
        return bool(self.failures)


class _Failed(Exception):
    def __init__(self, case: SamplingCase) -> None:
        self.case = case


class _BudgetSpent(BaseException):
    """Ends the shrinker once its budget is spent (see `search.driver._BudgetSpent`)."""


@dataclass
class _Round:
    target: FailureClass | None = None
    examples: int = 0
    shrink_runs: int = 0
    seconds_to_find: float = 0.0
    latest: SamplingCase | None = None
    failing: dict[SamplingCase, Evaluation] = field(default_factory=dict)


def search_sampling(
    spec: str,
    *,
    max_examples: int,
    seed: int,
    factory: Any = None,
    shrink_budget: int = SHRINK_BUDGET,
    minimize_budget: int = MINIMIZE_BUDGET,
    max_failures: int = 4,
    strategy: st.SearchStrategy[SamplingCase] | None = None,
    on_run: Callable[[SampledRun], None] | None = None,
    enough: Callable[[FailureClass], bool] | None = None,
) -> SamplingSearch:
    """Generated sampling cases until a new failure class, shrunk; again, up to `max_failures`, or
    until a class found is `enough` (a planted bug's search: once its sampling check has fired)."""
    factory = factory or load_decoder(spec)
    result, set_aside, start = SamplingSearch(), set(), time.perf_counter()
    for index in range(max_failures):
        if result.cases_run >= max_examples:
            break
        state = _Round()
        draws = sampling_cases() if strategy is None else strategy
        minimal = search_round(spec, factory, state, max_examples - result.cases_run, derived_seed(seed, index),
                               set_aside, shrink_budget, draws, result, on_run)  # fmt: skip
        result.cases_run += state.examples
        if minimal is None or state.target is None:
            break
        set_aside.add(state.target)
        minimal, evaluation = minimize(spec, factory, minimal, state.target, state.failing[minimal], minimize_budget)
        result.failures.append(SamplingFound(state.target, minimal, evaluation, result.cases_run,
                                             state.seconds_to_find, state.shrink_runs))  # fmt: skip
        if enough is not None and enough(state.target):
            break
    result.seconds = time.perf_counter() - start
    return result


def search_round(
    spec: str,
    factory: Any,
    state: _Round,
    max_examples: int,
    seed: int,
    set_aside: set[FailureClass],
    shrink_budget: int,
    strategy: st.SearchStrategy[SamplingCase],
    result: SamplingSearch,
    on_run: Callable[[SampledRun], None] | None,
) -> SamplingCase | None:
    start = time.perf_counter()

    def fails(scase: SamplingCase) -> bool:
        if state.target is not None:
            if state.shrink_runs >= shrink_budget:
                raise _BudgetSpent
            state.shrink_runs += 1
        sampled = run_sampling_case(spec, scase, factory=factory)
        evaluation = evaluate(SAMPLER, sampled)
        if state.target is None:
            state.examples += 1
            if on_run is not None:
                on_run(sampled)
        found = next((failure_class(v) for v in evaluation.violations if failure_class(v) not in set_aside), None)
        if found is None or (state.target is not None and found != state.target):
            return False
        if state.target is None:
            state.target, state.seconds_to_find = found, time.perf_counter() - start
        state.failing[scase] = evaluation
        return True

    @hseed(seed)
    @settings(max_examples=max_examples, derandomize=False, deadline=None, database=None,
              phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck), print_blob=False,
              report_multiple_bugs=False)  # fmt: skip
    @given(data=st.data())
    def prop(data: st.DataObject) -> None:
        scase = data.draw(strategy, label="sampling case")
        if scase not in state.failing and not fails(scase):
            return
        state.latest = scase
        raise _Failed(scase)

    try:
        with without_local_constants():
            prop()
    except _Failed as failed:
        return failed.case
    except _BudgetSpent:
        return state.latest
    return None


# ---------------------------------------------------------------------------------------
# Minimizing: the fewest rows, prompts, tokens and runs at which the case still fails in its class


def candidates(scase: SamplingCase) -> list[SamplingCase]:
    """Smaller cases, the largest cut first: a prompt's rows gone, half the rows of a prompt, fewer
    runs, fewer tokens, K 1, no pads, no EOS, no top-k or top-p, shorter prompts."""
    case, found = scase.case, []
    prompts = list(dict.fromkeys(case.prompts))

    def rows(keep: list[int]) -> SamplingCase | None:
        if not keep or len(keep) == case.batch_size:
            return None
        picked = tuple(case.prompts[i] for i in keep)
        return replace(scase, case=replace(case, prompts=picked, accept=tuple(() for _ in picked)))

    for prompt in prompts:  # a prompt's rows gone, then half of them, then one
        mine = [i for i, p in enumerate(case.prompts) if p == prompt]
        for drop in (mine, mine[len(mine) // 2 :], mine[-1:]):
            found.append(rows([i for i in range(case.batch_size) if i not in drop]))
    for runs in (1, scase.runs // 2, scase.runs - 1):
        found.append(replace(scase, runs=runs) if 1 <= runs < scase.runs else None)
    for tokens in (2, case.max_new_tokens // 2, case.max_new_tokens - 1):
        found.append(replace(scase, case=replace(case, max_new_tokens=tokens)) if 2 <= tokens < case.max_new_tokens
                     else None)  # fmt: skip
    simpler = {"num_draft_tokens": 1, "extra_pad_columns": 0, "eos_token_id": None}
    found += [replace(scase, case=replace(case, **{k: v})) for k, v in simpler.items() if getattr(case, k) != v]
    sampling = scase.sampling
    if sampling.top_k:
        found.append(replace(scase, sampling=replace(sampling, top_k=None)))
    if sampling.top_p is not None:
        found.append(replace(scase, sampling=replace(sampling, top_p=None)))
    for prompt in prompts:  # a prompt one token shorter, every row of it
        if len(prompt) > 1 and prompt[1:] not in prompts:
            shorter = tuple(p[1:] if p == prompt else p for p in case.prompts)
            found.append(replace(scase, case=replace(case, prompts=shorter)))
    return [c for c in found if c is not None]


def minimize(
    spec: str, factory: Any, scase: SamplingCase, target: FailureClass, evaluation: Evaluation,
    budget: int = MINIMIZE_BUDGET,
) -> tuple[SamplingCase, Evaluation]:  # fmt: skip
    """Greedy: take the first smaller case that still fails in `target`'s class, until none does or
    the budget is spent. Each case keeps its seed, so what it keeps is a replayable rejection."""
    runs = 0
    improved = True
    while improved and runs < budget:
        improved = False
        for candidate in candidates(scase):
            if runs >= budget:
                break
            runs += 1
            found = evaluate(SAMPLER, run_sampling_case(spec, candidate, factory=factory))
            if any(failure_class(v) == target for v in found.violations):
                scase, evaluation, improved = candidate, found, True
                break
    return scase, evaluation
