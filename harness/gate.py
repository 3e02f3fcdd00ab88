"""`specaudit gate`: the audit with thresholds, for CI, writing JUnit XML.

For every decoder x model it runs exactly what `specaudit audit` runs (`specaudit.cli.audit_model`:
Hypothesis-generated cases, every check, the failing case shrunk and diagnosed), records one
JUnit testcase, and applies the thresholds:

  checks          by default every decoder must pass every check (contract, I1, I2,
                  equivalence, token preservation) on every model: a violation fails its
                  testcase. Divergences at numerical ties (float32/bfloat16 runs, see
                  DESIGN.md) are not violations.
  --min-exact-match F
                  the exact-row rate (rows identical to the oracle / rows run) of a testcase
                  must be >= F, in [0, 1]. It matters when ties are allowed: a decoder can pass
                  every check "modulo ties" with few exact rows. Default 0 (no minimum); on
                  the exact models (float64) passing decoders always score 1.
  --max-failures N
                  the gate fails when more than N testcases fail. Default 0: any failure
                  fails the gate.

Each failing testcase leaves its shrunk case in --out as `<decoder>-<model>.json` (a
reproducer) and `test_regression_<decoder>-<model>.py` (see `specaudit minimize`).

Exit status: 0 when the gate passes, 1 when it fails (a decoder under test fails), 2 for usage
errors, each told in one line on stderr.
"""

from __future__ import annotations

import argparse
import socket
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specaudit.cli import Verdict

DEFAULT_JUNIT = Path("specaudit-junit.xml")
DEFAULT_OUT = Path("specaudit-out") / "gate"


@dataclass(frozen=True)
class Thresholds:
    min_exact_match: float = 0.0
    max_failures: int = 0

    def describe(self) -> str:
        return (
            f"every check must pass; exact-row rate >= {self.min_exact_match:g}; "
            f"at most {self.max_failures} failing decoder x model"
        )


def exact_rate(verdict: Verdict) -> float | None:
    return verdict.exact_rows / verdict.rows if verdict.rows else None


def judge(verdict: Verdict, thresholds: Thresholds) -> tuple[str, str, str] | None:
    """Why `verdict` fails the gate, as (type, message, details), or None when it passes."""
    d = verdict.diagnosis
    if d is not None:
        message = f"{d.first_check} violated ({d.signature}): {d.first.render() if d.first else d.reason}"
        return d.first_check or "failure", message, d.render()
    rate = exact_rate(verdict)
    if rate is not None and rate < thresholds.min_exact_match:
        message = (
            f"exact-row rate {rate:.3f} ({verdict.exact_rows}/{verdict.rows}) is below "
            f"--min-exact-match {thresholds.min_exact_match:g}"
        )
        return "threshold", message, message
    return None


def junit_xml(
    verdicts: list[Verdict],
    thresholds: Thresholds,
    reproducers: dict[int, list[Path]],
    properties: dict[str, str],
) -> ET.ElementTree:
    """One <testsuite name="specaudit-gate"> with one <testcase> per decoder x model."""
    verdicts_failed = [v for v in verdicts if judge(v, thresholds) is not None]
    total = sum(v.seconds for v in verdicts)
    suites = ET.Element(
        "testsuites", name="specaudit gate", tests=str(len(verdicts)), failures=str(len(verdicts_failed))
    )
    suites.set("errors", "0")
    suites.set("time", f"{total:.3f}")
    suite = ET.SubElement(
        suites,
        "testsuite",
        name="specaudit-gate",
        tests=str(len(verdicts)),
        failures=str(len(verdicts_failed)),
        errors="0",
        skipped="0",
        time=f"{total:.3f}",
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"),
        hostname=socket.gethostname(),
    )
    props = ET.SubElement(suite, "properties")
    for name, value in {**properties, "thresholds": thresholds.describe()}.items():
        ET.SubElement(props, "property", name=name, value=str(value))
    for i, v in enumerate(verdicts):
        case = ET.SubElement(
            suite, "testcase", classname=f"specaudit.{v.decoder}", name=v.model, time=f"{v.seconds:.3f}"
        )
        d = v.diagnosis
        measured = v.to_json()
        values = {
            "decoder": v.decoder,
            "model": v.model,
            "cases": str(v.examples),
            "exact_rows": f"{v.exact_rows}/{v.rows}",
            "exact_match": _number(measured.get("exact_match")),
            "partial_match": _number(measured.get("partial_match")),
            "tokens_per_second": _number(measured.get("tokens_per_second")),
            "instrumentation_overhead": _number(measured.get("instrumentation_overhead")),
            "first_check": (d.first_check or "") if d else "",
            "signature": (d.signature or "") if d else "",
            "verdict": d.verdict if d else "pass",
        }
        case_props = ET.SubElement(case, "properties")
        for name, value in values.items():
            ET.SubElement(case_props, "property", name=name, value=value)
        failure = judge(v, thresholds)
        if failure is not None:
            kind, message, details = failure
            element = ET.SubElement(case, "failure", message=message, type=kind)
            element.text = details
        if reproducers.get(i):
            out = ET.SubElement(case, "system-out")
            out.text = "\n".join(f"reproducer written to {path}" for path in reproducers[i])
    ET.indent(suites)
    return ET.ElementTree(suites)


def _number(value: Any) -> str:
    return "" if value is None else f"{value:.4g}"


def write_reproducers(verdict: Verdict, out: Path) -> list[Path]:
    """The shrunk failing case as `<decoder>-<model>.json` plus its regression test."""
    from specaudit.minimize import write_minimized

    assert verdict.diagnosis is not None
    name = f"{verdict.decoder}-{verdict.model}"
    return list(write_minimized(out, name, verdict.diagnosis, "shrunk by Hypothesis in specaudit gate"))


def cmd_gate(args: argparse.Namespace) -> int:
    # Imported here, not at module top: specaudit.cli imports this module to add the command.
    from specaudit.cli import Progress, audit_model, format_table, usage_error
    from specaudit.contract import DecoderLoadError, load_decoder
    from specaudit.models import DEFAULT_DECODERS
    from specaudit.models import MODELS as DEFAULT_MODELS

    specs = args.decoder or list(DEFAULT_DECODERS)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in DEFAULT_MODELS]
    if not models:
        return usage_error("--models names no model")
    if unknown:
        return usage_error(f"unknown model(s) {', '.join(unknown)}; built-in models are {', '.join(DEFAULT_MODELS)}")
    if args.examples < 1:
        return usage_error("--examples must be at least 1")
    if not 0.0 <= args.min_exact_match <= 1.0:
        return usage_error(f"--min-exact-match must be between 0 and 1, got {args.min_exact_match:g}")
    if args.max_failures < 0:
        return usage_error("--max-failures must be at least 0")
    if args.junit.is_dir():
        return usage_error(f"--junit {args.junit} is a directory; give a file path")
    if args.out.exists() and not args.out.is_dir():
        return usage_error(f"--out {args.out} exists and is not a directory")
    for spec in specs:
        try:
            load_decoder(spec)
        except DecoderLoadError as exc:
            return usage_error(str(exc))
    thresholds = Thresholds(args.min_exact_match, args.max_failures)
    print(
        f"specaudit gate: {len(specs)} decoder(s) x {len(models)} model(s), {args.examples} cases each, "
        f"seed {args.seed}\n  thresholds: {thresholds.describe()}"
    )
    progress = Progress(len(specs) * len(models), enabled=not args.quiet)
    verdicts = []
    for spec in specs:
        for model in models:
            verdict = audit_model(spec, model, args.examples, args.seed, progress)
            progress.finish_item(verdict)
            verdicts.append(verdict)
    print(format_table(verdicts))
    reproducers: dict[int, list[Path]] = {}
    try:
        for i, v in enumerate(verdicts):
            if v.diagnosis is not None:
                reproducers[i] = write_reproducers(v, args.out)
        properties = {"examples": str(args.examples), "seed": str(args.seed), "models": ",".join(models)}
        tree = junit_xml(verdicts, thresholds, reproducers, properties)
        args.junit.parent.mkdir(parents=True, exist_ok=True)
        tree.write(args.junit, encoding="utf-8", xml_declaration=True)
    except OSError as exc:
        return usage_error(f"cannot write the gate's output: {exc.filename or ''} {exc.strerror or exc}".strip())
    failed = [v for v in verdicts if judge(v, thresholds) is not None]
    for v in verdicts:
        failure = judge(v, thresholds)
        if failure is not None and failure[0] == "threshold":
            print(f"{v.decoder} on {v.model}: {failure[1]}")
    passed = len(failed) <= thresholds.max_failures
    print(
        f"\n{len(verdicts) - len(failed)} passed, {len(failed)} failed (at most {thresholds.max_failures} allowed): "
        f"gate {'PASSED' if passed else 'FAILED'}"
    )
    print(f"JUnit XML: {args.junit}")
    for paths in reproducers.values():
        for path in paths:
            print(f"reproducer: {path}")
    return 0 if passed else 1


def add_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add `gate` to the `specaudit` sub-command parsers (`build_parser`'s `sub`)."""
    from specaudit.models import MODELS as DEFAULT_MODELS

    parser = subparsers.add_parser(
        "gate",
        help="the audit with thresholds for CI: JUnit XML, reproducers, exit 0 pass / 1 fail / 2 usage error",
        description="Run the audit for every decoder x model, write JUnit XML and apply the thresholds: by default "
        "every decoder must pass every check on every model.",
    )
    parser.add_argument(
        "--decoder",
        action="append",
        default=[],
        metavar="MODULE:ATTR",
        help="decoder (repeatable; default: references)",
    )
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated built-in models")
    parser.add_argument("--examples", type=int, default=25, help="generated cases per decoder and model (default 25)")
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed (same seed, same cases)")
    parser.add_argument(
        "--junit", type=Path, default=DEFAULT_JUNIT, metavar="PATH", help=f"JUnit XML report (default: {DEFAULT_JUNIT})"
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, metavar="DIR", help=f"reproducers of failures (default: {DEFAULT_OUT})"
    )
    parser.add_argument(
        "--min-exact-match",
        type=float,
        default=0.0,
        metavar="F",
        help="minimum exact-row rate per decoder x model, in [0, 1] (default 0; matters when ties are allowed)",
    )
    parser.add_argument(
        "--max-failures",
        type=int,
        default=0,
        metavar="N",
        help="failing decoder x model pairs tolerated (default 0: any failure fails the gate)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.set_defaults(func=cmd_gate)
    return parser
