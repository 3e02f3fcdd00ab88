"""Real-model mode, the audit and its report: `specaudit audit --target PATH --draft PATH --prompts FILE`.

    specaudit audit --target DIR --draft DIR --prompts FILE [--device cuda] [--dtype bfloat16] \
        [--decoder MODULE:ATTR] [--check-rate 0.25] [--batch-size 8] [--max-new-tokens 64] \
        [--num-draft-tokens 4] [--out DIR]

The prompts (SpecBench-style JSONL with `turns`, or one prompt per line) are tokenized with the
target's tokenizer and cut into batches; each batch is run and judged by `specaudit.adapters.realmodel`.
This module prints one line per batch and an overall verdict per decoder (exact and partial
match, ties, each check's status, throughput, the I2 sampling and the instrumentation
overhead), and with `--out DIR` writes DIR/report.json and, for a failing batch, two
reproducers under DIR/repro: the real case (`real_*.json`, the real token ids; it needs the
real models) and its transplant (`transplant_*.json`, see `specaudit.audits.transplant`), which
`specaudit replay` runs on the CPU on the exact models.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from specaudit.adapters.realmodel import RealRun, audit_batch, run_batch, run_real, timed_call
from specaudit.artifacts.report import entry, write_report
from specaudit.artifacts.reproducer import write_real_failure
from specaudit.audits.regression import write_failure
from specaudit.audits.transplant import transplant
from specaudit.audits.verdict import merge_statuses
from specaudit.checks.cache import peek
from specaudit.checks.coverage import coverage_of_run, merged
from specaudit.checks.diagnosis import Diagnosis, diagnose
from specaudit.config.settings import RealAuditSettings
from specaudit.contracts import subjects
from specaudit.contracts.decoder import load_decoder
from specaudit.contracts.violation import render
from specaudit.models.loading import load_pair, read_prompts, special_ids, tokenize
from specaudit.models.pretrained import cache_dir
from specaudit.numerics.calibration import NoiseFloor
from specaudit.numerics.noise import measure_noise
from specaudit.numerics.tolerance import DTYPES
from specaudit.reference.batched import BatchedGreedy
from specaudit.running.runner import run_case

REPORT_KIND = str(subjects.REAL_MODEL.report)
"""The kind of a real-model batch's report entry (`contracts.subjects.REAL_MODEL`)."""
CONTROL = "specaudit.reference.batched:BatchedGreedy"
LOW_PRECISION = (torch.float16, torch.bfloat16)


def _pct(x: float) -> str:
    return "n/a" if x != x else f"{x:+.0%}"


def _finite(x: float) -> float | None:
    return None if x != x or x in (math.inf, -math.inf) else x


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def batch_line(run: RealRun, diagnosis: Diagnosis) -> str:
    """One batch: verdict, match, throughput, I2 sampling, overhead, and the evidence of a failure."""
    status = "PASS" if diagnosis.passed else "FAIL"
    line = (
        f"  batch {run.batch}: {len(run.case.prompts)} rows  {status} ({diagnosis.verdict})  "
        f"exact {diagnosis.exact_match:.2f} partial {diagnosis.partial_match:.2f} ties {diagnosis.ties}  "
        f"{run.tokens_per_s:.1f} tok/s (oracle BS1 {run.oracle_tokens_per_s:.1f})  "
        f"I2 on {run.sampled_calls}/{len(run.recording.target_calls)} target calls  "
        f"overhead: recording {_pct(run.record_overhead)}, checks {_pct(run.check_overhead)}"
    )
    line += f"\n    coverage: {coverage_of_run(run).summary()}"
    ties = numerics_line(run)
    if ties:
        line += f"\n    within the measured noise: {ties}"
    if diagnosis.finding is not None:
        line += f"\n    {diagnosis.finding.render()}"
        line += "\n" + "\n".join("    " + s for s in render(list(diagnosis.violations), limit=4).splitlines())
    if run.baseline_outputs is not None and run.outputs is not None and run.baseline_outputs != run.outputs:
        line += "\n    note: the instrumented run's output differs from the un-instrumented run's (nondeterminism?)"
    return line


def numerics_line(run: RealRun) -> str:
    """The rows that are equivalent modulo numerics: where they took the other side of a tie, by how much."""
    compared = peek(run, "equivalence", "equivalence")  # the equivalence check's comparison, if it ran
    if run.outputs is None or compared is None:
        return ""
    rows = [r for r in compared.rows if r.ties]
    return "; ".join(f"row {r.row}: {r.numerics()}" for r in rows)


def control_match(runs: list[RealRun], target: Any, draft: Any, timeout_s: float) -> float:
    """Exact-match rate of the batched non-speculative control on the same batches, against the
    same oracle: the divergence batched arithmetic alone causes."""
    exact = rows = 0
    for run in runs:
        outputs, _, _, _ = timed_call(CONTROL, BatchedGreedy, target, draft, run.case, timeout_s)
        expected = [list(o.tokens) for o in run.oracle]
        exact += sum(o == e for o, e in zip(outputs or [], expected))
        rows += len(expected)
    return exact / max(rows, 1)


def second_witness(run: RealRun, noise: NoiseFloor, draft: Any, settings: RealAuditSettings) -> Diagnosis:
    """A failing low-precision batch re-run with both models in the witness's precision, every call
    checked: a bug that shows there too is not a low-precision accident."""
    target = noise.witness
    dtype = next(n for n, d in DTYPES.items() if d == target.dtype)
    higher = copy.deepcopy(draft).to(target.dtype)
    floor = measure_noise(
        target,
        run.case.prompts,
        label=noise.model,
        steps=settings.max_new_tokens,
        pad_token_id=run.case.pad_token_id,
        store=cache_dir() / "calibration",
    )
    case = replace(run.case, dtype=dtype)
    again = run_batch(
        run.decoder,
        run.factory or load_decoder(run.decoder),
        case,
        target,
        higher,
        sample=lambda i: True,
        sample_rate=1.0,
        batch=run.batch,
        baseline=False,
        timeout_s=settings.timeout_s,
    )
    again.noise = floor
    return audit_batch(again)


def witness_line(run: RealRun, diagnosis: Diagnosis, second: Diagnosis | None) -> str:
    """Which witness decided a failure."""
    if second is None:
        return f"    decided by the {run.case.dtype} run (no higher-precision re-run needed)"
    same = (second.first_check, second.signature) == (diagnosis.first_check, diagnosis.signature)
    if second.passed:
        return (
            f"    decided by the {run.case.dtype} run; the {second.case.dtype} witness passes "
            f"({second.verdict}): the fault shows only in low precision, beyond its measured noise"
        )
    agree = "the same check and signature" if same else f"{second.first_check}, {second.signature}"
    return f"    decided by both witnesses: the {second.case.dtype} re-run fails too ({agree})"


def write_reproducers(
    out: Path, run: RealRun, diagnosis: Diagnosis, settings: RealAuditSettings
) -> tuple[list[str], list[str]]:
    """The real case (naming both model directories, so that `specaudit replay` loads them) and
    its CPU transplant as reproducers under OUT/repro; returns (report lines, paths written)."""
    name = f"{run.decoder}-batch{run.batch}"
    models = {"target": settings.target, "draft": settings.draft, "device": settings.device}
    real = write_real_failure(out / "repro", f"real-{name}", diagnosis, **models)  # no test: needs the real models
    lines, paths = [f"    reproducer (real models): {real}"], [str(real)]
    try:
        moved = transplant(run)
    except Exception as exc:  # a transplant that cannot be built must not hide the real verdict
        text = str(exc).strip().splitlines()
        lines.append(f"    transplant: not built ({type(exc).__name__}: {text[0] if text else ''})")
        return lines, paths
    replay = diagnose(run_case(run.decoder, moved.case))
    outcome = f"FAIL ({replay.first_check}, {replay.signature})" if not replay.passed else "PASS (does not reproduce)"
    written = write_failure(
        out / "repro", f"transplant-{name}", replay, "transplanted from a real-model batch", test=not replay.passed
    )
    lines.append(f"    transplant on the CPU (transparent target, scripted draft): {outcome}: {written[0]}")
    paths += [str(p) for p in written]
    return lines, paths


def write_partial(settings: RealAuditSettings, report: list[dict[str, Any]]) -> None:
    """report.json as far as the audit has got (`"complete": false`), rewritten after every batch:
    an audit cut off by its step's time limit (a device lease, a CI timeout) still leaves every
    verdict it reached; the final write drops the flag."""
    if settings.out is not None:
        write_report(settings.out, "audit --target", report, complete=False)


def batch_report(run: RealRun, diagnosis: Diagnosis, checks: dict[str, str], reproducers: list[str]) -> dict[str, Any]:
    """One batch's report entry: the diagnosis, each check's status, throughput, sampling, overhead
    and what the batch exercised."""
    subject = {"decoder": run.decoder, "model": run.case.model, "draft": run.case.draft, "batch": run.batch}
    coverage = coverage_of_run(run)
    return entry(REPORT_KIND, subject, diagnosis.passed, diagnosis.first, diagnosis.signature, {
        "decoder": run.decoder,
        "batch": run.batch,
        "diagnosis": diagnosis.to_json(),
        "checks": checks,
        "outputs": run.outputs,
        "tokens_per_s": _finite(run.tokens_per_s),
        "oracle_tokens_per_s": _finite(run.oracle_tokens_per_s),
        "check_rate": run.sample_rate,
        "sampled_calls": run.sampled_calls,
        "target_calls": len(run.recording.target_calls),
        "decoder_seconds": _finite(run.baseline_seconds),
        "instrumented_seconds": run.seconds,
        "check_seconds": _finite(run.check_seconds),
        "record_overhead": _finite(run.record_overhead),
        "check_overhead": _finite(run.check_overhead),
        "reproducers": reproducers,
    }, coverage)  # fmt: skip


def overall(
    runs: list[RealRun], diagnoses: list[Diagnosis], checks: dict[str, str], rate: float, control: float
) -> str:
    """A decoder's verdict over every batch: match, checks, throughput, sampling and overhead."""
    rows = sum(len(r.case.prompts) for r in runs)
    exact = sum(d.exact_match * len(r.case.prompts) for d, r in zip(diagnoses, runs)) / max(rows, 1)
    partial = sum(d.partial_match * len(r.case.prompts) for d, r in zip(diagnoses, runs)) / max(rows, 1)
    base = sum(r.baseline_seconds for r in runs)
    oracle_tokens = sum(len(o.tokens) for r in runs for o in r.oracle)
    first = next((d for d in diagnoses if not d.passed), None)
    verdicts = ", ".join(sorted({d.verdict for d in diagnoses}))
    return (
        f"  overall: {'FAIL' if first else 'PASS'} ({verdicts})  {rows} rows, exact match {exact:.2f}, "
        f"partial match {partial:.2f}, ties {sum(d.ties for d in diagnoses)} "
        f"(batched control without speculation: exact match {control:.2f})"
        + (f"; first violated check {first.first_check}, signature {first.signature}" if first else "")
        + "\n  checks: "
        + ", ".join(f"{check} {'FAIL' if status == 'fail' else status}" for check, status in checks.items())
        + f"\n  throughput: {_ratio(sum(r.new_tokens for r in runs), base):.1f} tok/s un-instrumented "
        f"(batch-size-1 oracle {_ratio(oracle_tokens, sum(r.oracle_seconds for r in runs)):.1f} tok/s)"
        f"\n  check rate {rate:g} (I2 on {sum(r.sampled_calls for r in runs)}/"
        f"{sum(len(r.recording.target_calls) for r in runs)} target calls); instrumentation overhead: "
        f"recording {_pct(_ratio(sum(r.seconds for r in runs), base) - 1)}, I1+I2 checks "
        f"{_pct(_ratio(sum(r.check_seconds for r in runs), base))} of un-instrumented decoder time"
        f"\n  coverage: {merged([coverage_of_run(r) for r in runs]).summary()}"
    )


def run_real_audit(settings: RealAuditSettings) -> int:
    """Every decoder on the prompts, batch by batch: exit 0 when every batch passes, 1 on a failure."""
    factories = {spec: load_decoder(spec) for spec in settings.decoders}
    prompts = read_prompts(settings.prompts)[: settings.max_prompts]
    target, draft, tokenizer = load_pair(settings.target, settings.draft, settings.device, settings.dtype)
    tokens = tokenize(tokenizer, prompts)  # bad prompts are input errors, before any decoding
    eos, pad = special_ids(tokenizer)
    dtype = next((n for n, d in DTYPES.items() if d == target.dtype), str(target.dtype))
    print(
        f"specaudit audit (real models): target {settings.target}, draft {settings.draft}, "
        f"device {settings.device}, dtype {dtype}\n"
        f"  {len(prompts)} prompt(s) in batches of {settings.batch_size}, K={settings.num_draft_tokens}, "
        f"max_new_tokens={settings.max_new_tokens}, eos={eos}, pad={pad}\n"
        f"  check rate {settings.check_rate:g}: I1 on every target call, I2 (K/V against batch size 1) on a "
        f"sampled {settings.check_rate:.0%} of target calls (seed {settings.seed})",
        flush=True,
    )
    noise = measure_noise(
        target,
        tokens,
        label=str(settings.target),
        steps=settings.max_new_tokens,
        pad_token_id=pad,
        store=cache_dir() / "calibration",
    )
    print(f"  noise floor: {noise.render()}", flush=True)
    control: float | None = None
    failed = 0
    report: list[dict[str, Any]] = []
    for spec in settings.decoders:
        runs = run_real(
            spec,
            target,
            draft,
            tokenizer,
            prompts,
            batch_size=settings.batch_size,
            num_draft_tokens=settings.num_draft_tokens,
            max_new_tokens=settings.max_new_tokens,
            sample_rate=settings.check_rate,
            seed=settings.seed,
            model_name=str(settings.target),
            timeout_s=settings.timeout_s,
            factory=factories[spec],
            noise=noise,
        )
        print(f"\n{spec}:", flush=True)
        if control is None:
            control = control_match(runs, target, draft, settings.timeout_s)
        diagnoses, statuses = [], []
        for run in runs:
            diagnosis = audit_batch(run)
            checks = dict(diagnosis.checks)
            diagnoses.append(diagnosis)
            statuses.append(checks)
            print(batch_line(run, diagnosis), flush=True)
            report.append(batch_report(run, diagnosis, checks, []))
            write_partial(settings, report)  # the verdict on disk before the witness and the reproducers
            if not diagnosis.passed and run.outputs is not None:
                second = second_witness(run, noise, draft, settings) if target.dtype in LOW_PRECISION else None
                print(witness_line(run, diagnosis, second), flush=True)
            written: list[str] = []
            if not diagnosis.passed and settings.out is not None:
                lines, written = write_reproducers(settings.out, run, diagnosis, settings)
                print("\n".join(lines), flush=True)
            if written:
                report[-1] = batch_report(run, diagnosis, checks, written)
                write_partial(settings, report)
        print(overall(runs, diagnoses, merge_statuses(statuses), settings.check_rate, control), flush=True)
        failed += not all(d.passed for d in diagnoses)
    print(f"\n{len(settings.decoders) - failed} passed, {failed} failed")
    if settings.out is not None:
        write_report(settings.out, "audit --target", report)
        print(f"report: {settings.out / 'report.json'}; reproducers under {settings.out / 'repro'}")
    return 1 if failed else 0
