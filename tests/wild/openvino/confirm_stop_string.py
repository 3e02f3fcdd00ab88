"""Standalone confirmation (imports no specaudit): OpenVINO GenAI's ContinuousBatchingPipeline
with a draft model leaves part of a stop string in the output when the stop string completes
inside an accepted run.

Greedy, f32 hints, one request, prompt [100, 101, 102, 103, 104], 16 new tokens, EOS ignored.
The target's greedy continuation (transformers, float64) begins [216, 479, 161, 421, ...], text
"w216 w479 w161 w421 ...". Stop string "w479 w161 w421" (the text of tokens 1..3), with
`include_stop_str_in_output=False`: the non-speculative pipeline returns [216] ("w216"), as it
should; with the draft model and num_assistant_tokens=4 it returns [216, 479, 161]
("w216 w479 w161": two thirds of the stop string kept, in the text and the token ids). K=1 and
K=7 return [216]; with `include_stop_str_in_output=True` every K returns [216, 479, 161, 421].

    python tests/wild/openvino/confirm_stop_string.py [TARGET_IR DRAFT_IR HF_TARGET]

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
PROMPT = [100, 101, 102, 103, 104]
NEW = 16
STOP = slice(1, 4)  # the stop string is the text of the greedy continuation's tokens 1..3
K = 4


def greedy(hf_target: Path) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(str(hf_target), dtype=torch.float64).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(NEW):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(PROMPT) :].tolist()


def run(target_ir: Path, draft_ir: Path, stop: str, k: int | None, include: bool = False) -> list[int]:
    """One request through a fresh pipeline (no speculation when k is None)."""
    config = ov_genai.SchedulerConfig()
    config.max_num_batched_tokens, config.dynamic_split_fuse, config.num_kv_blocks = 256, True, 64
    properties: dict = dict(F32)
    if k is not None:
        properties["draft_model"] = ov_genai.draft_model(str(draft_ir), "CPU", **F32)
    pipe = ov_genai.ContinuousBatchingPipeline(str(target_ir), config, "CPU", properties)
    gen = ov_genai.GenerationConfig()
    gen.max_new_tokens, gen.do_sample, gen.ignore_eos = NEW, False, True
    gen.stop_strings, gen.include_stop_str_in_output = {stop}, include
    if k is not None:
        gen.num_assistant_tokens = k
    handle = pipe.add_request(0, ov.Tensor(np.asarray([PROMPT], dtype=np.int64)), gen)
    out: list[int] = []
    while pipe.has_non_finished_requests():
        pipe.step()
        while handle.can_read():
            for output in handle.read().values():
                out.extend(int(t) for t in output.generated_ids)
    return out


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
    plain, spec = run(target_ir, draft_ir, stop, None), run(target_ir, draft_ir, stop, K)
    print(f"greedy continuation {oracle[:6]}..., stop string {stop!r}, include_stop_str_in_output=False")
    print(f"expected {expected} {tokenizer.decode(expected)!r}")
    print(f"non-speculative: {plain} {tokenizer.decode(plain)!r}")
    print(f"draft model, num_assistant_tokens={K}: {spec} {tokenizer.decode(spec)!r}")
    confirmed = plain == expected and spec != expected and stop.split()[0] in tokenizer.decode(spec)
    print("CONFIRMED: part of the stop string is left in the speculative output" if confirmed else "NOT confirmed")
    return 0 if confirmed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
