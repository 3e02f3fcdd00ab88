"""Engine state machine wall time, two versions of specaudit side by side.

Times `run_machine` (the ci profile's 30 runs of at most 12 rules, plus the drain) of reference
engines on the transparent model and tiny Llama, in fresh processes that alternate between two
source trees, so both see the same machine load. A tree is laid out as the wheel installs it
(harness/ is specaudit, reference/, fixtures/ and properties/ its subpackages), as `make cycles`
does; pass a git revision and it is checked out into a temporary worktree.

    python bench/engine_judge_time.py BEFORE_REV [AFTER_REV (default: the working tree)] [--rounds 2]

Prints one line per (model, engine, tree) with the median and total seconds over seeds x rounds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("EqSpecEngine", "ExSpecEngine")
MODELS = ("transparent", "llama")
SEEDS = 3

CHILD = """
import json, sys, time, torch
torch.set_num_threads(1)
from specaudit.search.engine_machine import run_machine
out = {}
for model in %(models)r:
    for engine in %(engines)r:
        for seed in range(%(seeds)d):
            start = time.perf_counter()
            run_machine(f"specaudit.reference.engines:{engine}", 30, 12, seed=seed, model=model)
            out.setdefault(f"{model} {engine}", []).append(time.perf_counter() - start)
print(json.dumps(out))
"""


def package(source: Path, into: Path) -> Path:
    """`source` laid out as the wheel installs it, under `into`."""
    shutil.copytree(source / "harness", into / "specaudit")
    for folder in ("reference", "fixtures", "properties"):
        shutil.copytree(source / folder, into / "specaudit" / folder)
    return into


def tree(rev: str | None, work: Path, name: str) -> Path:
    if rev is None:
        return package(ROOT, work / name)
    checkout = work / f"{name}-src"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "-q", str(checkout), rev], check=True)
    try:
        return package(checkout, work / name)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "-f", str(checkout)], check=True)


def timed(path: Path) -> dict[str, list[float]]:
    code = CHILD % {"models": MODELS, "engines": ENGINES, "seeds": SEEDS}
    env = {"PYTHONPATH": str(path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after", nargs="?", default=None)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        trees = {"before": tree(args.before, work, "before"), "after": tree(args.after, work, "after")}
        seconds: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for name, path in trees.items():  # alternating: both trees see the same load
                for key, values in timed(path).items():
                    seconds.setdefault((key, name), []).extend(values)
    for (key, name), values in sorted(seconds.items()):
        print(f"{key} {name}: median {statistics.median(values):.2f} s, total {sum(values):.1f} s ({len(values)} runs)")


if __name__ == "__main__":
    main()
