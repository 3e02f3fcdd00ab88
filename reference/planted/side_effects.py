"""Planted bugs in the decoder contract: side effects and unobserved calls, with the output right.

A decoder can produce the right tokens and still be unusable: one that calls the target through `forward()`
skips its hooks (so the harness cannot observe the run, nor accelerate place it), one that writes into the
caller's attention_mask or leaves a hook on the shared target corrupts whatever runs next. The harness must
refuse such runs by the contract check instead of judging them on their tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from specaudit.models.compat import cache_keyword, call_model, output_cache
from specaudit.reference.eqspec import BatchState, EqSpec, left_pad_positions
from specaudit.reference.planted.info import BugInfo


def forward_directly(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Any,
) -> tuple[torch.Tensor, Any]:
    """`compat.call_model`, through `model.forward(...)`: the module's hooks never run."""
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    out = model.forward(**kwargs, use_cache=True, **{cache_keyword(model): cache})
    return out.logits, output_cache(out)


class ForwardBypass(EqSpec):
    """Every target call goes through `target.forward(...)` instead of `target(...)`, as
    wrappers do that want to skip hook overhead (—).

    The tokens are right, but no forward hook of the target runs: not accelerate's device
    placement or offloading, not an instrumentation. The harness refuses such a run as
    unobserved instead of judging it on the calls it happened to see.
    """

    name = "forward_bypass"
    bug = BugInfo("target called through forward(), bypassing its hooks", "—", "contract", "contract", True)

    def prefill(
        self, target: torch.nn.Module, draft: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[BatchState, torch.Tensor]:
        mask = attention_mask.long()
        positions = left_pad_positions(mask)  # [B, T]
        logits, target_cache = forward_directly(target, input_ids, mask, positions, DynamicCache())  # [B, T, V]
        _, draft_cache = call_model(draft, input_ids, mask, positions, DynamicCache())
        first = logits[:, -1].argmax(-1)  # [B]
        rows = torch.arange(input_ids.shape[0])
        return BatchState(rows, mask, mask, first, target_cache, draft_cache), first

    def batch_verify(self, target: torch.nn.Module, state: BatchState, drafts: torch.Tensor) -> torch.Tensor:
        block = torch.cat([state.pending[:, None], drafts], dim=1)  # [B, K + 1]
        positions = self.positions(state, state.mask, block.shape[1], "target")  # [B, K + 1]
        mask = torch.cat([state.mask, state.mask.new_ones(block.shape)], dim=1)  # [B, S + K + 1]
        logits, state.target_cache = forward_directly(target, block, mask, positions, state.target_cache)
        return logits.argmax(-1)


class MutatesInputs(EqSpec):
    """Prefill position ids computed in place on `attention_mask.long()`, meant as a copy (—).

    For an int64 mask `.long()` is the tensor itself, so the caller's attention_mask now holds
    position ids. The decoder kept a clone for itself and its tokens are right; the caller's
    tensor is not.
    """

    name = "mutates_inputs"
    bug = BugInfo("writes into the caller's attention_mask", "—", "contract", "contract", True)

    def prefill(
        self, target: torch.nn.Module, draft: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[BatchState, torch.Tensor]:
        mask = attention_mask.clone()  # the decoder's own copy of the layout
        positions = attention_mask.long().cumsum_(-1).sub_(1).clamp_(min=0)  # [B, T], in the caller's tensor
        logits, target_cache = call_model(target, input_ids, mask, positions, DynamicCache())  # [B, T, V]
        _, draft_cache = call_model(draft, input_ids, mask, positions, DynamicCache())
        first = logits[:, -1].argmax(-1)  # [B]
        rows = torch.arange(input_ids.shape[0])
        return BatchState(rows, mask, mask, first, target_cache, draft_cache), first


class MutatesModel(EqSpec):
    """A forward hook registered on the target (to keep the last logits for an acceptance
    statistic) and never removed (—).

    The tokens are right, but the shared target leaves generate() with one more hook each
    run: every later run of any decoder, and the oracle, runs through it.
    """

    name = "mutates_model"
    bug = BugInfo("forward hook left on the target", "—", "contract", "contract", True)

    def generate(self, target: torch.nn.Module, draft: torch.nn.Module, *args: Any, **kwargs: Any) -> list[list[int]]:
        target.register_forward_hook(self.keep_logits)
        return super().generate(target, draft, *args, **kwargs)

    def keep_logits(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self.last_logits = output.logits[:, -1]  # [B, V]
