"""`specaudit gate`: the audit with thresholds, for CI, writing JUnit XML.

For every decoder x model it runs exactly what `specaudit audit` runs (`specaudit.artifacts.audit.audit_model`:
Hypothesis-generated cases, every check, the failing case shrunk and diagnosed), records one
JUnit testcase with every check's status, and applies the thresholds:

  checks          every decoder must pass every check on every model: a violation fails its
                  testcase. Divergences at numerical ties (float32/bfloat16 runs, see
                  DESIGN.md) are not violations.
  --xfails FILE   known failures, one `decoder model check rule` per line (`*` matches
                  anything; see `specaudit.config.xfails`). A violation listed there is reported as
                  a known failure (a skipped testcase of type xfail) and does not fail the
                  gate; the search goes on past it, so a new failure of the same decoder x
                  model still fails the gate. An entry that matched no violation is listed
                  at the end (`file:line: entry matched no failure`); the exit status stays.
  --min-exact-match F
                  the exact-row rate (rows identical to the oracle / rows run) of a testcase
                  must be >= F, in [0, 1]. The built-in models run in float64, where a row
                  that passes every check is exact; so the rate falls below 1 only through
                  known failures, and F bounds how much output a decoder may get wrong
                  while its failures are listed as known.

Each failing testcase leaves its shrunk case in --out as `<decoder>_<model>.json` (a
reproducer) and `test_regression_<decoder>_<model>.py` (see `specaudit.artifacts.reproducer`).

Engines (`--engine MODULE:ATTR`, repeatable; alone it gates the engines only) run through the
engine state machine (`specaudit.search.engine_machine`) with up to --examples runs on each of
--models: one testcase per engine and model (`name="engine-machine[MODEL]"`), failing on the
first broken check unless --xfails lists it under that model. The machine stops at its first
failure, so a known engine failure ends that search. A failing engine leaves its shrunk rule
sequence as `<engine>-<model>-engine.json` (replay with `specaudit replay FILE --engine X`)
and its regression test.

Exit status: 0 when the gate passes, 1 when it fails; bad input is a `UsageError`.
"""

from __future__ import annotations

import json
import socket
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specaudit.artifacts.audit import (
    EngineVerdict,
    Progress,
    Verdict,
    audit_engine,
    audit_model,
    engine_file_name,
    finish_engine,
    format_engine_table,
    format_table,
)
from specaudit.artifacts.reproducer import write_engine_failure, write_failure
from specaudit.config.settings import GateSettings
from specaudit.contracts.decoder import load_decoder
from specaudit.contracts.engine import load_engine
from specaudit.contracts.errors import UsageError
from specaudit.contracts.violation import Violation, render


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


def junit_xml(
    verdicts: list[Verdict],
    settings: GateSettings,
    reproducers: dict[int, list[Path]],
    engines: list[EngineVerdict] | None = None,
    engine_reproducers: dict[int, list[Path]] | None = None,
) -> ET.ElementTree:
    """One <testsuite name="specaudit-gate"> with one <testcase> per decoder x model, then one per engine."""
    engines = engines or []
    failures = [judge(v, settings) for v in verdicts]
    engine_failures = [judge_engine(v, settings) for v in engines]
    failed = sum(f is not None for f in failures + engine_failures)
    skipped = sum(f is None and bool(v.known) for f, v in zip(failures, verdicts))
    skipped += sum(f is None and bool(engine_known(v, settings)) for f, v in zip(engine_failures, engines))
    total = f"{sum(v.seconds for v in verdicts) + sum(v.run.seconds for v in engines):.3f}"
    tests = str(len(verdicts) + len(engines))
    counts = {"tests": tests, "failures": str(failed), "errors": "0", "skipped": str(skipped)}
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
    for i, (e, failure) in enumerate(zip(engines, engine_failures)):
        engine_testcase(suite, e, failure, engine_known(e, settings), (engine_reproducers or {}).get(i, []))
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
    outcome(case, values, failure, known_message(v) if v.known else None, reproducers)


def outcome(
    case: ET.Element, values: dict[str, str], failure: Failure | None, known: str | None, reproducers: list[Path]
) -> None:
    """A testcase's properties, then its failure, or its xfail when only known failures, and reproducers."""
    case_props = ET.SubElement(case, "properties")
    for name, value in values.items():
        ET.SubElement(case_props, "property", name=name, value=value)
    if failure is not None:
        element = ET.SubElement(case, "failure", message=failure.message, type=failure.kind)
        element.text = failure.details
    elif known is not None:
        ET.SubElement(case, "skipped", type="xfail", message=known)
    if reproducers:
        out = ET.SubElement(case, "system-out")
        out.text = "\n".join(f"reproducer written to {path}" for path in reproducers)


def engine_known(v: EngineVerdict, settings: GateSettings) -> list[Violation]:
    """The engine's violations when --xfails lists every one of them (on its model), else []."""
    known = [x for x in v.violations if settings.xfails.matches(v.engine, v.model, x.check, x.rule)]
    return known if v.violations and len(known) == len(v.violations) else []


def judge_engine(v: EngineVerdict, settings: GateSettings) -> Failure | None:
    """Why an engine fails the gate: its first violation, unless all of them are known failures."""
    if v.passed or engine_known(v, settings):
        return None
    first = v.violations[0]
    rules = len(v.reproducer["ops"]) if v.reproducer else 0
    details = f"after {rules} rules:\n{render(v.violations)}\nreproducer: {json.dumps(v.reproducer)}"
    return Failure(first.check, f"{first.check} violated: {first.render()}", details)


def engine_testcase(
    suite: ET.Element, v: EngineVerdict, failure: Failure | None, known: list[Violation], reproducers: list[Path]
) -> None:
    """One engine: the state machine's runs, the admission events and the outcome."""
    case = ET.SubElement(
        suite,
        "testcase",
        classname=f"specaudit.{v.engine}",
        name=f"engine-machine[{v.model}]",
        time=f"{v.run.seconds:.3f}",
    )
    j = v.to_json()
    values = {
        "engine": v.engine,
        "model": v.model,
        "runs": str(v.run.runs),
        "rules": str(v.run.rules),
        "runs_to_failure": "" if j["runs_to_failure"] is None else str(j["runs_to_failure"]),
        "shrunk_rules": "" if j["minimized_rules"] is None else str(j["minimized_rules"]),
        "first_check": j["first_check"] or "",
        "rule": j["rule"] or "",
        "verdict": "pass" if v.passed else "fail",
        **{f"event:{what}": f"{share:.3f}" for what, share in v.run.events.items()},
    }
    message = "known failures: " + ", ".join(sorted({f"{x.check} {x.rule}" for x in known})) if known else None
    outcome(case, values, failure, message, reproducers)


def _number(value: Any) -> str:
    return "" if value is None else f"{value:.4g}"


def check_outputs(settings: GateSettings) -> None:
    if settings.junit.is_dir():
        raise UsageError(f"--junit {settings.junit} is a directory; give a file path")
    if settings.out.exists() and not settings.out.is_dir():
        raise UsageError(f"--out {settings.out} exists and is not a directory")


def write_outputs(
    verdicts: list[Verdict], settings: GateSettings, engines: list[EngineVerdict] | None = None
) -> dict[int, list[Path]]:
    """The reproducers of the failing testcases, then the JUnit XML; returns the reproducers' paths
    (the engines' after the decoders', numbered on)."""
    reproducers: dict[int, list[Path]] = {}
    engine_reproducers: dict[int, list[Path]] = {}
    engines = engines or []
    try:
        for i, v in enumerate(verdicts):
            if v.diagnosis is not None:
                name = f"{v.decoder}-{v.model}"
                reproducers[i] = write_failure(
                    settings.out, name, v.diagnosis, "shrunk by Hypothesis in specaudit gate"
                )
        for i, e in enumerate(engines):
            if e.reproducer is not None:
                engine_reproducers[i] = write_engine_failure(
                    settings.out, engine_file_name(e), e.reproducer, e.violations, "shrunk in specaudit gate"
                )
        tree = junit_xml(verdicts, settings, reproducers, engines, engine_reproducers)
        settings.junit.parent.mkdir(parents=True, exist_ok=True)
        tree.write(settings.junit, encoding="utf-8", xml_declaration=True)
    except OSError as exc:
        raise UsageError(
            f"cannot write the gate's output: {exc.filename or ''} {exc.strerror or exc}".strip()
        ) from None
    return {**reproducers, **{len(verdicts) + i: paths for i, paths in engine_reproducers.items()}}


def decoders_line(settings: GateSettings) -> str:
    if not settings.decoders and settings.engines:
        return "no decoder"
    return f"{len(settings.decoders)} decoder(s) x {len(settings.models)} model(s)"


def run_gate(settings: GateSettings) -> int:
    """`specaudit gate`: exit 0 when every testcase passes or fails only in known ways, else 1."""
    check_outputs(settings)
    for spec in settings.decoders:
        load_decoder(spec)  # an unloadable decoder is a usage error before anything runs
    for spec in settings.engines:
        load_engine(spec)
    engines_line = f", {len(settings.engines)} engine(s) through the engine state machine" if settings.engines else ""
    print(
        f"specaudit gate: {decoders_line(settings)}{engines_line}, "
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
    engines = []
    plan = [(spec, model) for spec in settings.engines for model in settings.models]
    for i, (spec, model) in enumerate(plan, 1):
        engines.append(audit_engine(spec, settings.examples, settings.seed, model=model))
        finish_engine(engines[-1], i, len(plan), settings.quiet)
    if verdicts:
        print(format_table(verdicts))
    if engines:
        print(("\n" if verdicts else "") + format_engine_table(engines))
    reproducers = write_outputs(verdicts, settings, engines)
    failures = [judge(v, settings) for v in verdicts]
    for v, failure in zip(verdicts, failures):
        if failure is not None and failure.kind == "threshold":
            print(f"{v.decoder} on {v.model}: {failure.message}")
    engine_failures = [judge_engine(e, settings) for e in engines]
    failed = sum(f is not None for f in failures + engine_failures)
    known = sum(f is None and bool(v.known) for f, v in zip(failures, verdicts))
    known += sum(f is None and bool(engine_known(e, settings)) for f, e in zip(engine_failures, engines))
    print(
        f"\n{len(verdicts) + len(engines) - failed - known} passed, {known} known failure(s), {failed} failed: "
        f"gate {'FAILED' if failed else 'PASSED'}"
    )
    print(f"JUnit XML: {settings.junit}")
    for paths in reproducers.values():
        for path in paths:
            print(f"reproducer: {path}")
    for line in settings.xfails.unused_lines():  # stale or too narrow entries: told, not fatal
        print(line)
    return 1 if failed else 0
