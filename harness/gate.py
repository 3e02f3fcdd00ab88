"""`specaudit gate`: the audit with thresholds, for CI, writing JUnit XML.

For every decoder x model it runs exactly what `specaudit audit` runs (`specaudit.audit.audit_model`:
Hypothesis-generated cases, every check, the failing case shrunk and diagnosed), records one
JUnit testcase with every check's status, and applies the thresholds:

  checks          every decoder must pass every check on every model: a violation fails its
                  testcase. Divergences at numerical ties (float32/bfloat16 runs, see
                  DESIGN.md) are not violations.
  --xfails FILE   known failures, one `decoder model check rule` per line (`*` matches
                  anything; see `specaudit.xfails`). A violation listed there is reported as
                  a known failure (a skipped testcase of type xfail) and does not fail the
                  gate; the search goes on past it, so a new failure of the same decoder x
                  model still fails the gate.
  --min-exact-match F
                  the exact-row rate (rows identical to the oracle / rows run) of a testcase
                  must be >= F, in [0, 1]. The built-in models run in float64, where a row
                  that passes every check is exact; so the rate falls below 1 only through
                  known failures, and F bounds how much output a decoder may get wrong
                  while its failures are listed as known.

Each failing testcase leaves its shrunk case in --out as `<decoder>_<model>.json` (a
reproducer) and `test_regression_<decoder>_<model>.py` (see `specaudit.reproducer`).

Exit status: 0 when the gate passes, 1 when it fails; bad input is a `UsageError`.
"""

from __future__ import annotations

import socket
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specaudit.audit import Progress, Verdict, audit_model, format_table
from specaudit.contract import load_decoder
from specaudit.errors import UsageError
from specaudit.reproducer import write_failure
from specaudit.settings import GateSettings
from specaudit.violation import Violation


@dataclass(frozen=True)
class Failure:
    """Why a testcase fails the gate: the JUnit failure's type, message and body."""

    kind: str
    message: str
    details: str


def describe(settings: GateSettings) -> str:
    known = f"{len(settings.xfails)} known failure entr{'y' if len(settings.xfails) == 1 else 'ies'}"
    return f"every check must pass except {known}; exact-row rate >= {settings.min_exact_match:g}"


def new_violations(verdict: Verdict, settings: GateSettings) -> list[Violation]:
    """The diagnosed case's violations that no --xfails entry covers."""
    if verdict.diagnosis is None:
        return []
    return [
        v
        for v in verdict.diagnosis.violations
        if not settings.xfails.matches(verdict.decoder, verdict.model, v.check, v.rule)
    ]


def judge(verdict: Verdict, settings: GateSettings) -> Failure | None:
    """Why `verdict` fails the gate, or None when it passes (known failures included)."""
    d = verdict.diagnosis
    if d is not None:
        new = new_violations(verdict, settings)
        first = new[0] if new else d.first
        check = first.check if first else d.first_check
        message = f"{check} violated ({d.signature}): {first.render() if first else d.reason}"
        return Failure(check or "failure", message, d.render())
    rate = verdict.exact_match
    if rate is not None and rate < settings.min_exact_match:
        message = (
            f"exact-row rate {rate:.3f} ({verdict.exact_rows}/{verdict.rows}) is below "
            f"--min-exact-match {settings.min_exact_match:g}"
        )
        return Failure("threshold", message, message)
    return None


def known_message(verdict: Verdict) -> str:
    return "known failures: " + ", ".join(f"{check} {rule}" for check, rule in sorted(verdict.known))


def junit_xml(verdicts: list[Verdict], settings: GateSettings, reproducers: dict[int, list[Path]]) -> ET.ElementTree:
    """One <testsuite name="specaudit-gate"> with one <testcase> per decoder x model."""
    failures = [judge(v, settings) for v in verdicts]
    failed = sum(f is not None for f in failures)
    skipped = sum(f is None and bool(v.known) for f, v in zip(failures, verdicts))
    total = f"{sum(v.seconds for v in verdicts):.3f}"
    counts = {"tests": str(len(verdicts)), "failures": str(failed), "errors": "0", "skipped": str(skipped)}
    suites = ET.Element("testsuites", name="specaudit gate", **counts, time=total)
    suite = ET.SubElement(
        suites,
        "testsuite",
        name="specaudit-gate",
        **counts,
        time=total,
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"),
        hostname=socket.gethostname(),
    )
    props = ET.SubElement(suite, "properties")
    suite_props = {
        "examples": str(settings.examples),
        "seed": str(settings.seed),
        "models": ",".join(settings.models),
        "thresholds": describe(settings),
    }
    for name, value in suite_props.items():
        ET.SubElement(props, "property", name=name, value=value)
    for i, (v, failure) in enumerate(zip(verdicts, failures)):
        testcase(suite, v, failure, reproducers.get(i, []))
    ET.indent(suites)
    return ET.ElementTree(suites)


def testcase(suite: ET.Element, v: Verdict, failure: Failure | None, reproducers: list[Path]) -> None:
    """One decoder x model: its measurements and check statuses as properties, then its outcome."""
    case = ET.SubElement(suite, "testcase", classname=f"specaudit.{v.decoder}", name=v.model, time=f"{v.seconds:.3f}")
    d = v.diagnosis
    measured = v.to_json()
    values = {
        "decoder": v.decoder,
        "model": v.model,
        "cases": str(v.examples),
        "exact_rows": f"{v.exact_rows}/{v.rows}",
        "exact_match": _number(measured["exact_match"]),
        "partial_match": _number(measured["partial_match"]),
        "tokens_per_second": _number(measured["tokens_per_second"]),
        "instrumentation_overhead": _number(measured["instrumentation_overhead"]),
        "first_check": (d.first_check or "") if d else "",
        "signature": (d.signature or "") if d else "",
        "verdict": d.verdict if d else "pass",
        **{f"check:{check}": status for check, status in v.checks.items()},
    }
    case_props = ET.SubElement(case, "properties")
    for name, value in values.items():
        ET.SubElement(case_props, "property", name=name, value=value)
    if failure is not None:
        element = ET.SubElement(case, "failure", message=failure.message, type=failure.kind)
        element.text = failure.details
    elif v.known:
        ET.SubElement(case, "skipped", type="xfail", message=known_message(v))
    if reproducers:
        out = ET.SubElement(case, "system-out")
        out.text = "\n".join(f"reproducer written to {path}" for path in reproducers)


def _number(value: Any) -> str:
    return "" if value is None else f"{value:.4g}"


def check_outputs(settings: GateSettings) -> None:
    if settings.junit.is_dir():
        raise UsageError(f"--junit {settings.junit} is a directory; give a file path")
    if settings.out.exists() and not settings.out.is_dir():
        raise UsageError(f"--out {settings.out} exists and is not a directory")


def write_outputs(verdicts: list[Verdict], settings: GateSettings) -> dict[int, list[Path]]:
    """The reproducers of the failing testcases, then the JUnit XML; returns the reproducers' paths."""
    reproducers: dict[int, list[Path]] = {}
    try:
        for i, v in enumerate(verdicts):
            if v.diagnosis is not None:
                name = f"{v.decoder}-{v.model}"
                reproducers[i] = write_failure(
                    settings.out, name, v.diagnosis, "shrunk by Hypothesis in specaudit gate"
                )
        tree = junit_xml(verdicts, settings, reproducers)
        settings.junit.parent.mkdir(parents=True, exist_ok=True)
        tree.write(settings.junit, encoding="utf-8", xml_declaration=True)
    except OSError as exc:
        raise UsageError(
            f"cannot write the gate's output: {exc.filename or ''} {exc.strerror or exc}".strip()
        ) from None
    return reproducers


def run_gate(settings: GateSettings) -> int:
    """`specaudit gate`: exit 0 when every testcase passes or fails only in known ways, else 1."""
    check_outputs(settings)
    for spec in settings.decoders:
        load_decoder(spec)  # an unloadable decoder is a usage error before anything runs
    print(
        f"specaudit gate: {len(settings.decoders)} decoder(s) x {len(settings.models)} model(s), "
        f"{settings.examples} cases each, seed {settings.seed}\n  thresholds: {describe(settings)}"
    )
    progress = Progress(len(settings.decoders) * len(settings.models), enabled=not settings.quiet)
    verdicts = []
    for spec in settings.decoders:
        for model in settings.models:
            verdict = audit_model(
                spec, model, settings.examples, settings.seed, progress=progress, known=settings.xfails
            )
            progress.finish_item(verdict)
            verdicts.append(verdict)
    print(format_table(verdicts))
    reproducers = write_outputs(verdicts, settings)
    failures = [judge(v, settings) for v in verdicts]
    for v, failure in zip(verdicts, failures):
        if failure is not None and failure.kind == "threshold":
            print(f"{v.decoder} on {v.model}: {failure.message}")
    failed = sum(f is not None for f in failures)
    known = sum(f is None and bool(v.known) for f, v in zip(failures, verdicts))
    print(
        f"\n{len(verdicts) - failed - known} passed, {known} known failure(s), {failed} failed: "
        f"gate {'FAILED' if failed else 'PASSED'}"
    )
    print(f"JUnit XML: {settings.junit}")
    for paths in reproducers.values():
        for path in paths:
            print(f"reproducer: {path}")
    return 1 if failed else 0
