"""OpenVINO GenAI sampling under speculation (`do_sample=True`): lossless in distribution.

Each prompt is sent `PER_PROMPT` times, each request with its own `rng_seed`, its own K (1..7) and
arrival step, seeded from the audit's seed; every request runs to `NEW_TOKENS` (EOS ignored), and
each of its tokens is scored against the target's exact float64 distribution given its own prefix
(`adapters.sampling_blackbox.judge_samples`, the judge of vLLM's and transformers-cb's sampling:
pooled into one goodness-of-fit test with a false-alarm rate fixed in advance). The pipeline runs
with a whole token budget and no prefix caching, so the known defects `spec-token-budget` and
`prefix-cache-partial` are out of play: a failure here is not one of them.

Level of evidence: the output level, as the greedy audit (the engine owns its models).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from specaudit.adapters.engine_blackbox import Request, check_tokens, contract_violation
from specaudit.adapters.openvino.engine import EngineOptions, OpenVinoEngine, build_pipeline
from specaudit.adapters.openvino.steps import drive, out_of_vocabulary
from specaudit.adapters.openvino.workloads import MAX_ARRIVAL, MAX_K, Workload
from specaudit.adapters.sampling_blackbox import Sample, SamplingVerdict, judge_samples, request_seed
from specaudit.adapters.transports import StepRun, cut_short
from specaudit.contracts.sampling import Sampling

OV_SAMPLING = Sampling(temperature=0.8, top_k=20, top_p=0.9)
"""Every warper cutting: the tiny Llama's top token then holds about 0.6 of the mass."""
PROMPTS = (tuple(range(4, 15)), (7, 8, 9), tuple(range(40, 47)), (40, 41, 42) * 4)
"""Short and long prompts, one a repeated motif so that prompt lookup drafts."""
PER_PROMPT = 16
NEW_TOKENS = 12
METHODS = ("draft", "lookup")


def sampling_options(method: str) -> EngineOptions:
    """A whole budget, no prefix caching: the conditions of the budget and prefix-cache defects removed."""
    return EngineOptions(method, max_num_batched_tokens=256, prefix_caching=False)


def sampling_workload(seed: int) -> tuple[Workload, dict[int, int]]:
    """`PER_PROMPT` requests of each prompt, interleaved, with K and arrival steps drawn from `seed`
    (a private generator: no global randomness); per request its `rng_seed`."""
    draw = random.Random(seed)
    n = len(PROMPTS) * PER_PROMPT
    prompts = tuple(PROMPTS[i % len(PROMPTS)] for i in range(n))
    ks = tuple(draw.randint(1, MAX_K) for _ in range(n))
    arrivals = tuple(draw.randint(0, MAX_ARRIVAL) for _ in range(n))
    workload = Workload(prompts, (NEW_TOKENS,) * n, ks, arrivals, (None,) * n)
    return workload, {i: request_seed(seed, i) for i in range(n)}


def run_sampling(
    target_ir: Path, draft_ir: Path, target: torch.nn.Module, method: str, seed: int = 0,
    sampling: Sampling = OV_SAMPLING, sent: Sampling | None = None,
) -> tuple[SamplingVerdict, OpenVinoEngine]:  # fmt: skip
    """The workload sampled by a fresh pipeline with `method`'s speculation, judged at `sampling`;
    `sent`: the settings the pipeline is given instead (a planted mismatch: tests only)."""
    options = sampling_options(method)
    workload, seeds = sampling_workload(seed)
    engine = OpenVinoEngine(build_pipeline(target_ir, draft_ir, options), options, None)
    engine.sampling, engine.seeds = sent or sampling, seeds
    run = drive(engine, workload, {})
    vocab = int(target.config.vocab_size)
    samples = [sample(i, workload, run, seed, vocab) for i in range(len(workload.prompts))]
    verdict = judge_samples(f"openvino-sampling-{method}", target, samples, sampling, seed)
    return verdict, engine


def sample(i: int, workload: Workload, run: StepRun, seed: int, vocab: int) -> Sample:
    """Request `i`'s tokens as a sample, or the contract break (the pipeline raising, unfinished, an
    id outside the vocabulary, too few tokens) that stands for them."""
    request = Request(i, workload.prompts[i], NEW_TOKENS, float(workload.arrivals[i]))
    prompt_index = PROMPTS.index(workload.prompts[i])
    got = run.tokens.get(i, [])
    if i not in run.done:
        why = run.error or contract_violation("responds", f"unfinished after {run.steps} steps", i)
        return Sample(request, prompt_index, seed, None, cut_short(why, i, len(got), NEW_TOKENS))
    outside = out_of_vocabulary(got, vocab, i)
    if outside is not None:
        return Sample(request, prompt_index, seed, None, outside[1])
    return Sample(request, prompt_index, seed, tuple(got), check_tokens(request, got, None))


def sampling_row(method: str, verdict: SamplingVerdict, engine: OpenVinoEngine) -> dict[str, Any]:
    """The report's record of one sampling run: the verdict and its fit, acceptance and ragged share."""
    figures = {key: value for key, value in verdict.to_json().items() if key != "samples"}
    return {"configuration": f"sampling-{method}", "options": sampling_options(method).to_json(), **figures,
            "acceptance": engine.acceptance(), "ragged_share": engine.log.ragged_share()}  # fmt: skip


def sampling_rows(
    target_ir: Path, draft_ir: Path, target: torch.nn.Module, seed: int, say: Any
) -> list[dict[str, Any]]:  # fmt: skip
    """The sampling run of the non-speculative control, then of each speculative method, on one
    workload and judge. The draft model failing where the control passes is the known defect
    `spec-sampling` (counted, its verdict kept in the row); any other failure stands."""
    rows = []
    for method in ("none", *METHODS):
        verdict, engine = run_sampling(target_ir, draft_ir, target, method, seed)
        row = sampling_row(method, verdict, engine)
        if method == "draft" and not verdict.passed and rows[0]["passed"]:
            row |= {"passed": True, "known": {"spec-sampling": 1}, "verdict": f"known defect spec-sampling "
                    f"(explained, not a verdict: {verdict.verdict})"}  # fmt: skip
        say(f"sampling-{method}: {row['verdict']}")
        rows.append(row)
    return rows
