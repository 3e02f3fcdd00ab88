"""I1, rectangular alignment: every target call sees one consistent rectangular batch."""

from __future__ import annotations

import torch

from specaudit.contracts.violation import Violation
from specaudit.running.instrument import CallRecord
from specaudit.running.runner import Run


def implied_positions(call: CallRecord, batch: int, width: int) -> torch.Tensor:
    """Position ids the model used: the ones passed, or HF's default past length + arange. [B, T]"""
    if call.position_ids is not None and call.position_ids.dim() == 2:
        return call.position_ids.expand(batch, width).long()
    return (call.past_length + torch.arange(width)).expand(batch, width)


def i1_call_violations(call: CallRecord, pad_token_id: int | None = None) -> list[Violation]:
    """I1 for one target call: shapes agree, mask is [B, P + T], every row with a real input
    attends something. A row whose inputs are all `pad_token_id` may attend nothing (a prefill
    that holds a one-token prompt's only token back); its output means nothing, and
    transformers itself unmasks such rows to avoid NaN."""
    v = []

    def bad(rule: str, found: str, expected: str, row: int | None = None) -> None:
        v.append(Violation("I1", rule, found, expected, call=call.index, row=row))

    ids = call.input_ids
    if ids is None or ids.dim() != 2:
        bad("input-shape", f"input_ids of shape {None if ids is None else tuple(ids.shape)}", "[B, T]")
        return v
    batch, width = ids.shape
    if len(set(call.layer_lengths)) > 1:
        bad("cache-length", f"cache layers of lengths {list(call.layer_lengths)}", "one length P in every layer")
    past = call.past_length
    if call.cache_batch is not None and call.cache_batch != batch:
        bad("cache-batch", f"a cache of {call.cache_batch} rows", f"{batch} rows like input_ids")
    pos = call.position_ids
    if pos is not None and (pos.dim() != 2 or pos.shape[-1] != width or pos.shape[0] not in (1, batch)):
        bad("position-shape", f"position_ids of shape {tuple(pos.shape)}", f"[{batch}, {width}]")
    mask = call.attention_mask
    if mask is None:
        return v
    if tuple(mask.shape) != (batch, past + width):
        bad(
            "mask-shape",
            f"attention_mask of shape {tuple(mask.shape)}",
            f"[{batch}, {past + width}] (P={past} + T={width})",
        )
        return v
    if not bool(((mask == 0) | (mask == 1)).all()):
        bad("mask-values", "attention_mask values other than 0 and 1", "a 0/1 mask")
    padding = (ids == pad_token_id).all(1) if pad_token_id is not None else torch.zeros(batch, dtype=torch.bool)
    for row in ((mask.sum(1) == 0) & ~padding).nonzero()[:, 0].tolist():
        bad(
            "row-attends-nothing",
            "a row with a real input whose mask is all zeros",
            "at least one attended slot (a real input attends at least itself)",
            row=row,
        )
    return v


def check_i1(run: Run) -> list[Violation]:
    if not run.recording.target_calls and run.error is None:
        return [Violation("I1", "target-called", "no call of the target model", "at least one target forward")]
    pad = run.case.pad_token_id
    return [v for call in run.recording.target_calls for v in i1_call_violations(call, pad)]
