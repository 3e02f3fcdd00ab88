"""What the conformance suite explores per decoder x model under a profile (issue 27, point 7).

The eight conformance properties of one decoder x model draw the same cases from the same seed
(`properties/conftest.py`) and judge one run of each (`cached_run`), so the distinct cases of a
parametrization are one stream. This script runs the suite's contract property alone, as the
suite runs it (`pytest properties/test_conformance.py -k test_decoder_contract`, `CI=true`, the
profile asked for), with itself loaded as a pytest plugin that wraps the module's `cached_run`
and records every run of the stream: distinct cases, batch sizes, K, the longest sequence
(prompt plus generated) and highest position a target call saw, rows that grew past 40 tokens
from a prompt of at most 40, rows that generated more than 41 tokens (what tests/decoders/
late_bug.py needs), ragged rounds (scheduled rounds in which live rows accept different
counts), EOS stops, failing cases and seconds; and, where the tree has it, helper coverage
(`specaudit.checks.coverage`) merged over the runs.

Results go to bench/results/suite_coverage.json under `--label` (other labels are kept) and
bench/results/suite_coverage.md shows every label side by side.

    python bench/suite_coverage.py --label before [--decoder SPEC] [--models NAMES] [--profile specaudit-ci]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from specaudit.contracts.case import Case
    from specaudit.running.runner import Run

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
NOTES = "_notes"
"""A key of suite_coverage.json holding lines of prose the markdown shows above the tables (edited by hand)."""
OUT_ENV = "SUITE_COVERAGE_OUT"
"""Where the plugin side writes the stream's figures (one JSON line per item)."""
GROWTH = 40
"""A row "grows past" this many tokens when its prompt holds at most that many and prompt plus output more."""
SHORT_PROMPT = 16
"""A short prompt, for the figure of rows that grew from one past 41 tokens."""
LATE = 40
"""tests/decoders/late_bug.py's buffer: its bug needs a row that generates more than this many tokens."""


@dataclass
class Stream:
    """The figures of the distinct cases one property of a decoder x model ran (its stream)."""

    drawn: int = 0
    distinct: set[Case] = field(default_factory=set)
    rows: Counter[int] = field(default_factory=Counter)
    ks: Counter[int] = field(default_factory=Counter)
    max_new_tokens: int = 0
    longest_sequence: int = 0
    highest_position: int = 0
    grew_past: int = 0  # cases with a row that grew past GROWTH tokens
    grew_from_short: int = 0  # ... from a prompt of at most SHORT_PROMPT tokens to more than GROWTH + 1
    generated_past: int = 0  # cases with a row that generated more than LATE + 1 tokens
    longest_output: int = 0
    ragged_rounds: int = 0
    ragged_cases: int = 0
    eos_stops: int = 0
    failing: int = 0
    seconds: float = 0.0
    coverage: Any = None  # specaudit.checks.coverage.Coverage, merged, where the tree has it

    def add(self, run: Run) -> None:
        from specaudit.checks.registry import all_violations

        self.drawn += 1
        if run.case in self.distinct:
            return
        case = run.case
        self.distinct.add(case)
        outputs = run.outputs or [[] for _ in case.prompts]
        self.rows[case.batch_size] += 1
        self.ks[case.num_draft_tokens] += 1
        self.max_new_tokens = max(self.max_new_tokens, case.max_new_tokens)
        lengths = [len(p) + len(o) for p, o in zip(case.prompts, outputs)]
        self.longest_sequence = max(self.longest_sequence, *lengths)
        self.highest_position = max(self.highest_position, highest_position(run))
        self.grew_past += any(len(p) <= GROWTH < n for p, n in zip(case.prompts, lengths))
        self.grew_from_short += any(len(p) <= SHORT_PROMPT and n > GROWTH + 1 for p, n in zip(case.prompts, lengths))
        self.generated_past += any(len(o) > LATE + 1 for o in outputs)
        self.longest_output = max(self.longest_output, *map(len, outputs))
        ragged = ragged_rounds(case, outputs)
        self.ragged_rounds += ragged
        self.ragged_cases += ragged > 0
        eos = case.eos_token_id
        self.eos_stops += sum(1 for o in outputs if o and eos is not None and o[-1] == eos)
        self.failing += bool(all_violations(run))
        self.seconds += run.seconds
        self.coverage = merged_coverage(self.coverage, run)

    def figures(self) -> dict[str, object]:
        return {
            "cases drawn": self.drawn,
            "distinct cases": len(self.distinct),
            "batch sizes (distinct)": len(self.rows),
            "largest batch": max(self.rows, default=0),
            "cases with >= 2 rows": sum(n for b, n in self.rows.items() if b >= 2),
            "cases with > 16 rows": sum(n for b, n in self.rows.items() if b > 16),
            "K (distinct)": len(self.ks),
            "largest K": max(self.ks, default=0),
            "largest max_new_tokens": self.max_new_tokens,
            "longest sequence": self.longest_sequence,
            "highest position": self.highest_position,
            f"cases with a row grown past {GROWTH}": self.grew_past,
            f"... from a prompt of <= {SHORT_PROMPT} to >= {GROWTH + 2}": self.grew_from_short,
            "longest output": self.longest_output,
            f"cases with a row that generated > {LATE + 1} tokens (late bug)": self.generated_past,
            "ragged rounds (scheduled)": self.ragged_rounds,
            "cases with a ragged round": self.ragged_cases,
            "rows stopped at EOS": self.eos_stops,
            "failing cases": self.failing,
            "decoder seconds": round(self.seconds, 1),
        }


def highest_position(run: Run) -> int:
    """The highest position id any target call gave a token (implied ones: past length + arange)."""
    best = 0
    for call in run.recording.target_calls:  # position_ids [B, T]
        if call.position_ids is not None:
            best = max(best, int(call.position_ids.max()))
        elif call.input_ids is not None:
            best = max(best, max(call.layer_lengths, default=0) + call.input_ids.shape[1] - 1)
    return best


def ragged_rounds(case: Case, outputs: list[list[int]]) -> int:
    """Scheduled rounds in which the live rows accept different counts (scripted draft only)."""
    from specaudit.search.strategies import round_counts

    if case.draft != "scripted" or case.batch_size < 2:
        return 0
    per_row = [round_counts(a, case.num_draft_tokens, len(o)) for a, o in zip(case.accept, outputs)]
    depth = max(map(len, per_row), default=0)
    return sum(len({r[j][1] for r in per_row if j < len(r)}) > 1 for j in range(depth))


def merged_coverage(before: Any, run: Run) -> Any:
    """Helper D's coverage of the run, merged into `before`, where `specaudit.checks.coverage` exists."""
    try:
        from specaudit.checks.coverage import coverage_of_run
    except ImportError:
        return None
    this = coverage_of_run(run)
    return this if before is None else before.merge(this)


COVERAGE_FIGURES = ("runs", "rounds", "ragged_rounds", "finished_early", "longest_sequence", "highest_position")
COVERAGE_FIGURES += ("pad_prompts", "eos_stops")


def coverage_figures(coverage: Any) -> dict[str, object]:
    """The merged `Coverage` of the distinct cases, flattened into table rows ("coverage." + field)."""
    if coverage is None:
        return {}
    data = coverage.to_json()
    out: dict[str, object] = {f"coverage.{name}": data.get(name) for name in COVERAGE_FIGURES}
    out["coverage.batch_sizes"] = f"{len(data['batch_sizes'])} sizes, up to {max(data['batch_sizes'], default=0)}"
    out["coverage.k_values"] = ",".join(map(str, data["k_values"]))
    out["coverage.flags"] = ", ".join(data["flags"]) or "none"
    return out


# ---------------------------------------------------------------------------------------
# The plugin side: loaded into the suite's pytest run with `-p suite_coverage`


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """Record every run the item's property asks `cached_run` for; write the figures after it."""
    module = getattr(item, "module", None)
    real = getattr(module, "cached_run", None)
    if real is None or OUT_ENV not in os.environ:
        yield
        return
    stream = Stream()

    def recording(spec: str, case: Any) -> Any:
        run = real(spec, case)
        stream.add(run)
        return run

    module.cached_run = recording  # type: ignore[union-attr]
    try:
        yield
    finally:
        module.cached_run = real  # type: ignore[union-attr]
        with Path(os.environ[OUT_ENV]).open("a") as out:
            figures = {**stream.figures(), **coverage_figures(stream.coverage)}
            out.write(json.dumps({"item": item.name, "figures": figures}) + "\n")


# ---------------------------------------------------------------------------------------
# The script side


def measure(decoder: str, model: str, profile: str) -> dict[str, object]:
    """The contract property of `decoder` x `model` under `profile`, as the suite runs it; its stream's figures."""
    out = RESULTS / f".suite_coverage.{os.getpid()}.jsonl"
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "properties/test_conformance.py", "-k", "test_decoder_contract"]
    command += ["--decoder", decoder, "--models", model, "--hypothesis-profile", profile]
    command += ["-p", "suite_coverage", "-p", "no:cacheprovider", "-p", "no:xdist", "-q"]
    path = os.pathsep.join([str(Path(__file__).parent), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "CI": "true", "PYTHONPATH": path, OUT_ENV: str(out)}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    lines = out.read_text().splitlines() if out.exists() else []
    out.unlink(missing_ok=True)
    if not lines:
        raise SystemExit(f"no stream recorded (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    figures: dict[str, object] = json.loads(lines[-1])["figures"]
    figures["property exit status"] = done.returncode
    figures["wall seconds"] = round(seconds, 1)
    return figures


def markdown(record: dict[str, Any]) -> str:
    """Every label's figures side by side, one table per decoder x model."""
    lines = [
        "# Suite coverage: the distinct cases one decoder x model runs, and what they cover",
        "",
        "`python bench/suite_coverage.py --label LABEL` (see its docstring). Each column is one label's run of",
        "the suite's contract property for the parametrization (`CI=true`, the profile named below), its",
        "stream of cases recorded; the other seven properties draw the same stream and judge the same runs.",
        "",
    ]
    lines += [*record.get(NOTES, []), ""] if record.get(NOTES) else []
    labels = [label for label in record if label != NOTES]
    keys = sorted({k for label in labels for k in record[label]}, key=lambda k: (k.split(" | ")[1], k))
    for key in keys:
        columns = [label for label in labels if key in record[label]]
        rows = [r for r in dict.fromkeys(r for c in columns for r in record[c][key]) if r != "meta"]
        lines += [f"## {key}", "", "| figure | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
        for row in rows:
            lines.append(f"| {row} | " + " | ".join(str(record[c][key].get(row, "")) for c in columns) + " |")
        meta = "; ".join(f"{c}: {record[c][key].get('meta', '')}" for c in columns)
        lines += ["", meta, ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="the column these figures go under, e.g. before / after")
    parser.add_argument("--decoder", default="specaudit.reference.eqspec:EqSpec")
    parser.add_argument("--models", default="transparent", help="comma-separated built-in models")
    parser.add_argument("--profile", default="specaudit-ci")
    args = parser.parse_args()
    path = RESULTS / "suite_coverage.json"
    for model in args.models.split(","):
        figures = measure(args.decoder, model, args.profile)
        figures["meta"] = (
            f"{args.profile}, {os.cpu_count()} CPUs, "
            f"load {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
        )
        print(args.label, model, json.dumps(figures), flush=True)
        record = json.loads(path.read_text()) if path.exists() else {}  # read again: other labels may have landed
        record.setdefault(args.label, {})[f"{args.decoder.rsplit(':', 1)[-1]} | {model}"] = figures
        path.write_text(json.dumps(record, indent=1) + "\n")
        (RESULTS / "suite_coverage.md").write_text(markdown(record))


if __name__ == "__main__":
    main()
