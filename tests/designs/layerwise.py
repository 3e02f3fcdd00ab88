"""A layer-by-layer runner: the target's embedding, decoder layers, norm and LM head called one by one.

Pipeline and early-exit libraries never call the model: they run its parts with a 4-D mask and
positions of their own. This one recomputes every live request each round, left-padded into
one batch, in two forwards over a fresh cache:

    prefill:  the committed prefixes s[:-1], left-padded, positions 0, 1, ... per row (no LM head)
    verify:   [x, d_1..d_K] per row at positions |s| - 1, |s|, ... on that cache -> y_1..y_{K+1}
    accept:   a = max{a : d_i = y_i for i <= a};  commit d_1..d_a and y_{a+1}

Wasteful (every round recomputes every prefix) and correct. A model without decoder layers (the
transparent model) is called whole, in the same rounds. `LayerwiseUnpaddedPositions` plants the
classic bug: positions counted from the padded batch's first column, so a left-padded row's
tokens sit `pad` positions too far.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from tests.designs.split_verify import SplitVerify, accepted, cut, draft_tokens, finished


def layers_of(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    base = model.base_model
    return next((m for m in base.children() if isinstance(m, torch.nn.ModuleList)), None) if base is not model else None


def causal_mask(mask: torch.Tensor, queries: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, T, S] additive mask: key s visible to query t when mask[s] and s <= S - T + t."""
    width = mask.shape[1]
    causal = torch.arange(width)[None] <= width - queries + torch.arange(queries)[:, None]  # [T, S]
    allowed = mask.bool()[:, None, None, :] & causal[None, None]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def cache_kwarg(layer: torch.nn.Module) -> str:
    import inspect

    names = inspect.signature(layer.forward).parameters
    return next(n for n in ("cache", "past_key_values", "past_key_value", "layer_past") if n in names)


def run_parts(
    model: torch.nn.Module,
    ids: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, P + T]
    positions: torch.Tensor,  # [B, T]
    cache: DynamicCache,
    head: bool,
) -> torch.Tensor | None:
    """One forward through the model's parts; logits [B, T, V] when `head`."""
    base, layers = model.base_model, layers_of(model)
    assert layers is not None
    hidden = model.get_input_embeddings()(ids)  # [B, T, H]
    extra: dict[str, Any] = {}
    if hasattr(base, "rotary_emb"):
        extra["position_embeddings"] = base.rotary_emb(hidden, positions)
    else:  # learned positions (GPT-2)
        hidden = hidden + base.wpe(positions)
    attention = causal_mask(mask, ids.shape[1], hidden.dtype)
    for layer in layers:
        out = layer(hidden, attention_mask=attention, position_ids=positions, use_cache=True,
                    **{cache_kwarg(layer): cache}, **extra)  # fmt: skip
        hidden = out[0] if isinstance(out, tuple) else out
    if not head:
        return None
    norm = getattr(base, "norm", None) or base.ln_f
    return model.get_output_embeddings()(norm(hidden))


def run_whole(
    model: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    cache: DynamicCache,
    head: bool,
) -> torch.Tensor | None:
    from specaudit.models.compat import cache_keyword

    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_keyword(model): cache}
    )
    return out.logits if head else None


class Layerwise(SplitVerify):
    """Batched rounds of recomputation through the target's parts (see the module docstring)."""

    name = "layerwise"

    def positions(self, mask: torch.Tensor) -> torch.Tensor:
        """[B, T] each row's positions under left padding: 0 at its first real token."""
        return (mask.cumsum(-1) - 1).clamp(min=0)

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
    ) -> list[list[int]]:
        forward = run_parts if layers_of(target) is not None else run_whole
        sequences = [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask)]
        outs: list[list[int]] = [[] for _ in sequences]
        while live := [r for r, out in enumerate(outs) if not finished(out, max_new_tokens, eos_token_id)]:
            drafts = [draft_tokens(draft, sequences[r], num_draft_tokens) for r in live]
            predicted = self.verify(forward, target, [sequences[r] for r in live], drafts, pad_token_id)
            for r, d, y in zip(live, drafts, predicted):
                new = accepted(d, y)
                sequences[r] += new
                outs[r] += new
        return [cut(out, max_new_tokens, eos_token_id) for out in outs]

    def verify(
        self, forward: Any, target: torch.nn.Module, sequences: list[list[int]], drafts: list[list[int]], pad: int
    ) -> list[list[int]]:
        """The target's argmax after [x, d_1..d_K] for every row: a prefill of the prefixes, then one call."""
        width = max(len(s) - 1 for s in sequences)
        prefix = torch.tensor([[pad] * (width - len(s) + 1) + s[:-1] for s in sequences], dtype=torch.long)  # [B, W]
        mask = torch.tensor([[0] * (width - len(s) + 1) + [1] * (len(s) - 1) for s in sequences], dtype=torch.long)
        cache = DynamicCache()
        if width:
            forward(target, prefix, mask, self.positions(mask), cache, head=False)
        step = torch.tensor([s[-1:] + d for s, d in zip(sequences, drafts)])  # [B, K + 1]
        full = torch.cat([mask, torch.ones_like(step)], dim=1)  # [B, W + K + 1]
        logits = forward(target, step, full, self.positions(full)[:, width:], cache, head=True)  # [B, K + 1, V]
        return logits.argmax(-1).tolist()


class LayerwiseUnpaddedPositions(Layerwise):
    """Planted: positions from the batch's first column, so a left-padded row's are shifted by its padding."""

    name = "layerwise-unpadded-positions"

    def positions(self, mask: torch.Tensor) -> torch.Tensor:
        return torch.arange(mask.shape[1]).expand(mask.shape)
