"""What a check computes once per decoder run, in the slots its registry entry declares.

A check's slots live in `run.derived.cached[check]` (`running.runner.Derived`), named by the
check's `caches` in the registry (`checks.registry.Check.caches`): I2's row binding and views,
equivalence's tie-aware comparison. Other checks read them through the same call (equivalence
reads I2's views), so one set of facts per run feeds every message;
tests/checks/test_registry.py holds every slot filled to one its check declares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def cached(run: Any, check: str, slot: str, make: Callable[[], T]) -> T:
    """`check`'s `slot` on `run` (a `running.runner.Run`), made by `make` the first time."""
    slots = run.derived.cached.setdefault(check, {})
    if slot not in slots:
        slots[slot] = make()
    return slots[slot]


def peek(run: Any, check: str, slot: str) -> Any:
    """`check`'s `slot` on `run` if a check already filled it, else None (nothing is computed)."""
    return run.derived.cached.get(check, {}).get(slot)
