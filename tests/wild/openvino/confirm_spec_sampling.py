"""Standalone confirmation (imports no specaudit): OpenVINO GenAI's ContinuousBatchingPipeline
with a draft model does not sample from the target's distribution: with top_k=20 it emits tokens
outside the target's 20 likeliest, which the non-speculative pipeline never does.

Sampling (temperature 1, top_k 20), f32 hints, 32 requests of prompt [4..14] (11 tokens), each
with its own rng_seed, 12 new tokens, EOS ignored, num_assistant_tokens=3, draft model: the
layer-0 draft. Every emitted token is ranked among the float64 target's logits given its own
prefix (transformers, teacher-forced); a token ranked below 20th by more than MARGIN logits is
impossible under top_k=20. Measured 7 Dec: the draft model emits 129 such tokens of 384 (the
first at request 0, index 2, 7.55 logits below the 20th); the non-speculative pipeline emits
none. specaudit's pooled fit (temperature 1, no top-k) puts the draft model's tokens at KS
distance 0.29 from the target's p, where the bound at a false-alarm rate of 1e-6 is 0.10 and
the non-speculative pipeline's distance is 0.02.

    python tests/wild/openvino/confirm_spec_sampling.py [TARGET_IR DRAFT_IR HF_TARGET]

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
PROMPT = list(range(4, 15))
REQUESTS = 32
NEW = 12
TOP_K = 20
K = 3
MARGIN = 0.01  # logits: far above the float32 pipeline's distance from the float64 target


def sampled(target_ir: Path, draft_ir: Path, speculative: bool) -> list[list[int]]:
    """REQUESTS seeded requests through a fresh pipeline (whole budget, no prefix caching)."""
    config = ov_genai.SchedulerConfig()
    config.max_num_batched_tokens, config.dynamic_split_fuse, config.num_kv_blocks = 256, True, 64
    properties: dict = dict(F32)
    if speculative:
        properties["draft_model"] = ov_genai.draft_model(str(draft_ir), "CPU", **F32)
    pipe = ov_genai.ContinuousBatchingPipeline(str(target_ir), config, "CPU", properties)
    handles = []
    for i in range(REQUESTS):
        gen = ov_genai.GenerationConfig()
        gen.max_new_tokens, gen.ignore_eos, gen.do_sample = NEW, True, True
        gen.temperature, gen.top_k, gen.top_p, gen.rng_seed = 1.0, TOP_K, 1.0, 1000 + i
        if speculative:
            gen.num_assistant_tokens = K
        handles.append(pipe.add_request(i, ov.Tensor(np.asarray([PROMPT], dtype=np.int64)), gen))
    out: list[list[int]] = [[] for _ in handles]
    while pipe.has_non_finished_requests():
        pipe.step()
        for i, handle in enumerate(handles):
            while handle.can_read():
                for output in handle.read().values():
                    out[i].extend(int(t) for t in output.generated_ids)
    return out


def outside_top_k(model: torch.nn.Module, tokens: list[int]) -> list[tuple[int, float]]:
    """(index, how far below the k-th logit) of each token the target's top-k excludes."""
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1]
    kth = logits.topk(TOP_K, dim=-1).values[:, -1]
    chosen = logits.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
    gap = kth - chosen
    return [(i, float(g)) for i, g in enumerate(gap) if g > MARGIN]


def main(argv: list[str]) -> int:
    if len(argv) not in (0, 3):
        print(__doc__, file=sys.stderr)
        return 2
    target_ir, draft_ir, hf = (
        (Path(a) for a in argv)
        if argv
        else (CACHE / "openvino" / "tiny-llama", CACHE / "openvino" / "tiny-llama-draft", CACHE / "vllm" / "tiny-llama")
    )
    if not (target_ir / "openvino_model.xml").is_file() or not (hf / "config.json").is_file():
        print(f"missing models under {target_ir} / {hf}: run `make audit-openvino` once", file=sys.stderr)
        return 2
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float64).eval()
    found = {}
    for speculative in (False, True):
        outputs = sampled(target_ir, draft_ir, speculative)
        bad = [(r, i, g) for r, tokens in enumerate(outputs) for i, g in outside_top_k(model, tokens)]
        found[speculative] = bad
        name = f"draft model, num_assistant_tokens={K}" if speculative else "non-speculative"
        print(f"{name}: {len(bad)} of {REQUESTS * NEW} tokens outside the target's top {TOP_K}", end="")
        first = f"; first: request {bad[0][0]}, index {bad[0][1]}, {bad[0][2]:.2f} below the {TOP_K}th logit"
        print(first if bad else "")
    confirmed = not found[False] and bool(found[True])
    print("CONFIRMED: the draft model's sampling leaves the target's top-k" if confirmed else "NOT confirmed")
    return 0 if confirmed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
