"""Deterministically wrong decoders: every row's last new token is off by one, on every case.

Every case then fails output equivalence and nothing else (each row alike, so another pool
order gives the same outputs, permuted): what a known-failures file lists as known.
"""

from __future__ import annotations

from typing import Any

from specaudit.fixtures import VOCAB_SIZE
from specaudit.reference.eqspec import EqSpec


class WrongLastToken:
    name = "wrong-last-token"

    def generate(self, *args: Any, **kwargs: Any) -> list[list[int]]:
        out = EqSpec().generate(*args, **kwargs)
        return [row[:-1] + [(row[-1] + 1) % VOCAB_SIZE] if row else row for row in out]


class WrongLastTokenToo(WrongLastToken):
    """The same bug under another name (a second decoder under test)."""

    name = "wrong-last-token-too"
