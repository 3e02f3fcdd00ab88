"""One plan run whole, in four shards merged, and as Ray tasks: the same verdicts, cases, JUnit
testcases and reproducers; a shard killed midway makes the merge fail."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from specaudit.artifacts.report import load_report
from specaudit.commands.cli import main
from specaudit.config.shards import shard_of

pytestmark = pytest.mark.slow

DECODERS = (
    "specaudit.reference.eqspec:EqSpec",  # passes: shard 2 of 4
    "specaudit.reference.mutants:BonusFromDraft",  # fails the gate: shard 3 of 4
    "specaudit.reference.mutants:PositionsFromArange",  # fails the gate: shard 4 of 4 (shard 1 is empty)
)
TIMINGS = {"seconds", "tokens_per_second", "outside_models_share", "instrumentation_overhead"}
TIMINGS |= {"instrumentation_overhead_basis"}


def gate(out: Path, *extra: str) -> int:
    args = ["gate", "--models", "transparent", "--examples", "2", "--quiet", "--jobs", "1"]
    args += [a for spec in DECODERS for a in ("--decoder", spec)]
    return main([*args, "--out", str(out), "--junit", str(out / "junit.xml"), *extra])


def verdicts(directory: Path) -> list[dict]:
    """The report's entries without their timings."""
    return [{k: v for k, v in e.items() if k not in TIMINGS} for e in load_report(directory / "report.json")["entries"]]


def junit_cases(junit: Path) -> list[tuple]:
    """Each testcase's name, failure and properties but its timings."""
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        failure = case.find("failure")
        props = {p.get("name"): p.get("value") for p in case.iter("property") if p.get("name") not in TIMINGS}
        what = None if failure is None else (failure.get("type"), failure.get("message"))
        out.append((case.get("classname"), case.get("name"), what, sorted(props.items())))
    return out


def reproducers(directory: Path) -> dict[str, str]:
    skip = {"report.json", "junit.xml"}
    return {
        str(p.relative_to(directory)): p.read_text() for p in directory.rglob("*") if p.is_file() and p.name not in skip
    }


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    out = tmp_path_factory.mktemp("whole")
    return out, gate(out, "--shard", "1/1")


def test_the_chosen_plan_spreads_over_the_shards() -> None:
    """The plan below puts one cell in each of shards 2, 3 and 4 and none in shard 1 (an empty
    shard must still report, or the merge would call it missing)."""
    assert [shard_of(f"decoder:{spec}@transparent", 4) for spec in DECODERS] == [2, 3, 4]


def test_four_shards_merged_equal_the_whole_run(whole: tuple[Path, int], tmp_path: Path) -> None:
    """The merge of four shards has the whole run's exit status, entries, testcases and reproducers."""
    out, status = whole
    assert status == 1  # two planted bugs fail the gate
    shards = [tmp_path / f"shard{i}" for i in range(1, 5)]
    assert [gate(d, "--shard", f"{i}/4") for i, d in enumerate(shards, start=1)] == [0, 0, 1, 1]
    merged = tmp_path / "merged"
    assert main(["merge", *map(str, shards), "--out", str(merged)]) == status
    assert verdicts(merged) == verdicts(out)
    assert junit_cases(merged / "junit.xml") == junit_cases(out / "junit.xml")
    assert reproducers(merged) == reproducers(out)
    assert len(reproducers(out)) == 4  # each failing decoder: its reproducer and regression test


def test_a_shard_killed_midway_fails_the_merge(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Shard 3 killed while it runs again over its finished report of an earlier run leaves no
    report (a stale one is removed at the start): `merge` exits 2 naming it, writes nothing."""
    for i in (1, 2, 3, 4):
        gate(tmp_path / f"shard{i}", "--shard", f"{i}/4")
    killed = tmp_path / "shard3"
    args = [sys.executable, "-m", "specaudit", "gate", "--models", "transparent", "--examples", "2", "--jobs", "1"]
    args += [a for spec in DECODERS for a in ("--decoder", spec)]
    args += ["--shard", "3/4", "--out", str(killed), "--junit", str(killed / "junit.xml")]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert process.stdout is not None
    for line in process.stdout:  # its headline: the shard's search has started
        if "shard 3/4" in line:
            break
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    capsys.readouterr()
    dirs = [tmp_path / f"shard{i}" for i in range(1, 5)]
    assert main(["merge", *map(str, dirs), "--out", str(tmp_path / "merged")]) == 2
    assert "shard3: no report.json: that shard did not finish" in capsys.readouterr().err
    assert not (tmp_path / "merged").exists()


def test_ray_tasks_equal_the_whole_run(whole: tuple[Path, int], tmp_path: Path) -> None:
    """The plan's cells as tasks on a local Ray (CPU) give the whole run's verdicts and files."""
    pytest.importorskip("ray")
    out, status = whole
    ray_out = tmp_path / "ray"
    assert gate(ray_out, "--shard", "1/1", "--ray") == status
    assert verdicts(ray_out) == verdicts(out)
    assert junit_cases(ray_out / "junit.xml") == junit_cases(out / "junit.xml")
    assert reproducers(ray_out) == reproducers(out)
