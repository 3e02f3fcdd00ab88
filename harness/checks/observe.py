"""Reading one target call: every row's attended stream, past then current, and how far it
holds each request's sequence; where no verification round can span two calls. Read by the
row follower (`specaudit.checks.rows`) and the K/V reader (`specaudit.checks.kv`) alike."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specaudit.checks.i1 import implied_positions
from specaudit.fixtures.transparent import fit_mask, read_slots
from specaudit.running.instrument import CallRecord

UNKNOWN = -1  # a token or position the call does not show (a real model's past; beyond a row's stream)
NO_TOKEN = -2  # beyond a request's sequence


@dataclass(frozen=True)
class Observation:
    """One call's rows as streams of attended entries, past then current, left-aligned. [B, W]"""

    tokens: torch.Tensor  # [B, W] UNKNOWN for a real model's past and beyond a row's length
    positions: torch.Tensor  # [B, W]
    slots: torch.Tensor  # [B, W] cache slot of each entry
    past: torch.Tensor  # [B] attended past slots m
    length: torch.Tensor  # [B] attended entries L (past + current)


# ---------------------------------------------------------------------------------------
# Reading one call


def input_mask(call: CallRecord) -> torch.Tensor:
    """Which of the call's current inputs each row attends: the mask the model applied, over its
    own columns (`fit_mask` of the whole mask, the past's columns left out)."""
    assert call.input_ids is not None
    batch, width = call.input_ids.shape
    return fit_mask(call.attention_mask, batch, call.past_length + width)[:, call.past_length :].bool()  # [B, T]


def observe(call: CallRecord, exact: bool) -> Observation:
    """The attended stream of every row: one scatter per tensor, no loop over rows."""
    ids = call.input_ids
    assert ids is not None
    batch, width = ids.shape
    past = call.past_length
    mask = fit_mask(call.attention_mask, batch, past + width).bool()  # [B, P + T], what the model applied
    past_tokens = torch.full((batch, past), UNKNOWN, dtype=torch.long)
    past_positions = past_tokens.clone()
    if exact and past and call.cache_after and call.cache_after[0][0].shape[2] >= past:
        tokens, positions = read_slots(call.cache_after[0][0])  # [B, S]
        past_tokens, past_positions = tokens[:, :past], positions[:, :past]
    try:
        current_positions = implied_positions(call, batch, width)  # [B, T]
    except RuntimeError:  # position ids of a shape I1 reports
        current_positions = torch.full((batch, width), UNKNOWN, dtype=torch.long)
    tokens = torch.cat([past_tokens, ids.long()], dim=1)  # [B, P + T]
    positions = torch.cat([past_positions, current_positions], dim=1)
    rank = mask.long().cumsum(1) - 1  # stream index of each attended slot
    length = mask.sum(1)  # [B]
    w = int(length.max()) if batch else 0
    index = torch.where(mask, rank, w)  # unattended slots go to a spill column

    def stream(values: torch.Tensor) -> torch.Tensor:
        return torch.full((batch, w + 1), UNKNOWN, dtype=torch.long).scatter_(1, index, values)[:, :w]

    slots = torch.arange(past + width).expand(batch, -1)
    return Observation(stream(tokens), stream(positions), stream(slots), mask[:, :past].sum(1), length)


def common_prefixes(
    obs: Observation,
    sequences: torch.Tensor,
    lengths: torch.Tensor,
    exact: bool,
    past_match: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, R] how many leading stream entries hold request r's sequence at positions 0, 1, ...

    A real model's past slots hold K/V, not tokens: `past_match` [B, R] says how many leading
    past slots of row b hold request r's batch-size-1 entries (`KVReader.past_prefixes`); a
    call without a snapshot (`None`) counts its past as matching (its rows bind by their inputs).
    The result never passes the row's length or the request's.
    """
    batch, width = obs.tokens.shape
    if width == 0:  # every row attends nothing (an all-pad prefill): no entry holds anything
        return torch.zeros(batch, sequences.shape[0], dtype=torch.long)
    seq = sequences[:, :width]
    if seq.shape[1] < width:
        seq = torch.cat([seq, seq.new_full((seq.shape[0], width - seq.shape[1]), NO_TOKEN)], dim=1)
    index = torch.arange(width)
    same = (obs.tokens[:, None, :] == seq[None]) & (obs.positions == index)[:, None, :]  # [B, R, W]
    free = index[None, :] >= obs.length[:, None]  # beyond the row's stream
    if not exact:
        in_past = index[None, :] < obs.past[:, None]  # [B, W]
        if past_match is None:
            free |= in_past
        else:
            same = torch.where(in_past[:, None, :], index[None, None, :] < past_match[:, :, None], same)
    bad = ~(same | free[:, None, :])
    first = torch.where(bad.any(-1), bad.int().argmax(-1), width)  # [B, R]
    return torch.minimum(torch.minimum(first, obs.length[:, None]), lengths[None, :])


def draft_between(draft_orders: Sequence[int], before: int | None, after: int) -> bool:
    """Was the draft called between two calls (`CallRecord.order`; `draft_orders` ascending)? Then
    a new round began, so no chunk of one verification can span them (a decoder's, an engine's)."""
    if before is None:
        return True
    return bisect.bisect_right(draft_orders, before) < bisect.bisect_left(draft_orders, after)
