"""`specaudit`: the command line. `specaudit audit` is the README's main job.

Exit status: 0 when every decoder passes, 1 when one fails, 2 for usage errors. Bad input
gets one clear line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from harness.pytest_plugin import DEFAULT_DECODERS, DEFAULT_MODELS

if TYPE_CHECKING:
    from harness.case import Case
    from harness.diagnosis import Diagnosis


@dataclass
class Verdict:
    """One decoder on one model: what ran and, on failure, the diagnosis of the shrunk case."""

    decoder: str
    model: str
    examples: int = 0
    seconds: float = 0.0
    exact_rows: int = 0
    rows: int = 0
    diagnosis: Diagnosis | None = None

    @property
    def passed(self) -> bool:
        return self.diagnosis is None


class _Failed(Exception):
    def __init__(self, case: Case) -> None:
        self.case = case


def audit_model(spec: str, model: str, examples: int, seed: int, progress: bool) -> Verdict:
    """Run all checks on `examples` generated cases; on failure, let Hypothesis shrink it."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    from harness.checks import equivalence
    from harness.contract import load_decoder
    from harness.diagnosis import all_violations, diagnose
    from harness.runner import run_case
    from harness.strategies import cases

    factory = load_decoder(spec)
    verdict = Verdict(spec, model)
    start = time.perf_counter()

    @hseed(seed)
    @settings(
        max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck), print_blob=False
    )
    @given(data=st.data())
    def prop(data: st.DataObject) -> None:
        case = data.draw(cases(model), label="case")
        run = run_case(spec, case, factory=factory)
        verdict.examples += 1
        if run.outputs is not None:
            rows = equivalence(run).rows
            verdict.rows += len(rows)
            verdict.exact_rows += sum(r.exact for r in rows)
        if progress and sys.stderr.isatty():
            print(f"\r  {spec} on {model}: {verdict.examples} cases run", end="", file=sys.stderr, flush=True)
        if all_violations(run):
            raise _Failed(case)

    try:
        prop()
    except _Failed as failed:  # Hypothesis re-raises the minimal case's failure last
        verdict.diagnosis = diagnose(run_case(spec, failed.case, factory=factory))
    verdict.seconds = time.perf_counter() - start
    if progress:
        status = "PASS" if verdict.passed else f"FAIL ({verdict.diagnosis.first_check})"  # type: ignore[union-attr]
        end = "\r" if sys.stderr.isatty() else ""
        print(f"{end}  {spec} on {model}: {status} after {verdict.seconds:.1f} s", file=sys.stderr, flush=True)
    return verdict


def format_table(verdicts: list[Verdict]) -> str:
    header = (
        f"{'decoder':<40} {'model':<12} {'cases':>5} {'exact rows':>10} {'seconds':>8}  "
        f"{'verdict':<8} {'first check':<18} signature"
    )
    lines = [header, "-" * len(header)]
    for v in verdicts:
        d = v.diagnosis
        exact = f"{v.exact_rows}/{v.rows}"
        result = "PASS" if d is None else "FAIL"
        check, signature = (d.first_check or "", d.signature or "") if d else ("", "")
        lines.append(
            f"{v.decoder:<40} {v.model:<12} {v.examples:>5} {exact:>10} {v.seconds:>8.1f}  "
            f"{result:<8} {check:<18} {signature}"
        )
    for v in verdicts:
        if v.diagnosis is not None:
            lines += ["", f"{v.decoder} on {v.model}: minimal failing case"]
            lines += ["  " + line for line in v.diagnosis.render().splitlines()[1:]]
    return "\n".join(lines)


def cmd_audit(args: argparse.Namespace) -> int:
    from harness.contract import DecoderLoadError, load_decoder

    specs = args.decoder or list(DEFAULT_DECODERS)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in DEFAULT_MODELS]
    if unknown:
        return usage_error(f"unknown model(s) {', '.join(unknown)}; built-in models are {', '.join(DEFAULT_MODELS)}")
    if args.examples < 1:
        return usage_error("--examples must be at least 1")
    for spec in specs:
        try:
            load_decoder(spec)
        except DecoderLoadError as exc:
            return usage_error(str(exc))
    print(
        f"specaudit audit: {len(specs)} decoder(s) x {len(models)} model(s), "
        f"{args.examples} cases each, seed {args.seed}"
    )
    verdicts = []
    for spec in specs:
        for model in models:
            verdicts.append(audit_model(spec, model, args.examples, args.seed, progress=not args.quiet))
    print(format_table(verdicts))
    failed = [v for v in verdicts if not v.passed]
    print(f"\n{len(verdicts) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def cmd_replay(args: argparse.Namespace) -> int:
    """Replay one case file against a decoder and print its diagnosis."""
    from harness.case import Case, CaseFormatError
    from harness.contract import DecoderLoadError, load_decoder
    from harness.diagnosis import diagnose
    from harness.runner import run_case

    try:
        case = Case.load(args.case)
        factory = load_decoder(args.decoder)
    except (CaseFormatError, DecoderLoadError) as exc:
        return usage_error(str(exc))
    try:
        diagnosis = diagnose(run_case(args.decoder, case, factory=factory))
    except ValueError as exc:  # a case naming an unknown model, draft or dtype
        return usage_error(str(exc))
    print(json.dumps(diagnosis.to_json(), indent=1) if args.json else diagnosis.render())
    return 0 if diagnosis.passed else 1


def usage_error(message: str) -> int:
    print(f"specaudit: error: {message}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specaudit", description="Correctness audit for batch speculative decoders.")
    sub = parser.add_subparsers(dest="command")
    audit = sub.add_parser("audit", help="audit decoders on the built-in models (default: the reference decoders)")
    audit.add_argument("--decoder", action="append", default=[], metavar="MODULE:ATTR", help="decoder (repeatable)")
    audit.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated built-in models")
    audit.add_argument("--examples", type=int, default=25, help="generated cases per decoder and model")
    audit.add_argument("--seed", type=int, default=0, help="Hypothesis seed (same seed, same cases)")
    audit.add_argument("--quiet", action="store_true", help="no progress line")
    audit.set_defaults(func=cmd_audit)
    replay = sub.add_parser("replay", help="replay a case file (a reproducer) against a decoder")
    replay.add_argument("case", type=Path, metavar="FILE")
    replay.add_argument("--decoder", required=True, metavar="MODULE:ATTR")
    replay.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    replay.set_defaults(func=cmd_replay)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed one usage line
        return 2 if exc.code else 0
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
