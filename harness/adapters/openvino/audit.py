"""`make audit-openvino`: OpenVINO GenAI's continuous batching under drawn workloads, per configuration.

Each configuration is a pipeline's settings (speculation, chunked prefill through a small
`max_num_batched_tokens`, prefix caching). Hypothesis draws workloads (`workloads.workloads`);
each runs on a fresh pipeline through the step API, and the requests are judged at the output
level by the judge every black box shares (`adapters.engine_blackbox.judge_answers`: the
batch-size-1 greedy oracle, tie-aware, the output contract). A failure is shrunk by Hypothesis
to a minimal workload with the same first check and rule; a known defect of OpenVINO GenAI
(`KNOWN_DEFECTS`) that explains a failure is counted, not shrunk, so the audit stays green and
says so. Then one sampling workload runs without speculation, with the draft model and with
prompt lookup, judged in distribution (`sampling`).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from specaudit.adapters.engine_blackbox import (
    Answer,
    EngineAuditResult,
    Request,
    check_tokens,
    contract_violation,
    judge_answers,
    load_target,
)
from specaudit.adapters.openvino.engine import EngineOptions, OpenVinoEngine, build_pipeline
from specaudit.adapters.openvino.precision import CPU_DEFAULTS, at_precision, low_precision, rejudged
from specaudit.adapters.openvino.sampling import OV_SAMPLING, sampling_rows
from specaudit.adapters.openvino.steps import drive, out_of_vocabulary
from specaudit.adapters.openvino.workloads import Workload, exercised, unexercised, workloads
from specaudit.adapters.transports import cut_short
from specaudit.artifacts.reproducer import Reproducer
from specaudit.checks.stops import (
    check_stop_output,
    check_usage,
    completing,
    expected_usage,
    expected_with_stop,
    stop_from,
)
from specaudit.contracts.errors import UsageError
from specaudit.contracts.violation import Violation
from specaudit.reference.oracle import greedy_oracle
from specaudit.search.drawn import drawn_search

CHUNK = 8
"""A token budget per step below most drawn prompts' length, so prefills are chunked."""
SPEC_CHUNK = 32
"""The speculative configurations' budget: below the longest prompts and most steps' arrivals (so
prefills are still chunked) but above most steps' verification. At `CHUNK` the known defect
`spec-token-budget` explained 15 of 20 drawn `draft` workloads and none passed clean (0 of 20);
at 32 it explained 1, and 6 passed clean (bench/results/openvino_audit.md)."""
CONFIGURATIONS: dict[str, EngineOptions] = {
    "control": EngineOptions("none", max_num_batched_tokens=CHUNK, prefix_caching=True),
    "draft": EngineOptions("draft", max_num_batched_tokens=SPEC_CHUNK, prefix_caching=True),
    "draft-whole": EngineOptions("draft", max_num_batched_tokens=256, prefix_caching=False),
    "lookup": EngineOptions("lookup", max_num_batched_tokens=SPEC_CHUNK, prefix_caching=True),
    "draft-bf16": EngineOptions("draft", max_num_batched_tokens=256, prefix_caching=True, hints=CPU_DEFAULTS),
}
"""Per configuration the pipeline's settings; K is drawn per request (1..7) in every speculative one.
`draft-bf16` runs at the CPU defaults (bf16, u8 KV cache), judged against the non-speculative
control at that precision (`precision`), with a whole budget so the known defect stays out."""
DTYPE = "float32"  # the f32 hints: ties are judged at float32's rounding


@dataclass
class Run:
    """One workload through one pipeline: the judged result and the per-step evidence."""

    workload: Workload
    result: EngineAuditResult
    acceptance: float | None
    ragged_share: float
    steps: int
    cancelled: list[int]
    stops: dict[int, Stop] = field(default_factory=dict)
    numerics: int = 0  # requests off the oracle that the control at the same precision explains (`judged_run`)


@dataclass(frozen=True)
class Stop:
    """A request's stop string as a run resolved it from the request's oracle (EOS applied)."""

    text: str
    include: bool
    oracle: tuple[int, ...]  # the oracle's tokens up to the request's limit
    completes: int | None  # index of the token completing it within the limit; None: it does not stop the request
    kept: int | None = None  # tokens a request keeps when the stop is not included (those before it)


_ORACLES: dict[tuple[int, tuple[int, ...], int, int | None], list[int]] = {}


def oracle_tokens(target: torch.nn.Module, prompt: tuple[int, ...], n: int, eos: int | None) -> list[int]:
    """`greedy_oracle`'s tokens, remembered per target, prompt, length and EOS: a known defect's
    explanation runs the same workload several times, and these oracles are most of a run's time."""
    key = (id(target), tuple(prompt), n, eos)
    if key not in _ORACLES:
        with torch.no_grad():
            _ORACLES[key] = [int(t) for t in greedy_oracle(target, prompt, max_new_tokens=n, eos_token_id=eos).tokens]
    return _ORACLES[key]


def resolve_stops(target: torch.nn.Module, workload: Workload, eos: int | None, decode: Callable) -> dict[int, Stop]:
    """Each drawn stop string (`Workload.stops`) from its request's oracle, read past the limit where
    the stop lies beyond it; a stop `stop_from` finds unjudgeable (or cut off by the EOS) is dropped,
    and so is one the EOS token completes (the EOS kept, or the stop string cut: both are answers)."""
    out = {}
    for i, prompt in enumerate(workload.prompts):
        spec = workload.stop(i)
        if spec is None:
            continue
        start, n, head, tail, include = spec
        limit = workload.limits[i]
        oracle = oracle_tokens(target, prompt, max(limit, start + n), eos)
        text = stop_from(decode, oracle, start, n, head, tail, include)
        ends = None if text is None else completing(decode, oracle, text)
        if text is not None and (eos is None or oracle[ends] != eos):  # a stop completed by the EOS: two answers
            cut = expected_with_stop(decode, oracle[:limit], text, False)
            out[i] = Stop(text, include, tuple(oracle[:limit]), completing(decode, oracle[:limit], text),
                          None if cut is None else len(cut))  # fmt: skip
    return out


def eos_token(target: torch.nn.Module, workload: Workload) -> int | None:
    """Request 0's oracle token at `eos_at` (an EOS the target emits part-way), None without one."""
    if workload.eos_at is None:
        return None
    tokens = oracle_tokens(target, workload.prompts[0], workload.eos_at + 1, None)
    return tokens[min(workload.eos_at, len(tokens) - 1)]


def judged(
    label: str, target: torch.nn.Module, workload: Workload, engine: OpenVinoEngine, eos: int | None,
    stops: dict[int, Stop] | None = None,
) -> tuple[EngineAuditResult, list[int], int]:  # fmt: skip
    """The workload's outputs judged: a cancelled request against its oracle up to what it emitted
    (one cancelled before its first token is not compared, so a workload whose every request was
    passes with nothing compared; nor is a cancelled request's stop string); anything emitted after
    the cancel is the breach `aborted-silent` that ends the run (the step loop holds every call to
    the engine contract). A finished request with a stop string whose ids follow its oracle is judged
    by `checks.stops` (ids, text, finish reason), then compared up to where it stopped; one whose ids
    leave the oracle is left to the equivalence check (ties followed), its stop string unjudged. Then
    each request's usage count (`usage_checked`)."""
    stops = stops or {}
    start = time.perf_counter()
    run = drive(engine, workload, stops)
    seconds = time.perf_counter() - start
    requests, answers = [], {}
    vocab = int(target.config.vocab_size)
    for i, prompt in enumerate(workload.prompts):
        got = run.tokens.get(i, [])
        limit = workload.limits[i]
        note = ""
        if i in run.cancelled:
            if not got:
                continue
            held = run.cancelled[i]
            limit, note = min(len(got), limit), f"cancelled holding {held} tokens, judged up to what it emitted"
        request = Request(i, prompt, limit, float(workload.arrivals[i]))
        requests.append(request)
        added, done = run.added.get(i), run.done.get(i)
        outside = out_of_vocabulary(got, vocab, i)
        if outside is not None:  # judged up to it: the oracle cannot take an id outside the vocabulary
            answers[i] = Answer(tuple(got[: outside[0]]), outside[1], added, None, note)
        elif done is None:
            why = run.error or contract_violation("responds", f"unfinished after {run.steps} steps", i)
            answers[i] = Answer(tuple(got), cut_short(why, i, len(got), workload.limits[i]), added, None, note)
        elif i in stops and got == list(stops[i].oracle[: len(got)]):
            stop = stops[i]
            broken = check_stop_output(engine.decode, stop.oracle, got, engine.text(i), stop.text, stop.include, i,
                                       engine.finish.get(i))  # fmt: skip
            if stop.completes is not None and broken is None:  # stopped where it should: compare what it kept
                requests[-1] = request = replace(request, max_new_tokens=len(got))
            answers[i] = Answer(tuple(got), broken or check_tokens(request, got, eos), added, done, note)
        else:
            answers[i] = Answer(tuple(got), check_tokens(request, got, eos), added, done, note)
    result = judge_answers(label, "steps", target, requests, answers, eos, DTYPE, seconds, run.error)
    return usage_checked(result, engine, stops, set(run.cancelled)), sorted(run.cancelled), run.steps


def usage_checked(
    result: EngineAuditResult, engine: OpenVinoEngine, stops: dict[int, Stop], cancelled: set[int]
) -> EngineAuditResult:
    """Each finished request's generated-token count (the handle's perf metrics) against its outputs
    (`checks.stops.check_usage`): judged only where the outputs themselves passed, so the count is
    compared with right outputs; a cancelled request's count is not judged."""
    outcomes = []
    for o in result.outcomes:
        i, reported = o.request.id, engine.usage(o.request.id)
        judged_outputs = o.error is None and o.violation is None and o.tokens is not None
        if judged_outputs and i not in cancelled and reported is not None:
            stop = stops.get(i)
            text, include = (None, False) if stop is None else (stop.text, stop.include)
            want = expected_usage(engine.decode, () if stop is None else stop.oracle, o.tokens, text, include)
            o = replace(o, error=check_usage(reported, want, i))
        outcomes.append(o)
    return replace(result, outcomes=tuple(outcomes))


@dataclass
class ConfigurationResult:
    """One configuration's search: examples drawn, the first failure shrunk, the evidence per step."""

    name: str
    options: EngineOptions
    examples: int = 0
    clean: int = 0  # examples that passed with no known defect explaining a failure
    shrink_runs: int = 0
    seconds: float = 0.0
    acceptances: list[float] = field(default_factory=list)
    ragged: list[float] = field(default_factory=list)
    requests: int = 0
    cancelled: int = 0
    failure: Run | None = None
    known: dict[str, int] = field(default_factory=dict)
    known_runs: dict[str, Run] = field(default_factory=dict)  # per known defect, the first workload it explained
    numerics: int = 0  # requests off the oracle that the control at the same precision explains
    features: dict[str, int] = field(default_factory=dict)  # `workloads.exercised`, summed over the draws
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.failure is None and self.error is None

    @property
    def verdict(self) -> str:
        if self.error is not None:
            return f"ERROR {self.error}"
        if self.failure is not None:
            v = self.failure.result.violations[0]
            return f"FAIL [{v.check}: {v.rule}] {v.render()}"
        known = [f"known defect {k} x{n}" for k, n in self.known.items()]
        known += [f"numerics x{self.numerics} (requests the control at this precision explains)"] * bool(self.numerics)
        known += [f"flagged: {', '.join(self.unexercised())} never drawn"] * bool(self.unexercised())
        return "PASS" + (f" ({'; '.join(known)})" if known else "")

    def count(self, workload: Workload, run: Run) -> None:
        """A drawn workload's figures (not a shrink's)."""
        self.numerics += run.numerics
        self.examples += 1
        self.clean += run.result.passed
        self.requests += len(workload.prompts)
        self.cancelled += len(run.cancelled)
        self.ragged.append(run.ragged_share)
        for feature, n in exercised(workload, self.options.max_num_batched_tokens).items():
            self.features[feature] = self.features.get(feature, 0) + n
        if run.acceptance is not None:
            self.acceptances.append(run.acceptance)

    def unexercised(self) -> list[str]:
        """Features the configuration enables that no drawn workload reached (a weak pass, said so)."""
        o = self.options
        return unexercised(self.features, o.max_num_batched_tokens, o.prefix_caching, o.method != "none")

    def acceptance(self) -> float | None:
        return sum(self.acceptances) / len(self.acceptances) if self.acceptances else None

    def ragged_share(self) -> float:
        return sum(self.ragged) / len(self.ragged) if self.ragged else 0.0

    def to_json(self) -> dict[str, Any]:
        failure = None
        if self.failure is not None:
            failure = {"workload": self.failure.workload.to_json(), "result": self.failure.result.to_json()}
        return {"configuration": self.name, "options": self.options.to_json(), "passed": self.passed,
                "verdict": self.verdict, "examples": self.examples, "clean": self.clean,
                "shrink_runs": self.shrink_runs,
                "seconds": round(self.seconds, 2), "acceptance": self.acceptance(),
                "ragged_share": self.ragged_share(), "requests": self.requests, "cancelled": self.cancelled,
                "known": self.known, "numerics": self.numerics, "exercised": self.features,
                "unexercised": self.unexercised(), "failure": failure}  # fmt: skip


def run_one(
    target_ir: Path, draft_ir: Path, target: torch.nn.Module, options: EngineOptions, workload: Workload, label: str
) -> Run:
    """A fresh pipeline (no state carried between workloads, so a reproducer replays alone)."""
    engine = OpenVinoEngine(build_pipeline(target_ir, draft_ir, options), options, None)
    engine.eos = eos_token(target, workload)
    stops = resolve_stops(target, workload, engine.eos, engine.decode)
    result, cancelled, steps = judged(label, target, workload, engine, engine.eos, stops)
    return Run(workload, result, engine.acceptance(), engine.log.ragged_share(), steps, cancelled, stops)


def judged_run(
    target_ir: Path, draft_ir: Path, target: torch.nn.Module, options: EngineOptions, workload: Workload, label: str
) -> Run:  # fmt: skip
    """`run_one`, and at a low precision a failing result judged against the non-speculative control
    at that precision (`precision`): the requests whose departure numerics explain pass."""
    run = run_one(target_ir, draft_ir, target, options, workload, label)
    if run.result.passed or not low_precision(options):
        return run
    control = run_one(target_ir, draft_ir, target, replace(options, method="none"), workload, "control")
    verdict = at_precision(target, workload.prompts, run.result, control.result, label)
    if verdict is None:
        return run
    return replace(run, result=rejudged(run.result, verdict), numerics=len(verdict.numerics))


def search(
    name: str, options: EngineOptions, target_ir: Path, draft_ir: Path, target: torch.nn.Module,
    examples: int, minutes: float, seed: int, say: Callable[[str], None], stops: bool = False,
) -> ConfigurationResult:  # fmt: skip
    """Hypothesis draws up to `examples` workloads within `minutes` (with stop strings: `stops`, but
    not at a low precision: a stop string is cut from the float64 oracle's text, which a bf16 run
    may leave by numerics before reaching it, and the precision judge judges tokens only); the
    first failure not explained by a known defect is shrunk (same first check and rule, still
    unexplained) until the budget ends."""
    from specaudit.adapters.openvino.defects import explained

    out = ConfigurationResult(name, options)
    start = time.monotonic()
    vocab = int(target.config.vocab_size)

    def rerun(run_options: EngineOptions, workload: Workload) -> Run:
        return judged_run(target_ir, draft_ir, target, run_options, workload, f"openvino-{name}")

    def judge(workload: Workload, shrinking: bool) -> tuple[list[Violation] | None, Run]:
        run = rerun(options, workload)
        out.shrink_runs += shrinking
        if not shrinking:
            out.count(workload, run)
        if run.result.passed:
            return None, run
        defects = explained(options, run, rerun)
        for defect in [] if shrinking else defects:
            out.known[defect] = out.known.get(defect, 0) + 1
            out.known_runs.setdefault(defect, run)
        # a known defect passes (while shrinking too: a shrink must not wander into one)
        return (None if defects else run.result.violations), run

    drawn = workloads(vocab, stops=stops and not low_precision(options), budget=options.max_num_batched_tokens)
    found = drawn_search(drawn, judge, examples, seed, 60.0 * minutes)
    out.failure = None if found.failure is None else found.failure.evidence
    if found.failure is None and found.error is not None:
        out.error = unreliable(found.error)
    out.seconds = time.monotonic() - start
    say(f"{name}: {out.verdict} ({out.examples} examples, {out.seconds:.0f} s)")
    return out


def unreliable(exc: Exception) -> str:
    """An error's text, cause first: Hypothesis's Flaky means a workload that failed (unexplained) once
    passed, or was explained, when run again on a fresh pipeline: the engine's outcome for that
    workload is not reproducible (nondeterministic outputs, or a known defect that shows only sometimes)."""
    from hypothesis.errors import Flaky

    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, Flaky):
        causes = "; ".join(f"{type(e).__name__}: {e}" for e in getattr(exc, "exceptions", ()))
        text = (f"not reproducible: a workload failed once and not when run again on a fresh pipeline (first: "
                f"{causes[:400]}) ({text}")  # fmt: skip
        return text[:1600] + ")"
    return text[:300]


def table(results: list[ConfigurationResult]) -> str:
    head = ("configuration", "method", "chunk", "prefix cache", "examples", "clean", "requests", "cancelled",
            "acceptance", "ragged share", "seconds", "verdict")  # fmt: skip
    rows = [head]
    for r in results:
        acc = r.acceptance()
        rows.append((r.name, r.options.method, str(r.options.max_num_batched_tokens), str(r.options.prefix_caching),
                     str(r.examples), str(r.clean), str(r.requests), str(r.cancelled),
                     "-" if acc is None else f"{acc:.2f}", f"{r.ragged_share():.2f}", f"{r.seconds:.0f}",
                     r.verdict))  # fmt: skip
    return aligned(rows)


def sampling_table(rows: list[dict[str, Any]]) -> str:
    head = ("configuration", "requests", "tokens", "acceptance", "ragged share", "verdict")
    return aligned([head] + [
        (r["configuration"], str(r["requests"]), str(r["tokens"]),
         "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}", f"{r['ragged_share']:.2f}", r["verdict"])
        for r in rows
    ])  # fmt: skip


def aligned(rows: list[tuple[str, ...]]) -> str:
    """Columns padded to their widest cell; the last (the verdict) left as long as it is."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[-1]]) for row in rows)


def write_reproducers(results: list[ConfigurationResult], out: Path) -> list[Path]:
    """Per configuration, its shrunk failure and the first workload each known defect explained, as
    `openvino` reproducers under `out` (`specaudit replay FILE` runs them again)."""
    from specaudit.adapters.openvino.reproducer import write_reproducer

    paths = []
    for r in results:
        if r.failure is not None:
            paths.append(write_reproducer(out, r.name, r.options, r.failure, None))
        for defect, run in r.known_runs.items():
            paths.append(write_reproducer(out, r.name, r.options, run, defect))
    return paths


def run_openvino(
    names: list[str], examples: int, minutes: float, seed: int, out: Path | None, stops: bool = True,
    sampling: bool = True,
) -> int:  # fmt: skip
    """`specaudit audit-openvino`: exit 0 when every configuration and sampling run passes (known
    defects counted), 1 otherwise, 2 for an unknown configuration."""
    from specaudit.adapters.openvino.models import ir_directories

    unknown = [n for n in names if n not in CONFIGURATIONS]
    if unknown:
        print(
            f"specaudit: unknown configuration(s) {unknown}; choose from {', '.join(CONFIGURATIONS)}", file=sys.stderr
        )
        return 2

    def say(text: str) -> None:
        print(f"specaudit: {text}", file=sys.stderr, flush=True)

    start = time.monotonic()
    target_ir, draft_ir, hf_target = ir_directories(say=say)
    target = load_target(str(hf_target), "float64")
    results = [search(n, CONFIGURATIONS[n], target_ir, draft_ir, target, examples, minutes, seed, say, stops)
               for n in names]  # fmt: skip
    sampled = sampling_rows(target_ir, draft_ir, target, seed, say) if sampling else []
    print(table(results))
    if sampled:
        print(f"\nsampling ({OV_SAMPLING!r}, whole budget, no prefix caching; lossless in distribution):")
        print(sampling_table(sampled))
    from specaudit.adapters.openvino.defects import KNOWN_DEFECTS

    for defect in sorted({k for r in results for k in r.known} | {k for r in sampled for k in r.get("known", {})}):
        print(f"\nknown failure {defect} (explained, not a verdict): {KNOWN_DEFECTS[defect]}")
    for r in results:
        if r.failure is not None:
            print(f"\n{r.name}: minimal workload ({r.failure.workload.size()}):")
            print(json.dumps(r.failure.workload.to_json()))
            print(r.failure.result.table())
    print(f"\nlevel of evidence: output level (OpenVINO GenAI owns its models); {time.monotonic() - start:.0f} s")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "openvino.json").write_text(json.dumps([r.to_json() for r in results] + sampled, indent=1) + "\n")
        for path in write_reproducers(results, out):
            print(f"reproducer: {path} (specaudit replay {path}, from the OpenVINO venv)")
    return 0 if all(r.passed for r in results) and all(r["passed"] for r in sampled) else 1


def replay_reproducer(reproducer: Reproducer, options: Any = None) -> Any:
    """An `openvino` reproducer's workload through a fresh pipeline with the file's options, judged
    again (`reproducer.OpenVinoReplay`); `specaudit replay FILE` lands here (its row's replayer:
    replay's options change nothing, the file names the pipeline)."""
    if importlib.util.find_spec("openvino_genai") is None:
        raise UsageError(f"{reproducer.where} replays OpenVINO GenAI: run it with the OpenVINO venv's specaudit "
                         "(.venv-openvino/bin/specaudit replay FILE; make openvino-venv)")  # fmt: skip
    from specaudit.adapters.openvino.models import ir_directories
    from specaudit.adapters.openvino.reproducer import OpenVinoReplay

    try:
        options = EngineOptions.from_json(reproducer.subject["options"])
        workload = Workload.from_json(reproducer.payload["workload"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"{reproducer.where}: malformed OpenVINO options or workload ({exc})") from None
    target_ir, draft_ir, hf_target = ir_directories(say=lambda _: None)
    label = f"openvino-{reproducer.subject.get('configuration', 'replay')}"
    run = run_one(target_ir, draft_ir, load_target(str(hf_target), "float64"), options, workload, label)
    recorded = {key: reproducer.evidence.get(key) for key in ("first_check", "rule", "known_defect")}
    return OpenVinoReplay(run.result, recorded)
