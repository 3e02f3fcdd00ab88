"""Standalone confirmation (imports no specaudit): OpenVINO GenAI's ContinuousBatchingPipeline
with a draft model at num_assistant_tokens=2 never matches a stop string that completes in the
request's first verify step: the request runs on to its limit.

Greedy, f32 hints, one request, prompt [4], 12 new tokens, EOS ignored. The target's greedy
continuation (transformers, float64) begins [145, 85, 328, 14, ...], text "w145 w85 w328 w14 ...".
Stop string "w145 w85" (the text of tokens 0..1), `include_stop_str_in_output=False`: the
non-speculative pipeline returns [] (the stop string is the output's start), as it should, and
so do num_assistant_tokens 1 and 4; with num_assistant_tokens=2 it returns all 12 tokens
[145, 85, 328, ...] with finish reason LENGTH. The stop string "w85 w328" (tokens 1..2) is missed
the same way (the non-speculative pipeline returns [145]).

    python tests/wild/openvino/confirm_stop_missed.py [TARGET_IR DRAFT_IR HF_TARGET]

Defaults: the IR and Hugging Face directories `make audit-openvino` builds under
~/.cache/specaudit (the built-in tiny Llama and its layer-0 draft). Exit 0: the defect is
present (confirmed); 1: not (fixed, or failing differently); 2: set-up error.
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
PROMPT = [4]
NEW = 12
STOP = slice(0, 2)  # the stop string is the text of the greedy continuation's tokens 0..1
K = 2


def greedy(hf_target: Path) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(str(hf_target), dtype=torch.float64).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(NEW):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(PROMPT) :].tolist()


def run(target_ir: Path, draft_ir: Path, stop: str, k: int | None, new: int = NEW) -> tuple[list[int], str]:
    """One request through a fresh pipeline (no speculation when k is None): its ids and last finish reason."""
    config = ov_genai.SchedulerConfig()
    config.max_num_batched_tokens, config.dynamic_split_fuse, config.num_kv_blocks = 256, True, 64
    properties: dict = dict(F32)
    if k is not None:
        properties["draft_model"] = ov_genai.draft_model(str(draft_ir), "CPU", **F32)
    pipe = ov_genai.ContinuousBatchingPipeline(str(target_ir), config, "CPU", properties)
    gen = ov_genai.GenerationConfig()
    gen.max_new_tokens, gen.do_sample, gen.ignore_eos = new, False, True
    gen.stop_strings, gen.include_stop_str_in_output = {stop}, False
    if k is not None:
        gen.num_assistant_tokens = k
    handle = pipe.add_request(0, ov.Tensor(np.asarray([PROMPT], dtype=np.int64)), gen)
    out: list[int] = []
    reason = "NONE"
    while pipe.has_non_finished_requests():
        pipe.step()
        while handle.can_read():
            for output in handle.read().values():
                out.extend(int(t) for t in output.generated_ids)
                if output.finish_reason.name != "NONE":
                    reason = output.finish_reason.name
    return out, reason


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
    oracle = greedy(hf)
    tokenizer = ov_genai.Tokenizer(str(target_ir))
    stop = tokenizer.decode(oracle[STOP])
    expected = oracle[: STOP.start]
    plain = run(target_ir, draft_ir, stop, None)
    fine = {k: run(target_ir, draft_ir, stop, k) for k in (1, 4)}
    spec = run(target_ir, draft_ir, stop, K)
    print(f"greedy continuation {oracle[:6]}..., stop string {stop!r}, include_stop_str_in_output=False")
    print(f"expected {expected} {tokenizer.decode(expected)!r}")
    print(f"non-speculative: {plain}")
    for k, got in fine.items():
        print(f"draft model, num_assistant_tokens={k}: {got}")
    print(f"draft model, num_assistant_tokens={K}: {spec}")
    confirmed = plain[0] == expected and all(g[0] == expected for g in fine.values())
    confirmed = confirmed and spec == (oracle[:NEW], "LENGTH")
    print("CONFIRMED: the stop string never matched, the request ran to its limit" if confirmed else "NOT confirmed")
    return 0 if confirmed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
