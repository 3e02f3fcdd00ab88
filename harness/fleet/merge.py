"""`specaudit merge DIR...`: the shards of one plan joined into one report and one exit status.

Each DIR is one shard's output (`specaudit audit --shard i/n --out DIR`, `specaudit gate --shard
i/n --out DIR --junit DIR/junit.xml`): its report.json names the shard, the whole plan's cells and
its own (`specaudit.audits.plan.shard_record`). The merge refuses, before writing anything, a set
of shards that is not one complete run of one plan:

- a DIR without report.json: a shard that was killed or never finished (the report is written
  last, so a half-run shard has none);
- a report without a shard record, of another command, plan or budget (`digest`);
- a shard missing from 1..N, or given twice; a shard whose cells are not the ones the stable hash
  gives it, or whose entries do not match its cells one for one.

That is exit 2 with what is wrong, never a pass. Otherwise it writes OUT/report.json (the entries
in the plan's order, as one unsharded run writes them), the reproducers (every shard's files
but its report and JUnit, at the same relative paths), and for the gate one JUnit XML with every
shard's testcases in plan order; exit 1 when any shard failed (its exit status), else 0.
"""

from __future__ import annotations

import filecmp
import shutil
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specaudit.artifacts.junit import write_junit
from specaudit.artifacts.report import load_report, write_report
from specaudit.config.shards import shard_of
from specaudit.contracts.errors import UsageError

REPORT = "report.json"


@dataclass(frozen=True)
class ShardRun:
    """One shard's output directory and what its report says."""

    directory: Path
    report: dict[str, Any]

    @property
    def record(self) -> dict[str, Any]:
        return self.report["shard"]

    @property
    def name(self) -> str:
        return f"shard {self.record['index']}/{self.record['count']} ({self.directory})"

    @property
    def junit(self) -> Path | None:
        """Its JUnit XML (the gate's), relative paths read from its directory."""
        where = self.report.get("junit")
        return None if where is None else self.directory / where


def read_shard(directory: Path) -> ShardRun:
    """DIR's report, which must be a finished shard's."""
    path = Path(directory) / REPORT
    if not path.is_file():
        raise UsageError(
            f"{directory}: no {REPORT}: that shard did not finish (killed, failed to start, or still running); "
            "a missing shard fails the merge"
        )
    report = load_report(path)
    record = report.get("shard")
    if not isinstance(record, dict) or not {"index", "count", "plan", "cells", "digest"} <= record.keys():
        raise UsageError(f"{path}: not a shard's report (run the audit or the gate with --shard I/N)")
    if report.get("exit") not in (0, 1):
        raise UsageError(f"{path}: no exit status in the report; expected 0 or 1, found {report.get('exit')!r}")
    return ShardRun(Path(directory), report)


def check_complete(runs: list[ShardRun]) -> None:
    """The shards are every shard of one plan, once each, each with its own cells and entries."""
    first = runs[0]
    for run in runs[1:]:
        if run.report["command"] != first.report["command"]:
            commands = f"{run.report['command']} vs {first.report['command']}"
            raise UsageError(f"{run.name} and {first.name} are reports of different commands ({commands})")
        for key in ("count", "digest"):
            if run.record[key] != first.record[key]:
                raise UsageError(
                    f"{run.name} ran another plan than {first.name} ({key} {run.record[key]} vs "
                    f"{first.record[key]}): shards must share --examples, --seed, --models and subjects"
                )
    count = first.record["count"]
    indices = [run.record["index"] for run in runs]
    twice = sorted({i for i in indices if indices.count(i) > 1})
    if twice:
        raise UsageError(f"shard(s) {', '.join(f'{i}/{count}' for i in twice)} given more than once")
    missing = [i for i in range(1, count + 1) if i not in indices]
    if missing:
        raise UsageError(
            f"shard(s) {', '.join(f'{i}/{count}' for i in missing)} missing: {len(runs)} of {count} given; "
            "a missing shard fails the merge"
        )
    for run in runs:
        check_cells(run)


def check_cells(run: ShardRun) -> None:
    """The shard ran exactly the cells the stable hash gives it, one entry per cell."""
    record, entries = run.record, run.report["entries"]
    expected = [cell for cell in record["plan"] if shard_of(cell, record["count"]) == record["index"]]
    if record["cells"] != expected:
        raise UsageError(
            f"{run.name}: its cells are not the ones its index gives ({len(record['cells'])} cells, "
            f"expected {len(expected)}): was it run with another plan or another specaudit?"
        )
    if len(entries) != len(expected):
        raise UsageError(f"{run.name}: {len(entries)} entries for its {len(expected)} cells: the report is incomplete")


def merged_entries(runs: list[ShardRun]) -> list[dict[str, Any]]:
    """Every shard's entries, in the plan's order."""
    by_cell = {cell: e for run in runs for cell, e in zip(run.record["cells"], run.report["entries"])}
    return [by_cell[cell] for cell in runs[0].record["plan"]]


def copy_reproducers(runs: list[ShardRun], out: Path) -> list[Path]:
    """Every shard's files but its report and JUnit, at the same relative paths under OUT; two
    shards writing one path with different contents is an error (cells are disjoint)."""
    copied = []
    for run in runs:
        skip = {(run.directory / REPORT).resolve(), *([run.junit.resolve()] if run.junit else [])}
        for path in sorted(p for p in run.directory.rglob("*") if p.is_file() and p.resolve() not in skip):
            target = out / path.relative_to(run.directory)
            if target.exists() and not filecmp.cmp(path, target, shallow=False):
                raise UsageError(f"{run.name}: {path.name} differs from another shard's file of that name")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            copied.append(target)
    return copied


# ---------------------------------------------------------------------------------------
# JUnit: every shard's testcases, in plan order


def shard_testcases(run: ShardRun) -> list[tuple[str, ET.Element]]:
    """(cell, testcase) for each testcase of the shard's JUnit: a verdict's testcase opens its
    cell, a decoder's further failure (`MODEL failure N`, a `failure` property) belongs to it."""
    assert run.junit is not None
    if not run.junit.is_file():
        raise UsageError(f"{run.name}: its JUnit {run.junit} is missing; give --junit inside the shard's --out")
    try:
        suite = ET.parse(run.junit).getroot().find("testsuite")
    except ET.ParseError as exc:
        raise UsageError(f"{run.junit}: not readable JUnit XML ({exc})") from None
    if suite is None:
        raise UsageError(f"{run.junit}: no <testsuite>")
    cells, out, cell = iter(run.record["cells"]), [], None
    for case in suite.findall("testcase"):
        further = case.find("properties/property[@name='failure']") is not None
        if not further:
            cell = next(cells, None)
        if cell is None:
            raise UsageError(f"{run.junit}: more testcases than the shard's {len(run.record['cells'])} cells")
        out.append((cell, case))
    return out


def relocated(case: ET.Element, run: ShardRun, out: Path) -> ET.Element:
    """The testcase with its reproducer lines pointing into OUT."""
    text = case.find("system-out")
    if text is not None and text.text:
        lines = []
        for line in text.text.splitlines():
            head, sep, path = line.partition("reproducer written to ")
            if sep:
                p = Path(path)
                try:
                    p = p.resolve().relative_to(run.directory.resolve())
                except ValueError:
                    p = Path(p.name)
                line = f"{head}{sep}{out / p}"
            lines.append(line)
        text.text = "\n".join(lines)
    return case


def merged_junit(runs: list[ShardRun], out: Path) -> ET.ElementTree:
    """One <testsuites> holding one <testsuite>: the first shard's properties and the shard count,
    every testcase in plan order, the counts and time summed again."""
    order = {cell: i for i, cell in enumerate(runs[0].record["plan"])}
    pairs = [(cell, relocated(case, run, out)) for run in runs for cell, case in shard_testcases(run)]
    cases = [case for _, case in sorted(pairs, key=lambda pair: order[pair[0]])]  # stable: a cell's own order kept
    first = ET.parse(runs[0].junit).getroot()
    suite_in = first.find("testsuite")
    assert suite_in is not None
    failures = sum(c.find("failure") is not None for c in cases)
    skipped = sum(c.find("failure") is None and c.find("skipped") is not None for c in cases)
    total = f"{sum(float(c.get('time', '0')) for c in cases):.3f}"
    counts = {"tests": str(len(cases)), "failures": str(failures), "errors": "0", "skipped": str(skipped)}
    root = ET.Element("testsuites", name=first.get("name", "specaudit"), **counts, time=total)
    attrs = {k: v for k, v in suite_in.attrib.items() if k not in counts and k != "time"}
    suite = ET.SubElement(root, "testsuite", **{**attrs, **counts, "time": total})
    props = ET.SubElement(suite, "properties")
    for prop in suite_in.findall("properties/property"):
        ET.SubElement(props, "property", name=prop.get("name", ""), value=prop.get("value", ""))
    ET.SubElement(props, "property", name="shards", value=str(runs[0].record["count"]))
    suite.extend(cases)
    ET.indent(root)
    return ET.ElementTree(root)


# ---------------------------------------------------------------------------------------
# The command


def run_merge(directories: list[Path], out: Path, junit: Path | None = None) -> int:
    """`specaudit merge`: exit 0 when every shard is there and passed, 1 when one failed; an
    incomplete set of shards is a `UsageError` (exit 2) before anything is written."""
    if not directories:
        raise UsageError("merge needs the shards' output directories")
    runs = [read_shard(d) for d in directories]
    check_complete(runs)
    if any(out.resolve() == run.directory.resolve() for run in runs):
        raise UsageError(f"--out {out} is one of the shards' directories; give a new one")
    status = max(run.report["exit"] for run in runs)
    command, count = runs[0].report["command"], runs[0].record["count"]
    copied = copy_reproducers(runs, out)
    entries = merged_entries(runs)
    merged = {"count": count, "plan": runs[0].record["plan"], "digest": runs[0].record["digest"]}
    path = write_report(out, command, entries, merged=merged, exit=status)
    if all(run.junit is not None for run in runs):
        junit = junit or out / "junit.xml"
        write_junit(junit, merged_junit(runs, out))
        print(f"JUnit XML: {junit}")
    failed = [run.name for run in runs if run.report["exit"]]
    print(f"specaudit merge: {count} shard(s) of {len(entries)} cells ({command}): report {path}")
    print(f"{len(copied)} reproducer file(s) under {out}")
    print(f"failed shard(s): {', '.join(failed)}" if failed else "every shard passed")
    return status


__all__ = ["run_merge"]
