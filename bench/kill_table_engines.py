"""Kill table, engine section: how fast the engine state machine catches each planted engine bug (issue 11).

For every entry of specaudit.reference.engine_mutants.ENGINE_CATALOG, every model of --models
(the transparent one, and tiny Llama, whose past I2 reads as K/V) and several seeds, run the
engine state machine (`specaudit.search.engine_machine.run_machine`: the `ci` profile's 30 runs of at
most 12 rules, plus the drain) until the first failure, let Hypothesis shrink it, then
delta-debug the shrunk rules (`minimize_ops`). Records per bug: median runs and rules to the
first failure, the first failing run's length, median and slowest seconds to it, the shrunk
rule-sequence length (Hypothesis; then after ddmin), the first check and rule, the signature
the engine diagnosis derives (`diagnose_engine`, on the ddmin'd failure) and whether it is the
catalog's (EngineBugInfo.signature), and the whole run's time. The reference engines get a row
each too: their wall time for the same budget and the shares of runs with an admission into a
batch with ragged acceptance and with a duplicate prompt among concurrent requests.

Writes the "Engine bugs" section of bench/results/kill_table.md (the decoder section above it is
kept) and the rows with "kind" "engine" and "engine-reference" of kill_table.json (the decoder
rows are kept). With --only, the named bugs' rows on --models replace theirs and every other
engine row, the reference rows and the section's header are kept (a paragraph says what was
re-measured).

    python bench/kill_table_engines.py [--seeds 3] [--max-examples 30] [--models transparent,llama]
        [--only NAME ...] [--note TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
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
    row.update(expected_check=bug.first_check, expected_rule=bug.rule, expected_signature=bug.signature)
    if not found:
        return row
    smallest = min(found, key=lambda r: (r.shrunk_rules or 0, r.seconds))
    assert smallest.failure is not None
    minimized = minimize_ops(smallest.failure.reproducer)
    first = smallest.failure.violations[0]
    diagnosed = diagnose_engine(minimized.violations, minimized.reproducer).signature
    row.update(
        runs_to_first_median=statistics.median(r.runs_to_failure or 0 for r in found),
        rules_to_first_median=statistics.median(r.rules_to_failure or 0 for r in found),
        first_failing_run_rules_median=statistics.median(r.first_failing_rules or 0 for r in found),
        seconds_to_first_median=round(statistics.median(r.seconds_to_failure or 0.0 for r in found), 2),
        seconds_to_first_slowest=round(max(r.seconds_to_failure or 0.0 for r in found), 2),
        seconds_total_median=round(statistics.median(r.seconds for r in found), 2),
        shrunk_rules_min=smallest.shrunk_rules,
        shrunk_rules_median=statistics.median(r.shrunk_rules or 0 for r in found),
        ddmin_rules=len(minimized.reproducer.ops),
        first_check=first.check,
        rule=first.rule,
        diagnosed_signature=diagnosed,
        signature_matches=diagnosed == bug.signature,
        first_per_seed=[
            f"{r.failure.first_check}/{r.failure.violations[0].rule}/{r.failure.diagnosis.signature}"
            for r in found
            if r.failure
        ],
        reproducer=minimized.reproducer.to_json(),
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


def against(found: str, expected: str) -> str:
    """A measured value, with the catalog's when it differs."""
    return found if found == expected else f"{found} (catalog: {expected})"


def markdown(rows: list[dict[str, Any]], references: list[dict[str, Any]], header: str) -> str:
    lines = [
        SECTION,
        "",
        header,
        "",
        "| planted engine bug | model | caught | first check | rule | signature (diagnosed / catalog) "
        "| signature matches catalog | runs to first failure (median) | rules to first failure (median, all runs) "
        "| first failing run (rules) | seconds to first failure (median / slowest) | shrunk rules (min / median) "
        "| after ddmin | seconds per run of the machine (median) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        caught = f"{'yes' if r['caught'] else 'no'}, {r['caught']}/{r['seeds']}"
        if not r["caught"]:
            lines.append(f"| {r['bug']} | {r['model']} | {caught} |" + " - |" * 11)
            continue
        matches = {True: "yes", False: "no"}.get(r.get("signature_matches"), "-")  # "-": recorded before the column
        lines.append(
            f"| {r['bug']} | {r['model']} | {caught} | {against(r['first_check'], r['expected_check'])} | "
            f"{against(r['rule'], r['expected_rule'])} | {r.get('diagnosed_signature', '-')} / "
            f"{r.get('expected_signature', r.get('signature'))} | {matches} | {r['runs_to_first_median']} | "
            f"{r['rules_to_first_median']} | {r['first_failing_run_rules_median']} | "
            f"{r['seconds_to_first_median']} / {r['seconds_to_first_slowest']} | "
            f"{r['shrunk_rules_min']} / {r['shrunk_rules_median']} | {r['ddmin_rules']} | {r['seconds_total_median']} |"
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
                f"{r['seconds_slowest']} | {r['ragged_admission_share']} | {r.get('duplicate_prompt_share', '-')} |"
            )
    return "\n".join(lines) + "\n"


def merged(rows: list[dict[str, Any]], previous: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The previous engine rows with those of `rows` (same bug and model) replaced or added: by
    model (in the order first recorded), then in catalog order."""
    by_key = {(r["model"], r["bug"]): r for r in previous if r.get("kind") == "engine" and r["bug"] in ENGINE_CATALOG}
    by_key.update({(r["model"], r["bug"]): r for r in rows})
    models = list(dict.fromkeys(model for model, _ in by_key))
    order = list(ENGINE_CATALOG)
    return [by_key[key] for key in sorted(by_key, key=lambda k: (models.index(k[0]), order.index(k[1])))]


def previous_header(text: str) -> str:
    """The header paragraphs of the engine section recorded in kill_table.md ('' if none)."""
    section = text.partition("\n" + SECTION + "\n")[2]
    return section.split("\n|")[0].strip()


def write(rows: list[dict[str, Any]], references: list[dict[str, Any]] | None, header: str) -> str:
    """Write the engine rows of the json and the engine section of the markdown; keep the decoder
    rows and section. references=None (--only): `rows` are merged into the recorded engine rows,
    the recorded reference rows are kept and `header` is appended to the recorded one."""
    path = RESULTS / "kill_table.json"
    previous = json.loads(path.read_text())
    kept = [r for r in previous if not str(r.get("kind", "")).startswith("engine")]
    md = RESULTS / "kill_table.md"
    text = md.read_text() if md.exists() else ""
    if references is None:
        rows = merged(rows, previous)
        references = [r for r in previous if r.get("kind") == "engine-reference"]
        header = "\n\n".join(h for h in (previous_header(text), header) if h)
    path.write_text(json.dumps(kept + rows + references, indent=1) + "\n")
    decoders = text.split("\n" + SECTION)[0].rstrip("\n")
    section = markdown(rows, references, header)
    md.write_text((decoders + "\n\n" if decoders else "") + section)
    return section


def measured_at() -> str:
    """Today's date and the checkout's commit, with the top-level folders of uncommitted changes."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=RESULTS, capture_output=True, text=True, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = sorted({f.split("/")[0] + "/" for f in git("diff", "--name-only", "HEAD").splitlines()})
    changes = f" (uncommitted changes under {', '.join(dirty)})" if dirty else ""
    return f"{time.strftime('%Y-%m-%d')} at commit {commit}{changes}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-examples", type=int, default=30, help="runs of the machine (the ci profile's 30)")
    parser.add_argument("--only", nargs="*", default=None, help="re-measure these catalog names, keep the other rows")
    parser.add_argument("--models", default="transparent,llama", help="comma-separated built-in models")
    parser.add_argument("--note", default="", help="a sentence appended to the header (e.g. the machine's load)")
    args = parser.parse_args()
    models = args.models.split(",")
    unknown = [name for name in args.only or [] if name not in ENGINE_CATALOG]
    if unknown:
        parser.error(f"not in ENGINE_CATALOG: {', '.join(unknown)}")
    when = measured_at()
    started = time.perf_counter()
    rows = []
    for model in models:
        for name in args.only or list(ENGINE_CATALOG):
            rows.append(kill_engine(name, model, args.seeds, args.max_examples))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "reproducer"}), flush=True)
    measured: list[dict[str, Any]] = []
    for model in [] if args.only else models:
        for spec in DEFAULT_ENGINES:
            measured.append(reference_row(spec, model, args.seeds, args.max_examples))
            print(json.dumps(measured[-1]), flush=True)
    references = None if args.only else measured  # None: keep the recorded reference rows
    what = f"`--only {' '.join(args.only)}` re-measured those rows" if args.only else "Measured"
    header = (
        f"{what} on {when} with `python bench/kill_table_engines.py"
        f"{' --only ' + ' '.join(args.only) if args.only else ''}`: engine state machine on "
        f"{' and '.join(models)} (float64), {args.seeds} seeds, "
        f"at most {args.max_examples} runs of {STEPS} rules (plus the drain) per seed, Hypothesis shrinking, "
        "then ddmin over the shrunk rules; "
        f"{torch.get_num_threads()} torch threads, {time.perf_counter() - started:.0f} s in all, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end."
    )
    if args.note:
        header += " " + args.note
    if args.only:
        header += " The other rows are kept from the run above."
    else:
        header += (
            " A run is one generated rule sequence; rules to first failure count every rule of every run up to "
            "and including the failing one. The signature is the engine diagnosis's (`diagnose_engine`) on the "
            "ddmin'd failure; a first check or rule that differs from the catalog's (EngineBugInfo) is shown "
            "with the catalog's in brackets."
        )
    print(write(rows, references, header))


if __name__ == "__main__":
    main()
