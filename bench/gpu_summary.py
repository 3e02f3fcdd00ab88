"""summary.md for a `bench/gpu_check.sh` run, built from the audits' report.json files.

    python bench/gpu_summary.py RESULTS_DIR

RESULTS_DIR is what gpu_check.sh writes: audit/<dtype>/<name>/report.json (the audit's `--out`),
audit/<dtype>/<name>.log, steps.tsv (step, exit status, seconds, timeout) and model.log. One
table row per decoder and dtype: the verdict, row-weighted exact match, ties, the first violated
check and signature, what was expected and whether the run met it. Nothing is hard-coded but
the expectation: reference decoders pass, planted bugs fail, except `positions_in_model_dtype`,
which can only fail where a position reaches past the integers the dtype holds exactly.

The `cb` step (bench/gpu_cb.py: transformers' continuous batching on the same target, judged by
the paged checks) leaves cb/<dtype>/report.json with its plan: one row per planned item and
dtype, as expected when an entry point passes and a planted bug fails (at the check and rule
its catalog names, else "yes, other rule"); a planned item without an entry did not finish.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REFERENCES = ("EqSpec", "ExSpec", "BatchedGreedy", "LazySpec")
EXACT_INTEGERS = {"bfloat16": 256, "float16": 2048, "float32": 2**24, "float64": 2**53}
"""Largest n such that every integer in [0, n] is exact in the dtype (8, 11, 24, 53 significant bits)."""


@dataclass(frozen=True)
class Outcome:
    name: str
    dtype: str
    rc: str
    seconds: str
    verdict: str
    exact: str
    ties: str
    first_check: str
    signature: str
    expected: str
    met: str


def read_steps(results: Path) -> dict[str, tuple[str, str]]:
    """step name -> (exit status, seconds) from steps.tsv."""
    path = results / "steps.tsv"
    steps: dict[str, tuple[str, str]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) >= 3 and parts[0] != "step":
                steps[parts[0]] = (parts[1], parts[2])
    return steps


def batches_of(report: Any) -> list[dict[str, Any]]:
    """The per-batch entries: report.json's envelope (`specaudit.artifacts.report`), or a bare list
    of batches as written before it."""
    if isinstance(report, dict):
        report = report.get("entries", report.get("batches", []))
    return [b for b in report if isinstance(b, dict) and "diagnosis" in b]


def max_position(batches: list[dict[str, Any]]) -> int:
    """The largest position id any row reached: prompt length + new tokens - 1."""
    top = 0
    for batch in batches:
        requests = batch["diagnosis"].get("case", {}).get("requests", [])
        outputs = batch.get("outputs") or [[] for _ in requests]
        for request, out in zip(requests, outputs):
            top = max(top, len(request.get("prompt", [])) + len(out or []) - 1)
    return top


def planted_signature(name: str, rows: int = 1) -> str:
    """The first check and signature the catalog records for a planted bug in a batch of `rows`
    ("" if unknown): a real-model batch is not shrunk, so a bug signed on a one-row minimal case
    has its batch signature there (`BugInfo.batch_signature`)."""
    try:
        from specaudit.reference.mutants import CATALOG
    except ImportError:
        return ""
    bug = getattr(CATALOG.get(name), "bug", None)
    if bug is None:
        return ""
    signature = bug.batch_signature if rows >= 2 and bug.batch_signature else bug.signature
    return f"{bug.first_check}, {signature}"


def largest_batch(batches: list[dict[str, Any]]) -> int:
    """The most rows of any batch judged."""
    return max((len(b["diagnosis"].get("case", {}).get("requests", [])) for b in batches), default=0)


def expectation(name: str, dtype: str, batches: list[dict[str, Any]]) -> str:
    if name in REFERENCES:
        return "PASS"
    if name == "positions_in_model_dtype":
        reach, limit = max_position(batches), EXACT_INTEGERS.get(dtype, 0)
        if reach <= limit:
            return f"PASS (positions <= {reach}, exact in {dtype})"
    recorded = planted_signature(name, largest_batch(batches))
    return f"FAIL ({recorded})" if recorded else "FAIL"


def judged(expected: str, verdict: str, first_check: str, signature: str) -> str:
    """yes: the verdict expected (and for a planted bug the catalog's check and signature);
    "yes, other signature": caught, but named differently than the catalog records."""
    if expected.split()[0] != verdict.split()[0]:
        return "**no**"
    if expected.startswith("FAIL (") and expected != f"FAIL ({first_check}, {signature})":
        return "yes, other signature"
    return "yes"


def outcome(name: str, dtype: str, report_path: Path, step: tuple[str, str]) -> Outcome:
    rc, seconds = step
    if not report_path.is_file():
        why = "timed out" if rc in ("124", "137") else "skipped" if rc == "-" else f"no report (exit {rc})"
        expected = "FAIL" if name not in REFERENCES else "PASS"
        return Outcome(name, dtype, rc, seconds, why, "", "", "", "", expected, "no")
    batches = batches_of(json.loads(report_path.read_text()))
    diagnoses = [b["diagnosis"] for b in batches]
    rows = [len(d.get("case", {}).get("requests", [])) or 1 for d in diagnoses]
    exact = sum(d.get("exact_match", 0.0) * n for d, n in zip(diagnoses, rows)) / max(sum(rows), 1)
    failed = next((d for d in diagnoses if not d.get("passed")), None)
    verdicts = ", ".join(sorted({str(d.get("verdict")) for d in diagnoses}))
    verdict = f"{'FAIL' if failed else 'PASS'} ({verdicts})"
    expected = expectation(name, dtype, batches)
    first_check = str(failed.get("first_check")) if failed else ""
    signature = str(failed.get("signature")) if failed else ""
    ties = str(sum(int(d.get("ties") or 0) for d in diagnoses))
    met = judged(expected, verdict, first_check, signature)
    return Outcome(name, dtype, rc, seconds, verdict, f"{exact:.2f}", ties, first_check, signature, expected, met)


def collect(results: Path, steps: dict[str, tuple[str, str]]) -> list[Outcome]:
    """One Outcome per audit step in steps.tsv (named audit/<dtype>/<name>), in run order."""
    out = []
    for step, status in steps.items():
        parts = step.split("/")
        if len(parts) == 3 and parts[0] == "audit":
            _, dtype, name = parts
            out.append(outcome(name, dtype, results / step / "report.json", status))
    return sorted(out, key=run_order)


def run_order(o: Outcome) -> tuple[int, str, str]:
    """References first (in REFERENCES order), then planted bugs by name; dtypes by name."""
    rank = REFERENCES.index(o.name) if o.name in REFERENCES else len(REFERENCES)
    return rank, o.name, o.dtype


UNFINISHED = ("timed out", "skipped", "no report")
CB_DTYPES = ("float32", "bfloat16", "float16")


def finished(o: Outcome) -> bool:
    """Whether the audit wrote its report.json (it may still have failed)."""
    return not o.verdict.startswith(UNFINISHED)


@dataclass(frozen=True)
class CbOutcome:
    """One planned item of the `cb` step (bench/gpu_cb.py) in one dtype."""

    item: str
    dtype: str
    judging: str
    verdict: str
    first_check: str
    signature: str
    expected: str
    met: str
    engine: str
    judge: str


def cb_expected(plan: dict[str, Any]) -> str:
    """PASS, or FAIL (check/rule) as the planted bug's catalog names it."""
    return "PASS" if plan.get("expect") == "PASS" else f"FAIL ({plan.get('check')}/{plan.get('rule')})"


def cb_outcome(plan: dict[str, Any], found: dict[str, Any] | None, dtype: str, judging: str, why: str) -> CbOutcome:
    """A planned item against its entry (None: it did not finish, for `why`)."""
    expected = cb_expected(plan)
    if found is None:
        return CbOutcome(plan["item"], dtype, judging, why, "", "", expected, "no", "", "")
    first = found.get("first") or {}
    check = f"{first.get('check')}/{first.get('rule')}" if first else ""
    verdict = "PASS" if found.get("passed") else "FAIL"
    if expected.split()[0] != verdict:
        met = "**no**"
    else:
        met = "yes" if expected == "PASS" or expected == f"FAIL ({check})" else "yes, other rule"
    engine, judge = str(found.get("engine_seconds", "")), str(found.get("judge_seconds", ""))
    return CbOutcome(plan["item"], dtype, judging, verdict, check, str(found.get("signature") or ""), expected, met,
                     engine, judge)  # fmt: skip


def cb_collect(results: Path, steps: dict[str, tuple[str, str]]) -> list[CbOutcome]:
    """One CbOutcome per planned item of every cb/<dtype>/report.json; one row saying why when
    the step ran but left no plan ([] when there was no `cb` step)."""
    if "cb" not in steps:
        return []
    rc = steps["cb"][0]
    why = "timed out" if rc in ("124", "137") else "skipped" if rc == "-" else f"no result (exit {rc})"
    out = []
    order = {dtype: i for i, dtype in enumerate(CB_DTYPES)}  # the step's order: float32 first
    for path in sorted((results / "cb").glob("*/report.json"), key=lambda p: (order.get(p.parent.name, 9), p)):
        report = json.loads(path.read_text())
        dtype, judging = path.parent.name, str(report.get("judging", ""))
        if report.get("unavailable"):
            out.append(CbOutcome("all", dtype, judging, f"not run: {report['unavailable']}", "", "", "", "no", "", ""))
            continue
        entries = {e["subject"].get("item"): e for e in report.get("entries", []) if isinstance(e, dict)}
        errors = report.get("errors") or {}
        for plan in report.get("planned", []):
            because = f"raised {errors[plan['item']]}" if plan["item"] in errors else why
            out.append(cb_outcome(plan, entries.get(plan["item"]), dtype, judging, because))
    return out or [CbOutcome("all", "-", "", why, "", "", "", "no", "", "")]


def cb_table(outcomes: list[CbOutcome]) -> list[str]:
    columns = ("item", "dtype", "judging", "verdict", "first check", "signature", "expected", "as expected")
    lines = ["| " + " | ".join((*columns, "engine s", "judge s")) + " |", "|" + "---|" * 10]
    for o in outcomes:
        cells = (o.item, o.dtype, o.judging, o.verdict, o.first_check, o.signature, o.expected, o.met, o.engine)
        lines.append("| " + " | ".join(cells) + f" | {o.judge} |")
    return lines


def cb_lines(outcomes: list[CbOutcome], steps: dict[str, tuple[str, str]]) -> list[str]:
    """The `cb` step's section ([] when there was none)."""
    if not outcomes:
        return []
    met = sum(o.met.startswith("yes") for o in outcomes)
    done = sum(o.verdict.startswith(("PASS", "FAIL")) for o in outcomes)
    rc, seconds = steps["cb"]
    return [
        "",
        "## transformers' continuous batching on the target (`bench/gpu_cb.py`)",
        "",
        f"{met} of {len(outcomes)} runs as expected (entry points pass, planted bugs fail); {done} finished; "
        f'step exit {rc} in {seconds} s. Judging "full": every paged-engine check (float32); "exact": the '
        "paged layout to the bit, without kv-entry, greedy-commit and the output checks (half precision).",
        "",
        *cb_table(outcomes),
    ]


def table(outcomes: list[Outcome]) -> list[str]:
    columns = ("decoder", "dtype", "verdict", "exact match", "ties", "first check", "signature", "expected")
    lines = ["| " + " | ".join((*columns, "as expected", "exit", "s")) + " |", "|" + "---|" * 11]
    for o in outcomes:
        cells = (o.name, o.dtype, o.verdict, o.exact, o.ties, o.first_check, o.signature, o.expected, o.met, o.rc)
        lines.append("| " + " | ".join(cells) + f" | {o.seconds} |")
    return lines


def cost_lines(cost: Path) -> list[str]:
    """What the cost bench left (its figures need matplotlib; cost.json and cost.md come first)."""
    if not cost.is_dir():
        return []
    files = sorted(p.name for p in cost.iterdir() if p.name != "cost.log")
    log = (cost / "cost.log").read_text().strip().splitlines() if (cost / "cost.log").is_file() else []
    last = f"; its last line: `{log[-1].strip()}`" if log else ""
    return [f"- cost bench files: {', '.join(files) or 'none'} (see `cost/cost.md`){last}"]


def render(results: Path) -> str:
    steps = read_steps(results)
    outcomes, cb = collect(results, steps), cb_collect(results, steps)
    met = sum(o.met.startswith("yes") for o in outcomes)
    unfinished = [f"{o.dtype}/{o.name}" for o in outcomes if not finished(o)]
    cb_done = sum(o.verdict.startswith(("PASS", "FAIL")) for o in cb)
    renamed = sum(o.met == "yes, other signature" for o in outcomes)
    model = (results / "model.log").read_text().strip().splitlines() if (results / "model.log").is_file() else []
    env = (results / "env.log").read_text().strip().splitlines() if (results / "env.log").is_file() else []
    lines = [
        "# GPU check: real-model audit on a config-built Llama pair",
        "",
        "Generated by `bench/gpu_summary.py` from the report.json files of `bench/gpu_check.sh`.",
        "",
        *[f"    {line}" for line in env[:6] + [m for m in model if m.startswith("gpu_model")]],
        "",
        f"{met} of {len(outcomes)} audit runs as expected (reference decoders pass, planted bugs fail); "
        f"{renamed} planted bug(s) caught under another check or signature than the catalog records "
        "(`specaudit.reference.mutants`, measured on the built-in models).",
        "",
        f"Finished: {len(outcomes) - len(unfinished)} of {len(outcomes)} audit runs"
        + (f" (not: {', '.join(unfinished)})" if unfinished else "")
        + (f"; {cb_done} of {len(cb)} transformers-cb runs" if cb else "")
        + ".",
        "",
        *table(outcomes),
        *cb_lines(cb, steps),
        "",
        "Other steps (exit status, seconds; 124/137: stopped by its timeout, -: skipped for lack of time):",
        "",
        *[f"- {step}: exit {rc}, {s} s" for step, (rc, s) in steps.items() if step != "cb" and "/" not in step],
        *cost_lines(results / "cost"),
        "",
        "Per run: `audit/<dtype>/<decoder>.log` (stdout and stderr), `audit/<dtype>/<decoder>/report.json`, "
        "reproducers under `audit/<dtype>/<decoder>/repro/`; transformers-cb under `cb/` (`cb.log`, "
        "`<dtype>/report.json`); the cost bench under `cost/`.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python bench/gpu_summary.py RESULTS_DIR", file=sys.stderr)
        return 2
    results = Path(argv[0])
    text = render(results)
    (results / "summary.md").write_text(text)
    print(text, end="")
    steps = read_steps(results)
    outcomes, cb = collect(results, steps), cb_collect(results, steps)
    return 0 if outcomes and all(o.met.startswith("yes") for o in [*outcomes, *cb]) else 1


if __name__ == "__main__":
    sys.exit(main())
