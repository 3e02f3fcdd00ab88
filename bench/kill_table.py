"""Kill table: how fast the suite catches each planted bug (issue 3).

For every entry of specaudit.reference.mutants.CATALOG and several seeds, search generated cases (the
same strategies as the conformance suite) until the first failure, then let Hypothesis
shrink it and diagnose the minimal case. Records per bug: median examples and seconds to
the first failure, the slowest seed, shrunk rows, first violated check and signature.
Each bug is searched on the model its BugInfo names first (`models`: a bug that needs a real
model, dtype or draft is searched on a tiny real model), unless --model says otherwise.
Writes bench/results/kill_table.json and kill_table.md; with --only, the named rows replace
theirs in the existing table and the others are kept. The engine bugs' section and rows
(bench/kill_table_engines.py) are kept as they are.

    python bench/kill_table.py [--seeds 3] [--model transparent] [--max-examples 300] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from specaudit.audits.verdict import EFFICIENCY_CHECKS
from specaudit.checks.diagnosis import diagnose
from specaudit.reference.mutants import CATALOG
from specaudit.running.runner import run_case
from specaudit.search.driver import search

ENGINE_SECTION = "## Engine bugs"
"""Where bench/kill_table_engines.py's section of kill_table.md starts: kept when this table is rewritten."""

RESULTS = Path(__file__).parent / "results"


def kill(name: str, model: str, seeds: int, max_examples: int, shrink_budget: int) -> dict[str, object]:
    spec = f"specaudit.reference.mutants:{name}"
    attempts = [
        search(spec, model, max_examples=max_examples, seed=seed, shrink_budget=shrink_budget) for seed in range(seeds)
    ]
    found = [a for a in attempts if a.found]
    row: dict[str, object] = {"bug": name, "model": model, "seeds": seeds, "caught": len(found)}
    if not found:
        return row
    smallest = min((a.minimal for a in found if a.minimal is not None), key=lambda c: (c.batch_size, len(repr(c))))
    diagnosis = diagnose(run_case(spec, smallest))
    row.update(
        examples_median=statistics.median(a.examples for a in found),
        seconds_median=round(statistics.median(a.seconds_to_first or 0.0 for a in found), 2),
        seconds_slowest=round(max(a.seconds_to_first or 0.0 for a in found), 2),
        shrink_seconds_median=round(statistics.median(a.seconds - (a.seconds_to_first or 0.0) for a in found), 2),
        shrunk_rows=smallest.batch_size,
        first_check=diagnosis.first_check,
        signature=diagnosis.signature,
        minimal_case=smallest.to_json(),
    )
    return row


def level(check: str) -> str:
    """The verdict level a first check reports at (issue 38): a cost check's finding is an efficiency one."""
    return "efficiency" if check in EFFICIENCY_CHECKS else "correctness"


def markdown(rows: list[dict[str, object]]) -> str:
    lines = [
        "| planted bug | model | caught | examples to first failure (median) "
        "| seconds to first failure (median / slowest) | shrunk rows | first check | level | signature |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["caught"]:
            lines.append(f"| {r['bug']} | {r['model']} | 0/{r['seeds']} | - | - | - | - | - | - |")
            continue
        lines.append(
            f"| {r['bug']} | {r['model']} | {r['caught']}/{r['seeds']} | {r['examples_median']} | "
            f"{r['seconds_median']} / {r['seconds_slowest']} | {r['shrunk_rows']} | {r['first_check']} | "
            f"{level(str(r['first_check']))} | {r['signature']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--model", default=None, help="search every bug on this model (default: its BugInfo's)")
    parser.add_argument("--max-examples", type=int, default=300)
    parser.add_argument("--shrink-budget", type=int, default=150, help="decoder runs for shrinking a failure")
    parser.add_argument("--only", nargs="*", default=None, help="restrict to these catalog names")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "kill_table" if args.model in (None, "transparent") else f"kill_table_{args.model}"
    path = RESULTS / f"{stem}.json"
    previous = json.loads(path.read_text()) if path.exists() else []
    engines = [r for r in previous if str(r.get("kind", "")).startswith("engine")]  # kill_table_engines.py's
    kept = {r["bug"]: r for r in previous if r not in engines} if args.only else {}
    for name in args.only or list(CATALOG):
        model = args.model or CATALOG[name].bug.models[0]
        row = kill(name, model, args.seeds, args.max_examples, args.shrink_budget)
        print(json.dumps({k: v for k, v in row.items() if k != "minimal_case"}), flush=True)
        kept[name] = row
    rows = [kept[name] for name in CATALOG if name in kept]
    for row in rows:
        row.setdefault("model", "transparent")  # rows recorded before the table named its model
    path.write_text(json.dumps(rows + engines, indent=1) + "\n")
    where = args.model or "each bug's first BugInfo model"
    header = f"Model: {where}; {args.seeds} seeds, at most {args.max_examples} examples per search"
    header += " (rows kept from an earlier table keep their own seeds: see caught).\n\n" if args.only else ".\n\n"
    md = RESULTS / f"{stem}.md"
    engine_section = md.read_text().partition("\n" + ENGINE_SECTION)[1:] if md.exists() else ("", "")
    md.write_text(header + markdown(rows) + "".join(engine_section))
    print(header + markdown(rows))


if __name__ == "__main__":
    main()
