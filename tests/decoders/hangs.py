"""Decoders that hang: the controls of the watchdog, of a hang's reproducer and of how fast a
hang is reported (issue 27, point 8).

- `HangsOnTwoRows`: hangs for `HANG_BOUND_S` on a batch of two or more rows (a hang's reproducer).
- `HangsAlways`: never returns on any batch, after its prefill (a loop waiting for rows that
  never finish): the whole decoder is a hang.
- `HangsOnThreeRows`: never returns on a batch of three or more rows; otherwise a correct
  EQSPEC, so the search must find the hang among passing cases and shrink it to three rows.

"Never" is `FOREVER_S`, so a broken watchdog fails a test instead of hanging it; the watchdog
stops these decoders long before (they sleep in short steps, where its stop lands at once).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from specaudit.reference.eqspec import EqSpec

HANG_BOUND_S = 10.0
"""A hang stops by itself after this long, so a broken watchdog fails a test instead of hanging it."""

FOREVER_S = 900.0
"""How long a decoder that "never returns" waits before it gives up (longer than any idle limit)."""


def wait(seconds: float) -> None:
    """Sleep in short steps: the watchdog's stop (an exception raised in this thread) lands between them."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.01)


class HangsOnTwoRows:
    """Hangs (bounded) on a batch of two or more rows; otherwise a correct EQSPEC."""

    def generate(self, target: Any, draft: Any, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if input_ids.shape[0] >= 2:
            wait(HANG_BOUND_S)
        return EqSpec().generate(target, draft, input_ids, *args, **kwargs)


class HangsAlways:
    """Prefills the batch once, then waits for rows that never finish: no batch ever returns."""

    name = "hangs-always"

    @torch.no_grad()
    def generate(
        self, target: Any, draft: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any
    ) -> Any:
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]
        target(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True)
        wait(FOREVER_S)
        raise RuntimeError(f"gave up waiting after {FOREVER_S:g} s: the watchdog should have stopped this run")


class HangsOnThreeRows:
    """Never returns on a batch of three or more rows; otherwise a correct EQSPEC."""

    name = "hangs-on-three-rows"

    def generate(self, target: Any, draft: Any, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if input_ids.shape[0] >= 3:
            wait(FOREVER_S)
        return EqSpec().generate(target, draft, input_ids, *args, **kwargs)
