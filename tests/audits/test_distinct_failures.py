"""Every distinct failure of a decoder is listed (issue 27, point 3): the audit's table, report.json
with its reproducers under DIR/repro, and the gate's JUnit, one each, each reproducer replaying to
its own check and rule.

The verdict is built from the three minimal cases an audit of `ThreeDefects` shrinks to (one per
planted defect), so the outputs are tested without the search (tests/search/test_distinct.py
tests that the search finds them)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from specaudit.artifacts.reproducer import identifier
from specaudit.audits.audit import write_outputs
from specaudit.audits.decoders import DecoderVerdict as Verdict
from specaudit.audits.decoders import distinct, failure_name, format_table
from specaudit.audits.gate import held_to_gate, junit_xml
from specaudit.checks.diagnosis import Diagnosis, diagnose
from specaudit.commands.replay import replay
from specaudit.config.settings import GateSettings
from specaudit.contracts.case import Case
from specaudit.running.runner import run_case

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = "tests.decoders.three_defects:ThreeDefects"


def case(prompt: tuple[int, ...], k: int, max_new: int, eos: int | None, pad: int, extra: int) -> Case:
    """One row, every draft rejected."""
    return Case((prompt,), ((False,) * (max_new + k + 2),), k, max_new, eos, pad, extra)


MINIMAL = {
    ("I2", "history-token"): case((0,), 1, 2, None, 0, 1),  # defect 1: the pad-valued prompt token lost
    ("equivalence", "first-divergence"): case((0, 0, 0), 1, 1, None, 0, 0),  # defect 3: odd prompt, column -2
    ("contract", "ends-at-eos"): case((95,), 1, 3, 127, 0, 0),  # defect 2: EOS correction not tested
}


@pytest.fixture(scope="module")
def failures() -> list[Diagnosis]:
    return distinct([diagnose(run_case(SPEC, c)) for c in MINIMAL.values()])


@pytest.fixture
def verdict(failures: list[Diagnosis]) -> Verdict:
    v = Verdict(SPEC, "transparent", examples=25)
    v.failures, v.diagnosis = list(failures), failures[0]
    return v


def test_each_minimal_case_shows_its_own_defect(failures: list[Diagnosis]) -> None:
    """The three minimal cases fail with three different (check, rule) pairs: three failures, not one."""
    found = [(d.first_check, d.first.rule if d.first else None) for d in failures]
    assert found == list(MINIMAL), found


def test_the_table_lists_every_failure(verdict: Verdict) -> None:
    """One table row per distinct failure, and each one's minimal failing case."""
    table = format_table([verdict])
    assert "+ failure 2 of 3" in table and "+ failure 3 of 3" in table, table
    for check, rule in list(MINIMAL)[1:]:
        assert f"{check} ({rule})" in table, (check, rule, table)
    for i in (1, 2, 3):
        assert f"minimal failing case (failure {i} of 3)" in table, table


def test_report_and_reproducers_list_every_failure(verdict: Verdict, tmp_path: Path) -> None:
    """report.json's entry keeps the first failure as `first`/`signature` and lists all three under
    `failures`, each with a reproducer in DIR/repro that replays to its own check and rule."""
    write_outputs(tmp_path, [verdict])
    (entry,) = json.loads((tmp_path / "report.json").read_text())["entries"]
    assert (entry["first"]["check"], entry["first"]["rule"]) == list(MINIMAL)[0]
    listed = [(f["first"]["check"], f["first"]["rule"]) for f in entry["failures"]]
    assert listed == list(MINIMAL), listed
    assert entry["signature"] == entry["failures"][0]["signature"]
    reproducers = [tmp_path / "repro" / f["reproducer"] for f in entry["failures"]]
    assert len(set(reproducers)) == 3 and all(p.exists() for p in reproducers), reproducers
    replayed = [(d.first_check, d.first.rule) for d in (replay(path, SPEC) for path in reproducers)]
    assert replayed == list(MINIMAL), replayed
    assert len(list((tmp_path / "repro").glob("test_regression_*.py"))) == 3


def test_junit_has_a_failing_testcase_per_failure(verdict: Verdict, tmp_path: Path) -> None:
    """The gate's JUnit: the decoder x model testcase fails on the first, and one more testcase
    per further failure (`MODEL failure N`) fails with its own check, rule and reproducer."""
    settings = GateSettings(decoders=(SPEC,), models=("transparent",), junit=tmp_path / "j.xml", out=tmp_path)
    judged = held_to_gate(verdict, settings)
    paths = [tmp_path / f"{identifier(failure_name(verdict, i))}.json" for i in range(3)]
    root = junit_xml([judged], settings, [paths]).getroot()
    cases = root.findall("./testsuite/testcase")
    assert [c.get("name") for c in cases] == ["transparent", "transparent failure 2", "transparent failure 3"]
    assert [c.find("failure").get("type") for c in cases] == [check for check, _ in MINIMAL]  # type: ignore[union-attr]
    rules = [{p.get("name"): p.get("value") for p in c.iter("property")}["rule"] for c in cases]
    assert rules == [rule for _, rule in MINIMAL], rules
    assert (root.get("tests"), root.get("failures")) == ("3", "3")
    for c, path in zip(cases[1:], paths[1:]):
        assert f"reproducer written to {path}" in (c.findtext("system-out") or ""), ET.tostring(c)
