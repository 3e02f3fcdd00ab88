"""Layer-by-layer runners: a forward assembled from the model's own parts.

Some libraries never call the model: they call its embedding, each decoder layer, the final
norm and the LM head themselves (pipeline, early-exit and layer-skipping runners). Such a
forward is recorded as one target call (`CallRecord.entry == "layers"`,
`specaudit.running.instrument`), read where the model itself would read it:

- its tokens: the input of the token embedding;
- its positions: the input of the position module the model uses (the rotary embedding's
  `position_ids`, or a learned position embedding's ids), not a layer's `position_ids`
  argument, which a rotary layer ignores;
- its mask and cache: the first decoder layer's arguments. A 4-D mask is read as the 2-D key
  mask it applies under the causal rule; a mask of another form cannot be judged;
- its cache after the call: when the last decoder layer returns;
- the tokens its logits choose: the LM head's output.

Only the first layer's arguments are read: a later layer given another mask, positions or
cache writes other K/V, which I2 compares layer by layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Parts:
    """The modules a layer-by-layer runner calls, each hooked on its own."""

    embed: torch.nn.Module  # token ids -> hidden states
    positions: torch.nn.Module | None  # rotary embedding (x, position_ids) or learned positions (ids); None: none
    first: torch.nn.Module  # the first decoder layer: mask and cache
    last: torch.nn.Module  # the last decoder layer: the cache is complete when it returns
    head: torch.nn.Module  # hidden states -> logits


def model_parts(model: torch.nn.Module, base: torch.nn.Module) -> Parts | None:
    """The parts of a causal LM whose body `base` holds a list of decoder layers; None for a model
    without them (the transparent model: a runner can only call it whole)."""
    try:
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    layers = next((m for m in base.children() if isinstance(m, torch.nn.ModuleList) and len(m)), None)
    if layers is None or not isinstance(embed, torch.nn.Module) or not isinstance(head, torch.nn.Module):
        return None
    positions = getattr(base, "rotary_emb", None) or getattr(base, "wpe", None)
    return Parts(embed, positions if isinstance(positions, torch.nn.Module) else None, layers[0], layers[-1], head)


def position_input(parts: Parts, args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """[B or 1, T] the position ids a call of the position module was given: the rotary
    embedding's `position_ids` (x, position_ids), a learned embedding's input."""
    if isinstance(parts.positions, torch.nn.Embedding):
        ids = args[0] if args else kwargs.get("input")
    else:
        ids = args[1] if len(args) > 1 else kwargs.get("position_ids")
    return ids if isinstance(ids, torch.Tensor) else None


def key_mask(mask: torch.Tensor, past: int, batch: int) -> torch.Tensor | None:
    """[B, S] the 2-D key mask a 4-D mask [B or 1, 1, T, S] applies, or None when it is not one.

    The last query attends every key its row may (query t sees slots s <= past + t), so its row of
    the mask is the key mask m; the 4-D mask must then be m[s] and (s <= past + t) at every query
    that attends anything (a pad query's row may be unmasked by the attention kernel: its output
    is never read). Additive masks attend where the bias is above half the dtype's minimum.
    """
    if mask.dim() != 4 or mask.shape[1] != 1:
        return None
    allowed = (mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2)[:, 0]  # [B, T, S]
    queries, width = allowed.shape[1:]
    keys = allowed[:, -1]  # [B, S]
    causal = torch.arange(width, device=mask.device)[None] <= past + torch.arange(queries, device=mask.device)[:, None]
    implied = keys[:, None] & causal  # [B, T, S]
    live = implied.any(-1)  # [B, T]
    if not torch.equal(allowed[live], implied[live]):
        return None
    return keys.long().expand(batch, width)
