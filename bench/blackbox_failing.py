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

With `--vllm-python`, the same over HTTP against two vLLM servers of the tiny Llama under the
draft-model configuration, started side by side: one unpatched, one with a planted vLLM bug
(`reference.vllm_mutants`, `--planted`) loaded into every server process by
`bench/vllm_plant/sitecustomize.py`; `audit_server` judges both (the black box of `make audit-vllm`).

    python bench/blackbox_failing.py [--requests 8] [--tokens 64] [--repeats 5]
    python bench/blackbox_failing.py --vllm-python .venv-vllm/bin/python [--planted slot-at-block-boundary]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import specaudit.adapters.engine_blackbox as engine_blackbox
from specaudit.adapters.transports import audit_callable, audit_server
from specaudit.fixtures.pairs import draft_model, target_model
from specaudit.reference.engine_mutants import AdmitPositionsFromWidth
from specaudit.reference.engines import EqSpecEngine
from specaudit.reference.oracle import answer_oracles

OUT = Path(__file__).parent / "results" / "blackbox_failing.md"
OUT_VLLM = Path(__file__).parent / "results" / "blackbox_failing_vllm.md"
LOGS = Path("specaudit-out") / "blackbox_failing"  # the servers' logs
PLANT = Path(__file__).parent / "vllm_plant"  # its sitecustomize plants the bug in the server's processes
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


def run_once(audit: Callable[[], Any], oracle: torch.nn.Module, cut: bool) -> Sample:
    """One black-box audit (`audit()`), with the oracle's forwards counted on `oracle`."""
    calls: list[int] = []
    handle = oracle.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with oracle_mode(cut):
            start = time.perf_counter()
            result = audit()
            seconds = time.perf_counter() - start
    finally:
        handle.remove()
    return Sample(seconds, result.oracle_seconds, len(calls), tuple(map(verdict_of, result.violations)))


def in_process(args: argparse.Namespace) -> tuple[dict[str, Callable[[], Any]], torch.nn.Module, str]:
    """The built-in engines' black box: each engine name -> one audit of a fresh engine."""
    target, draft = target_model("llama"), draft_model("llama", "tiny", [])
    oracle = copy.deepcopy(target)  # the engine calls `target`; only the oracle's forwards are counted
    arrivals = [i // 2 * 2 for i in range(args.requests)]  # pairs arriving every other step: late ones get admitted

    def audit(cls: type) -> Callable[[], Any]:
        return lambda: audit_callable(
            cls(target, draft, num_draft_tokens=args.k, eos_token_id=None, pad_token_id=0), oracle,
            prompts(args.requests, args.seed), max_new_tokens=args.tokens, arrivals=arrivals, timeout_s=600,
        )  # fmt: skip

    where = (f"tiny Llama pair (float64, 1 torch thread), {args.requests} requests x {args.tokens} tokens "
             f"arriving in pairs every other step, K={args.k}, in process (`audit_callable`, the built-in "
             f"engines' black box)")  # fmt: skip
    return {name: audit(cls) for name, cls in ENGINES.items()}, oracle, where


def served(args: argparse.Namespace, stack: ExitStack) -> tuple[dict[str, Callable[[], Any]], torch.nn.Module, str]:
    """Two vLLM servers of the tiny Llama (draft-model configuration), unpatched and planted,
    kept up in `stack`: each name -> one `audit_server` run against it."""
    from specaudit.adapters.engine_blackbox import load_target
    from specaudit.adapters.vllm_lifecycle import HOST, SERVER_ENV, check_python, free_port, server_command, serving
    from specaudit.adapters.vllm_models import model_directories
    from specaudit.adapters.vllm_server import SERVER_BLOCK, boundary_prompts, speculative_config
    from specaudit.models.pretrained import cache_dir
    from specaudit.reference.vllm_mutants import BY_NAME

    version = check_python(args.vllm_python)
    target, draft = model_directories("tiny", cache_dir() / "vllm", print)
    oracle = load_target(str(target), "float32")
    texts = boundary_prompts(oracle.config.vocab_size, args.requests, args.seed)
    module = BY_NAME[args.planted].target.split(":")[0]  # what the sitecustomize waits for
    variants = {"passing (unpatched vLLM)": {}, f"failing (vLLM with {args.planted})": {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PLANT), os.environ.get("PYTHONPATH")])),
        "SPECAUDIT_VLLM_PLANTED": args.planted, "SPECAUDIT_VLLM_PLANTED_MODULE": module,
    }}  # fmt: skip
    audits: dict[str, Callable[[], Any]] = {}
    for name, env in variants.items():
        port = free_port()
        url = f"http://{HOST}:{port}"
        command = server_command(args.vllm_python, target, port, speculative_config("draft", draft, target))
        log = LOGS / f"server-{len(audits)}.log"
        stack.enter_context(serving([*command, *SERVER_BLOCK], url, log, 900.0, {**SERVER_ENV, **env}))
        audits[name] = lambda url=url: audit_server(
            url, oracle, texts, max_new_tokens=args.tokens, seed=args.seed, timeout_s=300,
            model=str(target), dtype="float32",
        )  # fmt: skip
    where = (f"tiny Llama served by vLLM {version} (float32, draft-model configuration, `--block-size 32`), "
             f"{args.requests} motif prompts of 8-90 tokens x {args.tokens} tokens over HTTP (`audit_server`, "
             f"the black box of `make audit-vllm`), two servers up side by side")  # fmt: skip
    return audits, oracle, where


def verdict_of(v: Any) -> tuple[Any, ...]:
    """What must not depend on the oracle's mode: who, which check and rule, where, which tokens."""
    found, expected = v.evidence.get("found_token"), v.evidence.get("expected_token")
    return (v.request, v.check, v.rule, v.evidence.get("index"), found, expected)


def table(samples: dict[tuple[str, str], list[Sample]]) -> list[str]:
    lines = [
        "| engine | oracle | audit s (median) | oracle s (median) | oracle forwards | violations |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for (engine, oracle), runs in samples.items():
        audit = statistics.median(s.seconds for s in runs)
        alone = statistics.median(s.oracle_seconds for s in runs)
        n, forwards = len(runs[0].verdict), runs[0].forwards
        lines.append(f"| {engine} | {oracle} | {audit:.2f} | {alone:.2f} | {forwards} | {n} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", help="time vLLM servers over HTTP instead (the vLLM venv's python)")
    parser.add_argument("--planted", default="slot-at-block-boundary", help="the failing server's vLLM bug")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.out = args.out or (OUT_VLLM if args.vllm_python else OUT)
    torch.set_num_threads(1)
    with ExitStack() as stack:
        audits, oracle, where = served(args, stack) if args.vllm_python else in_process(args)
        variants = [(e, o) for e in audits for o in ORACLES]
        samples: dict[tuple[str, str], list[Sample]] = {v: [] for v in variants}
        load = os.getloadavg()
        wall = time.perf_counter()
        for repeat in range(args.repeats):
            for engine, mode in variants[repeat % 4 :] + variants[: repeat % 4]:
                samples[(engine, mode)].append(run_once(audits[engine], oracle, ORACLES[mode]))
        wall = time.perf_counter() - wall
    for engine in audits:
        full, cut = (samples[(engine, o)][0].verdict for o in ORACLES)
        assert full == cut, f"{engine}: verdict with the full oracle {full}, with the cut one {cut}"
    lines = report(args, where, samples, load, os.getloadavg(), wall)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def report(
    args: argparse.Namespace,
    where: str,
    samples: dict[tuple[str, str], list[Sample]],
    before: tuple[float, float, float],
    after: tuple[float, float, float],
    wall: float,
) -> list[str]:
    command = (f"python bench/blackbox_failing.py --requests {args.requests} --tokens {args.tokens} "
               f"--repeats {args.repeats} --k {args.k} --seed {args.seed}")  # fmt: skip
    if args.vllm_python:
        command += f" --vllm-python {args.vllm_python} --planted {args.planted}"
    return [
        "# Failing against passing black-box time (bench/blackbox_failing.py)",
        "",
        f"`{command}`: {where}. Each variant {args.repeats} times, interleaved, order rotated; medians. "
        f"Machine: {os.cpu_count()} cores, load average {before[0]:.1f} at the start and {after[0]:.1f} at "
        f"the end; {wall:.0f} s in all (servers' start-up not counted).",
        "",
        *table(samples),
        "",
        "Verdicts (request, check, rule, index, found, expected) are identical with the full and the cut "
        "oracle for both engines (asserted by the script). Oracle forwards are counted on the oracle's own "
        "copy of the target: a right answer costs one teacher-forced forward; a wrong one, with the full "
        "oracle, one more per token left after its divergence, with the cut one at most two. The paged "
        "engines' records (vLLM's white box, transformers-cb) judge through the same "
        "`answer_oracles(cut=True)`.",
    ]


if __name__ == "__main__":
    main()
