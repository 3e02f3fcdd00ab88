"""Black-box continuous-batching engines: the evidence and its judgement, at the output level.

For engines that own their models (a vLLM `LLM`, an OpenAI-compatible server, a step-wise
engine whose models the harness cannot hook). Requests arrive on a seeded schedule, so that
some join while others run, which is where continuous batching goes wrong (positions counted
from the wrong origin, stale cache rows, masks not extended); each request's tokens are then
compared with the batch-size-1 greedy oracle of a target the harness holds in process (the same
weights the engine serves), tie-aware as `specaudit.checks.compare_row` does.

This module is what every transport shares, so that the judge knows no transport: the requests
and their arrival schedule, the output-contract rules (`RULES`), the judgement (`judge_answers`:
oracles, tie-aware comparison, overlaps) and the result (`EngineAuditResult`). The transports
(a server, a callable, a step-wise engine) are `specaudit.adapters.transports`; the
`specaudit blackbox` command is `specaudit.commands.blackbox`.

Level of evidence: OUTPUT ONLY. What is checked is each request's tokens, length and stop
against the oracle: exact match, partial match, first divergence. The harness sees no forward
of the engine's models, so there is no I1, no I2, no row identity, no token preservation and no
diagnosis of the cause; a pass is evidence that these schedules produced oracle outputs, not
that the engine's cache and masks are right (a wrong row can still produce the right argmax).
For engines whose models can be hooked, the step-wise engine contract and its state machine
(`specaudit.search.engine_machine`) check all of that.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st

from specaudit._moved import forward as _forward
from specaudit.adapters.blackbox import dtype_name
from specaudit.artifacts.report import entry
from specaudit.checks.coverage import OUTPUTS, Coverage, coverage_of_answers
from specaudit.checks.equivalence import RowEquivalence, divergence
from specaudit.checks.outputs import OUTPUT_RULES, OutputEvidence, compared, token_violation
from specaudit.checks.registry import BLACK_BOX, Evaluation, evaluate
from specaudit.contracts.builtins import MODELS
from specaudit.contracts.violation import Violation
from specaudit.reference.oracle import OracleResult, answer_oracles, greedy_oracle
from specaudit.running.record import Entry, Record

EVIDENCE = (
    "output level only: each request's tokens against the batch-size-1 greedy oracle; the engine's "
    "model forwards are not observed, so no I1, no I2, no row identity and no diagnosis of the cause"
)

RULES: dict[str, str] = {
    "responds": "a response within the time limit",
    "http-status": "HTTP 200",
    "json-response": "a JSON completion object",
    "token-ids": "choices[0].token_ids, a list of int token ids (send return_token_ids)",
    **OUTPUT_RULES,  # token-count, max-new-tokens, ends-at-eos: `checks.outputs`, shared with paged engines
    "generate-returns": "generate() returning one list of int token ids per prompt, without raising",
}
"""Each output-contract rule of the black-box engine audit and what it wants."""


def contract_violation(rule: str, found: str, request: int | None, evidence: dict[str, Any] | None = None) -> Violation:
    return Violation("contract", rule, found, RULES.get(rule, rule), request=request, evidence=evidence or {})


# ---------------------------------------------------------------------------------------
# Requests and their arrival schedule


@dataclass(frozen=True)
class Request:
    """One request of the audit. `arrival`: seconds after the start (server), the step it is added at
    (step-wise engine) or its place in the arrival order (generate callable)."""

    id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival: float


def per_request(max_new_tokens: int | Sequence[int], n: int) -> list[int]:
    limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else [int(m) for m in max_new_tokens]
    if len(limits) != n or any(m < 1 for m in limits):
        raise ValueError(f"max_new_tokens: one value >= 1 per prompt ({n}), got {max_new_tokens!r}")
    return limits


def make_requests(
    prompts: Sequence[Sequence[int]], arrivals: Sequence[float], max_new_tokens: int | Sequence[int]
) -> list[Request]:
    """Requests 0..n-1 with the given arrivals (one per prompt)."""
    if len(arrivals) != len(prompts) or not prompts:
        raise ValueError(f"one arrival per prompt: {len(arrivals)} arrivals for {len(prompts)} prompts")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    limits = per_request(max_new_tokens, len(prompts))
    return [
        Request(i, tuple(int(t) for t in p), m, float(a)) for i, (p, m, a) in enumerate(zip(prompts, limits, arrivals))
    ]


def seeded_arrivals(n: int, seed: int, spread: float, *, steps: bool = False) -> list[float]:
    """Arrival offsets in [0, spread] from `random.Random(seed)`, the earliest at 0 (integers when `steps`)."""
    rng = random.Random(seed)
    raw = [float(rng.randint(0, int(spread))) if steps else rng.uniform(0.0, spread) for _ in range(n)]
    first = min(raw)
    return [round(a - first, 4) for a in raw]


def mixed_limits(n: int, limit: int, seed: int) -> list[int]:
    """Each request's max_new_tokens: the first `limit`, the others drawn from [limit // 4, limit] by
    the seed, so the limits land at different places (inside an accepted run, at a block boundary)."""
    rng = random.Random(f"limits-{seed}")
    return [limit] + [rng.randint(max(1, limit // 4), limit) for _ in range(n - 1)]


def likely_eos(target: torch.nn.Module, prompts: Sequence[Sequence[int]], limits: Sequence[int]) -> int | None:
    """An EOS that ends some requests early: of the tokens the target's greedy continuations emit,
    the one first emitted strictly inside the most continuations (neither first, which would test
    nothing, nor last), preferring one that leaves some request to run to its limit. None if no
    token qualifies (an EOS nobody produces would never be tested)."""
    inside: Counter[int] = Counter()
    everywhere: set[int] | None = None
    with torch.no_grad():
        for prompt, limit in zip(prompts, limits):
            tokens = greedy_oracle(target, tuple(prompt), max_new_tokens=limit, eos_token_id=None).tokens
            first = {t: i for i, t in reversed(list(enumerate(tokens)))}
            inside.update(t for t, i in first.items() if 0 < i < limit - 1)
            everywhere = set(first) if everywhere is None else everywhere & set(first)
    ranked = sorted(inside, key=lambda t: (t in (everywhere or set()), -inside[t], t))
    return ranked[0] if ranked else None


def arrival_offsets(n: int, spread: float, *, steps: bool = False) -> st.SearchStrategy[list[float]]:
    """Hypothesis strategy for `n` arrival offsets in [0, spread] (integer step indices when `steps`)."""
    one = (
        st.integers(0, int(spread)).map(float)
        if steps
        else st.floats(0.0, spread, allow_nan=False, allow_infinity=False)
    )
    return st.lists(one, min_size=n, max_size=n).map(lambda xs: [round(x - min(xs), 4) for x in xs])


# ---------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class RequestOutcome:
    """One request: what came back, when it was in flight, and how it compares with the oracle."""

    request: Request
    tokens: tuple[int, ...] | None  # None: no usable answer (see `error`)
    error: Violation | None  # the output contract broken for this request
    row: RowEquivalence | None  # tie-aware comparison with the oracle
    violation: Violation | None  # the first divergence, as an equivalence violation
    start: float | None  # sent (seconds), added (step index) or its generate call's index
    end: float | None  # answered (seconds), finished (step index) or its generate call's index
    overlapped: bool  # in flight with another request (same generate call, for callables)
    note: str = ""  # a normalisation applied to the answer (e.g. an EOS put back)

    @property
    def status(self) -> str:
        if self.error is not None:
            return "error"
        assert self.row is not None
        return self.row.verdict

    @property
    def first_divergence(self) -> int | None:
        return None if self.row is None else self.row.first_divergence

    @property
    def partial(self) -> float:
        return 0.0 if self.row is None else self.row.partial

    def render(self) -> str:
        r = self.request
        head = f"request {r.id} (arrival {r.arrival:g}, {len(r.prompt)} prompt tokens"
        head += ", overlapped)" if self.overlapped else ")"
        if self.error is not None:
            return f"{head}: ERROR [{self.error.rule}] {self.error.found}; wants {self.error.expected}"
        assert self.row is not None
        if self.violation is not None:
            i, found, ref = self.first_divergence, self.row.found, self.row.reference
            assert i is not None
            got = f"token {found[i]}" if i < len(found) else f"the end ({self.row.found_stop})"
            want = f"token {ref[i]}" if i < len(ref) else f"the end ({self.row.expected_stop})"
            ties = f", after {len(self.row.ties)} tie(s)" if self.row.ties else ""
            return (
                f"{head}: DIVERGED at index {i}: {got} where the batch-size-1 oracle has {want} "
                f"(partial match {self.row.partial:.2f}{ties})"
            )
        tail = f" ({self.note})" if self.note else ""
        return f"{head}: {self.row.verdict}, {len(self.row.found)} tokens{tail}"


@dataclass(frozen=True)
class EngineAuditResult:
    """Every request of one staggered run of a black-box engine, judged at the output level."""

    engine: str
    transport: str  # "http", "callable" or "steps"
    outcomes: tuple[RequestOutcome, ...]
    engine_error: Violation | None  # a breach that ended the run (step-wise engines)
    seconds: float  # wall time of the engine run
    oracle_seconds: float
    evidence: str = EVIDENCE
    coverage: Coverage = Coverage(level=OUTPUTS)  # arrivals, requests in flight, longest output, EOS stops
    evaluation: Evaluation | None = None  # the registry's checks of a black box (`evaluate(BLACK_BOX, ...)`)

    @property
    def errors(self) -> list[int]:
        return [o.request.id for o in self.outcomes if o.error is not None]

    @property
    def diverged(self) -> list[int]:
        return [o.request.id for o in self.outcomes if o.violation is not None]

    @property
    def passed(self) -> bool:
        """No request broke the output contract or diverged, and the registry's checks agree."""
        agreed = self.evaluation is None or self.evaluation.passed
        return self.engine_error is None and not self.errors and not self.diverged and agreed

    @property
    def violations(self) -> list[Violation]:
        out = [] if self.engine_error is None else [self.engine_error]
        return out + [v for o in self.outcomes for v in (o.error, o.violation) if v is not None]

    @property
    def exact_match(self) -> float:
        return sum(o.row is not None and o.row.exact for o in self.outcomes) / max(len(self.outcomes), 1)

    @property
    def partial_match(self) -> float:
        return sum(o.partial for o in self.outcomes) / max(len(self.outcomes), 1)

    @property
    def ties(self) -> int:
        return sum(len(o.row.ties) for o in self.outcomes if o.row is not None)

    @property
    def overlapped(self) -> int:
        return sum(o.overlapped for o in self.outcomes)

    @property
    def verdict(self) -> str:
        if self.engine_error is not None or self.errors:
            contract = any(v.check == "contract" for v in self.violations)
            what = "contract broken" if contract else f"unfinished (requests {self.errors})"
        elif self.diverged:
            what = f"diverged (requests {self.diverged})"
        elif self.ties:
            what = f"equivalent modulo numerics ({self.ties} tie(s))"
        else:
            what = "exact"
        return f"{what}; {self.evidence}"

    def render(self) -> str:
        lines = [f"{self.engine} [{self.transport}]: {'PASS' if self.passed else 'FAIL'}, {self.verdict}"]
        lines.append(
            f"  {len(self.outcomes)} requests ({self.overlapped} in flight together), exact match "
            f"{self.exact_match:.2f}, partial match {self.partial_match:.2f}, ties {self.ties}, "
            f"engine {self.seconds:.2f} s, oracle {self.oracle_seconds:.2f} s"
        )
        if self.engine_error is not None:
            lines.append(f"  engine: {self.engine_error.render()}")
        lines += ["  " + o.render() for o in self.outcomes]
        return "\n".join(lines)

    def table(self) -> str:
        """The verdict table: one row per request, its schedule, verdict and first divergence."""
        unit = TIME_UNITS.get(self.transport, "")
        head = ("request", f"arrival{unit}", f"start{unit}", f"end{unit}", "overlap", "verdict", "diverges at",
                "found", "expected")  # fmt: skip
        rows = [head] + [outcome_row(o) for o in self.outcomes]
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        status = "PASS" if self.passed else "FAIL"
        summary = (
            f"{self.engine} [{self.transport}]: {status}; exact match {self.exact_match:.2f}, partial match "
            f"{self.partial_match:.2f}, ties {self.ties}, {self.overlapped} of {len(self.outcomes)} requests in "
            f"flight together; engine {self.seconds:.2f} s, oracle {self.oracle_seconds:.2f} s"
        )
        notes = [f"  request {o.request.id}: {o.render().split(': ', 1)[1]}" for o in self.outcomes if o.error]
        if self.engine_error is not None:
            notes.insert(0, f"  engine: {self.engine_error.render()}")
        coverage = f"coverage: {self.coverage.summary()}" + "".join(f" [{f}]" for f in self.coverage.flags)
        return "\n".join([summary, *lines, *notes, coverage, f"level of evidence: {self.evidence}"])

    def report_entry(self, target: str, **figures: Any) -> dict[str, Any]:
        """Output level only: the first violation names a request and a token, no signature (no diagnosis)."""
        subject = {"engine": self.engine, "transport": self.transport, "target": target}
        first = self.violations[0] if self.violations else None
        return entry("blackbox", subject, self.passed, first, None, {**figures, **self.to_json()}, self.coverage)

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "transport": self.transport,
            "passed": self.passed,
            "verdict": self.verdict,
            "evidence": self.evidence,
            "exact_match": self.exact_match,
            "partial_match": self.partial_match,
            "ties": self.ties,
            "diverged": self.diverged,
            "errors": self.errors,
            "engine_error": None if self.engine_error is None else asdict(self.engine_error),
            "seconds": self.seconds,
            "oracle_seconds": self.oracle_seconds,
            "coverage": self.coverage.to_json(),
            "requests": [
                {
                    "id": o.request.id,
                    "prompt": list(o.request.prompt),
                    "max_new_tokens": o.request.max_new_tokens,
                    "arrival": o.request.arrival,
                    "start": o.start,
                    "end": o.end,
                    "overlapped": o.overlapped,
                    "status": o.status,
                    "tokens": None if o.tokens is None else list(o.tokens),
                    "expected": None if o.row is None else list(o.row.expected),
                    "expected_complete": None if o.row is None else o.row.complete,  # False: cut at the divergence
                    "first_divergence": o.first_divergence,
                    "partial": o.partial,
                    "note": o.note,
                    "violations": [asdict(v) for v in (o.error, o.violation) if v is not None],
                }
                for o in self.outcomes
            ],
        }


TIME_UNITS = {"http": " (s)", "steps": " (step)", "callable": " (call)"}
"""What a request's arrival, start and end count in, per transport."""


def outcome_row(o: RequestOutcome) -> tuple[str, ...]:
    """One request's cells of the verdict table: found/expected are the tokens at the first divergence."""
    r = o.request

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:g}"

    found = expected = where = "-"
    if o.error is not None:
        verdict = f"error [{o.error.rule}]"
    else:
        assert o.row is not None
        verdict = "DIVERGED" if o.violation is not None else o.row.verdict
        i = o.first_divergence
        if o.violation is not None and i is not None:
            where = str(i)
            found = str(o.row.found[i]) if i < len(o.row.found) else f"end ({o.row.found_stop})"
            expected = str(o.row.reference[i]) if i < len(o.row.reference) else f"end ({o.row.expected_stop})"
    overlap = "yes" if o.overlapped else "no"
    return (str(r.id), num(r.arrival), num(o.start), num(o.end), overlap, verdict, where, found, expected)


# ---------------------------------------------------------------------------------------
# The target and its oracle


def load_target(target: torch.nn.Module | str | Path, dtype: str | None = None, device: str = "cpu") -> torch.nn.Module:
    """The target the oracle runs on: a module as is, a built-in model name (`llama`, `qwen3`,
    `gpt2`, `transparent`: the fixtures' weights), or a Hugging Face directory (or `smollm2`)."""
    if isinstance(target, torch.nn.Module):
        return target
    if str(target) in MODELS:
        from specaudit.fixtures.pairs import target_model

        return target_model(str(target), dtype or "float64")
    from specaudit.models.loading import load_model, resolve_device
    from specaudit.models.pretrained import resolve

    return load_model("target", resolve(target), resolve_device(device), dtype or "auto")


def oracles(
    target: torch.nn.Module, requests: Sequence[Request], answers: dict[int, Answer], eos_token_id: int | None
) -> tuple[dict[int, OracleResult], float]:
    """Each request's batch-size-1 greedy output, found by checking its answer (`answer_oracles`:
    one teacher-forced forward for a right one), and the time taken."""
    start = time.perf_counter()
    wanted = [(r.prompt, answers[r.id].tokens or (), r.max_new_tokens) for r in requests]
    found = answer_oracles(target, wanted, eos_token_id, cut=True)
    return {r.id: result for r, result in zip(requests, found)}, time.perf_counter() - start


def answers_evidence(
    target: torch.nn.Module, record: Record, answers: dict[int, Answer], engine_error: Violation | None, dtype: str
) -> OutputEvidence:
    """The black box's evidence for the registry (`evaluate(BLACK_BOX, ...)`): its record, the
    output-contract breaks the transport found (per request, the engine's under None), ties judged
    by the oracle's margin against the dtype's rounding tolerance and re-synced on the target."""
    eos = record.eos_token_id

    def oracle_from(prefix: tuple[int, ...], n: int) -> OracleResult:
        with torch.no_grad():
            return greedy_oracle(target, prefix, max_new_tokens=n, eos_token_id=eos)

    errors: dict[int | None, Violation] = {r: a.error for r, a in answers.items() if a.error is not None}
    errors.update({r: missing(r) for r, a in answers.items() if a.error is None and a.tokens is None})
    if engine_error is not None:
        errors[None] = engine_error
    return OutputEvidence(record, dtype, oracle_from, errors)


def missing(request: int) -> Violation:
    return contract_violation("responds", "no answer and no error for the request", request)


def overlaps(spans: dict[int, tuple[float | None, float | None]]) -> dict[int, bool]:
    """Whether each request's in-flight span [start, end] meets another's."""
    known = {i: (s, e) for i, (s, e) in spans.items() if s is not None and e is not None}

    def meets(i: int, j: int) -> bool:
        return i != j and known[j][0] <= known[i][1] and known[i][0] <= known[j][1]

    return {i: i in known and any(meets(i, j) for j in known) for i in spans}


@dataclass
class Answer:
    """What the transport got for one request, before the comparison."""

    tokens: tuple[int, ...] | None = None
    error: Violation | None = None
    start: float | None = None
    end: float | None = None
    note: str = ""


def judge_answers(
    label: str,
    transport: str,
    target: torch.nn.Module,
    requests: Sequence[Request],
    answers: dict[int, Answer],
    eos_token_id: int | None,
    dtype: str | None,
    seconds: float,
    engine_error: Violation | None = None,
    say: Callable[[str], None] | None = None,
) -> EngineAuditResult:
    """Compare every answered request with its oracle; requests with an error are not compared.
    The answers are first the record every subject's evidence is (`running.record`): no calls,
    each request admitted and retired when the transport sent and got it."""
    if say is not None:
        say(f"engine done in {seconds:.2f} s; batch-size-1 greedy oracle for {len(requests)} requests")
    oracle, oracle_seconds = oracles(target, requests, answers, eos_token_id)
    dtype = dtype or dtype_name(target)
    unit = {"http": "seconds", "steps": "steps"}.get(transport, "calls")  # what arrivals count in (`Request`)
    record = Record(label, "blackbox", unit, eos_token_id)
    for r in requests:
        a = answers[r.id]
        record.admit(Entry(r.id, r.prompt, r.max_new_tokens, oracle[r.id], list(a.tokens or ()), a.start, a.end))
    evidence = answers_evidence(target, record, answers, engine_error, dtype)
    evaluation = evaluate(BLACK_BOX, evidence)
    rows = compared(evidence)  # the equivalence check's comparison (made here too if a contract break skipped it)
    flags = overlaps({r.id: (answers[r.id].start, answers[r.id].end) for r in requests})
    outcomes = []
    for r in requests:
        a, row = answers[r.id], rows.get(r.id)
        violation = None if row is None or row.equivalent else divergence(row)
        outcomes.append(RequestOutcome(r, a.tokens, a.error, row, violation, a.start, a.end, flags[r.id], a.note))
    covered = coverage_of_answers(record)
    return EngineAuditResult(label, transport, tuple(outcomes), engine_error, seconds, oracle_seconds, coverage=covered,
                             evaluation=evaluation)  # fmt: skip


def check_tokens(request: Request, tokens: list[int], eos_token_id: int | None) -> Violation | None:
    """The length and EOS rules on one request's tokens (`checks.outputs.token_violation`, the
    registry's contract on a black box's or a paged engine's record)."""
    return token_violation(request.id, tokens, request.max_new_tokens, eos_token_id)


__all__ = [
    "EVIDENCE",
    "RULES",
    "Answer",
    "EngineAuditResult",
    "Request",
    "RequestOutcome",
    "arrival_offsets",
    "judge_answers",
    "load_target",
    "make_requests",
    "seeded_arrivals",
]


# audit_server, audit_callable and CompletionsClient moved to specaudit.adapters.transports (ceb6d45);
# their old path still resolves here, with a DeprecationWarning (specaudit._moved).
__getattr__ = _forward(__name__)
