"""`specaudit audit --jobs N`: the independent searches run in worker processes, and nothing the
audit prints or writes depends on N but the timings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specaudit.artifacts.tables import short_name
from specaudit.commands.cli import main
from specaudit.contracts.errors import UsageError
from specaudit.search.jobs import default_jobs, run_all

EQSPEC = "specaudit.reference.eqspec:EqSpec"
MUTANT = "specaudit.reference.mutants:rejected_kv_attended"
FREE_LIST = "specaudit.reference.engine_mutants:FreeListOffByOne"
TIMINGS = {"seconds", "tokens_per_second", "outside_models_share", "instrumentation_overhead"}
"""What one run measures in time: it differs between any two runs, whatever N."""


def test_results_come_back_in_item_order() -> None:
    """Started longest first, finished in any order: the results and on_done see every index."""
    seen: list[int] = []
    results = run_all(abs, [-3, 1, -2, 5], 2, lambda i, r: seen.append(i), first=lambda x: x)
    assert results == [3, 1, 2, 5] and sorted(seen) == [0, 1, 2, 3]


def test_default_jobs_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECAUDIT_JOBS", "3")
    assert default_jobs() == 3
    monkeypatch.setenv("SPECAUDIT_JOBS", "many")
    with pytest.raises(UsageError, match="SPECAUDIT_JOBS='many' is not a number of workers; should be an integer"):
        default_jobs()
    monkeypatch.delenv("SPECAUDIT_JOBS")
    assert default_jobs() >= 1


def test_jobs_below_one_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--jobs", "0"]) == 2
    assert "--jobs must be at least 1, got 0" in capsys.readouterr().err


def without_timings(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def audit(out: Path, jobs: int, capsys: pytest.CaptureFixture[str]) -> tuple[list[str], Any, dict[str, str]]:
    """One small audit (a passing and a failing decoder, a failing engine): the order of the
    table's rows, report.json without timings, and every reproducer file's text."""
    argv = ["audit", "--decoder", EQSPEC, "--decoder", MUTANT, "--engine", FREE_LIST, "--models", "transparent"]
    assert main([*argv, "--examples", "5", "--quiet", "--out", str(out), "--jobs", str(jobs)]) == 1
    names = {short_name(spec) for spec in (EQSPEC, MUTANT, FREE_LIST)}
    rows = [
        line.split()[0]
        for line in capsys.readouterr().out.splitlines()
        if line.split()[:1] and line.split()[0] in names
    ]
    report = without_timings(json.loads((out / "report.json").read_text()))
    files = {p.name: p.read_text() for p in sorted((out / "repro").iterdir())}
    return rows, report, files


@pytest.mark.slow
def test_outputs_do_not_depend_on_the_number_of_workers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    serial = audit(tmp_path / "one", 1, capsys)
    parallel = audit(tmp_path / "two", 2, capsys)
    assert serial[0] == parallel[0] and serial[0][:2] == [short_name(EQSPEC), short_name(MUTANT)], serial[0]
    assert serial[1] == parallel[1]
    assert serial[2] == parallel[2] and len(serial[2]) >= 4, sorted(serial[2])
