"""A control for specaudit's I2 false alarm on lucidrains: specaudit's own `RecomputeSampling`, changed only so that
a row that emits EOS keeps being computed (its output is still cut at the EOS), as lucidrains' loop does.

Each output is the reference's output for the same draws cut at its first EOS, and every row attends only its own
tokens, so any failure specaudit reports on it is specaudit's (see bench/results/sampling_wild.md).
"""

from __future__ import annotations

from typing import Any

from specaudit.reference.sampling import RecomputeSampling
from tests.wild._common import cut


class RecomputePastEos(RecomputeSampling):
    """RecomputeSampling run without EOS, each row cut at its first EOS afterwards."""

    name = "RECOMPUTE_PAST_EOS"

    def generate(self, *args: Any, eos_token_id: int | None, max_new_tokens: int, **kwargs: Any) -> list[list[int]]:
        out = super().generate(*args, eos_token_id=None, max_new_tokens=max_new_tokens, **kwargs)
        return [cut(row, max_new_tokens, eos_token_id) for row in out]
