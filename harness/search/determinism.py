"""A seed decides what Hypothesis draws, and nothing else does."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def without_local_constants() -> Iterator[None]:
    """Hypothesis mixes literals from every local module imported so far into its draws, so the
    cases of a seed would depend on what the process imported before (the user's decoder, other
    tests on the same xdist worker). Without them the seed alone decides the cases."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:  # pragma: no cover - a Hypothesis without local constants
        yield
        return
    original, empty = providers._get_local_constants, Constants()
    providers.CONSTANTS_CACHE.cache.clear()
    providers._get_local_constants = lambda: empty
    try:
        yield
    finally:
        providers._get_local_constants = original
        providers.CONSTANTS_CACHE.cache.clear()
