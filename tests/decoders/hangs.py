"""A decoder that hangs on every batch of two or more rows: the negative control of a hang's reproducer."""

from __future__ import annotations

import time
from typing import Any

import torch

from specaudit.reference.eqspec import EqSpec

HANG_BOUND_S = 10.0
"""A hang stops by itself after this long, so a broken watchdog fails a test instead of hanging it."""


class HangsOnTwoRows:
    """Hangs (bounded) on a batch of two or more rows; otherwise a correct EQSPEC."""

    def generate(self, target: Any, draft: Any, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if input_ids.shape[0] >= 2:
            deadline = time.monotonic() + HANG_BOUND_S
            while time.monotonic() < deadline:
                time.sleep(0.01)
        return EqSpec().generate(target, draft, input_ids, *args, **kwargs)
