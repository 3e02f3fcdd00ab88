"""Batched sampling without speculation: the draft is never called, every token a plain step.

The simplest lossless sampler, and the baseline of the sampling audit: one target forward per
token for the whole batch over a cache realigned by nothing (rows keep their left padding),
each row's next token drawn from p = target_distribution(logits) with the run's generator. Its
tokens are all of role "plain"; a design that speculates must be indistinguishable from it.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specaudit.contracts.sampling import Sampling, target_distribution
from specaudit.models.compat import call_model


class PlainSampling:
    """Autoregressive batched sampling from the target alone (`num_draft_tokens` is not used)."""

    name = "plain-sampling"
    samples = True

    @torch.no_grad()
    def generate(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        num_draft_tokens: int,
        max_new_tokens: int,
        eos_token_id: int | None,
        pad_token_id: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
    ) -> list[list[int]]:
        sampling = Sampling(temperature, top_k, top_p)
        mask = attention_mask.long()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]
        logits, cache = call_model(target, input_ids, mask, positions, DynamicCache())  # [B, T, V]
        out: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        while True:
            token = torch.multinomial(target_distribution(logits[:, -1], sampling), 1, generator=generator)  # [B, 1]
            for row, t in enumerate(token[:, 0].tolist()):
                if not done[row]:
                    out[row].append(t)
                    done[row] = len(out[row]) >= max_new_tokens or t == eos_token_id
            if bool(done.all()):
                return out
            positions = mask.sum(1, keepdim=True)  # [B, 1] the next position counts real tokens
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            logits, cache = call_model(target, token, mask, positions, cache)
