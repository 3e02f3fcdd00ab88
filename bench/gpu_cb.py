"""transformers' continuous batching on a given model and device, judged by the paged checks.

    python bench/gpu_cb.py --model DIR --out DIR [--device cuda] [--dtype float32 --dtype bfloat16 ...]

The GPU check's `cb` step (bench/gpu_check.sh): the items of the `transformers-cb` audit subject
(`specaudit.audits.transformers_cb`) that run on any model, each entry point's fixed workload
(must pass) and each planted bug of `specaudit.reference.transformers_cb_mutants` (must be caught),
on the Hugging Face directory DIR (bench/gpu_model.py's target) instead of the built-in tiny
Llama, on `--device` (on CUDA: transformers' paged cache and its SDPA kernels; flash attention is
never switched to, `cb_config`). Writes OUT/<dtype>/report.json (`specaudit.artifacts.report`,
command "transformers-cb") after every item, with the plan and each item's expectation, so a
run cut short still says what finished.

How each dtype is judged, so that a correct engine is never failed for rounding:
- float32 ("full"): every check of the paged-engine subject (`verdict_of`), kv-entry against a
  float32 batch-size-1 run of the same weights, equivalence with its greedy oracle at float32's
  tie tolerance. The engine runs with TF32 off; the oracle runs on the CPU, where the trace's
  evidence already is (the adapter compares K/V there, and a CPU reference needs no device).
- float16, bfloat16 ("exact"): only what holds to the bit in any dtype, the paged layout
  (positions, tokens, slots, blocks, provenance, K/V untouched since written). kv-entry (a
  float32 bound), greedy-commit (argmax over half-precision logits that the engine and the
  observer compute with different GEMM shapes) and the output checks (a fixed tie tolerance,
  not a real model's noise) are not judged there, so the planted bugs only those catch
  (`logits-one-early`, `one-token-too-many`, `token-after-eos`) run in float32 only.

Reproducers are not written: they replay on the built-in tiny Llama, not on DIR.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

CB = "transformers.generation.continuous_batching"
NEEDED = (f"{CB}.input_outputs", f"{CB}.cache_allocators")
"""What the adapter reads (5.19 and 5.24 have both; 5.17 has no cache allocators)."""
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FULL, EXACT = "full", "exact"
INEXACT_RULES = frozenset({"kv-entry", "greedy-commit"})
"""Paged rules over floating-point results, a float32 bound and an argmax: not judged in half precision."""
COMMAND = "transformers-cb"


@dataclass(frozen=True)
class CbItem:
    """One run: a workload (`name` "smoke:<entry point>" or "planted:<bug>") and what it must give."""

    name: str
    workload: Any  # CbWorkload
    mutant: Any = None  # CbMutant, or None for an unpatched run

    def expectation(self) -> dict[str, Any]:
        if self.mutant is None:
            return {"item": self.name, "expect": "PASS"}
        return {"item": self.name, "expect": "FAIL", "check": self.mutant.check, "rule": self.mutant.rule}


def judging(dtype: str) -> str:
    return FULL if dtype == "float32" else EXACT


def judged_in(mutant: Any, how: str) -> bool:
    """Whether `how` judges the rule that must catch the planted bug."""
    return how == FULL or (mutant.check == "paged" and mutant.rule not in INEXACT_RULES)


def missing_support() -> str | None:
    """Why the installed transformers cannot run the adapter (None: it can)."""
    import transformers

    for module in NEEDED:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"transformers {transformers.__version__} has no {module} (the adapter needs 5.19 or later)"
    return None


def load(model: Path, dtype: str, device: str) -> torch.nn.Module:
    """DIR in `dtype` on `device`, SDPA attention (the CB path the observer reads)."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=DTYPES[dtype], attn_implementation="sdpa")
    return loaded.to(device).eval()


def eos_workload(oracle: torch.nn.Module) -> Any:
    """The "eos" workload with the token this model's greedy continuations produce most before
    their last step: EOS then stops a request with room for a token after it (`token-after-eos`)."""
    from specaudit.adapters.transformers_cb import MUTANT_WORKLOADS
    from specaudit.reference.oracle import greedy_oracle

    workload, seen = MUTANT_WORKLOADS["eos"], Counter()
    with torch.no_grad():
        for r in workload.requests:
            seen.update(greedy_oracle(oracle, r.prompt, max_new_tokens=r.max_new_tokens - 1, eos_token_id=None).tokens)
    return replace(workload, eos_token_id=seen.most_common(1)[0][0])


def plan(how: str, oracle: torch.nn.Module | None) -> list[CbItem]:
    """Each entry point's smoke workload, then each planted bug that `how` can catch."""
    from specaudit.adapters.transformers_cb import ENTRY_POINTS, MUTANT_WORKLOADS, SMOKE
    from specaudit.reference.transformers_cb_mutants import MUTANTS

    items = [CbItem(f"smoke:{entry}", SMOKE[entry]) for entry in ENTRY_POINTS]
    for m in MUTANTS:
        if judged_in(m, how):
            workload = eos_workload(oracle) if m.workload == "eos" else MUTANT_WORKLOADS[m.workload]
            items.append(CbItem(f"planted:{m.name}", workload, m))
    return items


def exact_verdict(run: Any, dtype: str) -> Any:
    """The paged layout alone (`evaluate(PAGED, PagedRun(trace))`, no outputs recorded): the
    trace without its half-precision argmax and written K/V, so kv-entry and greedy-commit have
    nothing to compare and every rule judged holds to the bit."""
    from specaudit.adapters.transformers_cb import CbVerdict
    from specaudit.checks.registry import PAGED, evaluate
    from specaudit.running.paged import PagedRun

    start = time.perf_counter()
    calls = tuple(replace(c, greedy=None, written_kv=None) for c in run.trace.calls)
    evaluation = evaluate(PAGED, PagedRun(replace(run.trace, calls=calls), dtype=dtype))
    return CbVerdict(run, evaluation, time.perf_counter() - start)


def run_item(item: CbItem, base: torch.nn.Module, oracle: torch.nn.Module | None, dtype: str) -> Any:
    """One item on a private copy of the engine's model (CB switches its attention while it runs)."""
    from specaudit.adapters.transformers_cb import run_workload, verdict_of
    from specaudit.reference.transformers_cb_mutants import planted

    model = copy.deepcopy(base)
    if item.mutant is None:
        run = run_workload(item.workload, model)
    else:
        with planted(item.mutant):
            run = run_workload(item.workload, model)
    return verdict_of(run, oracle) if judging(dtype) == FULL else exact_verdict(run, dtype)


def entry_of(item: CbItem, verdict: Any, model: Path, dtype: str, device: str) -> dict[str, Any]:
    """The report entry of the `transformers-cb` audit subject, with this run's model, dtype and judging."""
    from specaudit.adapters.transformers_cb import report_entry
    from specaudit.audits.transformers_cb import with_signature

    kind, _, name = item.name.partition(":")
    subject = {"item": item.name, "workload": kind, "dtype": dtype, "device": device, "judging": judging(dtype)}
    subject |= {"target": str(model), "planted" if kind == "planted" else "entry_point": name}
    return with_signature(report_entry(verdict, subject), verdict.first)


def write(out: Path, dtype: str, entries: list[dict[str, Any]], **extra: Any) -> None:
    from specaudit.artifacts.report import write_report

    write_report(out / dtype, COMMAND, entries, dtype=dtype, **extra)


def run_dtype(args: argparse.Namespace, dtype: str) -> tuple[int, int]:
    """Every item of one dtype, the report rewritten after each: (items as expected, items)."""
    from specaudit.audits.transformers_cb import quiet_paged_api

    how, device = judging(dtype), args.device
    oracle = load(args.model, "float32", "cpu") if how == FULL else None
    items = plan(how, oracle)
    base = load(args.model, dtype, device)
    header = {"model": str(args.model), "device": device, "judging": how}
    expected = [i.expectation() for i in items]
    entries: list[dict[str, Any]] = []
    errors: dict[str, str] = {}  # item -> what it raised: no verdict, and the next item still runs
    write(args.out, dtype, entries, **header, planned=expected, errors=errors, finished=False)
    met = 0
    for item, want in zip(items, expected):
        try:
            with quiet_paged_api():
                verdict = run_item(item, base, oracle, dtype)
        except Exception as exc:  # an engine or observer that breaks on this device: reported, not fatal
            errors[item.name] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"{dtype} {item.name}: raised {errors[item.name]}", flush=True)
            write(args.out, dtype, entries, **header, planned=expected, errors=errors, finished=False)
            continue
        entries.append(entry_of(item, verdict, args.model, dtype, device))
        met += (verdict.passed and want["expect"] == "PASS") or (not verdict.passed and want["expect"] == "FAIL")
        first = f"{verdict.first.check}/{verdict.first.rule}" if verdict.first is not None else "-"
        print(f"{dtype} {item.name}: {'PASS' if verdict.passed else 'FAIL'} ({first}), want {want['expect']}; "
              f"engine {verdict.run.seconds:.2f} s, judge {verdict.judge_seconds:.2f} s", flush=True)  # fmt: skip
        write(args.out, dtype, entries, **header, planned=expected, errors=errors, finished=len(entries) == len(items))
    return met, len(items)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a Hugging Face Llama directory (the target)")
    parser.add_argument("--out", type=Path, required=True, help="results: OUT/<dtype>/report.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPES), help="repeatable; default float32")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ["float32"]
    return args


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when every item came out as expected, 1 otherwise, 3 when transformers cannot run it."""
    args = parse(sys.argv[1:] if argv is None else argv)
    why = missing_support()
    if why is not None:
        for dtype in args.dtype:
            write(args.out, dtype, [], model=str(args.model), device=args.device, unavailable=why, finished=False)
        print(f"gpu_cb: not run: {why}", flush=True)
        return 3
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 judging assumes float32 arithmetic
        torch.backends.cudnn.allow_tf32 = False
    start, ok = time.perf_counter(), True
    for dtype in args.dtype:
        met, total = run_dtype(args, dtype)
        ok = ok and met == total
        print(f"gpu_cb {dtype}: {met} of {total} as expected", flush=True)
    print(f"gpu_cb: {'all' if ok else 'not all'} as expected in {time.perf_counter() - start:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
