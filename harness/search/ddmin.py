"""Delta debugging: shrink a failing case that Hypothesis never generated.

Three layers:

- `ddmin(items, fails)`: Zeller and Hildebrandt's minimizing delta debugging over a list,
  with a `fails(subset) -> bool` predicate (True: the subset still shows the failure).
- `Minimizer`: the one driver for whatever is shrunk, a case or an engine's rule sequence:
  the failure class to keep, each candidate run once, a run budget.
- `minimize_case(decoder_spec, case)`: ddmin and small scans applied to a `Case`, stage by
  stage, keeping the *same failure class*: the (first violated check, signature) pair of
  `specaudit.checks.diagnosis.diagnose` on the original case. A candidate that fails differently (a
  contract break where there was an I2 violation, say) does not count as reproducing. With
  `counts` (the gate's "not a known failure"), a candidate must also keep a violation that
  counts, so a case never shrinks into one that shows only known failures.
  `minimize_ops(rules)`: the same over an engine rule sequence (`EngineRules`), keeping the
  first violation's check and rule.

Stages, in order, repeated until a whole pass changes nothing (or the budget runs out):

  rows            ddmin over the rows. Dropping rows never separates duplicates' patterns,
                  so rows with the same prompt stay consistent.
  prompt tokens   ddmin over the tokens of each distinct prompt (>= 1 token kept), applied
                  to every row holding that prompt, so duplicates stay duplicates.
  schedule        the accept patterns are cut or padded with False to the case's horizon
                  (max_new_tokens + K + 2), then all patterns False (every draft rejected)
                  is tried, then ddmin over the set of True flags (per distinct prompt and
                  generated index) finds a 1-minimal set of flags that must stay True: fewer
                  accepted drafts, a simpler schedule.
  K               K = 1, 2, ..., K - 1: the smallest that still fails.
  max_new_tokens  1, 2, ..., max_new_tokens - 1: the smallest that still fails.
  padding         extra_pad_columns = 0.
  eos             eos_token_id = None (no EOS at all).

Changing K or max_new_tokens changes the horizon; the patterns are cut or padded with False
to the new one. A candidate that is not a valid case (two distinct prompts made equal with
different patterns) or is ambiguous for the scripted draft (a prompt plus its oracle
continuation starting with another prompt) is skipped without a run.

Every run goes through `specaudit.running.runner.run_case`, whose oracle continuations are cached per
prompt, so on the transparent model a rerun costs one decoder run: an 8-row case shrinks
in about a hundred runs, a few seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from specaudit.checks.diagnosis import Diagnosis, diagnose, first_cause
from specaudit.checks.registry import violations_in_order
from specaudit.config.settings import DEFAULT_MINIMIZE_BUDGET
from specaudit.contracts.case import Case
from specaudit.contracts.decoder import load_decoder
from specaudit.contracts.engine_rules import AddRequest, EngineRules, Op, as_rules
from specaudit.contracts.violation import Violation
from specaudit.running.runner import Run, run_case
from specaudit.search.engine_replay import replay_rules
from specaudit.search.strategies import ambiguous

T = TypeVar("T")
C = TypeVar("C")  # what is shrunk
E = TypeVar("E")  # what a run of it shows

DEFAULT_BUDGET = DEFAULT_MINIMIZE_BUDGET
"""Decoder runs `minimize_case` may spend; then it returns the smallest failing case so far."""


# ---------------------------------------------------------------------------------------
# Generic ddmin


def _split(indices: list[int], n: int) -> list[list[int]]:
    """`indices` cut into n contiguous chunks whose sizes differ by at most one."""
    size, extra = divmod(len(indices), n)
    chunks, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        chunks.append(indices[start:end])
        start = end
    return chunks


def ddmin(items: Sequence[T], fails: Callable[[list[T]], bool]) -> list[T]:
    """A 1-minimal failing sub-list of `items` (order kept): removing any one element passes.

    `fails(items)` must be True. The empty list is never tested (it is taken to pass), so
    the result has at least one element. Each distinct subset is tested at most once:
    results are cached by the tuple of the subset's indices into `items`, so elements need
    not be hashable and equal elements at different places stay distinct.

    Complexity (Zeller and Hildebrandt, 2002), in calls of `fails` for n items: worst case
    O(n^2) (at most n^2 + 3n); when a single element causes the failure, O(log n) (about
    2 log2 n). Granularity starts at 2 chunks; on a failing chunk it restarts at 2, on a
    failing complement it drops by one, otherwise it doubles until it reaches single
    elements, where the last round tests every one-element removal.
    """
    cache: dict[tuple[int, ...], bool] = {}

    def test(subset: list[int]) -> bool:
        key = tuple(subset)
        if key not in cache:
            cache[key] = bool(fails([items[i] for i in subset]))
        return cache[key]

    current = list(range(len(items)))
    if not test(current):
        raise ValueError("ddmin needs a failing input: fails(items) is False")
    n = 2
    while len(current) >= 2:
        n = min(n, len(current))
        chunks = _split(current, n)
        reduced = next((chunk for chunk in chunks if test(chunk)), None)
        if reduced is not None:
            current, n = reduced, 2
            continue
        if n > 2:  # with two chunks the complements are the chunks themselves
            for i in range(n):
                complement = [x for j, chunk in enumerate(chunks) if j != i for x in chunk]
                if test(complement):
                    reduced = complement
                    break
            if reduced is not None:
                current, n = reduced, max(n - 1, 2)
                continue
        if n >= len(current):
            break
        n = min(2 * n, len(current))
    return [items[i] for i in current]


# ---------------------------------------------------------------------------------------
# Minimizing a Case


@dataclass(frozen=True)
class Step:
    """One stage that changed the case: what it was, what it became, and the runs it took."""

    stage: str
    before: str
    after: str
    runs: int

    def render(self) -> str:
        return f"{self.stage}: {self.before} -> {self.after} ({self.runs} runs)"


@dataclass(frozen=True)
class MinimizeResult:
    original: Case
    case: Case  # the minimized case; it fails in the same class as the original
    original_diagnosis: Diagnosis
    diagnosis: Diagnosis  # of the minimized case
    runs: int  # decoder runs made, the original's included
    candidates: int  # candidate cases looked at (runs + cache hits + skipped invalid ones)
    steps: tuple[Step, ...]
    seconds: float
    exhausted: bool  # the budget ran out before a pass changed nothing

    def summary(self) -> str:
        o, c = self.original, self.case
        lines = [
            f"rows {o.batch_size} -> {c.batch_size}, prompt tokens {_tokens(o)} -> {_tokens(c)}, "
            f"accepted flags {_flags(o)} -> {_flags(c)}, K {o.num_draft_tokens} -> {c.num_draft_tokens}, "
            f"max_new_tokens {o.max_new_tokens} -> {c.max_new_tokens}",
            f"failure class kept: first check {self.diagnosis.first_check}, signature {self.diagnosis.signature}",
            f"{self.runs} decoder runs, {self.candidates} candidates, {self.seconds:.1f} s"
            + (" (budget exhausted)" if self.exhausted else ""),
        ]
        return "\n".join(lines + [step.render() for step in self.steps])


def _tokens(case: Case) -> int:
    return sum(map(len, case.prompts))


def _flags(case: Case) -> int:
    return sum(sum(p[: case.horizon]) for p in case.accept)


def with_rows(case: Case, rows: Sequence[int]) -> Case:
    return replace(case, prompts=tuple(case.prompts[r] for r in rows), accept=tuple(case.accept[r] for r in rows))


def fit_patterns(case: Case) -> Case:
    """The accept patterns cut or padded with False to exactly the case's horizon."""
    h = case.horizon
    return replace(case, accept=tuple(tuple(p[:h]) + (False,) * (h - len(p[:h])) for p in case.accept))


class CasePasses(ValueError):
    """The case handed to `minimize_case` passes every check: there is nothing to minimize."""


class _Budget(Exception):
    pass


class Minimizer(Generic[C, E]):
    """One minimization, whatever is shrunk (a case, a rule sequence): the failure class to keep,
    each candidate run once (by its key), at most `budget` runs. A candidate reproduces when it
    fails in the original's class; invalid or inadmissible ones, ones the harness cannot run, and
    unseen ones once the budget is spent count as passing, so ddmin winds down at once."""

    def __init__(
        self,
        original: C,
        run: Callable[[C], E],
        failure_class: Callable[[E], Hashable | None],
        *,
        budget: int,
        key: Callable[[C], Hashable] = lambda c: c,
        admissible: Callable[[C], bool] = lambda c: True,
        counts: Callable[[E], bool] = lambda e: True,
    ) -> None:
        self.run, self.failure_class, self.budget = run, failure_class, budget
        self.key, self.admissible, self.counts = key, admissible, counts
        self.runs = self.candidates = 0
        self.exhausted = False
        self.results: dict[Hashable, bool] = {}
        self.evidence: dict[Hashable, E] = {}
        first = self.evidence_of(original)
        self.target = failure_class(first)
        self.results[key(original)] = self.failing = self.reproduces(first)

    def evidence_of(self, candidate: C) -> E:
        k = self.key(candidate)
        if k not in self.evidence:
            if self.runs >= self.budget:
                self.exhausted = True
                raise _Budget
            self.runs += 1
            self.evidence[k] = self.run(candidate)
        return self.evidence[k]

    def fails(self, candidate: C | None) -> bool:
        """True if `candidate` fails in the original's failure class."""
        self.candidates += 1
        if candidate is None:
            return False
        k = self.key(candidate)
        if k not in self.results:
            if not self.admissible(candidate):
                self.results[k] = False
                return False
            try:
                e = self.evidence_of(candidate)
            except _Budget:
                return False
            except Exception:  # a candidate the harness cannot run does not reproduce anything
                self.results[k] = False
                return False
            self.results[k] = self.reproduces(e)
        return self.results[k]

    def reproduces(self, e: E) -> bool:
        """Fails in the original's class, with what `counts` asks (a violation that is not a
        known failure, when the caller tolerates some)."""
        found = self.failure_class(e)
        return found is not None and found == self.target and self.counts(e)


SignedClass = tuple[str | None, ...]
"""(first violated check, signature[, contract rule]): what a case minimizer keeps (`class_of`);
the search's `driver.FailureClass` is (check, rule)."""


@dataclass(frozen=True)
class Glance:
    """A candidate's run as far as keeping the original's failure class needs: its checks judged in
    order up to that class's check (a first failure after it is another class; order independence
    runs the decoder again), in full (`diagnosis`) only when it reproduces. The original is
    diagnosed in full: its class is not known before."""

    failure: SignedClass | None  # None: no check failed (up to the class's check)
    counted: bool  # a violation that `counts` (every violation by default) is among them
    diagnosis: Diagnosis | None


class Glancer:
    """A minimizer's `run`: the first case it runs (the original) in full, each later one up to the
    class the original failed in."""

    def __init__(self, runner: Callable[[Case], Run], counts: Callable[[Violation], bool] | None) -> None:
        self.runner, self.counts = runner, counts
        self.target: SignedClass | None = None

    def __call__(self, case: Case) -> Glance:
        run = self.runner(case)
        if self.target is None:
            d = diagnose(run)
            self.target = failure = failure_class(d)
            return Glance(failure, self.counted(d.violations), d)
        found = first_cause(run, through=self.target[0])  # the diagnosis's first: its cause
        if found is None:
            return Glance(None, False, None)
        first, (signature, _) = found
        failure = class_of(first.check, signature, first.violations[0])
        if failure != self.target or not self.counted(violations_in_order(run)):
            return Glance(failure, False, None)
        return Glance(failure, True, diagnose(run))

    def counted(self, violations: Iterable[Violation]) -> bool:
        return self.counts is None or any(self.counts(v) for v in violations)


CaseMinimizer = Minimizer[Case, Glance]


def case_minimizer(
    decoder_spec: str,
    case: Case,
    *,
    factory: Any = None,
    budget: int = DEFAULT_BUDGET,
    runner: Callable[[Case], Run] | None = None,
    counts: Callable[[Violation], bool] | None = None,
) -> CaseMinimizer:
    """A case's minimizer: each candidate run (`runner`, by default `run_case` on the built-in
    models) and judged (`Glancer`); a candidate ambiguous for the scripted draft is skipped unrun."""
    if runner is None:
        factory = factory or load_decoder(decoder_spec)
        runner = lambda c: run_case(decoder_spec, c, factory=factory)  # noqa: E731
    check_ambiguity = case.draft == "scripted" and not _ambiguous(case)
    return Minimizer(
        case,
        Glancer(runner, counts),
        lambda g: g.failure,
        budget=budget,
        admissible=lambda c: not (check_ambiguity and _ambiguous(c)),
        counts=lambda g: g.counted,
    )


def failure_class(d: Diagnosis) -> SignedClass | None:
    """A diagnosis's failure class (`class_of` its first violation), None when it passed."""
    return None if d.first is None else class_of(d.first_check, d.signature, d.first)


def class_of(check: str | None, signature: str | None, first: Violation) -> SignedClass:
    """(first violated check, signature); for a contract break also the rule broken, so a
    decoder that crashes does not stand in for one that overruns max_new_tokens. An invariant's
    kv-drift is signed bonus once the case has one row (`specaudit.checks.registry.decided`): the
    same failure, so shrinking a batch to that one row keeps its class."""
    if check == "contract":
        return check, signature, first.rule
    if check in ("I1", "I2") and signature == "bonus":
        return check, "kv-drift"
    return check, signature


def _ambiguous(case: Case) -> bool:
    try:
        return ambiguous(case.model, case.dtype, set(case.prompts), case.horizon)
    except Exception:
        return False


def _make(build: Callable[[], Case]) -> Case | None:
    try:
        return build()
    except ValueError:  # e.g. two distinct prompts made equal while their patterns differ
        return None


# ---------------------------------------------------------------------------------------
# Stages: each takes the current failing case and returns a smaller (or the same) one


def shrink_rows(m: CaseMinimizer, case: Case) -> Case:
    if case.batch_size < 2:
        return case
    rows = ddmin(list(range(case.batch_size)), lambda rows: m.fails(with_rows(case, rows)))
    return with_rows(case, rows)


def shrink_prompts(m: CaseMinimizer, case: Case) -> Case:
    groups: list[list[int]] = []
    for r, prompt in enumerate(case.prompts):
        for group in groups:
            if case.prompts[group[0]] == prompt:
                group.append(r)
                break
        else:
            groups.append([r])
    for group in groups:
        prompt = case.prompts[group[0]]
        if len(prompt) < 2:
            continue

        def candidate(tokens: list[int], case: Case = case, group: list[int] = group) -> Case | None:
            new = tuple(tokens)
            prompts = tuple(new if r in group else p for r, p in enumerate(case.prompts))
            return _make(lambda: replace(case, prompts=prompts))

        kept = ddmin(list(prompt), lambda tokens: m.fails(candidate(tokens)))
        case = candidate(kept) or case
    return case


def shrink_schedule(m: CaseMinimizer, case: Case) -> Case:
    fitted = fit_patterns(case)
    if fitted != case and m.fails(fitted):
        case = fitted
    none = replace(case, accept=tuple((False,) * len(p) for p in case.accept))
    if none != case and m.fails(none):
        return none
    patterns: dict[tuple[int, ...], tuple[bool, ...]] = dict(zip(case.prompts, case.accept))
    flags = [(prompt, i) for prompt, pattern in patterns.items() for i, a in enumerate(pattern) if a]
    if len(flags) < 2:
        return case

    def candidate(kept: list[tuple[tuple[int, ...], int]]) -> Case:
        on = set(kept)
        accept = tuple(tuple((p, i) in on for i in range(len(a))) for p, a in zip(case.prompts, case.accept))
        return replace(case, accept=accept)

    return candidate(ddmin(flags, lambda kept: m.fails(candidate(kept))))


def shrink_scalar(field: str) -> Callable[[CaseMinimizer, Case], Case]:
    def stage(m: CaseMinimizer, case: Case) -> Case:
        for value in range(1, getattr(case, field)):
            candidate = fit_patterns(replace(case, **{field: value}))
            if m.fails(candidate):
                return candidate
        return case

    return stage


def shrink_padding(m: CaseMinimizer, case: Case) -> Case:
    candidate = replace(case, extra_pad_columns=0)
    return candidate if candidate != case and m.fails(candidate) else case


def shrink_eos(m: CaseMinimizer, case: Case) -> Case:
    candidate = replace(case, eos_token_id=None)
    return candidate if candidate != case and m.fails(candidate) else case


STAGES: tuple[tuple[str, Callable[[CaseMinimizer, Case], Case]], ...] = (
    ("rows", shrink_rows),
    ("prompt tokens", shrink_prompts),
    ("schedule", shrink_schedule),
    ("K", shrink_scalar("num_draft_tokens")),
    ("max_new_tokens", shrink_scalar("max_new_tokens")),
    ("padding", shrink_padding),
    ("eos", shrink_eos),
)


def describe(stage: str, case: Case) -> str:
    if stage == "rows":
        return f"{case.batch_size} rows"
    if stage == "prompt tokens":
        return f"{_tokens(case)} tokens {[len(p) for p in case.prompts]}"
    if stage == "schedule":
        return f"{_flags(case)} accepted flags"
    if stage == "K":
        return f"K={case.num_draft_tokens}"
    if stage == "max_new_tokens":
        return f"max_new_tokens={case.max_new_tokens}"
    if stage == "padding":
        return f"extra_pad_columns={case.extra_pad_columns}"
    return f"eos={case.eos_token_id}"


def minimize_case(
    decoder_spec: str,
    case: Case,
    factory: Any = None,
    budget: int = DEFAULT_BUDGET,
    *,
    runner: Callable[[Case], Run] | None = None,
    counts: Callable[[Violation], bool] | None = None,
    max_passes: int = 4,
) -> MinimizeResult:
    """Shrink a failing `case` for `decoder_spec`, keeping its failure class.

    `budget` caps the decoder runs (the original's included); `runner` replaces
    `run_case(decoder_spec, case, factory=factory)`, for cases the built-in models cannot run;
    `counts` (default: every violation) says which violations a candidate must keep at least
    one of, so a shrunk case never fails only through known failures.
    Raises CasePasses (a ValueError) if the case does not fail at all.
    """
    start = time.perf_counter()
    m = case_minimizer(decoder_spec, case, factory=factory, budget=budget, runner=runner, counts=counts)
    if not m.failing:
        raise CasePasses(f"the case passes every check for {decoder_spec}: nothing to minimize")
    steps: list[Step] = []
    current = case
    for _ in range(max_passes):
        before_pass = current
        for name, stage in STAGES:
            runs = m.runs
            shrunk = stage(m, current)
            if shrunk != current:
                steps.append(Step(name, describe(name, current), describe(name, shrunk), m.runs - runs))
                current = shrunk
            if m.exhausted:
                break
        if m.exhausted or current == before_pass:
            break
    original, minimized = m.evidence[case].diagnosis, m.evidence[current].diagnosis
    assert original is not None and minimized is not None  # the original and every case it shrank to reproduce
    return MinimizeResult(
        case,
        current,
        original,
        minimized,
        m.runs,
        m.candidates,
        tuple(steps),
        time.perf_counter() - start,
        m.exhausted,
    )


# ---------------------------------------------------------------------------------------
# Engine rule sequences: the same ddmin over an engine reproducer's rules


@dataclass
class MinimizedOps:
    """Rules shrunk by `minimize_ops`, the violations they still show and what it cost."""

    original: EngineRules
    reproducer: EngineRules
    violations: list[Violation]
    replays: int
    seconds: float

    def summary(self) -> str:
        return (
            f"{len(self.original.ops)} rules -> {len(self.reproducer.ops)}, "
            f"{self.replays} replays, {self.seconds:.1f} s"
        )


class ReproducerPasses(ValueError):
    """The engine passes the reproducer: nothing to minimize."""


def failure_key(violations: list[Violation]) -> tuple[str, str] | None:
    """The failure class a smaller reproducer must keep: the first violation's check and rule."""
    return (violations[0].check, violations[0].rule) if violations else None


def simpler_adds(ops: list[Op], i: int) -> list[list[Op]]:
    """Candidates that simplify the add at `i`: every draft rejected, then a smaller
    max_new_tokens (1, 2, ...)."""
    op = ops[i]
    if not isinstance(op, AddRequest):
        return []
    variants = [replace(op, accept=(False,) * len(op.accept))] if any(op.accept) else []
    variants += [replace(op, max_new_tokens=n) for n in range(1, op.max_new_tokens)]
    return [ops[:i] + [v] + ops[i + 1 :] for v in variants]


def minimize_ops(reproducer: EngineRules | Mapping[str, Any], budget: int = 500) -> MinimizedOps:
    """ddmin over the rules, then each add simplified, on the same `Minimizer` as a case's: a
    candidate counts when its replay fails with the same first check and rule. At most `budget`
    replays; past it the smallest failing rules so far are kept. A dict in any form engine rules
    were written in is read as `EngineRules`."""
    start = time.perf_counter()
    original = as_rules(reproducer)
    m: Minimizer[list[Op], list[Violation]] = Minimizer(
        list(original.ops),
        lambda ops: replay_rules(original.with_ops(ops)),
        failure_key,
        budget=budget,
        key=tuple,
    )
    if not m.failing:
        raise ReproducerPasses(f"{original.engine} passes the reproducer's {len(original.ops)} rules")
    ops = ddmin(list(original.ops), m.fails)
    for i in range(len(ops)):
        ops = next((c for c in simpler_adds(ops, i) if m.fails(c)), ops)
    violations = m.evidence[m.key(ops)]
    return MinimizedOps(original, original.with_ops(ops), violations, m.runs, time.perf_counter() - start)
