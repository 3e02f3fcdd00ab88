"""Wall time of the default `specaudit audit` (the README's main job, run by CI), per item.

Runs `specaudit audit [ARGS]` once, stamps every progress line on stderr with the seconds since
the start, and prints the total, the exit status and the slowest items (for a serial run an
item's time is the gap to the previous line; for a parallel one it is only when it finished).

    python bench/audit_time.py [--label NAME] [--json FILE] [-- AUDIT ARGS ...]

The figures recorded in bench/results/audit_time.md came from this script.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ITEM = re.compile(r"^\[(?P<done>\d+)/(?P<total>\d+)\] (?P<what>.+?): (?P<status>PASS|FAIL)")


def specaudit() -> str:
    """The venv's console script next to this interpreter, else the one on PATH."""
    local = Path(sys.executable).with_name("specaudit")
    return str(local) if local.exists() else "specaudit"


def timed_run(args: list[str]) -> dict:
    """One run of `specaudit audit ARGS`: total seconds, exit status, (seconds, line) per item."""
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [specaudit(), "audit", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    items = []
    assert proc.stderr is not None and proc.stdout is not None
    for line in proc.stderr:
        line = line.strip("\r\n").strip()
        if ITEM.match(line):
            items.append((round(time.perf_counter() - start, 1), line))
            print(f"{items[-1][0]:8.1f}s {line}", file=sys.stderr, flush=True)
    out = proc.stdout.read()
    rc = proc.wait()
    return {"seconds": round(time.perf_counter() - start, 1), "rc": rc, "items": items, "summary": out[-400:]}


def slowest(items: list[tuple[float, str]], n: int = 10) -> list[tuple[float, str]]:
    """Gaps between consecutive finished items, largest first (serial runs: each item's time)."""
    gaps = [(round(t - prev, 1), line) for (prev, _), (t, line) in zip([(0.0, "")] + items, items)]
    return sorted(gaps, reverse=True)[:n]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="", help="a name for this run in the output")
    parser.add_argument("--json", type=Path, help="also write the result as JSON here")
    parser.add_argument("audit_args", nargs="*", help="arguments for specaudit audit (after --)")
    args = parser.parse_args(argv)
    result = {"label": args.label, "args": args.audit_args, "cpus": os.cpu_count(), **timed_run(args.audit_args)}
    result["load_average"] = os.getloadavg()
    print(f"{args.label or 'audit'}: {result['seconds']:.1f} s wall, exit {result['rc']}, {len(result['items'])} items")
    for gap, line in slowest(result["items"]):
        print(f"  {gap:7.1f}s  {line}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
