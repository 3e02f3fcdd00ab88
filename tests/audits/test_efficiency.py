"""Correct but wasteful is not wrong (issue 38, point 3): a finding of token preservation alone is
its own verdict level, "efficiency", in the table, report.json and JUnit; --strict-efficiency makes
it fatal; a planted token-preservation bug is still reported, at that level; a correctness failure
beside it still fails.

The verdicts are built from minimal cases (one of `draft_cache_not_rolled_back`, whose output is
right, one of `pads_attended`, which diverges), so the outputs are tested without the search."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from specaudit.audits.audit import write_outputs
from specaudit.audits.decoders import DecoderVerdict as Verdict
from specaudit.audits.decoders import format_table
from specaudit.audits.gate import held_to_gate, junit_xml
from specaudit.audits.verdict import efficiency_only, level_of, minimal_case_statuses, run_statuses
from specaudit.checks.diagnosis import Diagnosis, diagnose
from specaudit.checks.registry import evaluate
from specaudit.commands.cli import build_parser
from specaudit.config.settings import GateSettings
from specaudit.contracts.case import Case
from specaudit.running.runner import run_case

pytestmark = pytest.mark.usefixtures("one_thread")

WASTEFUL = "specaudit.reference.mutants:draft_cache_not_rolled_back"
WRONG = "specaudit.reference.mutants:pads_attended"
WASTEFUL_CASE = Case(((26,),), ("000000001000",), 1, 9, None, 0)  # the audit's minimal case
WRONG_CASE = Case(((0,), (119,)), ("0000000", "0100000"), 1, 4, None, 0)  # README's minimal case


@pytest.fixture(scope="module")
def wasteful() -> Diagnosis:
    return diagnose(run_case(WASTEFUL, WASTEFUL_CASE))


@pytest.fixture(scope="module")
def wrong() -> Diagnosis:
    return diagnose(run_case(WRONG, WRONG_CASE))


def verdict(spec: str, failures: list[Diagnosis], *, strict: bool = False, expect: bool = False) -> Verdict:
    v = Verdict(spec, "transparent", expect_failure=expect, examples=3, measured=3, strict_efficiency=strict)
    v.failures, v.diagnosis = list(failures), failures[0] if failures else None
    return v


def test_the_minimal_cases_are_what_the_tests_need(wasteful: Diagnosis, wrong: Diagnosis) -> None:
    """The wasteful case breaks token preservation only; the wrong one breaks correctness."""
    assert {v.check for v in wasteful.violations} == {"token-preservation"}, wasteful.violations
    assert wasteful.exact_match == 1.0 and efficiency_only(wasteful.violations)
    assert not efficiency_only(wrong.violations) and wrong.first_check == "I2"


def test_an_efficiency_finding_passes_at_its_own_level(wasteful: Diagnosis, tmp_path: Path) -> None:
    """Output and invariants right, drafts lost: level "efficiency", passed, in the table's verdict
    word, the checks table, report.json and the run's exit (as expected for a decoder under test)."""
    v = verdict(WASTEFUL, [wasteful])
    v.checks = {"token-preservation": "efficiency", "I2": "pass"}
    assert (v.level, v.passed, v.as_expected) == ("efficiency", True, True)
    table = format_table([v])
    row = table.splitlines()[2]
    assert " EFFICIENCY " in row and " FAIL " not in row, row
    assert "efficiency finding (not fatal), minimal case" in table, table
    write_outputs(tmp_path, [v])
    document = json.loads((tmp_path / "report.json").read_text())
    (entry,) = document["entries"]
    assert (document["passed"], entry["passed"], entry["level"]) == (True, True, "efficiency"), entry
    assert entry["failures"][0]["level"] == "efficiency"


def test_strict_efficiency_makes_it_fatal(wasteful: Diagnosis) -> None:
    """--strict-efficiency: the same finding fails the verdict, its level still "efficiency"."""
    v = verdict(WASTEFUL, [wasteful], strict=True)
    assert (v.level, v.passed, v.as_expected) == ("efficiency", False, False)
    assert " FAIL " in format_table([v]).splitlines()[2]
    assert v.report_entry()["passed"] is False


def test_a_planted_token_preservation_bug_is_caught_at_that_level(wasteful: Diagnosis) -> None:
    """A planted bug reported at the efficiency level is as expected; one not reported is not."""
    assert verdict(WASTEFUL, [wasteful], expect=True).as_expected
    assert not verdict(WASTEFUL, [], expect=True).as_expected


def test_a_correctness_failure_beside_it_still_fails(wasteful: Diagnosis, wrong: Diagnosis) -> None:
    """Both kinds found: level "fail", and the correctness failure is the verdict's first."""
    v = verdict(WRONG, [wrong, wasteful])
    assert (v.level, v.passed) == ("fail", False)
    assert v.fatal() == [wrong]
    assert level_of([wasteful.violations, wrong.violations]) == "fail"
    assert level_of([]) == "pass"


def test_junit_passes_an_efficiency_finding_unless_strict(
    wasteful: Diagnosis, wrong: Diagnosis, tmp_path: Path
) -> None:
    """The gate's testcase: no failure, `verdict`/`level` properties "efficiency" and the finding in
    its system-out; under --strict-efficiency a failure; a correctness failure's further efficiency
    finding is no failing testcase of its own."""
    settings = GateSettings(decoders=(WASTEFUL,), models=("transparent",), junit=tmp_path / "j.xml", out=tmp_path)
    for strict in (False, True):
        v = verdict(WASTEFUL, [wasteful], strict=strict)
        (case,) = junit_xml([held_to_gate(v, settings)], settings, [[]]).getroot().findall("./testsuite/testcase")
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        assert props["level"] == "efficiency", props
        if strict:
            assert case.find("failure") is not None, ET.tostring(case)
        else:
            assert case.find("failure") is None and props["verdict"] == "efficiency", ET.tostring(case)
            assert "efficiency finding (not fatal): token-preservation" in (case.findtext("system-out") or "")
    mixed = held_to_gate(verdict(WRONG, [wrong, wasteful]), settings)
    cases = junit_xml([mixed], settings, [[]]).getroot().findall("./testsuite/testcase")
    assert [c.find("failure").get("type") for c in cases] == ["I2"]  # type: ignore[union-attr]


def test_statuses_read_efficiency_for_the_efficiency_check(wasteful: Diagnosis) -> None:
    """A run's and a minimal case's failed token preservation reads "efficiency", not "fail"."""
    evaluation = evaluate(run_case(WASTEFUL, WASTEFUL_CASE))
    statuses = run_statuses(evaluation, lambda v: False)
    assert statuses["token-preservation"] == "efficiency" and "fail" not in statuses.values(), statuses
    minimal = minimal_case_statuses(wasteful.checks, wasteful.violations, lambda v: False)
    assert minimal["token-preservation"] == "efficiency", minimal


@pytest.mark.parametrize("command", ["audit", "gate"])
def test_the_flag_reaches_the_settings(command: str) -> None:
    """`--strict-efficiency` on audit and gate (off by default)."""
    parser = build_parser()
    assert parser.parse_args([command, "--strict-efficiency"]).strict_efficiency is True
    assert parser.parse_args([command]).strict_efficiency is False


def test_the_checks_table_and_the_minimal_case_say_the_same(wrong: Diagnosis, wasteful: Diagnosis) -> None:
    """Issue 38, point 6: the search's runs read I2 pass, the minimal case fails I2: the table reads
    FAIL for I2 (the minimal case is a run too), and efficiency for token preservation."""
    v = Verdict(WRONG, "transparent", examples=3)
    v.checks = {"I2": "pass", "equivalence": "pass", "token-preservation": "pass"}
    v.take_failures([wasteful, wrong], lambda x: False)
    assert v.failures == [wrong, wasteful] and v.diagnosis is wrong
    assert (v.checks["I2"], v.checks["equivalence"], v.checks["token-preservation"]) == ("fail", "fail", "efficiency")
    (row,) = [line for line in format_table([v]).splitlines() if line.startswith("mutants:pads_attended ")][-1:]
    assert "FAIL" in row and "I2 pass" not in row, row
