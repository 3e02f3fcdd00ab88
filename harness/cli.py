"""`specaudit`: the command line. `specaudit audit` is the README's main job.

Exit status: 0 when every decoder passes, 1 when one fails, 2 for usage errors. Bad input
gets one clear line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.pytest_plugin import DEFAULT_DECODERS, DEFAULT_MODELS

CHECK_ORDER = ("contract", "I1", "I2", "equivalence", "token-preservation")


@dataclass
class Verdict:
    """One decoder on one model: what ran and the first failure, if any (shrunk by Hypothesis)."""

    decoder: str
    model: str
    examples: int = 0
    seconds: float = 0.0
    exact_rows: int = 0
    rows: int = 0
    failure: str | None = None  # rendered evidence of the minimal failing case
    failed_check: str | None = None
    case: str | None = None

    @property
    def passed(self) -> bool:
        return self.failure is None


@dataclass
class _Failed(Exception):
    check: str
    evidence: str
    case: str
    notes: list[str] = field(default_factory=list)


def audit_model(spec: str, model: str, examples: int, seed: int, progress: bool) -> Verdict:
    """Run all checks on `examples` generated cases; on failure, let Hypothesis shrink it."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    from harness.checks import (
        check_contract,
        check_equivalence,
        check_i1,
        check_i2,
        check_token_preservation,
        equivalence,
        render,
    )
    from harness.contract import load_decoder
    from harness.runner import run_case
    from harness.strategies import cases

    factory = load_decoder(spec)
    verdict = Verdict(spec, model)
    start = time.perf_counter()

    @hseed(seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(data=st.data())
    def prop(data: st.DataObject) -> None:
        case = data.draw(cases(model), label="case")
        run = run_case(spec, case, factory=factory)
        violations = check_contract(run)
        if not violations:
            verdict.examples += 1
            eq = equivalence(run)
            verdict.rows += len(eq.rows)
            verdict.exact_rows += sum(r.exact for r in eq.rows)
            for check in (check_i1, check_i2, check_equivalence, check_token_preservation):
                violations += check(run)
        if progress and sys.stderr.isatty():
            print(f"\r  {spec} on {model}: {verdict.examples} cases run", end="", file=sys.stderr, flush=True)
        if violations:
            first = min(violations, key=lambda v: CHECK_ORDER.index(v.check))
            raise _Failed(first.check, render(violations, limit=3), repr(case))

    try:
        prop()
    except _Failed as failed:
        verdict.failure, verdict.failed_check, verdict.case = failed.evidence, failed.check, failed.case
    verdict.seconds = time.perf_counter() - start
    if progress:
        status = "PASS" if verdict.passed else f"FAIL ({verdict.failed_check})"
        end = "\r" if sys.stderr.isatty() else ""
        print(f"{end}  {spec} on {model}: {status} after {verdict.seconds:.1f} s", file=sys.stderr, flush=True)
    return verdict


def format_table(verdicts: list[Verdict]) -> str:
    header = f"{'decoder':<34} {'model':<12} {'cases':>5} {'exact rows':>10} {'seconds':>8}  verdict"
    lines = [header, "-" * len(header)]
    for v in verdicts:
        exact = f"{v.exact_rows}/{v.rows}"
        result = "PASS" if v.passed else f"FAIL ({v.failed_check})"
        lines.append(f"{v.decoder:<34} {v.model:<12} {v.examples:>5} {exact:>10} {v.seconds:>8.1f}  {result}")
    for v in verdicts:
        if not v.passed:
            lines += ["", f"{v.decoder} on {v.model}: minimal failing case", f"  {v.case}"]
            lines += [f"  {line}" for line in (v.failure or "").splitlines()]
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
    """Replay one case file against a decoder and print the evidence."""
    from harness.case import Case, CaseFormatError
    from harness.checks import check_contract, check_equivalence, check_i1, check_i2, check_token_preservation, render
    from harness.contract import DecoderLoadError, load_decoder
    from harness.runner import run_case

    try:
        case = Case.load(args.case)
        factory = load_decoder(args.decoder)
    except (CaseFormatError, DecoderLoadError) as exc:
        return usage_error(str(exc))
    try:
        run = run_case(args.decoder, case, factory=factory)
    except ValueError as exc:  # a case naming an unknown model, draft or dtype
        return usage_error(str(exc))
    violations = check_contract(run)
    if not violations:
        for check in (check_i1, check_i2, check_equivalence, check_token_preservation):
            violations += check(run)
    print(f"{args.decoder} on {case!r}")
    print(render(violations, limit=20) if violations else "PASS: every check holds")
    return 1 if violations else 0


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
