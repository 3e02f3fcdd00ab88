"""One report.json for every command: an envelope, and one entry per subject judged.

    {"format": "specaudit-report", "version": 1, "command": "audit", "passed": false,
     "entries": [{"kind": "decoder", "subject": {"decoder": ..., "model": ...}, "passed": false,
                  "first": {"check": "I2", "rule": ..., "call": 3, "row": 1, "slot": 7, "request": 1},
                  "signature": "kv-drift", "coverage": {"rounds": 40, "ragged_rounds": 12, ..., "flags": []},
                  ...the kind's own figures}, ...]}

Every entry opens with the same verdict fields, whatever its subject (a decoder on a built-in
model, an engine through the state machine, a real-model batch, a black box, a vLLM server
configuration), so a reader of any command's report finds what passed, where it first went
wrong and what it exercised (`coverage`, `specaudit.checks.coverage`) in one place; the figures
after them are the kind's own. An entry's kind is the `report` of a row of
`specaudit.contracts.subjects.KINDS`, the one table of subject kinds (`subject_kind`); the strings
are the ones reports were always written with. `load_report` reads the files
written before the envelope too (a bare list from `audit`, an object with a `plan` from
`blackbox`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specaudit.checks.coverage import UNMEASURED, Coverage
from specaudit.contracts import subjects
from specaudit.contracts.errors import UsageError
from specaudit.contracts.subjects import SubjectKind
from specaudit.contracts.violation import Violation

REPORT_FORMAT = "specaudit-report"
REPORT_VERSION = 1
KINDS = subjects.REPORT_KINDS
"""Every entry kind (`contracts.subjects.KINDS`' `report`)."""
WHERE = ("call", "row", "slot", "request")
LEVELS = ("pass", "efficiency", "fail")
"""An entry's verdict levels, least to most serious (`specaudit.audits.verdict.LEVELS`)."""


def first_fields(first: Violation | None) -> dict[str, Any] | None:
    """The first violation's check, rule and place (None: nothing broke, or nothing to point at)."""
    if first is None:
        return None
    return {"check": first.check, "rule": first.rule, **{k: getattr(first, k) for k in WHERE}}


def entry(
    kind: str,
    subject: dict[str, Any],
    passed: bool,
    first: Violation | None,
    signature: str | None,
    figures: dict[str, Any],
    coverage: Coverage | dict[str, Any] | None = None,
    level: str | None = None,
) -> dict[str, Any]:
    """One subject's verdict: the shared fields, then the kind's own figures. Every entry has a
    `level` ("pass", "efficiency": only findings of cost, which pass unless made fatal, "fail";
    default: from `passed`) and a `coverage` object (`checks.coverage.Coverage.to_json`: what the
    verdict exercised, and its flags): the one given, else the figures', else one flagged as not measured."""
    assert kind in KINDS, kind
    level = level or ("pass" if passed else "fail")
    assert level in LEVELS, level
    shared = {"kind": kind, "subject": subject, "passed": passed, "level": level, "first": first_fields(first),
              "signature": signature}  # fmt: skip
    shared["coverage"] = coverage_json(coverage if coverage is not None else figures.get("coverage"))
    return {**shared, **{k: v for k, v in figures.items() if k not in shared}}


def coverage_json(coverage: Coverage | dict[str, Any] | None) -> dict[str, Any]:
    if isinstance(coverage, Coverage):
        return coverage.to_json()
    return dict(coverage) if coverage is not None else UNMEASURED.to_json()


def report_document(command: str, entries: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    passed = all(e["passed"] for e in entries)
    return {"format": REPORT_FORMAT, "version": REPORT_VERSION, "command": command, "passed": passed, **extra,
            "entries": entries}  # fmt: skip


def write_report(directory: Path, command: str, entries: list[dict[str, Any]], **extra: Any) -> Path:
    """DIR/report.json; an unwritable DIR is the user's error, in one line."""
    path = Path(directory) / "report.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report_document(command, entries, **extra), indent=1, default=str) + "\n")
    except OSError as exc:
        raise UsageError(f"cannot write to --out {directory}: {exc.strerror or exc}") from None
    return path


def load_report(path: Path) -> dict[str, Any]:
    """A report of any command, as the envelope (an older bare list or black-box object upgraded)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: not a readable report.json ({exc})") from None
    if isinstance(data, dict) and data.get("format") == REPORT_FORMAT:
        return data
    if isinstance(data, list):  # `audit` and the real-model audit before the envelope
        return report_document("audit", [dict(e, passed=legacy_passed(e)) for e in data])
    if isinstance(data, dict) and "plan" in data:  # `blackbox` before the envelope
        return report_document("blackbox", [dict(data, kind=subjects.BLACK_BOX.report)])
    raise UsageError(f"{path}: not a specaudit report.json")


def subject_kind(e: dict[str, Any]) -> SubjectKind:
    """The row of the one table of subject kinds an entry's kind resolves to; UsageError for a kind no row writes."""
    kind = subjects.by_report(str(e.get("kind")))
    if kind is None:
        raise UsageError(f"report entry kind {e.get('kind')!r} is none of {', '.join(KINDS)}")
    return kind


def legacy_passed(old: dict[str, Any]) -> bool:
    """Whether an entry written before the envelope passed: its diagnosis says, or its absence."""
    diagnosis = old.get("diagnosis")
    return bool(diagnosis.get("passed", False)) if isinstance(diagnosis, dict) else diagnosis is None


__all__ = ["REPORT_FORMAT", "entry", "load_report", "report_document", "subject_kind", "write_report"]
