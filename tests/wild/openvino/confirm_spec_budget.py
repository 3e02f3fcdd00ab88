"""Standalone confirmation (imports no specaudit): OpenVINO GenAI's ContinuousBatchingPipeline
with speculation returns wrong outputs when `max_num_batched_tokens` is smaller than a step's
verification needs.

Greedy, f32 hints, num_assistant_tokens=1, two requests added together:
- draft model, prompts [437] and [6], 4 new tokens, budget 2: the second request differs from the
  model's greedy continuation (transformers, float64) from its second token on;
- prompt lookup, prompts [5] and [4, 4, 4], 6 new tokens, budget 3: the second request emits token
  id -1 after every token, 7 tokens in all.
Each is exact with a budget of 256, and without speculation at the small budget.

    python tests/wild/openvino/confirm_spec_budget.py [TARGET_IR DRAFT_IR HF_TARGET]

Defaults: the IR and Hugging Face directories `make audit-openvino` builds under
~/.cache/specaudit (the built-in tiny Llama and its layer-0 draft). Exit 0: the defect is
present in both (confirmed); 1: not (fixed, or failing differently); 2: set-up error.
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
CASES = {  # method: (prompts, new tokens, small budget)
    "draft": ([[437], [6]], 4, 2),
    "lookup": ([[5], [4, 4, 4]], 6, 3),
}


def run(target_ir: Path, draft_ir: Path, method: str, prompts: list[list[int]], new: int, budget: int) -> list:
    config = ov_genai.SchedulerConfig()
    config.max_num_batched_tokens = budget
    config.dynamic_split_fuse = True
    config.num_kv_blocks = 64
    properties: dict = dict(F32)
    if method == "draft":
        properties["draft_model"] = ov_genai.draft_model(str(draft_ir), "CPU", **F32)
    elif method == "lookup":
        properties["prompt_lookup"] = True
    pipe = ov_genai.ContinuousBatchingPipeline(str(target_ir), config, "CPU", properties)
    handles = []
    for i, prompt in enumerate(prompts):
        gen = ov_genai.GenerationConfig()
        gen.max_new_tokens, gen.do_sample, gen.ignore_eos = new, False, True
        if method != "none":
            gen.num_assistant_tokens = 1
        if method == "lookup":
            gen.max_ngram_size = 3
        handles.append(pipe.add_request(i, ov.Tensor(np.asarray([prompt], dtype=np.int64)), gen))
    out: list[list[int]] = [[] for _ in prompts]
    while pipe.has_non_finished_requests():
        pipe.step()
        for i, handle in enumerate(handles):
            if handle.can_read():
                for output in handle.read().values():
                    out[i].extend(int(t) for t in output.generated_ids)
    return out


def greedy(model: torch.nn.Module, prompts: list[list[int]], new: int) -> list[list[int]]:
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(new):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outputs.append(ids[len(prompt) :])
    return outputs


def main() -> int:
    args = [Path(a) for a in sys.argv[1:4]]
    ir = CACHE / "openvino"
    target_ir, draft_ir, hf_target = args if len(args) == 3 else (ir / "tiny-llama", ir / "tiny-llama-draft",
                                                                  CACHE / "vllm" / "tiny-llama")  # fmt: skip
    missing = [p for p in (target_ir, draft_ir, hf_target) if not (p / "config.json").is_file()]
    if missing:
        print(f"missing model directories {missing}: run `make audit-openvino` once, or pass them", file=sys.stderr)
        return 2
    print(f"openvino_genai {ov_genai.__version__}")
    model = AutoModelForCausalLM.from_pretrained(hf_target, dtype=torch.float64).eval()
    confirmed = True
    for method, (prompts, new, budget) in CASES.items():
        oracle = greedy(model, prompts, new)
        print(f"{method}: prompts {prompts}, greedy oracle (transformers, float64) {oracle}")
        runs = {(method, budget): None, (method, 256): None, ("none", budget): None}
        for m, b in runs:
            got = run(target_ir, draft_ir, m, prompts, new, b)
            right = got == oracle
            print(f"  {m}, max_num_batched_tokens={b}: {got} {'exact' if right else 'WRONG'}")
            confirmed &= right == ((m, b) != (method, budget))
    print("CONFIRMED: wrong outputs only with speculation under a small token budget" if confirmed
          else "NOT CONFIRMED (fixed, or fails differently)")  # fmt: skip
    return 0 if confirmed else 1


if __name__ == "__main__":
    sys.exit(main())
