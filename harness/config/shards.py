"""`--shard i/n`: which cells of a plan one CI job runs.

A cell is one item of the audit's or the gate's plan (a subject of a kind on a model), named by
`cell_id`. A cell belongs to shard `1 + hash(cell) mod n`, the hash being SHA-256 of its name: a
pure function of the cell alone, so adding or removing a cell never moves another one to a
different shard (a round-robin over the plan's order would move every cell after it), and every
job of a CI matrix computes the same split without talking to the others. `specaudit merge`
recomputes it to tell a shard that ran the wrong cells, or none, from a complete one.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from specaudit.contracts.errors import UsageError

SHARD_PATTERN = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count`, 1-based as CI matrices count (`--shard 1/4` ... `--shard 4/4`)."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def holds(self, cell: str) -> bool:
        return shard_of(cell, self.count) == self.index


def parse_shard(text: str) -> Shard:
    """`i/n` with 1 <= i <= n; anything else is a usage error naming what was given."""
    match = SHARD_PATTERN.match(text)
    if match is None:
        raise UsageError(f"--shard {text!r}: expected I/N, for example 1/4")
    index, count = int(match.group(1)), int(match.group(2))
    if count < 1 or not 1 <= index <= count:
        raise UsageError(f"--shard {text}: I must be in 1..N and N >= 1 (shards count from 1)")
    return Shard(index, count)


def shard_of(cell: str, count: int) -> int:
    """The 1-based shard of `cell` among `count`: stable across runs, machines and Python versions
    (not `hash()`, which is salted per process)."""
    digest = hashlib.sha256(cell.encode("utf-8")).digest()
    return 1 + int.from_bytes(digest[:8], "big") % count


def cell_id(kind: str, spec: str, model: str) -> str:
    """A cell's name: its subject kind, subject and model (`decoder:reference.eqspec:EqSpec@transparent`)."""
    return f"{kind}:{spec}@{model}"


def cell_ids(keys: list[tuple[str, str, str]]) -> list[str]:
    """Each (kind, spec, model) as its `cell_id`, in order; a repeated one (the same subject
    planned twice) gets `#2`, `#3`, ... so that every cell of a plan has a name of its own."""
    seen: dict[str, int] = {}
    out = []
    for key in keys:
        name = cell_id(*key)
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out


__all__ = ["Shard", "cell_id", "cell_ids", "parse_shard", "shard_of"]
