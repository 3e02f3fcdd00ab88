"""A subject kind is one row of the one table (`specaudit.contracts.subjects.KINDS`) and one
`SubjectDriver` (`specaudit.audits.plan.SUBJECTS`): the audit plans, runs, tables, reports and
counts a kind it was never written for, through the verdict protocol."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from specaudit.artifacts.report import entry
from specaudit.artifacts.tables import entries_table
from specaudit.audits import plan
from specaudit.audits.audit import run_audit
from specaudit.audits.plan import Item, SubjectDriver
from specaudit.audits.verdict import EntryVerdict, Progress, Verdict
from specaudit.config.settings import AuditSettings
from specaudit.contracts import subjects
from specaudit.contracts.subjects import EVIDENCE_PAGED, SubjectKind
from specaudit.contracts.violation import Violation

TOY = SubjectKind("paged", EVIDENCE_PAGED, None, "paged engine", (), "a toy paged engine's run")
"""The toy's row: judged as a paged engine, its entries of the paged engines' report kind."""
BROKEN = Violation("paged", "slot-mapping", "token 3 written at slot 17", "slot 16", call=2, request=1)


def run_toy(item: Item, progress: Progress | None) -> Verdict:
    """A paged engine's driver as the adapters write one: report entries, wrapped."""
    passed = item.spec == "toy:Good"
    first = None if passed else BROKEN
    made = entry("paged engine", {"engine": item.spec, "model": item.model}, passed, first, None, {"forwards": 3})
    return EntryVerdict("paged", made, item.expect_failure, ["", f"{item.spec}: {BROKEN.render()}"])


def toy_driver(specs: tuple[str, ...]) -> SubjectDriver:
    def table(verdicts: list[Verdict]) -> str:
        return entries_table("paged engine", [v.report_entry() for v in verdicts], [v.details() for v in verdicts])

    return SubjectDriver(
        "paged",
        lambda settings: [Item(spec, "transparent", False, 1, settings.seed, kind="paged") for spec in specs],
        lambda settings: [],
        lambda spec: None,
        run_toy,
        table,
        lambda items: f"{len(items)} paged engine(s), ",
    )


@pytest.fixture
def only(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The toy's row in the table and `SUBJECTS` holding the toy driver alone, for one test."""
    monkeypatch.setattr(subjects, "KINDS", (*subjects.KINDS, TOY))
    saved = plan.SUBJECTS[:]
    plan.SUBJECTS[:] = [toy_driver(request.param)]
    yield
    plan.SUBJECTS[:] = saved


@pytest.mark.parametrize("only", [("toy:Good", "toy:Broken")], indirect=True)
def test_a_new_subject_kind_is_audited_through_its_driver(
    only: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = AuditSettings(models=("transparent",), examples=1, quiet=True, out=tmp_path, jobs=1)
    assert run_audit(settings) == 1  # the broken one was not expected to fail
    out = capsys.readouterr().out
    assert out.startswith("specaudit audit: 2 paged engine(s), up to 1 cases each"), out
    rows = {line.split(",")[0]: line for line in out.splitlines() if line.startswith("toy:")}
    assert "PASS" in rows["toy:Good"] and "yes" in rows["toy:Good"], out
    assert "FAIL" in rows["toy:Broken"] and "slot-mapping" in rows["toy:Broken"], out
    assert f"toy:Broken: {BROKEN.render()}" in out and "1 as expected, 1 not" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(e["kind"], e["subject"]["engine"], e["passed"]) for e in report["entries"]] == [
        ("paged engine", "toy:Good", True),
        ("paged engine", "toy:Broken", False),
    ]
    assert report["entries"][1]["first"]["call"] == 2 and report["entries"][1]["forwards"] == 3


def test_a_driver_of_a_kind_the_table_lacks_is_refused() -> None:
    """The toy's driver without its row: refused when it is made, naming the table."""
    with pytest.raises(ValueError, match="'paged' is no subject kind.*contracts.subjects.KINDS"):
        toy_driver(("toy:Good",))
