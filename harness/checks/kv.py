"""A real model's attended past K/V against a batch-size-1 run: which request's entries a row's
past holds (for the row binder) and the first slot that is not its request's entry (for I2),
with the margin against the measured noise where there is one."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specaudit.checks.observe import Observation
from specaudit.numerics.tolerance import DTYPES, KV_TOLERANCE
from specaudit.running.instrument import CallRecord
from specaudit.running.runner import Run

# ---------------------------------------------------------------------------------------
# Real models: attended K/V against a batch-size-1 run
#
# A real model's past slots cannot be read as (token, position); their K/V are compared with
# the entries a batch-size-1 run computes for the row's tokens. The reference is the oracle's
# own cache (`greedy_oracle(keep_kv=True)`), sliced, whenever the row's tokens are a prefix of
# the oracle's prompt + output; only a row that diverged from the oracle costs one
# batch-size-1 forward of its sequence (once per sequence).
#
# Without a measured noise floor (the built-in tiny models) a slot must equal its expected
# entry within the dtype's fixed `KV_TOLERANCE`, relative to the entry's largest feature. With
# one (`run.noise`, real weights in real dtypes), a slot is judged by which (token, position)
# it holds: its distance d_E (max |.| over layers, heads and features, as the floor is
# measured) to the expected entry must be at most the bound b = KV_NOISE_MULTIPLE x
# noise.kv_max, and smaller than its distance to every alternative a bug would put there: the
# neighbouring positions' entries (off by one), the entry of another request at the same index
# (rows mixed up), the row's own masked slots and the pad token (pads attended). An
# alternative within b of the expected entry is the same entry up to noise and does not
# compete. By the triangle inequality a slot with d_E <= b / 2 is then nearer to its expected
# entry than to any competing alternative, so alternatives are computed only for slots in
# (b / 2, b] and for the violation's evidence.

KV_NOISE_MULTIPLE = 3.0
"""The I2 bound is this many times the measured worst-case K/V noise (`NoiseFloor.kv_max`).
Calibration measures a batched decode against batch size 1 along the same tokens; a
speculative decoder adds other shapes (verification chunks of K + 1, re-padded batches), so
its K/V may stray a little past the calibrated maximum. On SmolLM2-135M (CPU, 8 prompts,
bench/results/overhead.md) the correct decoders reach 1.08x kv_max in bfloat16 and 0.86x in
float32, while the nearest wrong entry (a neighbouring position's, another request's) is 6.4x
kv_max away in bfloat16 and 6.8e4x in float32: 3x leaves room on both sides."""

PREFIX_CHUNK = 16
"""Slots `KVReader.past_prefixes` compares per (row, request) pair at first, doubling while a pair
still matches: a row is settled against another request at its first differing slot, so of the
[B, R, M] comparison only about each row's own request's [M] is made (bench/harness_cost.py)."""


@dataclass(frozen=True)
class KVMiss:
    """The first attended past slot whose K/V are not its expected entry's, with the margin."""

    index: int  # stream index: the expected entry is the row's token at this position
    distance: float  # d_E: max |found - expected| over layers, heads and features
    bound: float | None  # the noise bound b (None: the dtype's fixed tolerance)
    nearest: Alternative | None = None  # the nearest competing alternative (None: none available)
    nearest_distance: float | None = None


@dataclass(frozen=True)
class Alternative:
    """An entry a bug would put in a slot instead of the expected one."""

    label: str  # in words, for the report
    token: int | None = None
    position: int | None = None
    request: int | None = None


def flat_cache(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """A call's cache snapshot as [B, S, F], one row per slot in `kv_rows` order (K0, V0, K1, ...),
    on the snapshot's device. A snapshot recorded as one [B, S, F] block (`running.instrument`)
    is that block, not a copy (read it, never write it); any other is copied once per layer."""
    parts = [x for kv in layers for x in kv]  # [B, H, S, D] each
    width = min(int(x.shape[2]) for x in parts)
    block = snapshot_block(parts)
    if block is not None:
        return block if block.dtype == dtype else block.to(dtype)
    batch = int(parts[0].shape[0])
    out = torch.empty(batch, width, sum(int(x.shape[1] * x.shape[3]) for x in parts), dtype=dtype,
                      device=parts[0].device)  # fmt: skip
    start = 0
    for x in parts:
        heads, dim = int(x.shape[1]), int(x.shape[3])
        out[:, :, start : start + heads * dim].view(batch, width, heads, dim).copy_(x[:, :, :width].transpose(1, 2))
        start += heads * dim
    return out


def snapshot_block(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """[B, S, F] the block that `parts` ([B, H, S, D] each, K0, V0, K1, ...) are views of, side by
    side in order over all of F, or None: layers of one width laid out so, read without a copy."""
    first = parts[0]
    batch, width = int(first.shape[0]), int(first.shape[2])
    features = sum(int(x.shape[1] * x.shape[3]) for x in parts)
    storage, start = first.untyped_storage(), first.storage_offset()
    if storage.nbytes() < (start + batch * width * features) * first.element_size():
        return None
    at = start
    for x in parts:
        heads, dim = int(x.shape[1]), int(x.shape[3])
        if (
            x.untyped_storage().data_ptr() != storage.data_ptr()
            or (x.dtype, x.device, int(x.shape[0]), int(x.shape[2])) != (first.dtype, first.device, batch, width)
            or x.storage_offset() != at
            or x.stride() != (width * features, dim, features, 1)
        ):
            return None
        at += heads * dim
    return first.as_strided((batch, width, features), (width * features, features, 1), start)


@dataclass(frozen=True)
class Settled:
    """What one call's `KVReader.past_prefixes` found, per (row, request): `first_mismatch` of a
    row against its request reads the same slots of the same snapshot against the same entries."""

    call: int
    clean: list[list[bool]]  # [B][R] every judged slot within the bound, none past half the noise bound
    limit: list[list[int]]  # [B][R] slots judged: min(past, len(sequence))
    slots: list[list[int]]  # [B][W] the attended stream's slots
    sources: tuple[int, ...]  # [R] id of the source each request's entries came from


class KVReader:
    """Compares a row's attended past K/V with the batch-size-1 entries of its tokens: a decoder
    run's rows (`of_run`) and an engine's (`specaudit.checks.engine`) alike.

    `sources` are K/V at hand, (tokens, [n, F] entries of them); `entries(tokens)` makes one
    batch-size-1 run of tokens that no source covers (the run's or the session's to make)."""

    def __init__(
        self,
        dtype: torch.dtype,
        sequences: Sequence[tuple[int, ...]],
        sources: Sequence[tuple[tuple[int, ...], torch.Tensor]],
        entries: Callable[[tuple[int, ...]], torch.Tensor],
        pad: int,
        kv_noise: float | None = None,
    ) -> None:
        self.rtol, self.atol = KV_TOLERANCE[dtype]
        self.work = torch.float64 if dtype == torch.float64 else torch.float32
        finite = kv_noise is not None and math.isfinite(kv_noise)
        # at least the dtype's atol: a floor measured as 0 (identical arithmetic) still leaves rounding room
        self.bound = max(KV_NOISE_MULTIPLE * kv_noise, self.atol) if finite and kv_noise is not None else None
        self.pad = pad
        self.sequences = list(sequences)  # per request: its tokens (a decoder's prompt + output)
        self.sources = [(tuple(tokens), kv.to(self.work)) for tokens, kv in sources]
        self.compute = entries
        self.forwards = 0  # batch-size-1 target forwards spent (the oracle's cache spares most)
        self.compared = 0  # (row, request, slot) triples `past_prefixes` compared (of B x R x M at most)
        self._call: tuple[int, torch.Tensor] | None = None  # the last call read, as [B, S, F]
        self._pad: torch.Tensor | None = None
        self._stack: tuple[tuple, torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # `stacked`
        self._moved: dict[tuple[int, torch.device], torch.Tensor] = {}  # sources copied to a snapshot's device
        self._settled: Settled | None = None  # the last `past_prefixes`: pairs `first_mismatch` need not redo

    @classmethod
    def of_run(cls, run: Run, sequences: Sequence[tuple[int, ...]]) -> KVReader:
        """A decoder run's reader: the oracle's kept caches at hand, `run.entries` for the rest."""
        kept = [
            (tuple(prompt) + tuple(o.tokens), o.kv)
            for prompt, o in zip(run.case.prompts, run.oracle)
            if o.kv is not None
        ]
        noise = None if run.noise is None else run.noise.kv_max
        return cls(DTYPES[run.case.dtype], sequences, kept, run.entries, run.case.pad_token_id, noise)

    # references

    def reference(self, tokens: tuple[int, ...], n: int) -> tuple[tuple[int, ...], torch.Tensor]:
        """(source tokens, [>= n, F]) whose first n rows are the batch-size-1 K/V of tokens[:n]:
        a slice of a kept cache when possible, else one batch-size-1 run of `tokens` (kept)."""
        want = tokens[:n]
        for seq, kv in self.sources:
            if kv.shape[0] >= n and seq[:n] == want:
                return seq, kv
        kv = self.compute(tokens).to(self.work)
        self.forwards += 1
        self.sources.append((tokens, kv))
        return tokens, kv

    def kept(self, tokens: tuple[int, ...], index: int, compute: bool = False) -> torch.Tensor | None:
        """The K/V of tokens[:index + 1] at `index` [F] if a source holds it; else, with `compute`,
        from one batch-size-1 run of `tokens` (kept, so once per sequence), else None."""
        want = tokens[: index + 1]
        if len(want) <= index:
            return None
        for seq, kv in self.sources:
            if kv.shape[0] > index and seq[: index + 1] == want:
                return kv[index]
        return self.reference(tokens, len(tokens))[1][index] if compute else None

    def pad_entry(self) -> torch.Tensor:
        """[F] the pad token alone at position 0 (one batch-size-1 forward of one token, once)."""
        if self._pad is None:
            self._pad = self.compute((self.pad,)).to(self.work)[0]
            self.forwards += 1
        return self._pad

    def past_prefixes(self, call: CallRecord, obs: Observation) -> torch.Tensor:
        """[B, R] how many leading attended past slots of row b hold request r's batch-size-1
        entries: the past's evidence of which request a row holds (the row binder's, before I2
        judges the bound row). Reads the oracle's kept caches; a diverged request costs one
        batch-size-1 forward, once.

        Compared on the snapshot's device, slot by slot as `same_slots` judges, in chunks of
        `PREFIX_CHUNK` slots doubling: a (row, request) pair leaves at its first differing slot,
        so the comparisons made are about one request's per row, not every request's. The host
        waits for the device once per round (the pairs left) and once for the outcome: [B, R]
        first differing slots, slots judged and clean pairs cross together."""
        batch, requests = obs.past.shape[0], len(self.sequences)
        width = int(obs.past.max()) if batch else 0
        if width == 0 or requests == 0:
            return torch.zeros(batch, requests, dtype=torch.long)
        flat = self.flat(call)  # [B, S, F]
        device, (_, size, features) = flat.device, flat.shape
        rows = flat.view(-1, features)  # [B * S, F]: a slot's entry is a row, gathered by index_select
        slots = obs.slots[:, :width].clamp(0, size - 1).to(device) + size * torch.arange(batch, device=device)[:, None]
        refs, bounds, offsets, lengths = self.stacked(width, device)  # [N, F], [N], [R], [R]
        limit = torch.minimum(obs.past.to(device)[:, None], lengths[None, :])  # [B, R] slots judged
        out = limit.clone()  # a pair with no differing slot holds all it is judged on
        near = torch.zeros_like(limit, dtype=torch.bool)  # a slot past half the noise bound (`first_mismatch`)
        active = limit > 0  # [B, R] pairs still matching, with slots left to judge
        start, chunk = 0, PREFIX_CHUNK
        while start < width:
            pairs = active.nonzero()  # [P, 2] (row, request): the round's one wait for the device
            if not pairs.shape[0]:
                break
            end = min(start + chunk, width)
            b, r = pairs[:, 0], pairs[:, 1]
            index = torch.arange(start, end, device=device)  # [c]
            judged = index < limit[b, r, None]  # [P, c]
            found = rows.index_select(0, slots[b, start:end].flatten())  # [P * c, F]
            at = (offsets[r, None] + index).clamp(max=refs.shape[0] - 1).flatten()  # [P * c]
            distance = found.sub_(refs.index_select(0, at)).abs_().amax(-1).view(-1, end - start)  # [P, c]
            bound = self.bound if self.bound is not None else bounds[at].view_as(distance)
            bad = ~(distance <= bound) & judged  # [P, c], as `same_slots` judges
            self.compared += int(distance.numel())
            if self.bound is not None:
                near[b, r] |= ((distance > self.bound / 2) & judged).any(1)
            hit = bad.any(1)  # [P]
            out[b, r] = torch.where(hit, bad.int().argmax(1) + start, out[b, r])
            active[b, r] = ~hit & (limit[b, r] > end)
            start, chunk = end, 2 * chunk
        # the call's one crossing to the host: first differing slots, slots judged, clean pairs
        host = torch.stack([out, limit, (out == limit) & ~near]).cpu()  # [3, B, R]
        out, limit, clean = host[0], host[1], host[2].bool()
        self._settled = Settled(call.index, clean.tolist(), limit.tolist(), obs.slots.tolist(), self._stack[0][1:])
        return out

    def settled(self, call: CallRecord, row: int, slots: Sequence[int], tokens: tuple[int, ...], m: int) -> bool:
        """Whether the last `past_prefixes` found `slots[:m]` of `row` holding `tokens`' entries,
        none past half the noise bound, from the source `first_mismatch` reads: then it has
        nothing to find, and the same comparison is not made twice."""
        memo = self._settled
        if memo is None or memo.call != call.index:
            return False
        r = next((q for q, sequence in enumerate(self.sequences) if sequence is tokens), None)
        return (
            r is not None
            and memo.clean[row][r]
            and memo.limit[row][r] == m
            and memo.sources[r] == id(self.reference(tokens, m)[1])
            and list(slots[:m]) == memo.slots[row][:m]
        )

    def stacked(self, width: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """([N, F] the sources every request's first min(width, len) entries come from, joined, on
        `device`; [N] each entry's fixed tolerance (`fixed_bound`); [R] where each request's
        reference starts in it; [R] min(width, len)): the references `reference` picks, the same
        ones as slot-by-slot reading, kept while the picks stay the same."""
        chosen, lengths = [], []
        for sequence in self.sequences:
            n = min(width, len(sequence))
            chosen.append(self.reference(sequence, n)[1])
            lengths.append(n)
        key = (device, *(id(kv) for kv in chosen))  # the sources stay in `self.sources`: their ids are theirs
        if self._stack is None or self._stack[0] != key:
            distinct = list({id(kv): kv for kv in chosen}.values())
            starts, at = {}, 0
            for kv in distinct:
                starts[id(kv)], at = at, at + int(kv.shape[0])
            joined = torch.cat([self.moved(kv, device) for kv in distinct])  # each source moved once per run
            offsets = torch.tensor([starts[id(kv)] for kv in chosen], device=device)
            self._stack = (key, joined, self.fixed_bound(joined), offsets)
        _, joined, bounds, offsets = self._stack
        return joined, bounds, offsets, torch.tensor(lengths, device=device)

    def moved(self, kv: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A source's entries on `device` (a snapshot's): copied once per source, not per call."""
        if kv.device == device:
            return kv
        key = (id(kv), device)
        if key not in self._moved:
            self._moved[key] = kv.to(device)
        return self._moved[key]

    def at(self, call: CallRecord, row: int, slots: Sequence[int]) -> torch.Tensor | None:
        """[L, F] the K/V the call left in `slots` of `row` (None: a cache-free call)."""
        if not call.cache_after:
            return None
        flat = self.flat(call)
        return flat[row, torch.tensor(list(slots), dtype=torch.long, device=flat.device)]

    def holds(self, call: CallRecord, row: int, slots: Sequence[int], tokens: tuple[int, ...]) -> bool:
        """Whether `slots` of `row` hold the batch-size-1 entries of `tokens`, one per slot."""
        found = self.at(call, row, slots)
        if found is None or len(slots) != len(tokens):
            return False
        want = self.moved(self.reference(tokens, len(tokens))[1], found.device)[: len(tokens)]
        return bool(self.same_slots(found[None], want).all())

    def same_slots(self, found: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
        """[B, n] whether found [B, n, F] holds want [n, F] (or [B, n, F]) slot by slot, as
        `first_mismatch` judges."""
        bound = self.bound if self.bound is not None else self.fixed_bound(want)
        return (found - want).abs().amax(-1) <= bound

    def flat(self, call: CallRecord) -> torch.Tensor:
        """[B, S, F] the call's snapshot (kept for the call's next row)."""
        if self._call is None or self._call[0] != call.index:
            self._call = (call.index, flat_cache(call.cache_after, self.work))
        return self._call[1]

    # judging

    def same_entries(self, entries: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
        """[A] which of `entries` [A, F] no check can tell from `expected` [F]: within the noise
        bound, or within the fixed tolerance."""
        bound = self.bound if self.bound is not None else self.fixed_bound(expected)
        return (entries - expected).abs().amax(-1) <= bound

    def fixed_bound(self, want: torch.Tensor) -> torch.Tensor:
        """[...] the dtype's fixed tolerance of each entry want [..., F]: atol + rtol x its largest
        |feature|. Relative to the entry, not to each feature: a feature near zero carries the
        rounding of the large terms that cancelled into it (tiny GPT-2 in bfloat16, position
        168: a feature of a 9.4-sized entry off by 0.0625, one bfloat16 step at 6, while the
        nearest wrong entry was 11.4 away)."""
        return self.atol + self.rtol * want.abs().amax(-1)

    def first_mismatch(
        self, call: CallRecord, row: int, slots: Sequence[int], tokens: tuple[int, ...]
    ) -> KVMiss | None:
        """The first attended past slot (of `slots`, in stream order) that does not hold the
        batch-size-1 entry of `tokens` at its index; slots past the end of `tokens` are not judged."""
        m = min(len(slots), len(tokens))
        if m == 0 or self.settled(call, row, slots, tokens, m):
            return None
        flat = self.flat(call)
        want = self.moved(self.reference(tokens, m)[1], flat.device)[:m]  # [m, F]
        found = flat[row].index_select(0, torch.tensor(slots[:m], dtype=torch.long, device=flat.device))  # [m, F]
        distance = (found - want).abs().amax(-1)  # [m]
        bad = ~(distance <= (self.bound if self.bound is not None else self.fixed_bound(want)))  # as `same_slots`
        suspect = (distance > self.bound / 2) & ~bad if self.bound is not None else torch.zeros_like(bad)
        # the row's one crossing to the host: [3, m] distances (exact in float64), bad and suspect slots
        host = torch.stack([distance.double(), bad.double(), suspect.double()]).cpu()
        distances, flags = host[0].tolist(), host[1:].bool()
        first = int(flags[0].int().argmax()) if bool(flags[0].any()) else m
        for i in flags[1].nonzero()[:, 0].tolist():  # within the bound but maybe nearer to an alternative
            if i >= first:
                break
            nearest = self.nearest(call, row, slots, tokens, i, found[i], want[i])
            if nearest is not None and nearest[1] <= distances[i]:
                return KVMiss(i, distances[i], self.bound, *nearest)
        if first == m:
            return None
        nearest = self.nearest(call, row, slots, tokens, first, found[first], want[first])
        return KVMiss(first, distances[first], self.bound, *(nearest or (None, None)))

    def nearest(
        self,
        call: CallRecord,
        row: int,
        slots: Sequence[int],
        tokens: tuple[int, ...],
        i: int,
        found: torch.Tensor,
        expected: torch.Tensor,
    ) -> tuple[Alternative, float] | None:
        """The competing alternative nearest to the entry found at index i, and its distance."""
        labels, entries = self.alternatives(call, row, slots, tokens, i)
        if not labels:
            return None
        competing = ~self.same_entries(entries, expected)  # the same entry up to noise is no competitor
        if not bool(competing.any()):
            return None
        distance = torch.where(competing, (entries - found).abs().amax(-1), math.inf)  # [A]
        k = int(distance.argmin())
        return labels[k], float(distance[k])

    def alternatives(
        self, call: CallRecord, row: int, slots: Sequence[int], tokens: tuple[int, ...], i: int
    ) -> tuple[list[Alternative], torch.Tensor]:
        """What a bug would put at stream index i instead, among entries at hand: [A] and [A, F]."""
        labels: list[Alternative] = []
        entries: list[torch.Tensor] = []
        for j in (i - 1, i + 1):  # off by one
            entry = self.kept(tokens, j) if j >= 0 else None
            if entry is not None:
                labels.append(Alternative(f"the entry at position {j} (off by one)", tokens[j], j))
                entries.append(entry[None])
        for q, sequence in enumerate(self.sequences):  # another request's entry at the same index
            if sequence[: i + 1] == tokens[: i + 1]:
                continue  # the same prefix: the same entry
            entry = self.kept(sequence, i, compute=True)  # a request that diverged from the oracle: once
            if entry is not None:
                labels.append(Alternative(f"request {q}'s entry at position {i}", sequence[i], i, q))
                entries.append(entry[None])
        flat = self.flat(call)
        attended = set(slots)
        masked = [s for s in range(min(call.past_length, flat.shape[1])) if s not in attended]
        if masked:  # the row's masked slots: pads, stale entries
            labels += [Alternative(f"masked slot {s} of this row (a pad or a stale entry)") for s in masked]
            entries.append(flat[row, torch.tensor(masked, dtype=torch.long, device=flat.device)])
        labels.append(Alternative(f"the pad token {self.pad} alone at position 0", self.pad, 0))
        entries.append(self.pad_entry()[None])
        return labels, torch.cat([e.to(flat.device) for e in entries])
