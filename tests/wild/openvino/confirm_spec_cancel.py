"""Standalone confirmation (imports no specaudit): with speculation, OpenVINO GenAI's
ContinuousBatchingPipeline still emits a token for a request after its handle's `cancel()`.

Greedy, f32 hints, one request, prompt [468], max_new_tokens=3, EOS ignored, draft model with
num_assistant_tokens=1. After the first step (which emits the request's first token) the handle is
cancelled; the next step emits one more token for it. The non-speculative pipeline emits nothing
after the cancel.

    python tests/wild/openvino/confirm_spec_cancel.py [TARGET_IR DRAFT_IR]

Defaults: the IR directories `make audit-openvino` builds under ~/.cache/specaudit.
Exit 0: the defect is present (confirmed); 1: not (fixed, or failing differently); 2: set-up error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import openvino as ov
import openvino_genai as ov_genai

CACHE = Path.home() / ".cache" / "specaudit" / "openvino"
F32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
PROMPT = [468]


def run(target_ir: Path, draft_ir: Path, speculative: bool) -> tuple[list[int], list[int]]:
    """Tokens emitted before the cancel (after one step) and after it."""
    config = ov_genai.SchedulerConfig()
    config.max_num_batched_tokens, config.dynamic_split_fuse, config.num_kv_blocks = 256, True, 64
    properties: dict = dict(F32)
    if speculative:
        properties["draft_model"] = ov_genai.draft_model(str(draft_ir), "CPU", **F32)
    pipe = ov_genai.ContinuousBatchingPipeline(str(target_ir), config, "CPU", properties)
    gen = ov_genai.GenerationConfig()
    gen.max_new_tokens, gen.do_sample, gen.ignore_eos = 3, False, True
    if speculative:
        gen.num_assistant_tokens = 1
    handle = pipe.add_request(0, ov.Tensor(np.asarray([PROMPT], dtype=np.int64)), gen)

    def read() -> list[int]:
        out: list[int] = []
        while handle.can_read():
            for output in handle.read().values():
                out.extend(int(t) for t in output.generated_ids)
        return out

    pipe.step()
    before = read()
    handle.cancel()
    while pipe.has_non_finished_requests():
        pipe.step()
    after = read()
    return before, after


def main(argv: list[str]) -> int:
    if len(argv) not in (0, 2):
        print(__doc__, file=sys.stderr)
        return 2
    target_ir, draft_ir = (Path(a) for a in argv) if argv else (CACHE / "tiny-llama", CACHE / "tiny-llama-draft")
    if not (target_ir / "openvino_model.xml").is_file() or not (draft_ir / "openvino_model.xml").is_file():
        print(f"missing models under {target_ir} / {draft_ir}: run `make audit-openvino` once", file=sys.stderr)
        return 2
    plain, spec = run(target_ir, draft_ir, False), run(target_ir, draft_ir, True)
    print(f"non-speculative: before the cancel {plain[0]}, after it {plain[1]}")
    print(f"draft model, K=1: before the cancel {spec[0]}, after it {spec[1]}")
    confirmed = len(plain[0]) == 1 and not plain[1] and len(spec[0]) == 1 and bool(spec[1])
    print("CONFIRMED: tokens emitted after the cancel with speculation" if confirmed else "NOT confirmed")
    return 0 if confirmed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
