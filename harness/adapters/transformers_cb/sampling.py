"""transformers' continuous batching sampling (`do_sample=True`): lossless in distribution.

The engine samples with its own logits processors (temperature, top-k, top-p, HF's order) and
`torch.multinomial`, seeded once per manager by `ContinuousBatchingConfig.seed`. Each prompt is
sent `PER_PROMPT` times through `generate_batch`; every request runs to `max_new_tokens` (no EOS)
and each of its tokens is scored against the target's exact float64 distribution given its own
prefix (`adapters.sampling_blackbox.judge_samples`: the same weights at batch size 1, pooled into
one goodness-of-fit test). The paged rules are not applied here: their `greedy-commit` holds a
commit to the target's argmax, which a sampler need not be.

Level of evidence: the output level (each request's tokens), as the vLLM sampling black box.
"""

from __future__ import annotations

import time
from typing import Any

from specaudit.adapters.engine_blackbox import Request, check_tokens, contract_violation
from specaudit.adapters.sampling_blackbox import EVIDENCE, Sample, SamplingVerdict, judge_samples
from specaudit.adapters.transformers_cb.driver import CB_LOGGER, cb_config, without_psutil_notes
from specaudit.adapters.transformers_cb.models import engine_model
from specaudit.adapters.transformers_cb.workload import ENGINE, CbRequest, CbWorkload
from specaudit.artifacts.report import entry
from specaudit.checks.registry import PAGED
from specaudit.contracts.sampling import Sampling
from specaudit.fixtures.tiny import build_tiny

CB_SAMPLING = Sampling(temperature=0.8, top_k=20, top_p=0.9)
"""Every warper on (transformers CB builds no temperature warper at 1.0); the tiny Llama's top
token then holds about 0.6 of the mass."""
PROMPTS = (tuple(range(1, 12)), (7, 8, 9), tuple(range(40, 47)), tuple(range(60, 66)))
PER_PROMPT = 16
NEW_TOKENS = 12


def sampling_workload() -> CbWorkload:
    """`PER_PROMPT` requests of each prompt through `generate_batch` on the tiny Llama of seed 0,
    pages of 4 (prompts and outputs cross them), prefills chunked to 32 tokens a batch."""
    requests = tuple(
        CbRequest(f"r{i}", PROMPTS[i % len(PROMPTS)], NEW_TOKENS) for i in range(len(PROMPTS) * PER_PROMPT)
    )
    return CbWorkload(requests, "generate_batch", page_size=4, num_blocks=128, max_batch_tokens=32)


def generation_config(sampling: Sampling, max_new_tokens: int) -> Any:
    """Sampling at `sampling`'s settings to `max_new_tokens`, EOS -1 (an id no model produces)."""
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, temperature=sampling.temperature,
                            top_k=sampling.top_k, top_p=sampling.top_p, eos_token_id=-1, pad_token_id=None)  # fmt: skip


def run_sampling(seed: int = 0, sampling: Sampling = CB_SAMPLING) -> SamplingVerdict:
    """The workload sampled by transformers CB (its sampler seeded with `seed`), judged against the
    float64 tiny Llama of the same weights."""
    workload = sampling_workload()
    config = cb_config(workload)
    config.seed = seed  # torch.manual_seed when the manager starts: the draws replay
    start = time.perf_counter()
    CB_LOGGER.addFilter(without_psutil_notes)
    try:
        out = engine_model(workload.seed).generate_batch(
            [list(r.prompt) for r in workload.requests], generation_config=generation_config(sampling, NEW_TOKENS),
            continuous_batching_config=config, warmup=False,
        )  # fmt: skip
    finally:
        CB_LOGGER.removeFilter(without_psutil_notes)
    engine_s = time.perf_counter() - start
    samples = [sample(i, r, out.get(f"req_{i}"), seed) for i, r in enumerate(workload.requests)]
    verdict = judge_samples(
        f"{ENGINE} generate_batch", build_tiny("llama", seed=workload.seed), samples, sampling, seed
    )
    verdict.engine_s = engine_s
    return verdict


def sample(index: int, request: CbRequest, result: Any, seed: int) -> Sample:
    """One request's result as a sample: its tokens, or the contract break that stands for them."""
    asked = Request(index, request.prompt, request.max_new_tokens, 0.0)
    prompt_index = PROMPTS.index(request.prompt)
    if result is None or result.error is not None:
        found = "no result" if result is None else f"failed: {result.error}"
        return Sample(asked, prompt_index, seed, None, contract_violation("responds", found, index))
    tokens = tuple(int(t) for t in result.generated_tokens)
    return Sample(asked, prompt_index, seed, tokens, check_tokens(asked, list(tokens), None))


def sampling_entry(verdict: SamplingVerdict, seed: int) -> dict[str, Any]:
    """The report entry (kind "paged engine", as every transformers CB entry): the verdict, its fit and timings."""
    subject = {"engine": ENGINE, "entry_point": "generate_batch", "target": "llama", "workload": "sampling",
               "seed": seed}  # fmt: skip
    figures = {key: value for key, value in verdict.to_json().items() if key != "samples"}
    figures |= {"engine_seconds": round(verdict.engine_s, 3), "judge_seconds": round(verdict.oracle_s, 3),
                "evidence": EVIDENCE}  # fmt: skip
    first = verdict.violations[0] if verdict.violations else None
    return entry(PAGED, subject, verdict.passed, first, None, figures)
