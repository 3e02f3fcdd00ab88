"""Wall and CPU time of the project's own test commands (`make test`, `make test-fast`), with the
load average beside them and the slowest tests (issue 26, point 6).

Runs each command once, in the tree given (default: this one), as the Makefile does but with
`--durations=N`, and prints one Markdown row per command for bench/results/test_time.md plus the
slowest tests. CPU seconds are the command's children's (xdist workers and the interpreters they
start): on a shared machine they say more than the wall time, which other jobs stretch.

    python bench/test_time.py [--tree DIR] [--workers 2] [--ci] [--fast] [--full] [--durations 15]

A tree other than this one (a clean copy of an older commit, to compare before and after in one
session) is imported through PYTHONPATH=DIR/_sp, a folder holding `specaudit` as links to DIR's
harness/ entries and its reference/, fixtures/ and properties/ (what the editable install maps).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DURATION = re.compile(r"^(?P<seconds>[\d.]+)s (?P<phase>call|setup|teardown)\s+(?P<test>\S+)$")


def command(fast: bool, workers: int, durations: int) -> list[str]:
    """The Makefile's test command (test-fast's when `fast`), with durations."""
    line = [sys.executable, "-m", "pytest", "properties/", "tests/", "-n", str(workers), "-q"]
    return line + (["-m", "not slow"] if fast else []) + [f"--durations={durations}"]


def environment(tree: Path, ci: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CI", None)
    if ci:
        env["CI"] = "true"
    if (tree / "_sp").is_dir():
        env["PYTHONPATH"] = str(tree / "_sp")
    return env


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def timed(argv: list[str], tree: Path, env: dict[str, str]) -> tuple[float, float, str, str]:
    """(wall seconds, children's CPU seconds, output, load before -> after) of one run."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    load_before = load()
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout + done.stderr, f"{load_before} -> {load()}"


def slowest(output: str, count: int) -> list[tuple[float, str]]:
    rows = [(float(m["seconds"]), f"{m['phase']} {m['test']}") for m in map(DURATION.match, output.splitlines()) if m]
    return sorted(rows, reverse=True)[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=ROOT)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ci", action="store_true", help="CI=true (the specaudit-ci profile), as CI runs it")
    parser.add_argument("--fast", action="store_true", help="time `make test-fast`")
    parser.add_argument("--full", action="store_true", help="time `make test`")
    parser.add_argument("--durations", type=int, default=15)
    args = parser.parse_args()
    for fast in [f for f, wanted in ((False, args.full), (True, args.fast)) if wanted]:
        argv = command(fast, args.workers, args.durations)
        wall, cpu, output, loads = timed(argv, args.tree, environment(args.tree, args.ci))
        summary = output.strip().splitlines()[-1] if output.strip() else "(no output)"
        name = f"{'make test-fast' if fast else 'make test'}, CI={'true' if args.ci else 'unset'}"
        print(f"| {args.tree} | {name} | {summary} | {wall:.0f} s | {cpu:.0f} s | {loads} |")
        for seconds, test in slowest(output, args.durations):
            print(f"    {seconds:8.2f} s  {test}")


if __name__ == "__main__":
    main()
