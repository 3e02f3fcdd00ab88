"""A library-style decoder: it refuses what it does not know, as serving libraries do.

Before running, it looks the target's `model_type` up in transformers' Auto registry (code that
dispatches on the architecture: `AutoConfig.for_model`, `AutoModelForCausalLM`'s mapping) and
validates `attn_implementation` against the names transformers documents. The built-in models
must pass these checks as the real classes do (issue 38: the transparent model's
'specaudit-transparent' and the float64 tiny Llama's 'specaudit_eager' were refused). Decoding
itself is batched, KV-cached greedy speculative decoding with one cache per request and a
verification call per round over the pending token and the drafts together.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, DynamicCache
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from specaudit.models.compat import crop_cache
from tests.designs.split_verify import SplitVerify, accepted, cut, draft_tokens, finished, greedy_next

KNOWN_ATTENTION = frozenset({"eager", "sdpa", "flash_attention_2", "flex_attention"})


class UnsupportedModel(ValueError):
    pass


def admit(model: torch.nn.Module) -> None:
    """Refuse a model whose architecture or attention implementation this library does not know."""
    config = model.config
    try:
        known = AutoConfig.for_model(config.model_type)
    except ValueError as exc:
        raise UnsupportedModel(f"unknown model_type {config.model_type!r}") from exc
    if type(known) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UnsupportedModel(f"model_type {config.model_type!r} has no causal LM class")
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention not in KNOWN_ATTENTION:
        raise UnsupportedModel(f"attn_implementation {attention!r} is not one of {sorted(KNOWN_ATTENTION)}")


class LibraryStyle(SplitVerify):
    """Admits the target and draft first, then verifies [pending, d_1..d_K] in one call per round."""

    name = "library-style"

    @torch.no_grad()
    def generate(self, target: torch.nn.Module, draft: torch.nn.Module, *args, **kwargs) -> list[list[int]]:  # noqa: ANN002, ANN003
        admit(target)
        admit(draft)
        return super().generate(target, draft, *args, **kwargs)

    def one(
        self, target: torch.nn.Module, draft: torch.nn.Module, prompt: list[int], k: int, limit: int, eos: int | None
    ) -> list[int]:
        sequence, out = list(prompt), []
        cache = DynamicCache()
        if len(prompt) > 1:
            greedy_next(target, prompt[:-1], 0, cache)
        while not finished(out, limit, eos):
            n = len(sequence)
            drafts = draft_tokens(draft, sequence, min(k, limit - len(out)))
            new = accepted(drafts, greedy_next(target, sequence[-1:] + drafts, n - 1, cache))
            crop_cache(cache, n + len(new) - 1)
            sequence += new
            out += new
        return cut(out, limit, eos)
