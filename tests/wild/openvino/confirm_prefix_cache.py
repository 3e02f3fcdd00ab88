"""Standalone confirmation (imports no specaudit): OpenVINO GenAI's ContinuousBatchingPipeline with
prefix caching hands one request another's output when two requests sharing a finished request's
one-token prompt are added in the same step. No speculation is needed.

Greedy, f32 hints, max_new_tokens=1 each, EOS ignored. Step 0: request 1, prompt [483], runs to
its end. Then, added in one step: request 0, prompt [483, 233], and request 2, prompt [483, 42]. The
target (transformers, float64) continues [483, 233] with 112 and [483, 42] with 395. With
prefix caching both return [395]; without it, [112] and [395].

    python tests/wild/openvino/confirm_prefix_cache.py [TARGET_IR HF_TARGET]

Defaults: the IR and Hugging Face directories `make audit-openvino` builds under ~/.cache/specaudit.
Exit 0: the defect is present (confirmed); 1: not (fixed, or failing differently); 2: set-up error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import openvino as ov
import openvino_genai as ov_genai
import torch
from transformers import AutoModelForCausalLM

CACHE = Path.home() / ".cache" / "specaudit"
F32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
FIRST = [483]
TOGETHER = {0: [483, 233], 2: [483, 42]}


def greedy_next(hf_target: Path, prompt: list[int]) -> int:
    model = AutoModelForCausalLM.from_pretrained(str(hf_target), dtype=torch.float64).eval()
    with torch.no_grad():
        return int(model(torch.tensor([prompt])).logits[0, -1].argmax())


def run(target_ir: Path, prefix_caching: bool) -> dict[int, list[int]]:
    """Request 1 to its end, then requests 0 and 2 added in the same step; each one's tokens."""
    config = ov_genai.SchedulerConfig()
    config.max_num_batched_tokens, config.dynamic_split_fuse, config.num_kv_blocks = 256, True, 64
    config.enable_prefix_caching = prefix_caching
    pipe = ov_genai.ContinuousBatchingPipeline(str(target_ir), config, "CPU", dict(F32))
    gen = ov_genai.GenerationConfig()
    gen.max_new_tokens, gen.do_sample, gen.ignore_eos = 1, False, True

    def add(rid: int, prompt: list[int]) -> object:
        return pipe.add_request(rid, ov.Tensor(np.asarray([prompt], dtype=np.int64)), gen)

    handles = {1: add(1, FIRST)}
    while pipe.has_non_finished_requests():
        pipe.step()
    handles.update({rid: add(rid, prompt) for rid, prompt in TOGETHER.items()})
    while pipe.has_non_finished_requests():
        pipe.step()
    out: dict[int, list[int]] = {}
    for rid, handle in handles.items():
        for output in handle.read_all():
            out.setdefault(rid, []).extend(int(t) for t in output.generated_ids)
    return out


def main(argv: list[str]) -> int:
    if len(argv) not in (0, 2):
        print(__doc__, file=sys.stderr)
        return 2
    target_ir, hf = (
        (Path(a) for a in argv) if argv else (CACHE / "openvino" / "tiny-llama", CACHE / "vllm" / "tiny-llama")
    )
    if not (target_ir / "openvino_model.xml").is_file() or not (hf / "config.json").is_file():
        print(f"missing models under {target_ir} / {hf}: run `make audit-openvino` once", file=sys.stderr)
        return 2
    expected = {rid: [greedy_next(hf, prompt)] for rid, prompt in TOGETHER.items()}
    cached, plain = run(target_ir, True), run(target_ir, False)
    print(f"expected (float64 oracle) {expected}")
    print(f"prefix caching on: { {rid: cached.get(rid) for rid in TOGETHER} }")
    print(f"prefix caching off: { {rid: plain.get(rid) for rid in TOGETHER} }")
    confirmed = all(plain.get(r) == e for r, e in expected.items()) and cached.get(0) == expected[2] != expected[0]
    print("CONFIRMED: request 0 gets request 2's output under prefix caching" if confirmed else "NOT confirmed")
    return 0 if confirmed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
