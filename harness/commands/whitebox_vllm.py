"""`specaudit whitebox-vllm`: vLLM's white box for one configuration, run with the vLLM venv's python: Hypothesis draws
workloads through an in-process engine (`adapters.vllm.whitebox.search`), and the result is
written as JSON (and a failure as a reproducer). `specaudit audit-vllm` runs it once per
served model and configuration, beside the black box:

    .venv-vllm/bin/python -m specaudit whitebox-vllm --model DIR --method self-draft --k 4 \\
        --kv-blocks 8 --max-num-batched-tokens 64 --examples 6 --minutes 2 --json out.json --out DIR
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from specaudit.adapters.vllm.whitebox import (
    EngineOptions,
    Shape,
    WhiteBoxResult,
    likely_tokens,
    load_target,
    search,
    write_failure,
)

STOP_PROMPTS = ((11, 12, 13, 14, 11, 12), (25, 26, 27, 25, 26, 27), (49, 48, 47, 46))
"""Prompts whose greedy continuations give the stop tokens drawn (the model's likely tokens)."""


@dataclass(frozen=True)
class WhiteboxSettings:
    """One configuration's white box: the models, the engine's settings, the search's budget."""

    model: str
    json: Path
    draft: str | None = None
    options: EngineOptions = EngineOptions()
    max_prompt: int = 48  # longest prompt drawn
    max_tokens: int = 48  # largest max_tokens drawn
    examples: int = 8  # workloads drawn at most
    minutes: float = 3.0  # the budget, drawing and shrinking
    seed: int = 0
    mutant: str | None = None  # plant this bug of `specaudit.reference.vllm_mutants` for the run
    out: Path = Path("specaudit-out/vllm-whitebox")  # a failure's reproducer


def run(settings: WhiteboxSettings) -> WhiteBoxResult:
    """Build the engine, its target and K/V reference, draw workloads until the budget ends."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from specaudit.adapters.vllm.observer import VllmObserver, build_llm, hf_kv_reference

    options = settings.options
    llm = build_llm(settings.model, options.speculative(settings.model, settings.draft), **options.engine_args())
    target = load_target(settings.model)
    probe = VllmObserver(llm)
    layers = probe.shadow.layers if probe.shadow is not None else ()
    probe.close()
    shape = Shape(int(target.config.vocab_size), options.block_size, settings.max_prompt, settings.max_tokens,
                  likely_tokens(target, STOP_PROMPTS), max_k=0 if options.method == "none" else options.k)  # fmt: skip
    subject = {"model": settings.model, "draft": settings.draft, "speculative": options.method}
    result = WhiteBoxResult(subject, options)
    reference = hf_kv_reference(settings.model, layers)
    return search(llm, target, reference, shape, result, settings.examples, settings.minutes, settings.seed)


def run_whitebox(settings: WhiteboxSettings) -> int:
    """`specaudit whitebox-vllm`: the search, its JSON result, a failure's reproducer; exit 1 on a failure."""
    with ExitStack() as stack:
        if settings.mutant:
            from specaudit.reference.vllm_mutants import BY_NAME, planted

            stack.enter_context(planted(BY_NAME[settings.mutant]))
        result = run(settings)
    if settings.mutant:
        result.subject["mutant"] = settings.mutant
    if not result.passed:
        write_failure(settings.out, result)
    settings.json.parent.mkdir(parents=True, exist_ok=True)
    settings.json.write_text(json.dumps(result.to_json(), indent=1, default=str) + "\n")
    print(result.render())
    return 0 if result.passed else 1
