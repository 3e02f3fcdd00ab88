"""Kill table, engine section: how fast the engine state machine catches each planted engine bug (issue 11).

For every entry of specaudit.reference.engine_mutants.ENGINE_CATALOG, every model of --models
(the transparent one, and tiny Llama, whose past I2 reads as K/V) and several seeds, run the
engine state machine (`specaudit.search.engine_machine.run_machine`: the `ci` profile's 30 runs of at
most 12 rules, plus the drain) until the first failure, let Hypothesis shrink it, then
delta-debug the shrunk rules (`minimize_ops`). Records per bug: median runs and rules to the
first failure, the first failing run's length, median and slowest seconds to it, the shrunk
rule-sequence length (Hypothesis; then after ddmin), the first check and rule, the signature
the engine diagnosis derives (against the catalog's), and the whole run's time. The reference
engines get a row each too: their wall time for the same budget and the shares of runs with
an admission into a batch with ragged acceptance and with a duplicate prompt among concurrent
requests.

Writes the "Engine bugs" section of bench/results/kill_table.md (the decoder section above it is
kept) and the rows with "kind": "engine" of kill_table.json (the decoder rows are kept).

    python bench/kill_table_engines.py [--seeds 3] [--max-examples 30] [--models transparent,llama] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from specaudit.reference.engine_mutants import ENGINE_CATALOG
from specaudit.search.ddmin import minimize_ops
from specaudit.search.engine_machine import DEFAULT_ENGINES, MachineRun, run_machine
from specaudit.search.engine_replay import diagnose_engine

RESULTS = Path(__file__).parent / "results"
SECTION = "## Engine bugs (continuous batching: the engine state machine)"
"""The heading of the engine section in kill_table.md; bench/kill_table.py keeps it when it rewrites."""
STEPS = 12
RAGGED = "admission into a batch with ragged acceptance"
DUPLICATE = "duplicate prompt among concurrent requests"


def kill_engine(name: str, model: str, seeds: int, max_examples: int) -> dict[str, Any]:
    """Every seed's run of the machine on one planted bug; the smallest shrunk failure is ddmin'd."""
    spec = f"specaudit.reference.engine_mutants:{name}"
    bug = ENGINE_CATALOG[name].bug
    runs = [run_machine(spec, max_examples, STEPS, seed=seed, model=model) for seed in range(seeds)]
    found = [r for r in runs if r.failure is not None]
    row: dict[str, Any] = {"kind": "engine", "bug": name, "model": model, "seeds": seeds, "caught": len(found)}
    row.update(expected_check=bug.first_check, expected_rule=bug.rule, signature=bug.signature)
    if not found:
        return row
    smallest = min(found, key=lambda r: (r.shrunk_rules or 0, r.seconds))
    assert smallest.failure is not None
    minimized = minimize_ops(smallest.failure.reproducer)
    first = smallest.failure.violations[0]
    row.update(
        runs_to_first_median=statistics.median(r.runs_to_failure or 0 for r in found),
        rules_to_first_median=statistics.median(r.rules_to_failure or 0 for r in found),
        first_failing_run_rules_median=statistics.median(r.first_failing_rules or 0 for r in found),
        seconds_to_first_median=round(statistics.median(r.seconds_to_failure or 0.0 for r in found), 2),
        seconds_to_first_slowest=round(max(r.seconds_to_failure or 0.0 for r in found), 2),
        seconds_total_median=round(statistics.median(r.seconds for r in found), 2),
        shrunk_rules_min=smallest.shrunk_rules,
        shrunk_rules_median=statistics.median(r.shrunk_rules or 0 for r in found),
        ddmin_rules=len(minimized.reproducer["ops"]),
        first_check=first.check,
        rule=first.rule,
        diagnosed_signature=diagnose_engine(minimized.violations, minimized.reproducer).signature,
        first_per_seed=[f"{r.failure.violations[0].check}/{r.failure.violations[0].rule}" for r in found if r.failure],
        reproducer=minimized.reproducer,
    )
    return row


def reference_row(spec: str, model: str, seeds: int, max_examples: int) -> dict[str, Any]:
    runs: list[MachineRun] = [run_machine(spec, max_examples, STEPS, seed=seed, model=model) for seed in range(seeds)]
    duplicates = statistics.median(r.events.get(DUPLICATE, 0.0) for r in runs)
    return {
        "kind": "engine-reference",
        "engine": spec,
        "model": model,
        "seeds": seeds,
        "passed": sum(r.passed for r in runs),
        "runs_median": statistics.median(r.runs for r in runs),
        "seconds_median": round(statistics.median(r.seconds for r in runs), 2),
        "seconds_slowest": round(max(r.seconds for r in runs), 2),
        "ragged_admission_share": round(statistics.median(r.events.get(RAGGED, 0.0) for r in runs), 3),
        "duplicate_prompt_share": round(duplicates, 3),
    }


def markdown(rows: list[dict[str, Any]], references: list[dict[str, Any]], header: str) -> str:
    lines = [
        SECTION,
        "",
        header,
        "",
        "| planted engine bug | model | caught | runs to first failure (median) "
        "| rules to first failure (median, all runs) | first failing run (rules) "
        "| seconds to first failure (median / slowest) | shrunk rules (min / median) "
        "| after ddmin | first check | rule | signature (diagnosed / catalog) "
        "| seconds per run of the machine (median) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["caught"]:
            lines.append(f"| {r['bug']} | {r['model']} | 0/{r['seeds']} | - | - | - | - | - | - | - | - | - | - |")
            continue
        lines.append(
            f"| {r['bug']} | {r['model']} | {r['caught']}/{r['seeds']} | {r['runs_to_first_median']} | "
            f"{r['rules_to_first_median']} | {r['first_failing_run_rules_median']} | "
            f"{r['seconds_to_first_median']} / {r['seconds_to_first_slowest']} | "
            f"{r['shrunk_rules_min']} / {r['shrunk_rules_median']} | {r['ddmin_rules']} | {r['first_check']} | "
            f"{r['rule']} | {r['diagnosed_signature']} / {r['signature']} | {r['seconds_total_median']} |"
        )
    if references:
        lines += [
            "",
            "| reference engine | model | passed | runs (median) | seconds (median / slowest) | runs with an admission "
            "into a ragged batch (median share) "
            "| runs with a duplicate prompt among concurrent requests (median share) |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in references:
            lines.append(
                f"| {r['engine']} | {r['model']} | {r['passed']}/{r['seeds']} | {r['runs_median']} | "
                f"{r['seconds_median']} / "
                f"{r['seconds_slowest']} | {r['ragged_admission_share']} | {r['duplicate_prompt_share']} |"
            )
    return "\n".join(lines) + "\n"


def write(rows: list[dict[str, Any]], references: list[dict[str, Any]], header: str) -> str:
    """Replace the engine rows of the json and the engine section of the markdown; keep the rest."""
    path = RESULTS / "kill_table.json"
    kept = [r for r in json.loads(path.read_text()) if not str(r.get("kind", "")).startswith("engine")]
    path.write_text(json.dumps(kept + rows + references, indent=1) + "\n")
    md = RESULTS / "kill_table.md"
    text = md.read_text() if md.exists() else ""
    decoders = text.split("\n" + SECTION)[0].rstrip("\n")
    section = markdown(rows, references, header)
    md.write_text((decoders + "\n\n" if decoders else "") + section)
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-examples", type=int, default=30, help="runs of the machine (the ci profile's 30)")
    parser.add_argument("--only", nargs="*", default=None, help="restrict to these catalog names (no reference rows)")
    parser.add_argument("--models", default="transparent,llama", help="comma-separated built-in models")
    args = parser.parse_args()
    models = args.models.split(",")
    started = time.perf_counter()
    rows = []
    for model in models:
        for name in args.only or list(ENGINE_CATALOG):
            rows.append(kill_engine(name, model, args.seeds, args.max_examples))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "reproducer"}), flush=True)
    references = []
    for model in [] if args.only else models:
        for spec in DEFAULT_ENGINES:
            references.append(reference_row(spec, model, args.seeds, args.max_examples))
            print(json.dumps(references[-1]), flush=True)
    header = (
        f"Engine state machine on {' and '.join(models)} (float64): {args.seeds} seeds, "
        f"at most {args.max_examples} runs of {STEPS} rules (plus the drain) per seed, Hypothesis shrinking, "
        "then ddmin over the shrunk rules; "
        f"{torch.get_num_threads()} torch threads, {time.perf_counter() - started:.0f} s in all, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end "
        "(`python bench/kill_table_engines.py`). A run is one generated rule sequence; rules to first failure "
        "count every rule of every run up to and including the failing one."
    )
    print(write(rows, references, header))


if __name__ == "__main__":
    main()
