"""Calibration figures: batched vs batch-size-1 noise of a real model, per dtype (bench/results/calibration.md).

    python bench/calibrate.py [--model smollm2] [--dtypes float32,bfloat16] [--prompts N] [--new-tokens N]

Sequences are the built-in prompts (chat template applied) followed by their float32 batch-size-1
greedy continuation, so every dtype is measured along the same tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specaudit.models.pretrained import DEFAULT_PROMPTS, resolve
from specaudit.numerics.calibration import calibrate
from specaudit.reference.oracle import greedy_oracle

RESULTS = Path(__file__).resolve().parent / "results"


def chat_ids(tokenizer: object, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)  # type: ignore[attr-defined]
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    path = resolve(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = [json.loads(line)["prompt"] for line in DEFAULT_PROMPTS.read_text().splitlines()[: args.prompts]]
    prompts = [chat_ids(tokenizer, t) for t in texts]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sequences = []
    for p in prompts:
        out = greedy_oracle(reference, tuple(p), max_new_tokens=args.new_tokens, eos_token_id=None)
        sequences.append(list(p) + list(out.tokens))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows = []
    for dtype in args.dtypes.split(","):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        start = time.perf_counter()
        floor = calibrate(model, sequences, [len(p) for p in prompts], pad, label=args.model)
        print(floor.render(), f"({time.perf_counter() - start:.0f} s)", flush=True)
        rows.append(floor)
    RESULTS.mkdir(exist_ok=True)
    lines = [
        f"# Calibration: {args.model}, {len(prompts)} prompts in one batch, {args.new_tokens} teacher-forced steps",
        "",
        "Batched (left-padded, one batch) against batch-size-1 decoding along the same tokens, CPU.",
        "",
        "| dtype | steps | logit noise p50 | p99 | max | K/V noise p99 | max | median abs K | oracle margin p50 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in rows:
        lines.append(
            f"| {f.dtype} | {f.steps} | {f.logit_p50:.3g} | {f.logit_p99:.3g} | {f.logit_max:.3g} | {f.kv_p99:.3g} | "
            f"{f.kv_max:.3g} | {f.kv_scale:.3g} | {f.margin_p50:.3g} |"
        )
    (RESULTS / "calibration.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
