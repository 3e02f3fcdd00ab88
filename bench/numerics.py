"""How often correct decoders meet numerical ties in float32 and bfloat16 (issue 3, numerics).

Runs the correct decoders and the paper's control (plain batched greedy, no speculation) on
the tiny architectures over a fixed seeded workload, and counts per dtype: rows, exact rows,
rows equivalent only modulo ties, ties, real divergences and invariant violations. Writes
bench/results/numerics.json and numerics.md.

    python bench/numerics.py [--cases N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from specaudit.checks import check_i1, check_i2, equivalence
from specaudit.contracts.case import Case
from specaudit.running.runner import run_case

DECODERS = {
    "EQSPEC": "specaudit.reference.eqspec:EqSpec",
    "EXSPEC": "specaudit.reference.exspec:ExSpec",
    "LazySpec": "specaudit.reference.lazy:LazySpec",
    "batched greedy (control)": "specaudit.reference.batched:BatchedGreedy",
}
ARCHS = ("llama", "qwen3", "gpt2")
RESULTS = Path(__file__).parent / "results"


def workload(seed: int, n: int, arch: str, dtype: str) -> list[Case]:
    """Ragged batches of 6 prompts, half the drafts accepted, K = 3, 16 new tokens."""
    rng = random.Random(f"{seed}-{arch}")
    out = []
    for _ in range(n):
        prompts = tuple(tuple(rng.randrange(128) for _ in range(rng.randint(2, 24))) for _ in range(6))
        accept = tuple(tuple(rng.random() < 0.5 for _ in range(24)) for _ in prompts)
        out.append(Case(prompts, accept, 3, 16, None, 0, model=arch, dtype=dtype))
    return out


def measure(cases_per_arch: int, seed: int) -> list[dict[str, object]]:
    rows = []
    for dtype in ("float32", "bfloat16"):
        for label, spec in DECODERS.items():
            stats = dict(dtype=dtype, decoder=label, rows=0, exact=0, equivalent_modulo_ties=0, ties=0, diverged=0)
            stats["invariant_violations"] = 0
            start = time.perf_counter()
            for arch in ARCHS:
                for case in workload(seed, cases_per_arch, arch, dtype):
                    run = run_case(spec, case)
                    eq = equivalence(run)
                    stats["rows"] += len(eq.rows)
                    stats["exact"] += sum(r.exact for r in eq.rows)
                    stats["equivalent_modulo_ties"] += sum(r.equivalent and not r.exact for r in eq.rows)
                    stats["ties"] += eq.ties
                    stats["diverged"] += sum(not r.equivalent for r in eq.rows)
                    stats["invariant_violations"] += len(check_i1(run)) + len(check_i2(run))
            stats["seconds"] = round(time.perf_counter() - start, 1)
            print(stats, flush=True)
            rows.append(stats)
    return rows


def markdown(rows: list[dict[str, object]], cases_per_arch: int, seed: int) -> str:
    lines = [
        f"Tiny llama, qwen3, gpt2; {cases_per_arch} cases each of 6 ragged rows, K=3, 16 new tokens, seed {seed}.",
        "",
        "| dtype | decoder | rows | exact | equivalent modulo ties | ties | diverged | invariant violations |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['decoder']} | {r['rows']} | {r['exact']} | {r['equivalent_modulo_ties']} "
            f"| {r['ties']} | {r['diverged']} | {r['invariant_violations']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=8, help="cases per architecture")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = measure(args.cases, args.seed)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "numerics.json").write_text(json.dumps({"seed": args.seed, "cases": args.cases, "rows": rows}, indent=1))
    (RESULTS / "numerics.md").write_text(markdown(rows, args.cases, args.seed))
    print(markdown(rows, args.cases, args.seed))


if __name__ == "__main__":
    main()
