"""Standalone confirmation (imports no specaudit): OpenVINO GenAI's ContinuousBatchingPipeline does
not apply a stop string that completes on the last token `max_new_tokens` allows, with or without
speculation.

Greedy, f32 hints, one request, prompt [100, 101, 102, 103, 104], EOS ignored. The target's greedy
continuation (transformers, float64) begins [216, 479, 161, 421, ...], text "w216 w479 w161 w421 ...".
Stop string "w421" (the text of token 3), `include_stop_str_in_output=False`: with
max_new_tokens=5 the pipeline returns [216, 479, 161] and finish reason STOP, as it should; with
max_new_tokens=4 (the stop string completes on the last token allowed) it returns
[216, 479, 161, 421] ("w216 w479 w161 w421": the stop string kept) and finish reason LENGTH.

    python tests/wild/openvino/confirm_stop_at_limit.py [TARGET_IR HF_TARGET]

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
PROMPT = [100, 101, 102, 103, 104]
STOP_TOKEN = 3  # the stop string is the text of the greedy continuation's token 3


def greedy(hf_target: Path, n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(str(hf_target), dtype=torch.float64).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(PROMPT) :].tolist()


def run(target_ir: Path, stop: str, new: int) -> tuple[list[int], str]:
    """One request through a fresh non-speculative pipeline: its tokens and last finish reason."""
    config = ov_genai.SchedulerConfig()
    config.max_num_batched_tokens, config.dynamic_split_fuse, config.num_kv_blocks = 256, True, 64
    pipe = ov_genai.ContinuousBatchingPipeline(str(target_ir), config, "CPU", dict(F32))
    gen = ov_genai.GenerationConfig()
    gen.max_new_tokens, gen.do_sample, gen.ignore_eos = new, False, True
    gen.stop_strings, gen.include_stop_str_in_output = {stop}, False
    handle = pipe.add_request(0, ov.Tensor(np.asarray([PROMPT], dtype=np.int64)), gen)
    out: list[int] = []
    reason = "NONE"
    while pipe.has_non_finished_requests():
        pipe.step()
        while handle.can_read():
            for output in handle.read().values():
                out.extend(int(t) for t in output.generated_ids)
                reason = output.finish_reason.name if output.finish_reason.name != "NONE" else reason
    return out, reason


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
    oracle = greedy(hf, STOP_TOKEN + 2)
    stop = ov_genai.Tokenizer(str(target_ir)).decode([oracle[STOP_TOKEN]])
    expected = oracle[:STOP_TOKEN]
    roomy, tight = run(target_ir, stop, STOP_TOKEN + 2), run(target_ir, stop, STOP_TOKEN + 1)
    print(f"greedy continuation {oracle}, stop string {stop!r}, include_stop_str_in_output=False, expected {expected}")
    print(f"max_new_tokens={STOP_TOKEN + 2}: {roomy}")
    print(f"max_new_tokens={STOP_TOKEN + 1} (the stop completes on the last token allowed): {tight}")
    confirmed = roomy == (expected, "STOP") and tight == (oracle[: STOP_TOKEN + 1], "LENGTH")
    print("CONFIRMED: the stop string is kept and the finish reason is LENGTH" if confirmed else "NOT confirmed")
    return 0 if confirmed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
