"""Per-dtype tolerances: how far a batched run may sit from a batch-size-1 run before it is a bug.

Fixed bounds, used where the models are built in (the transparent and tiny ones); real-model mode
measures its noise floor instead (`specaudit.numerics.calibration`).
"""

from __future__ import annotations

import torch

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

KV_TOLERANCE = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-3, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (4e-2, 4e-2),
}
"""(rtol, atol) for comparing a batched run's K/V with a batch-size-1 run's, per dtype."""

TIE_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}
"""Top-1/top-2 logit margin at or below which a divergence counts as a numerical tie."""
