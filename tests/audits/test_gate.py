"""`specaudit gate`: exit status, JUnit XML with every check's status, reproducers, known
failures (--xfails) and the exact-match threshold; and the known-failures file format."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch

from specaudit.checks.registry import BATCH_ORDER
from specaudit.commands.cli import main
from specaudit.config.xfails import load_xfails
from specaudit.contracts.case import Case
from specaudit.contracts.errors import UsageError
from specaudit.reference.eqspec import EqSpec
from specaudit.reference.planted.kv_cache import RejectedKvAttended

EQSPEC = "specaudit.reference.eqspec:EqSpec"
MUTANT = "specaudit.reference.mutants:rejected_kv_attended"
BONUS = "specaudit.reference.mutants:bonus_from_draft"


def gate(tmp_path: Path, *argv: str) -> int:
    junit, out = str(tmp_path / "junit.xml"), str(tmp_path / "repro")
    return main(["gate", "--junit", junit, "--out", out, "--quiet", "--models", "transparent", *argv])


def xfails_file(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "xfails.txt"
    path.write_text("# known failures\n" + "\n".join(lines) + "\n")
    return str(path)


def junit_cases(tmp_path: Path) -> list[ET.Element]:
    root = ET.parse(tmp_path / "junit.xml").getroot()
    assert root.tag == "testsuites"
    return root.findall("./testsuite/testcase")


def props(testcase: ET.Element) -> dict[str, str]:
    return {p.get("name", ""): p.get("value", "") for p in testcase.findall("./properties/property")}


def check_statuses(testcase: ET.Element) -> dict[str, str]:
    return {name.removeprefix("check:"): value for name, value in props(testcase).items() if name.startswith("check:")}


# ---------------------------------------------------------------------------------------
# Decoders for the gate's own tests


class TwoBugs:
    """Two different bugs: on a single row generate() raises (a contract break), on batches of
    2+ rows rejected drafts' KV stays attended (I2)."""

    name = "two_bugs"

    def generate(self, target: Any, draft: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kw: Any):  # type: ignore[no-untyped-def]
        if input_ids.shape[0] == 1:
            raise RuntimeError("single rows are not supported")
        return RejectedKvAttended().generate(target, draft, input_ids, attention_mask, **kw)


class Starving:
    """A correct decoder with a starving scheduler: it serves one request at a time to the end
    (EQSPEC on that row alone), while declaring that no request ever waits (max_wait_calls = 0)."""

    name = "starving"
    max_wait_calls = 0

    def generate(self, target: Any, draft: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kw: Any):  # type: ignore[no-untyped-def]
        outputs = []
        for ids, mask in zip(input_ids, attention_mask):
            row = ids[mask == 1][None]  # [1, L_b], its padding stripped
            outputs += EqSpec().generate(target, draft, row, torch.ones_like(row), **kw)
        return outputs


TWO_BUGS = f"{__name__}:TwoBugs"
STARVING = f"{__name__}:Starving"


# ---------------------------------------------------------------------------------------
# Pass and fail


def test_reference_decoder_passes_the_gate(tmp_path: Path) -> None:
    """EqSpec on the transparent model: exit 0, one passing testcase with its exact-row count and
    every registry check's status."""
    assert gate(tmp_path, "--decoder", EQSPEC, "--examples", "3") == 0
    (case,) = junit_cases(tmp_path)
    assert case.get("classname") == f"specaudit.{EQSPEC}" and case.get("name") == "transparent"
    assert case.find("failure") is None and case.find("skipped") is None
    p = props(case)
    assert p["cases"] == "3" and p["exact_match"] == "1" and p["signature"] == ""
    statuses = check_statuses(case)
    assert list(statuses) == list(BATCH_ORDER)
    assert statuses["I2"] == statuses["liveness"] == "pass"  # EqSpec declares max_wait_calls = 0
    assert set(statuses.values()) <= {"pass", "n/a"}
    assert not (tmp_path / "repro").exists()


def test_planted_bug_fails_the_gate(tmp_path: Path) -> None:
    """A planted bug: exit 1, a JUnit failure with check and signature, a reproducer and a regression test."""
    assert gate(tmp_path, "--decoder", MUTANT, "--examples", "3") == 1
    (case,) = junit_cases(tmp_path)
    failure = case.find("failure")
    assert failure is not None and failure.get("type") == "I2"
    assert "[I2: attends-wrong-slot]" in failure.get("message", "") and "bonus" in (failure.text or "")
    p = props(case)
    assert (p["first_check"], p["signature"]) == ("I2", "bonus") and check_statuses(case)["I2"] == "fail"
    written = sorted(path.name for path in (tmp_path / "repro").iterdir())
    assert written == [
        "specaudit_reference_mutants_rejected_kv_attended_transparent.json",
        "test_regression_specaudit_reference_mutants_rejected_kv_attended_transparent.py",
    ]
    assert "reproducer written to" in (case.findtext("system-out") or "")
    assert Case.load(tmp_path / "repro" / written[0]).batch_size <= 2


def test_starving_scheduler_fails_the_gate(tmp_path: Path) -> None:
    """A decoder whose outputs are right but which serves one request at a time while declaring
    max_wait_calls = 0 fails the gate on liveness. Seed 2's second case has two rows, the least that
    shows the wait, so the search fails at once and shrinks little (10 examples spent minutes
    shrinking a wide case of a decoder that runs row by row)."""
    assert gate(tmp_path, "--decoder", STARVING, "--examples", "2", "--seed", "2") == 1
    (case,) = junit_cases(tmp_path)
    failure = case.find("failure")
    assert failure is not None and failure.get("type") == "liveness", failure.get("message")
    statuses = check_statuses(case)
    assert statuses["liveness"] == "fail"
    assert statuses["equivalence"] == statuses["I2"] == "pass"  # every output is right


# ---------------------------------------------------------------------------------------
# Known failures


def test_known_failure_is_reported_not_fatal(tmp_path: Path) -> None:
    """A planted bug whose failures are all listed passes the gate as a known failure (a skipped
    testcase of type xfail, its checks marked xfail), and leaves no reproducer."""
    xfails = xfails_file(tmp_path, f"{MUTANT}  transparent  *  *   # fixed upstream, not released yet")
    assert gate(tmp_path, "--decoder", MUTANT, "--examples", "5", "--xfails", xfails) == 0
    (case,) = junit_cases(tmp_path)
    assert case.find("failure") is None
    skipped = case.find("skipped")
    assert (
        skipped is not None and skipped.get("type") == "xfail" and "I2 attends-wrong-slot" in skipped.get("message", "")
    )
    assert check_statuses(case)["I2"] == "xfail" and props(case)["cases"] == "5"  # the search went on past it
    root = ET.parse(tmp_path / "junit.xml").getroot()
    assert (root.get("failures"), root.get("skipped")) == ("0", "1")
    assert not (tmp_path / "repro").exists()


@pytest.mark.slow
def test_new_failure_is_not_hidden_by_a_known_one(tmp_path: Path) -> None:
    """With the contract break listed as known, the search goes past the single-row cases that
    show it, finds the I2 bug of the batches and fails the gate on it; shrinking keeps the new
    failure (2 rows: a single row would only show the known one)."""
    xfails = xfails_file(tmp_path, f"{TWO_BUGS} transparent contract generate-returns")
    assert gate(tmp_path, "--decoder", TWO_BUGS, "--examples", "10", "--seed", "4", "--xfails", xfails) == 1
    (case,) = junit_cases(tmp_path)
    failure = case.find("failure")
    assert failure is not None and failure.get("type") == "I2", failure.get("message")
    statuses = check_statuses(case)
    assert statuses["contract"] == "xfail" and statuses["I2"] == "fail"
    (reproducer,) = (tmp_path / "repro").glob("*.json")
    assert Case.load(reproducer).batch_size == 2


def test_min_exact_match_bites_through_known_failures(tmp_path: Path) -> None:
    """In float64 a row passing every check is exact, so the exact-row rate drops only through
    known failures: a listed bug passes the gate at --min-exact-match 0 and fails a threshold
    above its measured rate."""
    xfails = xfails_file(tmp_path, "*:bonus_from_draft * * *")
    assert gate(tmp_path, "--decoder", BONUS, "--examples", "5", "--xfails", xfails) == 0
    (case,) = junit_cases(tmp_path)
    exact, rows = map(int, props(case)["exact_rows"].split("/"))
    assert rows > 0 and exact / rows < 0.9 and case.find("skipped") is not None
    assert gate(tmp_path, "--decoder", BONUS, "--examples", "5", "--xfails", xfails, "--min-exact-match", "0.9") == 1
    (case,) = junit_cases(tmp_path)
    failure = case.find("failure")
    assert failure is not None and failure.get("type") == "threshold"
    assert f"({exact}/{rows}) is below --min-exact-match 0.9" in failure.get("message", "")


# ---------------------------------------------------------------------------------------
# Worker processes (--jobs)


TIMINGS = {"tokens_per_second", "instrumentation_overhead"}
"""The testcase properties that one run measures in time: they differ between any two runs."""


def gate_outcome(tmp_path: Path, jobs: int, capsys: pytest.CaptureFixture[str]) -> tuple[Any, ...]:
    """A small gate (a passing decoder, a failing one, a known failure; one entry of --xfails
    stale) on `jobs` workers: its exit status, every testcase's name, outcome and properties but
    the timings, the summary and stale-entry lines, and every reproducer's text."""
    xfails = xfails_file(tmp_path, "*:bonus_from_draft * * *", f"{EQSPEC} transparent I1 *   # never met")
    argv = ("--decoder", EQSPEC, "--decoder", MUTANT, "--decoder", BONUS, "--examples", "3", "--xfails", xfails)
    status = gate(tmp_path, *argv, "--jobs", str(jobs))
    cases = [
        (
            case.get("classname"),
            case.get("name"),
            [(e.tag, e.get("type"), e.get("message")) for e in case if e.tag in ("failure", "skipped")],
            {k: v for k, v in props(case).items() if k not in TIMINGS},
        )
        for case in junit_cases(tmp_path)
    ]
    out = capsys.readouterr().out.replace(str(tmp_path), "DIR")
    lines = [line for line in out.splitlines() if "gate " in line or "matched no failure" in line]
    files = {path.name: path.read_text() for path in sorted((tmp_path / "repro").iterdir())}
    return status, cases, lines, files


@pytest.mark.slow
def test_verdicts_do_not_depend_on_the_number_of_workers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--jobs 2 runs the searches in worker processes through the audit's `run_items`: the same
    exit status, testcases in plan order with the same verdicts, first checks and signatures, the
    same reproducers, and the known-failure entry a worker matched is not reported stale."""
    (tmp_path / "one").mkdir(), (tmp_path / "two").mkdir()
    serial = gate_outcome(tmp_path / "one", 1, capsys)
    parallel = gate_outcome(tmp_path / "two", 2, capsys)
    assert serial[0] == parallel[0] == 1
    assert serial[1] == parallel[1]
    outcomes = [(c[0], c[2][0][:2] if c[2] else None, c[3]["first_check"], c[3]["signature"]) for c in serial[1]]
    assert outcomes == [
        (f"specaudit.{EQSPEC}", None, "", ""),
        (f"specaudit.{MUTANT}", ("failure", "I2"), "I2", "bonus"),  # shrunk to one row
        (f"specaudit.{BONUS}", ("skipped", "xfail"), "", ""),  # its failures are known: the search went on
    ]
    summary = "1 passed, 1 known failure(s), 1 failed: gate FAILED"
    stale = f"DIR/xfails.txt:3: entry matched no failure ({EQSPEC} transparent I1 *)"  # line 2: met in a worker
    assert serial[2] == parallel[2] == [summary, stale]
    assert serial[3] == parallel[3] and len(serial[3]) == 2, sorted(serial[3])


def test_xfails_file_format(tmp_path: Path) -> None:
    """Four whitespace-separated fields, `#` comments, blank lines, and `*` anywhere in a field."""
    path = tmp_path / "known.txt"
    path.write_text(
        "# decoder model check rule\n\n"
        "specaudit.reference.mutants:* transparent I2 attends-*  # all mutants\n"
        "mypkg:Dec\tllama\t*\t*\n"
    )
    known = load_xfails(path)
    assert len(known) == 2 and known.entries[1].source == f"{path}:4"
    assert known.matches("specaudit.reference.mutants:pads_attended", "transparent", "I2", "attends-wrong-slot")
    assert not known.matches("specaudit.reference.mutants:pads_attended", "transparent", "I1", "attends-wrong-slot")
    assert not known.matches("specaudit.reference.mutants:pads_attended", "llama", "I2", "attends-wrong-slot")
    assert known.matches("mypkg:Dec", "llama", "liveness", "bounded-wait")
    assert not known.matches("mypkg:Dec2", "llama", "liveness", "bounded-wait")  # a field matches whole
    assert not known.matches("mypkg:De", "llama", "liveness", "bounded-wait")
    assert not known.matches("mypkg?Dec", "llama", "liveness", "bounded-wait")  # only `*` is special


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("a b c\n", ":1: got 3 field(s)"),
        ("# ok\na b c d e\n", ":2: got 5 field(s)"),
        (None, "cannot read known-failures file"),
    ],
)
def test_malformed_xfails_file_is_a_usage_error(tmp_path: Path, content: str | None, message: str) -> None:
    """A malformed line is a UsageError naming file:line; a missing file says it cannot be read."""
    path = tmp_path / "known.txt"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_xfails(path)


# ---------------------------------------------------------------------------------------
# Usage errors


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--models", "transparent,gpt7"), "unknown model(s) gpt7"),
        (("--examples", "0"), "--examples must be at least 1"),
        (("--min-exact-match", "1.5"), "--min-exact-match must be between 0 and 1"),
        (("--decoder", "specaudit.reference.nosuchmodule:X"), "not found"),
        (("--xfails", "XFAILS"), "xfails.txt:2: got 2 field(s)"),
        (("--jobs", "0"), "--jobs must be at least 1, got 0"),
    ],
)
def test_usage_errors_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    """Bad flags: exit 2, one line on stderr, nothing run and no JUnit written."""
    argv = tuple(xfails_file(tmp_path, "a b") if a == "XFAILS" else a for a in argv)
    assert gate(tmp_path, *argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specaudit: error: ") and message in err
    assert not (tmp_path / "junit.xml").exists()
