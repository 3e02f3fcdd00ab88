"""The fixed K/V tolerance of the built-in models is relative to an entry, not to each feature.

CI found the false alarm: EqSpec on tiny GPT-2 in bfloat16, a 170-token prompt, I2 reported
slot 168 "beyond the dtype's fixed tolerance" by 0.0625 (one bfloat16 step at 6) while the
nearest wrong entry was 11.4 away. Per feature, a feature near zero was held to the absolute
tolerance alone, though it carries the rounding of the large terms that cancelled into it."""

from __future__ import annotations

import torch

from specaudit.checks.kv import KVReader


def reader(dtype: torch.dtype) -> KVReader:
    def entries(tokens: tuple[int, ...]) -> torch.Tensor:
        raise AssertionError(f"no batch-size-1 run expected, asked for {tokens}")

    return KVReader(dtype, [(1, 2, 3)], [], entries, pad=0)


def entry(large: float = 9.4375) -> torch.Tensor:
    """[F] a K/V entry with one large feature and the rest near zero."""
    out = torch.full((16,), 0.01)
    out[0] = large
    return out


def test_a_near_zero_feature_off_by_a_step_of_the_entry_passes_in_bfloat16() -> None:
    want = entry()
    found = want.clone()
    found[3] += 0.0625  # the feature was 0.01: per feature 6x its own tolerance
    assert bool(reader(torch.bfloat16).same_slots(found[None, None], want[None])[0, 0])
    assert bool(reader(torch.bfloat16).same_entries(found[None], want)[0])


def test_another_entry_fails_in_bfloat16() -> None:
    want = entry()
    other = entry(large=-2.0)  # what an off-by-one slot holds: a different entry
    assert not bool(reader(torch.bfloat16).same_slots(other[None, None], want[None])[0, 0])
    assert not bool(reader(torch.bfloat16).same_entries(other[None], want)[0])


def test_float32_keeps_its_tight_bound() -> None:
    want = entry(large=1.0)
    found = want.clone()
    found[3] += 1e-2  # 10x float32's 1e-3 of the entry
    assert not bool(reader(torch.float32).same_slots(found[None, None], want[None])[0, 0])
    found[3] = want[3] + 5e-4
    assert bool(reader(torch.float32).same_slots(found[None, None], want[None])[0, 0])
