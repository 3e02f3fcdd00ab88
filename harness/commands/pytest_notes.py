"""A failing property's record, noted on its own pytest item for the plugin to write.

The conformance properties and the regression tests specaudit writes call `remember_failure`
(a decoder run) or `remember_engine_failure` (an engine's rules); `specaudit.commands.pytest_plugin`
reads the record back (`item.stash[FAILURE]`) and writes the reproducer (--specaudit-out) or
matches it against known failures (--specaudit-xfails).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from specaudit.artifacts.reproducer import engine_failure_record, failure_record
from specaudit.checks.diagnosis import Finding
from specaudit.contracts.item import FAILURE
from specaudit.contracts.violation import Violation
from specaudit.search.engine_replay import diagnose_engine

if TYPE_CHECKING:
    from specaudit.running.runner import Run


def note_on_item(node: Any, record: dict[str, Any]) -> None:
    """Keep `record` on the pytest item (`request.node`), replacing any earlier one: Hypothesis
    replays the minimal example last, so the record a failed test ends with is its shrunk
    counterexample. On the item, not in a global, so no test can pick up another's failure."""
    node.stash[FAILURE] = record


def remember_failure(run: Run, violations: list[Violation], node: Any = None) -> None:
    """Note a failing run on its pytest item for the plugin (--specaudit-out, --specaudit-xfails).
    Without `node` (regression tests written before failures travelled on the item) nothing is
    noted: the test still fails, only no reproducer is written."""
    if node is not None:
        note_on_item(node, failure_record(run.case, run.decoder, violations))


def remember_engine_failure(
    reproducer: dict[str, Any], violations: list[Violation], node: Any, diagnosis: Finding | None = None
) -> None:
    """Note a failing engine rule sequence on its pytest item, as the engine reproducer
    `specaudit replay FILE --engine X` reads (`engine_failure_record`), with its diagnosis, so the
    file the plugin writes names the failure class as a decoder's does. Pass the failure's own
    (`EngineFailure.diagnosis`, made once); without one it is made here from the violations."""
    if diagnosis is None and violations:
        diagnosis = diagnose_engine(violations, reproducer)
    note_on_item(node, engine_failure_record(reproducer, violations, diagnosis))
