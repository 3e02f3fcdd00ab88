"""`specaudit gate`: exit status, JUnit XML, reproducers, and the thresholds."""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import specaudit.cli
from specaudit.case import Case
from specaudit.cli import Verdict
from specaudit.diagnosis import diagnose
from specaudit.gate import add_command
from specaudit.runner import run_case

EQSPEC = "specaudit.reference.eqspec:EqSpec"
MUTANT = "specaudit.reference.mutants:rejected_kv_attended"


def gate(tmp_path: Path, *argv: str) -> int:
    parser = argparse.ArgumentParser(prog="specaudit")
    add_command(parser.add_subparsers(dest="command"))
    junit, out = str(tmp_path / "junit.xml"), str(tmp_path / "repro")
    args = parser.parse_args(["gate", "--junit", junit, "--out", out, "--quiet", *argv])
    return int(args.func(args))


def junit_cases(tmp_path: Path) -> list[ET.Element]:
    root = ET.parse(tmp_path / "junit.xml").getroot()
    assert root.tag == "testsuites"
    return root.findall("./testsuite/testcase")


def props(testcase: ET.Element) -> dict[str, str]:
    return {p.get("name", ""): p.get("value", "") for p in testcase.findall("./properties/property")}


def test_reference_decoder_passes_the_gate(tmp_path: Path) -> None:
    """EqSpec on the transparent model: exit 0, one passing testcase with its exact-row count."""
    assert gate(tmp_path, "--decoder", EQSPEC, "--models", "transparent", "--examples", "3") == 0
    (case,) = junit_cases(tmp_path)
    assert case.get("classname") == f"specaudit.{EQSPEC}" and case.get("name") == "transparent"
    assert case.find("failure") is None
    p = props(case)
    assert p["cases"] == "3" and p["exact_match"] == "1" and p["signature"] == ""
    assert not (tmp_path / "repro").exists()


def test_planted_bug_fails_the_gate(tmp_path: Path) -> None:
    """A planted bug: exit 1, a JUnit failure with check and signature, a reproducer and a regression test."""
    assert gate(tmp_path, "--decoder", MUTANT, "--models", "transparent", "--examples", "3") == 1
    (case,) = junit_cases(tmp_path)
    failure = case.find("failure")
    assert failure is not None and failure.get("type") == "I2"
    assert "[I2: attends-wrong-slot]" in failure.get("message", "") and "kv-drift" in (failure.text or "")
    p = props(case)
    assert (p["first_check"], p["signature"]) == ("I2", "kv-drift")
    written = sorted(path.name for path in (tmp_path / "repro").iterdir())
    assert written == [
        "specaudit_reference_mutants_rejected_kv_attended_transparent.json",
        "test_regression_specaudit_reference_mutants_rejected_kv_attended_transparent.py",
    ]
    assert "reproducer written to" in (case.findtext("system-out") or "")
    assert Case.load(tmp_path / "repro" / written[0]).batch_size <= 2


def fake_audit(verdicts: dict[str, Verdict]):  # type: ignore[no-untyped-def]
    def audit_model(spec: str, model: str, examples: int, seed: int, progress: object = None) -> Verdict:
        return verdicts[spec]

    return audit_model


@pytest.fixture
def failing_diagnosis():  # type: ignore[no-untyped-def]
    case = Case(((5,),), ((False,) * 6,), 1, 3, None, 0)
    return diagnose(run_case(MUTANT, case))


def test_min_exact_match_threshold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--min-exact-match fails a passing decoder x model whose exact-row rate is below it."""
    verdict = Verdict(EQSPEC, "transparent", examples=5, exact_rows=8, rows=10)
    monkeypatch.setattr(specaudit.cli, "audit_model", fake_audit({EQSPEC: verdict}))
    assert gate(tmp_path, "--models", "transparent", "--decoder", EQSPEC, "--min-exact-match", "0.8") == 0
    assert gate(tmp_path, "--models", "transparent", "--decoder", EQSPEC, "--min-exact-match", "0.9") == 1
    (case,) = junit_cases(tmp_path)
    failure = case.find("failure")
    assert failure is not None and failure.get("type") == "threshold"
    assert "0.800 (8/10) is below --min-exact-match 0.9" in failure.get("message", "")


def test_max_failures_threshold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing_diagnosis) -> None:  # type: ignore[no-untyped-def]
    """--max-failures N tolerates N failing decoder x model pairs; the JUnit still records them."""
    verdicts = {
        EQSPEC: Verdict(EQSPEC, "transparent", examples=3, exact_rows=6, rows=6),
        MUTANT: Verdict(MUTANT, "transparent", examples=1, rows=1, diagnosis=failing_diagnosis),
    }
    monkeypatch.setattr(specaudit.cli, "audit_model", fake_audit(verdicts))
    both = ("--models", "transparent", "--decoder", EQSPEC, "--decoder", MUTANT)
    assert gate(tmp_path, *both) == 1
    assert gate(tmp_path, *both, "--max-failures", "1") == 0
    cases = junit_cases(tmp_path)
    assert [c.find("failure") is None for c in cases] == [True, False]
    root = ET.parse(tmp_path / "junit.xml").getroot()
    assert root.get("tests") == "2" and root.get("failures") == "1"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--models", "transparent,gpt7"), "unknown model(s) gpt7"),
        (("--examples", "0"), "--examples must be at least 1"),
        (("--min-exact-match", "1.5"), "--min-exact-match must be between 0 and 1"),
        (("--max-failures", "-1"), "--max-failures must be at least 0"),
        (("--decoder", "specaudit.reference.nosuchmodule:X"), "not found"),
    ],
)
def test_usage_errors_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    """Bad flags: exit 2, one line on stderr, nothing run and no JUnit written."""
    assert gate(tmp_path, *argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specaudit: error: ") and message in err
    assert not (tmp_path / "junit.xml").exists()
