"""The black-box audit's oracle against the engine it judges, on the same requests, in one run.

SmolLM2-135M-Instruct in float32, 8 requests x 32 tokens (issue 17: the oracle must not be the
bottleneck of a real-model audit). Per repeat: the engine answers the requests (staggered, as
`specaudit blackbox` sends them), then the step-by-step batch-size-1 oracle (`greedy_oracle`,
what the audit ran before) and the teacher-forced one (`answer_oracle`, what it runs now) each
produce every request's greedy output; both must agree. Medians of the repeats are reported.

    python bench/oracle_speed.py --server http://127.0.0.1:8000   # a vLLM server on SmolLM2

The server is started by hand (or by `make audit-vllm`'s launcher) on the same machine; see
bench/README.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specaudit.adapters.engine_blackbox import Request, make_requests
from specaudit.adapters.transports import CompletionsClient, send_staggered
from specaudit.models.loading import load_model, load_tokenizer, read_prompts, tokenize
from specaudit.models.pretrained import DEFAULT_PROMPTS, resolve
from specaudit.reference.oracle import OracleResult, answer_oracle, greedy_oracle

OUT = Path(__file__).parent / "results" / "oracle_speed.md"


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def engine_answers(url: str, requests: list[Request]) -> dict[int, tuple[int, ...]]:
    """Every request's tokens from the server (`ignore_eos`: each runs to its limit)."""
    client = CompletionsClient(url, timeout_s=600)
    answers = send_staggered(requests, lambda r: client.complete(r, None))
    bad = {i: a.error for i, a in answers.items() if a.error is not None or a.tokens is None}
    if bad:
        raise SystemExit(f"the server failed requests: {bad}")
    return {i: a.tokens or () for i, a in answers.items()}


@torch.no_grad()
def stepwise(target: torch.nn.Module, requests: list[Request]) -> list[OracleResult]:
    return [greedy_oracle(target, r.prompt, max_new_tokens=r.max_new_tokens, eos_token_id=None) for r in requests]


@torch.no_grad()
def teacher_forced(
    target: torch.nn.Module, requests: list[Request], answers: dict[int, tuple[int, ...]]
) -> list[OracleResult]:
    return [
        answer_oracle(target, r.prompt, answers[r.id], max_new_tokens=r.max_new_tokens, eos_token_id=None)
        for r in requests
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="an OpenAI-compatible server on SmolLM2-135M float32")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    path = resolve("smollm2")
    target = load_model("target", path, torch.device("cpu"), "float32").eval()
    prompts = tokenize(load_tokenizer(path), read_prompts(DEFAULT_PROMPTS)[: args.prompts])
    requests = make_requests(prompts, [0.05 * i for i in range(len(prompts))], args.tokens)
    rows = []
    for _ in range(args.repeats):
        answers, engine_s = timed(lambda: engine_answers(args.server, requests))
        slow, slow_s = timed(lambda: stepwise(target, requests))
        fast, fast_s = timed(lambda answers=answers: teacher_forced(target, requests, answers))  # type: ignore[misc]
        same = [(a.tokens, a.stop) for a in slow] == [(b.tokens, b.stop) for b in fast]  # type: ignore[union-attr]
        exact = sum(a.tokens == answers[r.id] for a, r in zip(slow, requests))  # type: ignore[index, union-attr]
        rows.append((engine_s, slow_s, fast_s, same, exact))
        print(f"engine {engine_s:.2f} s, step-by-step {slow_s:.2f} s, teacher-forced {fast_s:.2f} s, same={same}")
    engine, slow, fast = (statistics.median(r[i] for r in rows) for i in range(3))
    lines = [
        "# The black-box oracle against the engine (bench/oracle_speed.py)",
        "",
        f"SmolLM2-135M-Instruct float32, {len(requests)} requests x {args.tokens} tokens (ignore_eos), "
        f"server {args.server}, {args.repeats} repeats in one run on this machine (2 cores); medians.",
        "",
        "| | seconds (median) | vs engine |",
        "|---|---:|---:|",
        f"| engine (all requests, staggered) | {engine:.2f} | 1.00 |",
        f"| step-by-step batch-size-1 oracle (`greedy_oracle`, before) | {slow:.2f} | {slow / engine:.2f} |",
        f"| teacher-forced oracle (`answer_oracle`, now) | {fast:.2f} | {fast / engine:.2f} |",
        "",
        f"Per repeat (engine, step-by-step, teacher-forced, same result, exact answers of {len(requests)}): "
        + "; ".join(f"{e:.2f} / {s:.2f} / {f:.2f} / {same} / {x}" for e, s, f, same, x in rows),
        "",
    ]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
