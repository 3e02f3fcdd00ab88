"""Planted engine bugs: small named variations of the reference engines the state machine must catch.

Each is a negative control for a check of `specaudit.search.engine_machine` (checks in the order
contract, I1, I2, equivalence, liveness). `ENGINE_CATALOG` maps name to class; every entry runs
as `--engine specaudit.reference.engine_mutants:NAME`. Each class carries a `bug: EngineBugInfo`
whose `first_check` and `rule` were measured with the state machine on its shrunk failing
sequence, and whose `signature` is the one the engine diagnosis derives from that failure by
the registry's mapping (`specaudit.search.engine_replay.diagnose_engine`); tests/search/test_engines.py
keeps all three honest. A retired row attended is a stale row attended: kv-drift, as the
registry maps every I2 slot fault, even where the live requests' outputs stay right.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from specaudit.models.compat import cache_from_tensors, cache_layers, call_model
from specaudit.reference.engines import EqSpecEngine, ExSpecEngine, pad_left, stack_caches
from specaudit.reference.eqspec import BatchState, left_pad_positions


@dataclass(frozen=True)
class EngineBugInfo:
    bug_class: str  # short description
    seen_in: str  # where that class of bug is seen ("—": nowhere in particular)
    signature: str  # one of specaudit.checks.registry.SIGNATURES: what the engine diagnosis derives
    first_check: str  # first failing check: contract, I1, I2, equivalence, liveness
    rule: str  # the rule of that check the shrunk failure breaks


# ---------------------------------------------------------------------------------------
# Admission


class AdmitPositionsFromWidth(EqSpecEngine):
    """The newcomer's prefill counts positions from the running batch's width (as if its prompt
    were appended to the batch) instead of from its own length."""

    bug = EngineBugInfo("admission positions from the batch width", "—", "position-id", "I2", "position-ids")

    def prefill(
        self, target: torch.nn.Module, draft: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[BatchState, torch.Tensor]:
        offset = 0 if self.state is None else int(self.state.mask.shape[1])
        mask = attention_mask.long()
        positions = left_pad_positions(mask) + offset  # [N, T] bug: + the batch width
        logits, target_cache = call_model(target, input_ids, mask, positions, DynamicCache())
        _, draft_cache = call_model(draft, input_ids, mask, positions, DynamicCache())
        first = logits[:, -1].argmax(-1)
        return BatchState(torch.arange(input_ids.shape[0]), mask, mask, first, target_cache, draft_cache), first


class NewcomerAttendsRunningRows(EqSpecEngine):
    """The newcomer is prefilled on top of a running row's cache with that row's mask, so its
    prompt attends another request's slots (a batch-wide mask copied into the new row)."""

    bug = EngineBugInfo("newcomer prefill attends the running rows' slots", "—", "kv-drift", "I2", "input-token")

    def prefill(
        self, target: torch.nn.Module, draft: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[BatchState, torch.Tensor]:
        if self.state is None:
            return super().prefill(target, draft, input_ids, attention_mask)
        n = input_ids.shape[0]
        rows = torch.zeros(n, dtype=torch.long)  # bug: every newcomer starts from running row 0
        past = stack_caches([_select(self.state.target_cache, rows)], int(self.state.mask.shape[1]))
        mask = torch.cat([self.state.mask[rows], attention_mask.long()], dim=1)  # [N, S + T]
        positions = left_pad_positions(attention_mask.long())  # its own positions 0, 1, ...
        logits, target_cache = call_model(target, input_ids, mask, positions, past)
        fresh, _ = super().prefill(target, draft, input_ids, attention_mask)  # the draft's own, correct
        first = logits[:, -1].argmax(-1)
        fresh.mask, fresh.pending, fresh.target_cache = mask, first, target_cache
        return fresh, first


class AdmitForgetsOtherMasks(EqSpecEngine):
    """Admission builds the merged mask as ones and writes only the newcomers' rows: the running
    rows' masks are not extended with zeros over the columns the repad added (nor their pads)."""

    bug = EngineBugInfo(
        "admission forgets to extend the other rows' masks", "—", "kv-drift", "I2", "attends-wrong-slot"
    )

    def merged_mask(self, running: torch.Tensor, fresh: torch.Tensor, width: int) -> torch.Tensor:
        mask = torch.ones(running.shape[0] + fresh.shape[0], width, dtype=torch.long)
        mask[running.shape[0] :] = pad_left(fresh, width, 1)  # bug: running rows stay all ones
        return mask


class StarvesLateArrivals(EqSpecEngine):
    """Admits only into an empty batch: a static-batch engine with a queue in front. A late
    arrival waits until every running request has finished."""

    bug = EngineBugInfo(
        "starvation of late arrivals", "static batching behind a queue", "scheduling", "liveness", "bounded-queue"
    )

    def admission_room(self) -> int:
        return self.max_batch_size if self.running() == 0 else 0


# ---------------------------------------------------------------------------------------
# Leaving


class FinishedKeptInBatch(EqSpecEngine):
    """Finished rows stay in the verification batch (their tokens are dropped by commit) until
    every row has finished, as a static batch does."""

    bug = EngineBugInfo("a finished request kept in the verification batch", "—", "kv-drift", "I2", "retired-row")

    def realign(
        self, state: BatchState, accepted: torch.Tensor, bonus: torch.Tensor, k: int, finished: torch.Tensor
    ) -> BatchState:
        keep_all = finished if bool(finished.all()) else torch.zeros_like(finished)  # bug
        return super().realign(state, accepted, bonus, k, keep_all)


class AbortLeavesRowAttended(EqSpecEngine):
    """abort() silences the request but leaves its row in the batch, still verified."""

    bug = EngineBugInfo("abort leaves the row attended", "—", "kv-drift", "I2", "retired-row")

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.silenced: set[int] = set()

    def abort(self, request_id: int) -> None:
        if not self.drop_waiting(request_id) and request_id in self.out:
            self.silenced.add(request_id)  # bug: the row is not gathered out

    def has_unfinished(self) -> bool:
        rows = [] if self.state is None else self.state.rows.tolist()
        return bool(self.waiting) or any(r not in self.silenced for r in rows)

    def step(self) -> dict[int, list[int]]:
        return {r: t for r, t in super().step().items() if r not in self.silenced}


class ReusedRowNotMasked(EqSpecEngine):
    """A finished row's cache row is handed to the next newcomer, whose slots are written after
    the old ones; the old slots are neither cleared nor masked."""

    bug = EngineBugInfo("a reused cache row not cleared or masked", "—", "kv-drift", "I2", "retired-row")

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.retired: list[tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]] = []

    def realign(
        self, state: BatchState, accepted: torch.Tensor, bonus: torch.Tensor, k: int, finished: torch.Tensor
    ) -> BatchState:
        block = (torch.arange(k + 1)[None, :] <= accepted[:, None]).long()  # [B, K + 1] pending + accepted
        kept = torch.cat([state.mask, block], dim=1)  # [B, S + K + 1] the slots a row holds after the round
        for b in finished.nonzero()[:, 0].tolist():  # keep the freed rows for reuse
            layers = [(keys[b : b + 1], values[b : b + 1]) for keys, values in cache_layers(state.target_cache)]
            self.retired.append((layers, kept[b]))
        return super().realign(state, accepted, bonus, k, finished)

    def merge(self, running: BatchState, fresh: BatchState) -> BatchState:
        if self.retired:
            old_kv, old_mask = self.retired.pop()
            fresh = _write_after(fresh, 0, old_kv, old_mask)  # bug: old slots stay attended
        return super().merge(running, fresh)


def _write_after(
    fresh: BatchState, row: int, old_kv: list[tuple[torch.Tensor, torch.Tensor]], old_mask: torch.Tensor
) -> BatchState:
    """Row `row` of `fresh` written after a reused row's old slots, the old mask kept."""
    width = fresh.mask.shape[1] + old_mask.shape[0]
    layers = []
    for (k, v), (ok, ov) in zip(cache_layers(fresh.target_cache), old_kv):
        old_k = ok.expand(k.shape[0], -1, -1, -1)  # [N, H, S_old, D]
        old_v = ov.expand(v.shape[0], -1, -1, -1)
        layers.append((torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)))
    old = torch.zeros(fresh.mask.shape[0], old_mask.shape[0], dtype=torch.long)
    old[row] = old_mask
    mask = torch.cat([old, fresh.mask], dim=1)  # [N, S_old + T]
    assert mask.shape[1] == width
    return BatchState(fresh.rows, mask, fresh.draft_mask, fresh.pending, cache_from_tensors(layers), fresh.draft_cache)


class FreeListOffByOne(ExSpecEngine):
    """The pool returns slot i + 1 to the free list when slot i empties: the finished request
    stays in its slot, and a newcomer can overwrite a running one."""

    bug = EngineBugInfo("an off-by-one in the slot free list", "—", "contract", "contract", "has-unfinished")

    def release(self, request_id: int) -> None:
        for slot, s in enumerate(self.slots):
            if s is not None and s.row == request_id:
                self.free = sorted({*self.free, (slot + 1) % len(self.slots)})  # bug: the neighbour's slot
                return


def _select(cache: object, rows: torch.Tensor) -> object:
    return cache_from_tensors([(k[rows], v[rows]) for k, v in cache_layers(cache)])


ENGINE_CATALOG: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        AdmitPositionsFromWidth,
        ReusedRowNotMasked,
        AbortLeavesRowAttended,
        FinishedKeptInBatch,
        NewcomerAttendsRunningRows,
        StarvesLateArrivals,
        FreeListOffByOne,
        AdmitForgetsOtherMasks,
    )
}
