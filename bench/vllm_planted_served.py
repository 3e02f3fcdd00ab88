"""Each planted vLLM bug in a *served* vLLM, under the black box over HTTP.

`make test-vllm` shows each bug of `reference.vllm_mutants` caught by the white box, and its
`output_visible` flag says whether the outputs of the in-process engine differ from batch-size-1
greedy. Until the `vllm.general_plugins` entry point, no bug could be put in a server's engine
core. This runs `specaudit audit-vllm --plant NAME --whitebox-examples 0` per bug on the tiny
Llama (the black box alone: the white box's level is `make test-vllm`'s), on the configuration
whose steps the bug needs, and tabulates what the black box saw. The front end's bugs
(`SERVED_MUTANTS`: stop strings, usage counts) only a served vLLM reaches; they run under the
target drafting for itself, whose accepted runs carry a stop string's completion past it.

    python bench/vllm_planted_served.py [--vllm-python .venv-vllm/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from specaudit.commands.audit_vllm import run_audit_vllm
from specaudit.config.settings import VllmAuditSettings
from specaudit.reference.vllm_mutants import MUTANTS, SERVED, SERVED_MUTANTS, VllmMutant

OUT = Path(__file__).parent / "results" / "vllm_planted_served.md"
CONFIGURATION = {"stop-checked-per-step": "self-draft"}  # multi-token steps crossing max_tokens
"""The configuration a bug's steps need; the rest run under the draft model (it rejects often)."""


def configuration_of(mutant: VllmMutant) -> str:
    """The front end's bugs under self-drafting (long accepted runs); the others as `CONFIGURATION` says."""
    return "self-draft" if mutant.workload == SERVED else CONFIGURATION.get(mutant.name, "draft")


def in_process(mutant: VllmMutant) -> str:
    """The catalog's `output_visible`; the front end's bugs have no in-process engine run (no tokenizer)."""
    return "- (front end)" if mutant.workload == SERVED else ("yes" if mutant.output_visible else "no")


def served(name: str, configuration: str, args: argparse.Namespace) -> dict:
    """One bug under the black box: verdict, first check and rule, exact match, diverged requests, seconds."""
    out = args.work / name
    settings = VllmAuditSettings(python=args.vllm_python, models=("tiny",), configurations=(configuration,),
                                 out=out, whitebox_examples=0, plant=name, seed=args.seed)  # fmt: skip
    start = time.perf_counter()
    run_audit_vllm(settings, say=lambda text: print(f"  {text}", flush=True))
    (entry,) = json.loads((out / f"tiny-{configuration}" / "report.json").read_text())["entries"]
    first = entry.get("first") or {}
    return {"passed": entry["passed"], "check": first.get("check"), "rule": first.get("rule"),
            "exact": entry["exact_match"], "diverged": len(entry["diverged"]), "errors": len(entry["errors"]),
            "requests": len(entry["requests"]), "seconds": time.perf_counter() - start}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path("specaudit-out/vllm-planted"))
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    load, wall = os.getloadavg(), time.perf_counter()
    rows = []
    for mutant in (*MUTANTS, *SERVED_MUTANTS):
        configuration = configuration_of(mutant)
        print(f"{mutant.name} ({configuration})", flush=True)
        rows.append((mutant, configuration, served(mutant.name, configuration, args)))
    wall = time.perf_counter() - wall
    lines = [
        "# Planted vLLM bugs in a served vLLM, under the black box (bench/vllm_planted_served.py)",
        "",
        f"`python bench/vllm_planted_served.py --seed {args.seed}`: per bug, `specaudit audit-vllm --models tiny "
        f"--configurations C --plant NAME --whitebox-examples 0`: the server started with "
        f"`SPECAUDIT_VLLM_PLANT=NAME`, 16 requests of the black box's boundary prompts (mixed `max_tokens`, an EOS "
        f"the target emits), over HTTP. Machine: {os.cpu_count()} cores, load average {load[0]:.1f} at the start; "
        f'{wall:.0f} s in all. "In process" is the catalog\'s `output_visible` (the outputs of an in-process '
        "engine on the observer's workload); the white box catches every one of `MUTANTS` (`make test-vllm`). "
        "`SERVED_MUTANTS` (front end) are the black box's alone, with stop strings drawn from the oracle's text.",
        "",
        "| planted bug | catalog's check/rule | configuration | black box over HTTP | first check/rule | exact "
        "| diverged | errors | in process | s |",
        "|---|---|---|---|---|---:|---:|---:|---|---:|",
    ]
    for mutant, configuration, r in rows:
        verdict = "PASS (missed)" if r["passed"] else "FAIL (caught)"
        first = f"{r['check']}/{r['rule']}" if r["check"] else "-"
        lines.append(
            f"| {mutant.name} | {mutant.check}/{mutant.rule} | {configuration} | {verdict} | {first} | "
            f"{r['exact']:.2f} | {r['diverged']} of {r['requests']} | {r['errors']} | "
            f"{in_process(mutant)} | {r['seconds']:.0f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
