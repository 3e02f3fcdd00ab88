"""`specaudit gate`: the audit with thresholds, for CI, writing JUnit XML.

For every decoder x model it runs exactly what `specaudit audit` runs (`specaudit.audits.decoders.audit_model`:
Hypothesis-generated cases, every check, the failing case shrunk and diagnosed), records one
JUnit testcase with every check's status and what its cases exercised (`coverage.*` properties,
`specaudit.checks.coverage`), and applies the thresholds:

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
reproducer) and `test_regression_<decoder>_<model>.py` (see `specaudit.audits.regression`).
A decoder whose search found several distinct failures (`specaudit.audits.decoders.MAX_FAILURES`)
gets one more failing testcase per failure after the first (`name="MODEL failure N"`), each with
its own reproducer (`..._failureN`).

Engines (`--engine MODULE:ATTR`, repeatable; alone it gates the engines only) run through the
engine state machine (`specaudit.search.engine_machine`) with up to --examples runs on each of
--models: one testcase per engine and model (`name="engine-machine[MODEL]"`), failing on the
first broken check unless --xfails lists it under that model. The machine stops at its first
failure, so a known engine failure ends that search. A failing engine leaves its shrunk rule
sequence as `<engine>-<model>-engine.json` (replay with `specaudit replay FILE --engine X`)
and its regression test.

`--jobs N` runs the searches (each decoder x model, then each engine x model) on N worker
processes, through the audit's own `specaudit.audits.plan.run_items`: default
$SPECAUDIT_JOBS, else one per available core; 1 runs them in this process. Each search is a pure
function of its arguments and the seed, and the results are collected in plan order, so the
verdicts, the testcases and their order, and the reproducers do not depend on N (the timings do).

The subjects are the audit's (`specaudit.audits.plan.SUBJECTS`); the JUnit layout is
`specaudit.artifacts.junit`, the testcases' contents are decided here from each verdict's report entry.

Exit status: 0 when the gate passes, 1 when it fails; bad input is a `UsageError`.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specaudit.artifacts.junit import Failure, Testcase, junit_document, write_junit
from specaudit.artifacts.report import subject_kind, write_report
from specaudit.artifacts.reproducer import identifier
from specaudit.audits.decoders import DecoderVerdict, failure_name
from specaudit.audits.engines import EngineVerdict
from specaudit.audits.plan import SUBJECTS, Item, forget_report, run_items, shard_items, shard_record, tables
from specaudit.audits.verdict import Verdict
from specaudit.checks.diagnosis import Diagnosis
from specaudit.config.settings import GateSettings
from specaudit.contracts import subjects
from specaudit.contracts.errors import UsageError
from specaudit.contracts.violation import render

SUMMARIES = {subjects.DECODER.name: "shrunk by Hypothesis in specaudit gate"}
"""What the regression tests the gate writes say of their case, per kind (else `SUMMARY`)."""
SUMMARY = "shrunk in specaudit gate"


@dataclass(frozen=True)
class Judged:
    """One verdict as the gate judged it, so the testcase and the counts read one decision: its
    report entry (the shared verdict fields, then the kind's figures), why it fails the gate
    (None: it passes) and the (check, rule) of the known failures it met."""

    verdict: Verdict
    entry: dict[str, Any]
    failure: Failure | None
    known: list[tuple[str, str]]
    more: tuple[Failure, ...] = ()  # a decoder's distinct failures after the first, in the order found

    @property
    def skipped(self) -> bool:
        """Passing only through known failures: a JUnit xfail."""
        return self.failure is None and bool(self.known)


def describe(settings: GateSettings) -> str:
    known = f"{len(settings.xfails)} known failure entr{'y' if len(settings.xfails) == 1 else 'ies'}"
    return f"every check must pass except {known}; exact-row rate >= {settings.min_exact_match:g}"


def held_to_gate(v: Verdict, settings: GateSettings) -> Judged:
    """`v` against the thresholds. A failing verdict fails the gate, except an engine whose every
    violation is known (its machine stopped there); a decoder's search already went past its
    known failures, and a passing decoder can still miss --min-exact-match."""
    e, known = v.report_entry(), known_failures(v, settings)
    if isinstance(v, DecoderVerdict):
        failure = below_threshold(v, settings) if e["passed"] else decoder_failure(v, settings)
        return Judged(v, e, failure, known, tuple(diagnosis_failure(d) for d in v.fatal()[1:]))
    assert isinstance(v, EngineVerdict), v
    failure = None if e["passed"] or known else engine_failure(v)
    return Judged(v, e, failure, known)


def known_failures(v: Verdict, settings: GateSettings) -> list[tuple[str, str]]:
    """(check, rule) of the known failures `v` met, sorted: those a decoder's search went past; an
    engine's violations only when --xfails lists every one of them (on its model)."""
    if isinstance(v, DecoderVerdict):
        return sorted(v.known)
    assert isinstance(v, EngineVerdict), v
    listed = [settings.xfails.matches(v.engine, v.model, x.check, x.rule) for x in v.violations]
    return sorted({(x.check, x.rule) for x in v.violations}) if listed and all(listed) else []


def decoder_failure(verdict: DecoderVerdict, settings: GateSettings) -> Failure:
    """A failing decoder's first violation that no --xfails entry covers (else its first), with its
    full diagnosis."""
    d = verdict.fatal()[0]  # a decoder fails exactly when it has a fatal failure (correctness ones first)
    new = [x for x in d.violations if not settings.xfails.matches(verdict.decoder, verdict.model, x.check, x.rule)]
    first = new[0] if new else d.first
    check = first.check if first else d.first_check
    message = f"{check} violated ({d.signature}): {first.render() if first else d.reason}"
    return Failure(check or "failure", message, d.render())


def diagnosis_failure(d: Diagnosis) -> Failure:
    """A further distinct failure of a decoder (one its search found with the first set aside)."""
    first = d.first
    message = f"{d.first_check} violated ({d.signature}): {first.render() if first else d.reason}"
    return Failure(d.first_check or "failure", message, d.render())


def below_threshold(verdict: DecoderVerdict, settings: GateSettings) -> Failure | None:
    """A passing decoder whose exact-row rate is below --min-exact-match, else None."""
    rate = verdict.exact_match
    if rate is None or rate >= settings.min_exact_match:
        return None
    message = (
        f"exact-row rate {rate:.3f} ({verdict.exact_rows}/{verdict.rows}) is below "
        f"--min-exact-match {settings.min_exact_match:g}"
    )
    return Failure("threshold", message, message)


def engine_failure(v: EngineVerdict) -> Failure:
    """A failing engine's first violation and signature, as a decoder's, with its diagnosis, all
    its violations and its shrunk rules."""
    first, d = v.violations[0], v.diagnosis
    rules = len(v.reproducer["ops"]) if v.reproducer else 0
    signature = f" ({d.signature})" if d is not None else ""
    head = f"{d.render()}\n" if d is not None else ""
    details = f"{head}after {rules} rules:\n{render(v.violations)}\nreproducer: {json.dumps(v.reproducer)}"
    return Failure(first.check, f"{first.check} violated{signature}: {first.render()}", details)


# ---------------------------------------------------------------------------------------
# The testcases: one per verdict, one more per further distinct failure of a decoder


def junit_xml(judged: list[Judged], settings: GateSettings, reproducers: list[list[Path]]) -> ET.ElementTree:
    """One <testsuite name="specaudit-gate"> with one <testcase> per verdict (decoders x models, then engines)."""
    suite_props = {
        "examples": str(settings.examples),
        "seed": str(settings.seed),
        "models": ",".join(settings.models),
        "thresholds": describe(settings),
    }
    cases = []
    for j, paths in zip(judged, reproducers):
        cases.append(testcase(j, paths))
        cases += [further_testcase(j, index, failure, paths) for index, failure in enumerate(j.more, start=2)]
    return junit_document("specaudit gate", "specaudit-gate", cases, suite_props)


def testcase(j: Judged, reproducers: list[Path]) -> Testcase:
    """One verdict: the shared verdict fields and the kind's own as properties, then its failure,
    or its xfail when only known failures, and its reproducers."""
    e = j.entry
    spec, model = e["subject"][e["kind"]], e["subject"]["model"]
    name = model if subject_kind(e) is subjects.DECODER else f"engine-machine[{model}]"
    xfail = "known failures: " + ", ".join(f"{check} {rule}" for check, rule in j.known) if j.known else None
    return Testcase(
        f"specaudit.{spec}", name, e["seconds"], properties(j.verdict, e), j.failure, xfail, tuple(reproducers),
        efficiency_notes(j.verdict) if j.failure is None else (),
    )  # fmt: skip


def efficiency_notes(v: Verdict) -> tuple[str, ...]:
    """A passing decoder's efficiency findings (not fatal without --strict-efficiency), one line each."""
    if not isinstance(v, DecoderVerdict) or v.level != "efficiency":
        return ()
    return tuple(f"efficiency finding (not fatal): {d.first_check} violated ({d.signature}): "
                 f"{d.first.render() if d.first else d.reason}" for d in v.diagnoses())  # fmt: skip


def further_testcase(j: Judged, index: int, failure: Failure, reproducers: list[Path]) -> Testcase:
    """A decoder's `index`-th distinct failure as a testcase of its own (`MODEL failure N`): its
    first check, rule and signature as properties, its failure, and its reproducer."""
    e, v = j.entry, j.verdict
    assert isinstance(v, DecoderVerdict), v
    spec, model = e["subject"]["decoder"], e["subject"]["model"]
    d = v.failures[index - 1]
    fields = {"kind": str(subjects.DECODER.report), "decoder": spec, "model": model, "failure": str(index),
              "first_check": d.first_check or "", "rule": d.first.rule if d.first else "",
              "signature": d.signature or "", "verdict": d.verdict}  # fmt: skip
    stem = identifier(failure_name(v, index - 1))
    mine = tuple(p for p in reproducers if p.stem in (stem, f"test_regression_{stem}"))
    return Testcase(f"specaudit.{spec}", f"{model} failure {index}", 0.0, fields, failure, None, mine)


def properties(v: Verdict, e: dict[str, Any]) -> dict[str, str]:
    """The kind and subject, the kind's figures, the shared verdict fields, the kind's statuses
    (a decoder's checks, an engine's admission events), then its coverage."""
    if isinstance(v, DecoderVerdict):  # a failing decoder's verdict tells how its output went wrong ("diverged", ...)
        figures, failed = decoder_figures(v, e), (e["diagnosis"] or {}).get("verdict", "fail")
        statuses = {f"check:{check}": status for check, status in e["checks"].items()}
    else:
        figures, failed = engine_figures(e), "fail"
        statuses = {f"event:{what}": f"{share:.3f}" for what, share in e["events"].items()}
    first = e["first"] or {}
    shared = {
        "first_check": first.get("check") or "",
        "rule": first.get("rule") or "",
        "signature": e["signature"] or "",
        "verdict": ("efficiency" if e.get("level") == "efficiency" else "pass") if e["passed"] else failed,
        "level": e.get("level", "pass" if e["passed"] else "fail"),
    }
    return {"kind": e["kind"], **e["subject"], **figures, **shared, **statuses, **coverage_properties(e)}


def coverage_properties(e: dict[str, Any]) -> dict[str, str]:
    """What the verdict exercised (`coverage.ragged_rounds`, ...; `coverage.flags`: what a pass did
    not exercise, "; "-separated), whether it passed or failed."""
    out = {}
    for key, value in (e.get("coverage") or {}).items():
        if isinstance(value, list):
            text = ("; " if key == "flags" else ",").join(map(str, value))
        else:
            text = "" if value is None else str(value)
        out[f"coverage.{key}"] = text
    return out


def decoder_figures(v: DecoderVerdict, e: dict[str, Any]) -> dict[str, str]:
    """A decoder's measurements (its exact-row count is the verdict's, the rest the entry's figures)."""
    rates = ("exact_match", "partial_match", "tokens_per_second", "instrumentation_overhead")
    return {"cases": str(e["cases"]), "exact_rows": f"{v.exact_rows}/{v.rows}", **{k: _number(e[k]) for k in rates}}


def engine_figures(e: dict[str, Any]) -> dict[str, str]:
    """An engine's measurements, all the entry's figures ("" for a count a passing run lacks)."""
    names = {"runs": "runs", "rules": "rules", "runs_to_failure": "runs_to_failure", "shrunk_rules": "minimized_rules"}
    return {name: "" if e[key] is None else str(e[key]) for name, key in names.items()}


def _number(value: Any) -> str:
    return "" if value is None else f"{value:.4g}"


# ---------------------------------------------------------------------------------------
# The run


def check_outputs(settings: GateSettings) -> None:
    if settings.junit.is_dir():
        raise UsageError(f"--junit {settings.junit} is a directory; give a file path")
    if settings.out.exists() and not settings.out.is_dir():
        raise UsageError(f"--out {settings.out} exists and is not a directory")


def write_outputs(judged: list[Judged], settings: GateSettings) -> list[list[Path]]:
    """The reproducers of the failing testcases, then the JUnit XML; returns each verdict's reproducers."""
    try:
        reproducers = [
            j.verdict.write_reproducers(settings.out, SUMMARIES.get(j.verdict.kind, SUMMARY)) for j in judged
        ]
        write_junit(settings.junit, junit_xml(judged, settings, reproducers))
    except OSError as exc:
        raise UsageError(
            f"cannot write the gate's output: {exc.filename or ''} {exc.strerror or exc}".strip()
        ) from None
    return reproducers


def write_shard_report(judged: list[Judged], settings: GateSettings, record: dict[str, Any], failed: int) -> None:
    """A shard's --out/report.json: its entries (each with whether it fails the gate), its shard
    record, its exit status and where its JUnit is, for `specaudit merge`."""
    entries = [dict(j.entry, gate="fail" if j.failure else "known" if j.skipped else "pass") for j in judged]
    junit = settings.junit.resolve()
    out = settings.out.resolve()
    where = str(junit.relative_to(out)) if junit.is_relative_to(out) else str(junit)
    write_report(settings.out, "gate", entries, shard=record, exit=int(failed > 0), junit=where)


def decoders_line(settings: GateSettings) -> str:
    if not settings.decoders and settings.engines:
        return "no decoder"
    return f"{len(settings.decoders)} decoder(s) x {len(settings.models)} model(s)"


def gate_items(settings: GateSettings) -> list[Item]:
    """The searches in plan order: every kind's (`SUBJECTS`), each with up to --examples cases or runs."""
    return [item for d in SUBJECTS for item in d.gate_plan(settings)]


def run_gate(settings: GateSettings) -> int:
    """`specaudit gate`: exit 0 when every testcase passes or fails only in known ways, else 1."""
    check_outputs(settings)
    plan = gate_items(settings)
    items = shard_items(plan, settings.shard)
    if settings.shard is not None:
        forget_report(settings.out)
    for d in SUBJECTS:
        for spec in dict.fromkeys(item.spec for item in items if item.kind == d.kind):
            d.load(spec)  # an unloadable subject is a usage error before anything runs
    engines_line = f", {len(settings.engines)} engine(s) through the engine state machine" if settings.engines else ""
    print(
        f"specaudit gate: {decoders_line(settings)}{engines_line}, "
        f"{settings.examples} cases each, seed {settings.seed}\n  thresholds: {describe(settings)}",
        flush=True,  # before the workers start
    )
    if settings.shard is not None:
        print(f"  shard {settings.shard}: {len(items)} of the plan's {len(plan)} cells", flush=True)
    verdicts = run_items(items, settings)
    if verdicts:
        print(tables(verdicts))
    judged = [held_to_gate(v, settings) for v in verdicts]
    reproducers = write_outputs(judged, settings)
    for j in judged:
        if j.failure is not None and j.failure.kind == "threshold":
            subject = j.entry["subject"]
            print(f"{subject[j.entry['kind']]} on {subject['model']}: {j.failure.message}")
    failed = sum(j.failure is not None for j in judged)
    known = sum(j.skipped for j in judged)
    if settings.shard is not None:
        write_shard_report(judged, settings, shard_record(plan, settings.shard), failed)
    print(
        f"\n{len(judged) - failed - known} passed, {known} known failure(s), {failed} failed: "
        f"gate {'FAILED' if failed else 'PASSED'}"
    )
    print(f"JUnit XML: {settings.junit}")
    for paths in reproducers:
        for path in paths:
            print(f"reproducer: {path}")
    for line in settings.xfails.unused_lines():  # stale or too narrow entries: told, not fatal
        print(line)
    return 1 if failed else 0
