"""`specaudit minimize FILE --decoder MODULE:ATTR`: delta-debug a failing case file.

The case (any case file: one written by hand, by a real-model run, or a reproducer the suite
left behind) is run against the decoder; if it fails, `specaudit.ddmin.minimize_case` shrinks
it keeping the failure class, and two files are written to --out:

  <name>.json                  the minimized case as a reproducer (replayable with
                               `specaudit replay` and minimizable again), plus the decoder and
                               the evidence;
  test_regression_<name>.py    a self-contained pytest file holding the case: run it with
                               `pytest test_regression_<name>.py --specaudit-decoder MODULE:ATTR`
                               (without it: the reference decoders).

Exit status: 1 when the decoder fails the case (files written), 0 when it passes, 2 for
usage errors (unreadable case, bad decoder, unknown model), each told in one line on stderr.
"""

from __future__ import annotations

import argparse
import pprint
import re
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specaudit.case import Case
    from specaudit.ddmin import MinimizeResult
    from specaudit.diagnosis import Diagnosis

DEFAULT_OUT = Path("specaudit-out") / "minimized"

_TEMPLATE = '''"""Regression test written by `specaudit minimize`: a minimized failing case, embedded.

Run it against a decoder with `pytest THIS_FILE --specaudit-decoder MODULE:ATTR`; without it the
specaudit plugin runs it against the reference decoders, which pass it.
"""

# Failed by:     {decoder}
# Failure class: first check {first_check}, signature {signature}
# Minimized:     {summary}
# Evidence when written:
{evidence}

from __future__ import annotations

import pytest

from specaudit.case import Case
from specaudit.violation import explain
from specaudit.diagnosis import all_violations
from specaudit.reproducer import remember_failure
from specaudit.runner import run_case

pytestmark = pytest.mark.specaudit

CASE = {case}


def test_regression_{name}(specaudit_decoder: str) -> None:
    """The minimized case passes every check: contract, I1, I2, equivalence, token preservation."""
    case = Case.from_json(CASE)
    run = run_case(specaudit_decoder, case)
    violations = all_violations(run)
    if violations:
        remember_failure(run, violations)  # the plugin writes it to --specaudit-out
    assert violations == [], explain(run, violations)
'''


def identifier(text: str) -> str:
    """`text` as a Python identifier fragment: runs of other characters become one `_`."""
    name = re.sub(r"[^A-Za-z0-9_]+", "_", text).strip("_")[:100]
    return name or "case"


def _comment(text: str) -> str:
    return "\n".join(f"#   {line}" for line in text.splitlines()) or "#   (none)"


def regression_test_source(case: Case, diagnosis: Diagnosis, name: str, summary: str = "") -> str:
    """A ready pytest file: `CASE` holds the case's JSON form as a Python literal; every
    free-text part (decoder, evidence) sits in comments, so any text is safe to embed."""
    from specaudit.violation import render

    return _TEMPLATE.format(
        decoder=diagnosis.decoder.replace("\n", " "),
        first_check=diagnosis.first_check,
        signature=diagnosis.signature,
        summary=summary.replace("\n", " ") or "-",
        evidence=_comment(render(list(diagnosis.violations))),
        case=pprint.pformat(case.to_json(), indent=1, width=100, sort_dicts=False),
        name=identifier(name),
    )


def write_minimized(directory: Path, name: str, diagnosis: Diagnosis, summary: str = "") -> tuple[Path, Path]:
    """Write `DIR/<name>.json` (reproducer) and `DIR/test_regression_<name>.py`; return both paths."""
    from specaudit.reproducer import write_reproducer

    name = identifier(name)
    failure: dict[str, Any] = {
        "case": diagnosis.case.to_json(),
        "decoder": diagnosis.decoder,
        "evidence": [asdict(v) for v in diagnosis.violations[:20]],
    }
    reproducer = write_reproducer(Path(directory), name, failure)
    test = Path(directory) / f"test_regression_{name}.py"
    test.write_text(regression_test_source(diagnosis.case, diagnosis, name, summary))
    return reproducer, test


def output_name(case_file: Path, out: Path) -> str:
    """The input file's stem; with `_min` added when that would overwrite the input itself."""
    name = identifier(case_file.stem)
    try:
        if (out / f"{name}.json").resolve() == case_file.resolve():
            name += "_min"
    except OSError:
        pass
    return name


def cmd_minimize(args: argparse.Namespace) -> int:
    from specaudit.case import Case, CaseFormatError
    from specaudit.cli import usage_error
    from specaudit.contract import DecoderLoadError, load_decoder
    from specaudit.ddmin import CasePasses, minimize_case
    from specaudit.fixtures.pairs import check_model

    if args.budget < 1:
        return usage_error("--budget must be at least 1")
    try:
        case = Case.load(args.case)
        factory = load_decoder(args.decoder)
        check_model(case.model, case.draft, case.dtype)
    except (CaseFormatError, DecoderLoadError, ValueError) as exc:
        return usage_error(str(exc))
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return usage_error(f"--out {out} exists and is not a directory")
    print(f"specaudit minimize: {args.case} ({case.batch_size} rows) against {args.decoder}")
    try:
        result = minimize_case(args.decoder, case, factory=factory, budget=args.budget)
    except CasePasses:
        print(f"{args.decoder} passes every check on {args.case}: nothing to minimize")
        return 0
    except DecoderLoadError as exc:  # the factory returned no usable decoder
        return usage_error(str(exc))
    return report(args, result, out)


def report(args: argparse.Namespace, result: MinimizeResult, out: Path) -> int:
    from specaudit.cli import usage_error

    print(result.diagnosis.render())
    print()
    print(f"minimized case ({result.original.batch_size} rows before, {result.case.batch_size} after):")
    print(f"  {result.case!r}")
    print(result.summary())
    try:
        reproducer, test = write_minimized(out, output_name(Path(args.case), out), result.diagnosis, _short(result))
    except OSError as exc:
        return usage_error(f"cannot write to {out}: {exc.strerror or exc}")
    print(f"\nreproducer:      {reproducer}")
    print(f"regression test: {test}")
    print(f"  pytest {test} --specaudit-decoder {args.decoder}")
    return 1


def _short(result: MinimizeResult) -> str:
    return (
        f"{result.original.batch_size} rows -> {result.case.batch_size}, "
        f"{result.runs} decoder runs, {result.seconds:.1f} s"
    )


def add_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add `minimize` to the `specaudit` sub-command parsers (`build_parser`'s `sub`)."""
    from specaudit.ddmin import DEFAULT_BUDGET

    parser = subparsers.add_parser(
        "minimize",
        help="delta-debug a failing case file down to a minimal case; write a reproducer and a regression test",
        description="Delta-debug a failing case file (rows, prompt tokens, schedule, K, max_new_tokens, padding, "
        "EOS), keeping its failure class; write DIR/<name>.json and DIR/test_regression_<name>.py.",
    )
    parser.add_argument("case", type=Path, metavar="FILE", help="a case file or reproducer (JSON)")
    parser.add_argument("--decoder", required=True, metavar="MODULE:ATTR", help="the decoder that fails the case")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, metavar="DIR", help=f"output directory (default: {DEFAULT_OUT})"
    )
    parser.add_argument(
        "--budget",
        type=int,
        default=DEFAULT_BUDGET,
        metavar="N",
        help=f"at most N decoder runs (default: {DEFAULT_BUDGET}); then the smallest failing case so far is kept",
    )
    parser.set_defaults(func=cmd_minimize)
    return parser
