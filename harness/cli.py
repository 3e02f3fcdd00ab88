"""`specaudit`: the command line. `specaudit audit` is the README's main job.

Exit status: 0 when every decoder passes, 1 when one fails, 2 for usage errors. Bad input
gets one clear line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specaudit.models import DEFAULT_DECODERS
from specaudit.models import MODELS as DEFAULT_MODELS

PLANTED_BUG_EXAMPLES = 300
"""Search budget for a planted bug: the search stops at its first failure, so this is a bound."""

if TYPE_CHECKING:
    from specaudit.diagnosis import Diagnosis
    from specaudit.runner import Run


@dataclass
class Verdict:
    """One decoder on one model: what ran and, on failure, the diagnosis of the minimal case."""

    decoder: str
    model: str
    expect_failure: bool = False  # a planted bug: the audit passes when it is caught
    examples: int = 0
    seconds: float = 0.0
    exact_rows: int = 0
    rows: int = 0
    partial_sum: float = 0.0
    tokens_per_second: list[float] = field(default_factory=list)
    outside_share: list[float] = field(default_factory=list)
    instrumentation_overhead: float | None = None
    diagnosis: Diagnosis | None = None

    @property
    def passed(self) -> bool:
        return self.diagnosis is None

    @property
    def as_expected(self) -> bool:
        return self.passed != self.expect_failure

    def record(self, run: Run) -> None:
        from specaudit.checks import equivalence

        self.examples += 1
        if run.outputs is None:
            return
        rows = equivalence(run).rows
        self.rows += len(rows)
        self.exact_rows += sum(r.exact for r in rows)
        self.partial_sum += sum(r.partial for r in rows)
        self.tokens_per_second.append(run.tokens_per_second)
        self.outside_share.append(run.outside_models_share)

    def to_json(self) -> dict[str, Any]:
        return {
            "decoder": self.decoder,
            "model": self.model,
            "expect_failure": self.expect_failure,
            "as_expected": self.as_expected,
            "cases": self.examples,
            "seconds": round(self.seconds, 3),
            "exact_match": self.exact_rows / self.rows if self.rows else None,
            "partial_match": self.partial_sum / self.rows if self.rows else None,
            "tokens_per_second": median(self.tokens_per_second),
            "outside_models_share": median(self.outside_share),
            "instrumentation_overhead": self.instrumentation_overhead,
            "diagnosis": self.diagnosis.to_json() if self.diagnosis else None,
        }


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def audit_model(
    spec: str, model: str, examples: int, seed: int, progress: Progress | None = None, expect_failure: bool = False
) -> Verdict:
    """Every check on up to `examples` generated cases; the first failure is shrunk and
    diagnosed. The first case also runs without hooks, to measure the instrumentation's cost."""
    from specaudit.contract import load_decoder
    from specaudit.diagnosis import diagnose
    from specaudit.runner import run_case
    from specaudit.search import search

    factory = load_decoder(spec)
    verdict = Verdict(spec, model, expect_failure)

    def on_run(run: Run) -> None:
        if verdict.instrumentation_overhead is None:  # both timed warm, after the first run
            plain = run_case(spec, run.case, factory=factory, instrumented=False)
            hooked = run_case(spec, run.case, factory=factory)
            verdict.instrumentation_overhead = hooked.seconds / max(plain.seconds, 1e-9) - 1.0
        verdict.record(run)
        if progress:
            progress.tick(f"{spec} on {model}: {verdict.examples} cases")

    result = search(spec, model, max_examples=examples, seed=seed, factory=factory, on_run=on_run)
    if result.minimal is not None:
        verdict.diagnosis = diagnose(run_case(spec, result.minimal, factory=factory))
    verdict.seconds = result.seconds
    return verdict


class Progress:
    """A one-line progress bar on stderr (a line per finished item when not a terminal)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.tty = sys.stderr.isatty()

    def tick(self, label: str) -> None:
        if self.enabled and self.tty:
            filled = int(20 * self.done / max(self.total, 1))
            bar = "#" * filled + "-" * (20 - filled)
            print(f"\r[{bar}] {self.done}/{self.total} {label[:70]:<70}", end="", file=sys.stderr, flush=True)

    def finish_item(self, verdict: Verdict) -> None:
        self.done += 1
        if self.enabled:
            outcome = "as expected" if verdict.as_expected else "UNEXPECTED"
            status = "PASS" if verdict.passed else f"FAIL ({verdict.diagnosis.signature})"  # type: ignore[union-attr]
            line = f"[{self.done}/{self.total}] {verdict.decoder} on {verdict.model}: {status}, {outcome}"
            print(("\r" if self.tty else "") + f"{line:<100}", file=sys.stderr, flush=True)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(verdicts: list[Verdict]) -> str:
    """The forensic table (the paper's Table 2, with a diagnosis in every row)."""
    header = (
        f"{'decoder':<44} {'model':<11} {'cases':>5} {'exact':>6} {'partial':>7} {'tok/s':>7} {'align%':>6}  "
        f"{'verdict':<9} {'first check':<18} {'signature':<17} expected"
    )
    lines = [header, "-" * len(header)]
    for v in verdicts:
        j = v.to_json()
        d = v.diagnosis
        lines.append(
            f"{v.decoder:<44} {v.model:<11} {v.examples:>5} {_fmt(j['exact_match'], '.2f'):>6} "
            f"{_fmt(j['partial_match'], '.2f'):>7} {_fmt(j['tokens_per_second'], '.0f'):>7} "
            f"{_fmt(None if j['outside_models_share'] is None else 100 * j['outside_models_share'], '.0f'):>6}  "
            f"{'PASS' if d is None else 'FAIL':<9} {(d.first_check or '') if d else '':<18} "
            f"{(d.signature or '') if d else '':<17} {'yes' if v.as_expected else 'NO'}"
        )
    overheads = [v.instrumentation_overhead for v in verdicts if v.instrumentation_overhead is not None]
    if overheads:
        lines.append(
            f"instrumentation overhead (hooked vs plain run of one case each): median {100 * median(overheads):.0f}%"
        )
    lines.append("align% = share of decoder time outside model forwards (realignment, acceptance, bookkeeping)")
    for v in verdicts:
        if v.diagnosis is not None and not v.expect_failure:
            lines += ["", f"{v.decoder} on {v.model}: minimal failing case"]
            lines += ["  " + line for line in v.diagnosis.render().splitlines()[1:]]
    return "\n".join(lines)


def default_audit() -> list[tuple[str, bool]]:
    """The main job: the reference decoders must pass, every planted bug must be caught."""
    from specaudit.reference.mutants import CATALOG

    return [(spec, False) for spec in DEFAULT_DECODERS] + [
        (f"specaudit.reference.mutants:{name}", True) for name in CATALOG
    ]


def write_outputs(directory: Path, verdicts: list[Verdict]) -> None:
    from specaudit.reproducer import write_reproducer

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "report.json").write_text(json.dumps([v.to_json() for v in verdicts], indent=1) + "\n")
    for v in verdicts:
        if v.diagnosis is not None:
            d = v.diagnosis.to_json()
            failure = {"case": d["case"], "decoder": d["decoder"], "evidence": d["violations"]}
            write_reproducer(directory / "repro", f"{v.decoder}__{v.model}", failure)


def cmd_audit(args: argparse.Namespace) -> int:
    from specaudit.contract import DecoderLoadError, load_decoder

    if getattr(args, "target", None):
        from specaudit.realmodel import run_real_audit

        return run_real_audit(args)
    if getattr(args, "draft", None) or getattr(args, "prompts", None):
        return usage_error("--draft and --prompts need --target (real-model mode)")

    targets = [(spec, False) for spec in args.decoder] or default_audit()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in DEFAULT_MODELS]
    if unknown:
        return usage_error(f"unknown model(s) {', '.join(unknown)}; built-in models are {', '.join(DEFAULT_MODELS)}")
    if args.examples < 1:
        return usage_error("--examples must be at least 1")
    for spec, _ in targets:
        try:
            load_decoder(spec)
        except DecoderLoadError as exc:
            return usage_error(str(exc))
    # planted bugs are audited on the exact model: it names slots and is fast; --decoder audits everywhere
    bug_models = [m for m in models if m == "transparent"] or models[:1]
    plan = [(spec, expect, model) for spec, expect in targets for model in (bug_models if expect else models)]
    print(
        f"specaudit audit: {len(plan)} decoder/model pairs ({len(targets)} decoders), "
        f"up to {args.examples} cases each, seed {args.seed}",
        flush=True,
    )
    progress = Progress(len(plan), enabled=not args.quiet)
    verdicts = []
    for spec, expect_failure, model in plan:
        budget = max(args.examples, PLANTED_BUG_EXAMPLES) if expect_failure else args.examples
        verdict = audit_model(spec, model, budget, args.seed, progress, expect_failure)
        progress.finish_item(verdict)
        verdicts.append(verdict)
    print(format_table(verdicts))
    if args.out:
        write_outputs(args.out, verdicts)
        print(f"report: {args.out / 'report.json'}; reproducers under {args.out / 'repro'}")
    wrong = [v for v in verdicts if not v.as_expected]
    print(f"\n{len(verdicts) - len(wrong)} as expected, {len(wrong)} not")
    return 1 if wrong else 0


def cmd_replay(args: argparse.Namespace) -> int:
    """Replay one case file against a decoder and print its diagnosis."""
    from specaudit.case import Case, CaseFormatError
    from specaudit.contract import DecoderLoadError, load_decoder
    from specaudit.diagnosis import diagnose
    from specaudit.runner import run_case

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
    sub.add_parser(
        "suite", help="run the installed conformance suite: specaudit suite --decoder MODULE:ATTR [pytest args]"
    )
    audit = sub.add_parser(
        "audit", help="audit decoders on the built-in models (default: reference decoders and planted bugs)"
    )
    audit.add_argument("--decoder", action="append", default=[], metavar="MODULE:ATTR", help="decoder (repeatable)")
    audit.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated built-in models")
    audit.add_argument("--examples", type=int, default=25, help="generated cases per decoder and model")
    audit.add_argument("--seed", type=int, default=0, help="Hypothesis seed (same seed, same cases)")
    audit.add_argument("--quiet", action="store_true", help="no progress line")
    audit.add_argument("--out", type=Path, default=None, metavar="DIR", help="write DIR/report.json and DIR/repro/")
    from specaudit.realmodel import add_arguments as add_real_model_arguments

    add_real_model_arguments(audit)  # --target/--draft/--device/--dtype/--prompts: real-model mode
    audit.set_defaults(func=cmd_audit)
    replay = sub.add_parser("replay", help="replay a case file (a reproducer) against a decoder")
    replay.add_argument("case", type=Path, metavar="FILE")
    replay.add_argument("--decoder", required=True, metavar="MODULE:ATTR")
    replay.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    replay.set_defaults(func=cmd_replay)
    from specaudit import gate, minimize

    minimize.add_command(sub)
    gate.add_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["suite"]:  # everything after `suite` belongs to pytest
        from specaudit.suite import run_suite

        return run_suite(argv[1:])
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
