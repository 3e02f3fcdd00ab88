"""A nondeterministic decoder: right on even calls of generate, one wrong token on odd calls.

A stand-in for a decoder with a race or an uninitialised buffer: the same case fails only
sometimes, which the suite must report as nondeterminism, with its replay failure rate.
"""

from __future__ import annotations

import itertools
from typing import Any

from specaudit.reference.eqspec import EqSpec

_calls = itertools.count()


class Flaky:
    name = "flaky"

    def generate(self, *args: Any, **kwargs: Any) -> list[list[int]]:
        out = EqSpec().generate(*args, **kwargs)
        if next(_calls) % 2 and out and out[0]:
            out[0][-1] = (out[0][-1] + 1) % 128  # a wrong last token in row 0
        return out
