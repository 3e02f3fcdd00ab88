"""Failing against passing black-box time over HTTP: two vLLM servers side by side, one carrying a
planted bug, each audited with the full and the cut oracle, interleaved in one run.

Issue 25, item 5: a failing audit of a served vLLM took 794-1058 s against 535 s for a passing
one, because after a divergence the oracle decoded the whole continuation step by step. The
black box (`audit_server`, judged by `adapters.engine_blackbox` through
`answer_oracles(cut=True)`) now needs only each answer's first divergence. This serves the tiny
Llama twice with the same draft-model configuration, `--block-size 32`: one server unpatched and
one started with `SPECAUDIT_VLLM_PLANT=bonus-from-draft` (the `vllm.general_plugins` entry point,
`reference.vllm_mutants.plant_from_env`, puts it in the server's engine core). The four variants
(server x oracle) run interleaved, the order rotated each repeat; medians. The script asserts the
unpatched server passes, the planted one fails, and both oracles give the same verdict.

    python bench/blackbox_failing_vllm.py [--vllm-python .venv-vllm/bin/python] [--repeats 3]

Run it with the main venv's python (the oracle and the black box); the servers run in the vLLM
venv's python (`make vllm-venv`).
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from blackbox_failing import ORACLES, Sample, oracle_mode, rotated, table, verdict_of

from specaudit.adapters.transports import audit_server
from specaudit.adapters.vllm.lifecycle import HOST, SERVER_ENV, check_python, free_port, server_command, serving
from specaudit.adapters.vllm.models import model_directories
from specaudit.adapters.vllm.server import SERVER_BLOCK, boundary_prompts, speculative_config
from specaudit.adapters.vllm.whitebox import load_target
from specaudit.config.settings import VLLM_MODEL_NAMES
from specaudit.models.pretrained import cache_dir
from specaudit.reference.vllm_mutants import PLANT_ENV

RESULTS = Path(__file__).parent / "results"
PLANTED = "bonus-from-draft"
MODELS = {"tiny": "the tiny Llama", "smollm2": "SmolLM2-135M-Instruct"}
NO_PREFIX_CACHE = ("--no-enable-prefix-caching",)
"""Each variant sends the same prompts to its server again: with prefix caching the planted server
hangs on the second submission (two requests running, nothing scheduled), which would make its
verdict a timeout rather than the divergences being timed."""
SERVERS = {"passing (unpatched vLLM)": None, f"failing ({PLANTED})": PLANTED}


def start_servers(stack: ExitStack, python: str, target: Path, draft: Path, logs: Path) -> dict[str, str]:
    """Both servers up at once (each in its own process group, stopped on every exit path): name -> URL."""
    urls = {}
    for name, planted in SERVERS.items():
        port = free_port()
        urls[name] = f"http://{HOST}:{port}"
        command = server_command(python, target, port, speculative_config("draft", draft, target))
        command += [*SERVER_BLOCK, *NO_PREFIX_CACHE]
        env = {**SERVER_ENV, **({PLANT_ENV: planted} if planted else {})}
        log = logs / f"{planted or 'unpatched'}.log"
        print(f"starting {name} on {urls[name]} (log {log})", flush=True)
        stack.enter_context(serving(command, urls[name], log, 600.0, env))
    return urls


def run_once(url: str, oracle: torch.nn.Module, target: Path, cut: bool, args: argparse.Namespace) -> Sample:
    calls: list[int] = []
    handle = oracle.register_forward_pre_hook(lambda *_: calls.append(1))
    prompts = boundary_prompts(oracle.config.vocab_size, args.requests, args.seed)
    arrivals = [0.2 * (i // 2) for i in range(args.requests)]  # pairs, 0.2 s apart: requests join a running batch
    try:
        with oracle_mode(cut):
            start = time.perf_counter()
            result = audit_server(url, oracle, prompts, max_new_tokens=args.tokens, arrivals=arrivals,
                                  model=str(target), timeout_s=300)  # fmt: skip
            seconds = time.perf_counter() - start
    finally:
        handle.remove()
    return Sample(seconds, result.oracle_seconds, len(calls), tuple(map(verdict_of, result.violations)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--model", default="tiny", choices=VLLM_MODEL_NAMES, help="the served model and its draft")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="default: bench/results/blackbox_failing_vllm_MODEL.md")
    args = parser.parse_args()
    version = check_python(args.vllm_python)
    torch.set_num_threads(1)
    root = cache_dir() / "vllm"
    target, draft = model_directories(args.model, root, print)
    oracle = load_target(str(target))
    variants = [(s, o) for s in SERVERS for o in ORACLES]
    samples: dict[tuple[str, str], list[Sample]] = {v: [] for v in variants}
    with ExitStack() as stack:
        up = time.perf_counter()
        urls = start_servers(stack, args.vllm_python, target, draft, root / "bench-logs")
        startup, load, wall = time.perf_counter() - up, os.getloadavg(), time.perf_counter()
        for repeat in range(args.repeats):
            for server, oracle_name in rotated(variants, repeat):
                sample = run_once(urls[server], oracle, target, ORACLES[oracle_name], args)
                print(f"{server} / {oracle_name}: {sample.seconds:.1f} s, {len(sample.verdict)} violations", flush=True)
                samples[(server, oracle_name)].append(sample)
        wall = time.perf_counter() - wall
    check_verdicts(samples)
    lines = report(args, version, samples, startup, load, os.getloadavg(), wall)
    out = args.out or RESULTS / f"blackbox_failing_vllm_{args.model}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def check_verdicts(samples: dict[tuple[str, str], list[Sample]]) -> None:
    """The unpatched server passes, the planted one fails, and the oracle's mode changes no verdict."""
    for server, planted in SERVERS.items():
        verdicts = {s.verdict for o in ORACLES for s in samples[(server, o)]}
        assert len(verdicts) == 1, f"{server}: the verdict differs between oracles or repeats: {verdicts}"
        (verdict,) = verdicts
        expected = "a failure" if planted else "a pass"
        assert bool(verdict) == bool(planted), f"{server}: expected {expected}, got {verdict}"


def report(
    args: argparse.Namespace,
    version: str,
    samples: dict[tuple[str, str], list[Sample]],
    startup: float,
    before: tuple[float, float, float],
    after: tuple[float, float, float],
    wall: float,
) -> list[str]:
    command = (f"python bench/blackbox_failing_vllm.py --model {args.model} --requests {args.requests} "
               f"--tokens {args.tokens} --repeats {args.repeats} --seed {args.seed}")  # fmt: skip
    return [
        "# Failing against passing black-box time over HTTP: vLLM (bench/blackbox_failing_vllm.py)",
        "",
        f"`{command}`: vLLM {version} (CPU) serving {MODELS[args.model]} (float32) with its draft model "
        f"(`--speculative-config` draft, K 4), `{' '.join(SERVER_BLOCK + NO_PREFIX_CACHE)}`, twice at once: "
        f"unpatched, and with "
        f"`{PLANT_ENV}={PLANTED}` (the plugin plants the bug in that server's engine core). {args.requests} "
        f"requests x {args.tokens} tokens, prompts of the black box's boundary lengths, arriving in pairs "
        f"0.2 s apart. Each variant {args.repeats} times, interleaved, order rotated; medians. Machine: "
        f"{os.cpu_count()} cores, load average {before[0]:.1f} at the start and {after[0]:.1f} at the end; "
        f"both servers healthy after {startup:.0f} s, then {wall:.0f} s of audits.",
        "",
        *table(samples, "server"),
        "",
        "Verdicts (request, check, rule, index, found, expected) are identical across oracles and repeats; "
        'the unpatched server passes and the planted one fails (asserted by the script). "Server s" is the '
        "audit less the oracle (sending, waiting for answers, judging). Oracle forwards are counted on the "
        "oracle's module: a right answer costs one teacher-forced forward (one more per near-tie); a wrong "
        "one, with the full oracle, one more per token after its divergence, with the cut one at most two.",
    ]


if __name__ == "__main__":
    main()
