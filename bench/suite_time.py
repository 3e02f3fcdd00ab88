"""Wall time of the conformance suite under the `specaudit-ci` profile, and what it draws (issue 9).

Runs, once,

    CI=true pytest properties/ -n 2 --decoder specaudit.reference.eqspec:EqSpec --hypothesis-show-statistics

and writes bench/results/suite_time.md (and .json): the wall time against the 5-minute target,
the pytest summary, the generate-phase seconds per property and model, and the share of drawn
cases carrying each hypothesis.event() label (scale, dtype, draft, acceptance depth ...),
averaged over the properties, per model.

    python bench/suite_time.py [--workers 2] [--decoder SPEC] [--models NAMES]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
TARGET_SECONDS = 300.0
SECTION = re.compile(r"^(?P<test>\S+::(?P<name>\w+)\[(?P<params>[^\]]*)\]):$")
PHASE = re.compile(r"during generate phase \((?P<seconds>[\d.]+) seconds\)")
EVENT = re.compile(r"^\s+\* (?P<share>[\d.]+)%, (?P<label>.+)$")
KEY_LABELS = (
    "shape: small",
    "shape: wide",
    "shape: long",
    "shape: deep",
    "rows>16",
    "rows>32",
    "prompt>256",
    "position>256",
    "max_new_tokens>24",
    "K>=8",
    "K>8",
    "extra pad columns>3",
    "rejection after >=3 accepted",
    "accept-all-K",
    *(f"accept-i-then-reject:i={i}" for i in range(12)),
    "acceptance: ragged across rows",
    "acceptance: ragged across rounds",
    "dtype:float64",
    "dtype:float32",
    "dtype:bfloat16",
    "draft:scripted",
    "draft:tiny",
)


def run_suite(workers: int, decoder: str, models: str | None) -> tuple[float, int, str]:
    """One timed run of the suite; returns (seconds, exit status, combined output)."""
    command = [sys.executable, "-m", "pytest", "properties/", "-n", str(workers), "--decoder", decoder]
    command += ["--hypothesis-show-statistics", "-q", "-p", "no:cacheprovider"]
    if models:
        command += ["--models", models]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, "CI": "true"}, capture_output=True, text=True)
    return time.perf_counter() - start, done.returncode, done.stdout + done.stderr


def parse_statistics(output: str) -> list[dict[str, object]]:
    """Per test: name, model, generate-phase seconds and {label: share of drawn cases in %}."""
    tests: list[dict[str, object]] = []
    for line in output.splitlines():
        section = SECTION.match(line)
        if section:
            model = section["params"].rsplit("-", 1)[-1]
            tests.append({"test": section["name"], "model": model, "seconds": None, "events": {}})
        elif tests and (phase := PHASE.search(line)) and tests[-1]["seconds"] is None:
            tests[-1]["seconds"] = float(phase["seconds"])
        elif tests and (event := EVENT.match(line)):
            tests[-1]["events"][event["label"]] = float(event["share"])  # type: ignore[index]
    return tests


def label_shares(tests: list[dict[str, object]]) -> dict[str, dict[str, float]]:
    """{model: {label: mean share over that model's properties}} for the labels of KEY_LABELS."""
    by_model: dict[str, list[dict[str, float]]] = defaultdict(list)
    for t in tests:
        by_model[str(t["model"])].append(t["events"])  # type: ignore[arg-type]
    return {
        model: {label: round(sum(e.get(label, 0.0) for e in events) / len(events), 1) for label in KEY_LABELS}
        for model, events in by_model.items()
    }


def markdown(seconds: float, status: int, summary: str, tests: list[dict[str, object]], command: str) -> str:
    verdict = "within" if seconds <= TARGET_SECONDS else "over"
    lines = [
        "# Conformance suite wall time (specaudit-ci profile)",
        "",
        f"`{command}`",
        "",
        f"Wall time **{seconds:.0f} s** ({verdict} the {TARGET_SECONDS:.0f} s target); exit status {status}; "
        f"`{summary}`. Machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end "
        "(shared with other work: wall times are upper bounds).",
        "",
        "## Generate-phase seconds per property and model",
        "",
    ]
    models = sorted({str(t["model"]) for t in tests})
    names = sorted({str(t["test"]) for t in tests})
    seconds_of = {(t["test"], t["model"]): t["seconds"] for t in tests}
    lines += ["| property | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
    for name in names:
        cells = [f"{seconds_of.get((name, m)) or 0:.1f}" for m in models]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    shares = label_shares(tests)
    lines += [
        "",
        "## Share of drawn cases per label (%, mean over the properties)",
        "",
        "Acceptance labels count scripted-draft cases only (a real draft accepts what it accepts).",
        "",
        "| label | " + " | ".join(models) + " |",
        "|---|" + "---|" * len(models),
    ]
    for label in KEY_LABELS:
        lines.append(f"| {label} | " + " | ".join(f"{shares[m][label]:.1f}" for m in models) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--decoder", default="specaudit.reference.eqspec:EqSpec")
    parser.add_argument("--models", default=None, help="comma-separated built-in models (default: all)")
    args = parser.parse_args()
    command = f"CI=true pytest properties/ -n {args.workers} --decoder {args.decoder}" + (
        f" --models {args.models}" if args.models else ""
    )
    seconds, status, output = run_suite(args.workers, args.decoder, args.models)
    summary = next((ln.strip("= ") for ln in reversed(output.splitlines()) if " in " in ln and "passed" in ln), "")
    summary = summary or next((ln for ln in reversed(output.splitlines()) if ln.strip()), "")
    tests = parse_statistics(output)
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"command": command, "seconds": round(seconds, 1), "status": status, "summary": summary, "tests": tests}
    (RESULTS / "suite_time.json").write_text(json.dumps(record, indent=1) + "\n")
    (RESULTS / "suite_time.md").write_text(markdown(seconds, status, summary, tests, command))
    print(markdown(seconds, status, summary, tests, command))


if __name__ == "__main__":
    main()
