"""The K/V reader's hot path (issue 40): the chunked pair comparison of `KVReader.past_prefixes`
gives what comparing every request's entries at every slot gives, and a snapshot recorded as one
[B, S, F] block is read without a copy."""

from __future__ import annotations

import random

import pytest
import torch

from specaudit.checks.kv import PREFIX_CHUNK, KVReader, flat_cache, snapshot_block
from specaudit.checks.observe import UNKNOWN, Observation
from specaudit.fixtures.pairs import target_model
from specaudit.running.instrument import CallRecord, instrument

FEATURES = 12


def entry(prefix: tuple[int, ...]) -> torch.Tensor:
    """[F] a made-up batch-size-1 entry of the prefix's last token: a function of the whole prefix."""
    return torch.randn(FEATURES, generator=torch.Generator().manual_seed(hash(prefix) % 2**31))


def entries(tokens: tuple[int, ...]) -> torch.Tensor:
    """[n, F] every prefix's entry, as a batch-size-1 run of `tokens` gives them."""
    return torch.stack([entry(tokens[: i + 1]) for i in range(len(tokens))])


def old_past_prefixes(reader: KVReader, call: CallRecord, obs: Observation) -> torch.Tensor:
    """Every request's entries compared at every slot, as the reader did before the chunking."""
    batch, requests = obs.past.shape[0], len(reader.sequences)
    width = int(obs.past.max()) if batch else 0
    out = torch.zeros(batch, requests, dtype=torch.long)
    if width == 0:
        return out
    flat = flat_cache(call.cache_after, reader.work)
    slots = obs.slots[:, :width].clamp(0, flat.shape[1] - 1)
    found = flat.gather(1, slots[..., None].expand(-1, -1, flat.shape[2]))
    index = torch.arange(width)
    for r, sequence in enumerate(reader.sequences):
        n = min(width, len(sequence))
        want = reader.reference(sequence, n)[1][:n]
        bad = ~reader.same_slots(found[:, :n], want) & (index[None, :n] < obs.past[:, None])
        out[:, r] = torch.minimum(torch.where(bad.any(1), bad.int().argmax(1), n), obs.past)
    return out


def random_case(seed: int, noise: float | None) -> tuple[KVReader, CallRecord, Observation]:
    """Requests sharing prefixes (twins, one a prefix of another), rows holding one of them with
    left padding, shuffled slots, perturbed, NaN, blended or foreign entries, pasts beyond a request."""
    rng = random.Random(seed)
    base = tuple(rng.randrange(50) for _ in range(rng.randrange(20, 90)))
    sequences = [base[: rng.randrange(5, len(base) + 1)] for _ in range(3)]
    sequences += [tuple(rng.randrange(50) for _ in range(rng.randrange(1, 80))) for _ in range(3)]
    sequences.append(sequences[0])  # a twin
    batch = rng.randrange(1, 9)
    past = [rng.randrange(0, 100) for _ in range(batch)]
    size = max(past) + 3
    flat = torch.randn(batch, size, FEATURES)
    slots = torch.full((batch, max(past) or 1), UNKNOWN, dtype=torch.long)
    for b, m in enumerate(past):
        held = rng.choice(sequences)
        order = list(range(size - m, size))
        if rng.random() < 0.3:
            rng.shuffle(order)
        for i, slot in enumerate(order):
            slots[b, i] = slot
            if i < len(held):
                flat[b, slot] = entry(held[: i + 1])
            if rng.random() < 0.03:
                flat[b, slot] += rng.choice([1e-7, 1e-3, 0.02, 0.03, 0.2, 5.0, float("nan")])
            elif 0 < i < len(held) and rng.random() < 0.03:  # nearer to the off-by-one entry, maybe within the bound
                flat[b, slot] = 0.45 * flat[b, slot] + 0.55 * entry(held[:i])
    sources = [(s, entries(s)) for s in sequences[:2]]  # the others computed on demand, once
    reader = KVReader(torch.float32, sequences, sources, entries, pad=0, kv_noise=noise)
    call = CallRecord("target", 0, None, None, None, (size,), batch)
    call.cache_after = [(flat[:, None, :, : FEATURES // 2], flat[:, None, :, FEATURES // 2 :])]
    pasts = torch.tensor(past)
    obs = Observation(slots, slots, slots, pasts, pasts)
    return reader, call, obs


@pytest.mark.parametrize("noise", [None, 0.01, 1.0])
def test_chunked_past_prefixes_match_the_full_comparison(noise: float | None) -> None:
    for seed in range(40):
        reader, call, obs = random_case(seed, noise)
        old = old_past_prefixes(reader, call, obs)
        assert torch.equal(reader.past_prefixes(call, obs), old), seed


def test_past_prefixes_compare_about_one_request_per_row() -> None:
    """Rows each holding one of 8 distinct requests: each row is compared in full with its own
    request only; every other pair leaves at its first chunk."""
    sequences = [tuple(range(100 * q + 1, 100 * q + 81)) for q in range(8)]
    batch, width = 8, 80
    flat = torch.stack([entries(s) for s in sequences])  # [B, S, F]: row b holds request b
    reader = KVReader(torch.float32, sequences, [(s, entries(s)) for s in sequences], entries, pad=0)
    call = CallRecord("target", 0, None, None, None, (width,), batch)
    call.cache_after = [(flat[:, None, :, : FEATURES // 2], flat[:, None, :, FEATURES // 2 :])]
    slots = torch.arange(width).expand(batch, -1)
    obs = Observation(slots, slots, slots, torch.full((batch,), width), torch.full((batch,), width))
    assert torch.equal(reader.past_prefixes(call, obs), torch.diag(torch.full((batch,), width)))
    assert reader.compared <= batch * width + batch * (len(sequences) - 1) * PREFIX_CHUNK
    assert reader.compared < batch * len(sequences) * width / 2  # the full comparison: B x R x M


def test_a_recorded_snapshot_is_one_block_read_without_a_copy() -> None:
    """The recording lays every layer's K and V side by side ([B, S, F]); the reader's flat view is
    that block itself, equal to the per-layer copy it was built from."""
    target = target_model("llama", "float32")
    with instrument(target, None) as recording:
        out = target(torch.tensor([[3, 4, 5], [6, 7, 8]]), use_cache=True)
        target(torch.tensor([[9], [10]]), past_key_values=out.past_key_values, use_cache=True)
    call = recording.target_calls[-1]
    parts = [x for kv in call.cache_after for x in kv]
    block = snapshot_block(parts)
    assert block is not None
    copies = [(k.contiguous(), v.contiguous()) for k, v in call.cache_after]
    assert snapshot_block([x for kv in copies for x in kv]) is None  # separate tensors: copied, as before
    expected = flat_cache(copies, parts[0].dtype)
    flat = flat_cache(call.cache_after, parts[0].dtype)
    assert flat.data_ptr() == block.data_ptr() and torch.equal(flat, expected)
    live = [x for kv in out.past_key_values.layers for x in (kv.keys, kv.values)]
    assert all(torch.equal(x, y) for x, y in zip(parts, live))


@pytest.mark.parametrize("noise", [None, 0.01, 1.0])
def test_first_mismatch_after_past_prefixes_is_what_it_finds_alone(noise: float | None) -> None:
    """A (row, request) pair `past_prefixes` settled (no slot beyond the bound, none past half the
    noise bound) is not compared again by `first_mismatch`, and every answer, skipped or made,
    is the one a fresh reader makes."""
    skipped = 0
    for seed in range(40):
        reader, call, obs = random_case(seed, noise)
        fresh, _, _ = random_case(seed, noise)
        reader.past_prefixes(call, obs)
        for b, m in enumerate(obs.past.tolist()):
            slots = obs.slots[b, :m].tolist()
            for sequence in reader.sequences:
                n = min(m, len(sequence))
                skipped += bool(n) and reader.settled(call, b, slots, sequence, n)
                found, alone = (
                    reader.first_mismatch(call, b, slots, sequence),
                    fresh.first_mismatch(call, b, slots, sequence),
                )
                assert repr(found) == repr(alone)  # NaN distances compare as text
    assert skipped > 100
