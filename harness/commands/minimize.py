"""`specaudit minimize FILE --decoder MODULE:ATTR`: delta-debug a failing case file.

The case (any case file: one written by hand, by a real-model run, or a reproducer the suite
left behind) is run against the decoder; if it fails, `specaudit.search.ddmin.minimize_case` shrinks
it keeping the failure class, and `specaudit.audits.regression.write_failure` writes two files to
the output directory:

  <name>.json                  the minimized case as a reproducer (replayable with
                               `specaudit replay` and minimizable again), plus the decoder and
                               the evidence;
  test_regression_<name>.py    a self-contained pytest file holding the case: run it with
                               `pytest test_regression_<name>.py --specaudit-decoder MODULE:ATTR`
                               (without it: the reference decoders).

A case whose output diverges from the oracle shrinks only to cases whose output diverges too (the
symptom a user reported, not only its class: an over-long mask can break I1 on one row with exact
output, when the two-row case's output was wrong); `--allow-exact-output` lifts that.

Exit status: 1 when the decoder fails the case (files written), 0 when it passes; bad input
(unreadable case, bad decoder, unknown model, unwritable output) is a `UsageError`.
"""

from __future__ import annotations

import json
from pathlib import Path

from specaudit.artifacts.reproducer import identifier, load_case, load_engine_reproducer
from specaudit.audits.regression import write_engine_failure, write_failure
from specaudit.checks.diagnosis import Diagnosis, diagnose
from specaudit.commands.replay import replay_engine_rules
from specaudit.config.settings import EngineMinimizeSettings, MinimizeSettings
from specaudit.contracts.decoder import load_decoder
from specaudit.contracts.errors import UsageError
from specaudit.contracts.violation import Violation, render
from specaudit.running.runner import run_case
from specaudit.search.ddmin import CasePasses, MinimizeResult, minimize_case


def output_name(case_file: Path, out: Path) -> str:
    """The input file's stem; with `_min` added when that would overwrite the input itself."""
    name = identifier(case_file.stem)
    try:
        if (out / f"{name}.json").resolve() == case_file.resolve():
            name += "_min"
    except OSError:
        pass
    return name


def run_minimize(settings: MinimizeSettings) -> int:
    """Minimize, print the result and write the reproducer and regression test: exit 1 (the
    decoder fails the case) or 0 (it passes: nothing to minimize)."""
    case = load_case(settings.case)
    factory = load_decoder(settings.decoder)
    if settings.out.exists() and not settings.out.is_dir():
        raise UsageError(f"--out {settings.out} exists and is not a directory")
    print(f"specaudit minimize: {settings.case} ({case.batch_size} rows) against {settings.decoder}")
    counts = None
    if settings.keep_divergence and diverges(diagnose(run_case(settings.decoder, case, factory=factory))):
        print("its output diverges from the oracle: every smaller case kept must diverge too")
        counts = is_divergence
    try:
        result = minimize_case(settings.decoder, case, factory=factory, budget=settings.budget, counts=counts)
    except CasePasses:
        print(f"{settings.decoder} passes every check on {settings.case}: nothing to minimize")
        return 0
    report(settings, result)
    return 1


def is_divergence(v: Violation) -> bool:
    """A violation of output equivalence: the output differs from the batch-size-1 oracle's."""
    return v.check == "equivalence"


def diverges(d: Diagnosis) -> bool:
    return any(map(is_divergence, d.violations))


def report(settings: MinimizeSettings, result: MinimizeResult) -> None:
    print(result.diagnosis.render())
    print()
    print(f"minimized case ({result.original.batch_size} rows before, {result.case.batch_size} after):")
    print(f"  {result.case!r}")
    print(result.summary())
    summary = (
        f"{result.original.batch_size} rows -> {result.case.batch_size}, "
        f"{result.runs} decoder runs, {result.seconds:.1f} s"
    )
    try:
        reproducer, test = write_failure(
            settings.out, output_name(settings.case, settings.out), result.diagnosis, summary
        )
    except OSError as exc:
        raise UsageError(f"cannot write to {settings.out}: {exc.strerror or exc}") from None
    print(f"\nreproducer:      {reproducer}")
    print(f"regression test: {test}")
    print(f"  pytest {test} --specaudit-decoder {settings.decoder}")


def minimize_engine(settings: EngineMinimizeSettings) -> int:
    """`specaudit minimize FILE --engine X` on an engine reproducer: ddmin over its rules
    (`specaudit.search.ddmin.minimize_ops`), keeping the first check and rule; writes the
    reproducer and regression test. Exit 1 (the engine fails the rules) or 0 (it passes)."""
    from specaudit.contracts.engine import load_engine
    from specaudit.search.ddmin import ReproducerPasses, minimize_ops

    reproducer = load_engine_reproducer(settings.case, settings.engine)
    load_engine(reproducer["engine"])
    if settings.out.exists() and not settings.out.is_dir():
        raise UsageError(f"--out {settings.out} exists and is not a directory")
    engine = reproducer["engine"]
    print(f"specaudit minimize: {settings.case} ({len(reproducer['ops'])} rules) against {engine}")
    built = replay_engine_rules(dict(reproducer, ops=[]))
    if built:  # nothing to shrink: the engine fails before the first rule
        print(f"{engine} fails before any rule:\n{render(built)}")
        return 1
    try:
        result = minimize_ops(reproducer, settings.budget)
    except ReproducerPasses:
        print(f"{engine} passes every check on {settings.case}: nothing to minimize")
        return 0
    print(render(result.violations))
    print(f"\nminimized rules ({result.summary()}):")
    for op in result.reproducer.ops:
        print(f"  {json.dumps(op.to_json())}")
    try:
        paths = write_engine_failure(
            settings.out,
            output_name(settings.case, settings.out),
            result.reproducer.to_json(),
            result.violations,
            result.summary(),
        )
    except OSError as exc:
        raise UsageError(f"cannot write to {settings.out}: {exc.strerror or exc}") from None
    print(f"\nreproducer:      {paths[0]}")
    print(f"regression test: {paths[1]}")
    print(f"  pytest {paths[1]}   (SPECAUDIT_ENGINE=MODULE:ATTR to run it against another engine)")
    return 1
