"""A broken rule with its evidence: what was found, what was expected, and where.

The free-text `found`/`expected` are for people; `evidence` holds the same facts as fields
(`found_token`, `found_position`, `expected_token`, `expected_position`, `index`, ...) for
the diagnosis, which reads fields and never parses text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class _Described(Protocol):
    """What a failure message names: a Run, or anything else with a decoder and a case."""

    decoder: str
    case: object


@dataclass(frozen=True)
class Violation:
    """One broken rule, with where it broke and what was found against what was expected."""

    check: str  # "contract", "I1", "I2", "equivalence", "token-preservation"
    rule: str
    found: str
    expected: str
    call: int | None = None  # target call (round)
    row: int | None = None  # row of the batch in that call
    slot: int | None = None  # cache slot (past + current) of that row
    request: int | None = None  # row of the case the batch row holds
    evidence: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def render(self) -> str:
        where = [
            f"{name} {value}"
            for name, value in (("target call", self.call), ("row", self.row), ("slot", self.slot))
            if value is not None
        ]
        if self.request is not None and self.row is None:
            where.append(f"request {self.request}")
        elif self.request is not None and self.request != self.row:
            where.append(f"(request {self.request})")
        place = ", ".join(where) if where else "run"
        return f"[{self.check}: {self.rule}] {place}: got {self.found}, but should be {self.expected}"


def render(violations: list[Violation], limit: int = 8) -> str:
    lines = [v.render() for v in violations[:limit]]
    if len(violations) > limit:
        lines.append(f"... and {len(violations) - limit} more")
    return "\n".join(lines)


def explain(run: _Described, violations: list[Violation]) -> str:
    """The failure message: decoder, case, and the evidence."""
    return f"decoder {run.decoder} on {run.case!r}\n{render(violations)}"
