"""specaudit's pytest plugin (entry point `pytest11`): inert in projects that do not use it.

It only adds `--specaudit-*` options and the `specaudit` marker. Everything else acts on
tests marked `specaudit` or asking for the `specaudit_decoder` fixture: parametrizing them by
decoder and model, writing the shrunk case (or engine rule sequence) a failing property noted on
its item (`item.stash[FAILURE]`, see `specaudit.commands.pytest_notes.remember_failure`) to disk, and listing the
--specaudit-xfails entries no failure matched (under pytest-xdist each worker sends the
entries it saw matching back to the controller, which lists them). Hypothesis profiles,
the unprefixed `--decoder`/`--models` and torch's thread setting belong to the conformance
suite's own conftest (`properties/conftest.py`). No torch is imported here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from specaudit.contracts.builtins import DEFAULT_DECODERS, parse_models
from specaudit.contracts.item import FAILURE


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("specaudit", "specaudit: conformance of batch speculative decoders")
    group.addoption(
        "--specaudit-decoder",
        dest="specaudit_decoder",
        action="append",
        default=[],
        metavar="MODULE:ATTR",
        help="decoder under test (repeatable; default: the reference decoders); the suite also takes --decoder",
    )
    group.addoption(
        "--specaudit-models",
        dest="specaudit_models",
        default=None,
        metavar="NAMES",
        help="comma-separated built-in models to run the properties on (default: all); the suite also takes --models",
    )
    group.addoption(
        "--specaudit-out",
        dest="specaudit_out",
        default="specaudit-failures",
        metavar="DIR",
        help="where a failing property (decoder or engine) writes its minimal case as a JSON reproducer "
        "(default: specaudit-failures)",
    )
    group.addoption(
        "--specaudit-strict-efficiency",
        "--strict-efficiency",
        dest="specaudit_strict_efficiency",
        action="store_true",
        help="fail a property on an efficiency finding (token preservation alone: output and invariants right, "
        "verified drafts thrown away); by default it is reported as xfail, a cost and not a bug",
    )
    group.addoption(
        "--specaudit-xfails",
        dest="specaudit_xfails",
        default=None,
        metavar="FILE",
        help="known failures: lines of 'decoder model check rule' (an engine in place of the decoder for the engine "
        "property); a listed failure is xfail, anything else fails",
    )


KNOWN_FAILURES = pytest.StashKey[object]()
USED_ENTRIES = "specaudit_xfails_used"
"""The key in an xdist worker's `workeroutput`: indices of the known-failure entries that matched."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "specaudit: a conformance property run for every decoder under test")
    if config.getoption("specaudit_decoder", default=None):
        decoder_specs(config)  # asked for by name: a bad one is a usage error before collection
    if config.getoption("specaudit_models", default=None) is not None:
        model_names(config)
    path = config.getoption("specaudit_xfails", default=None)
    if path:
        from specaudit.config.xfails import load_xfails
        from specaudit.contracts.errors import UsageError

        try:
            config.stash[KNOWN_FAILURES] = load_xfails(path)
        except UsageError as exc:
            raise pytest.UsageError(f"specaudit: {exc}") from None


def decoder_specs(config: pytest.Config) -> list[str]:
    """The decoders under test, each checked to load (a bad one is a usage error)."""
    from specaudit.contracts.decoder import DecoderLoadError, load_decoder

    specs = config.getoption("specaudit_decoder") or list(DEFAULT_DECODERS)
    for spec in specs:
        try:
            load_decoder(spec)
        except DecoderLoadError as exc:
            raise pytest.UsageError(f"specaudit: {exc}") from None
    return specs


def model_names(config: pytest.Config) -> list[str]:
    from specaudit.contracts.errors import UsageError

    try:
        return parse_models(config.getoption("specaudit_models"))
    except UsageError as exc:
        raise pytest.UsageError(f"specaudit: {exc}") from None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "specaudit_decoder" in metafunc.fixturenames:
        metafunc.parametrize("specaudit_decoder", decoder_specs(metafunc.config))
    if "specaudit_model" in metafunc.fixturenames:
        metafunc.parametrize("specaudit_model", model_names(metafunc.config))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    """After a property fails, write its shrunk case to --specaudit-out and say where."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when != "call" or item.get_closest_marker("specaudit") is None:
        return
    failure = item.stash.get(FAILURE, None)
    if not report.failed or failure is None:
        return
    first = None if is_engine(failure) else diagnosed_again(failure)  # (signature, whether it failed again)
    signed = failure if first is None or first[0] is None else dict(failure, signature=first[0])
    path = write(item.config.getoption("specaudit_out"), item.name, signed)  # property[decoder-model]
    report.sections.append(("specaudit", f"reproducer written to {path}"))
    failed, tries = rerun_failure(failure, failed_once=None if first is None else first[1])
    if failed < tries:  # a verdict of its own: what fails only sometimes cannot be known-failed either
        what = "engine" if is_engine(failure) else "decoder"
        report.sections.append(
            (
                "specaudit",
                f"nondeterministic {what}: the failing case failed again in {failed} of {tries} fresh runs; "
                f"reproducer {path}",
            )
        )
        return
    known = known_failure(item, failure)
    if known is not None:  # every violation is listed: reported as xfail, like pytest's own xfail
        report.outcome = "skipped"
        report.wasxfail = f"known failure ({known}); reproducer {path}"
    elif efficiency_finding(failure) and not item.config.getoption("specaudit_strict_efficiency"):
        report.outcome = "skipped"
        report.wasxfail = (
            f"efficiency finding, not a correctness failure (--strict-efficiency fails it); reproducer {path}"
        )


def efficiency_finding(failure: dict) -> bool:
    """Every violation of the failure is of a check of a design's cost (`audits.verdict.EFFICIENCY_CHECKS`)."""
    from specaudit.audits.verdict import cost_checks_only

    return cost_checks_only(v["check"] for v in failure.get("evidence") or [])


def is_engine(failure: dict) -> bool:
    """An engine property's record (a rule sequence with "ops"), not a decoder's case."""
    return "ops" in failure


def write(directory: str, name: str, failure: dict) -> Path:
    """The reproducer file of either record: a case file, or an engine reproducer."""
    from specaudit.artifacts.reproducer import write_engine_reproducer, write_reproducer

    return (write_engine_reproducer if is_engine(failure) else write_reproducer)(directory, name, failure)


def diagnosed_again(failure: dict) -> tuple[str | None, bool] | None:
    """A decoder's failing case run once afresh and diagnosed (`first_cause`, the diagnosis's first):
    (its signature, whether it failed again), the signature None when it passed this time (a
    nondeterministic decoder). None when the run or its diagnosis raised: the reproducer is then
    written without a signature, never lost. Made once, as the file is written, not on each
    failing Hypothesis example (`remember_failure` only notes the record)."""
    from specaudit.checks.diagnosis import first_cause
    from specaudit.contracts.case import Case
    from specaudit.running.runner import run_case

    try:
        found = first_cause(run_case(failure["decoder"], Case.from_json(failure["case"])))
    except Exception:  # a diagnosis that breaks must not cost the reproducer
        return None
    return (None, False) if found is None else (found[1][0], True)


def rerun_failure(failure: dict, tries: int = 3, failed_once: bool | None = None) -> tuple[int, int]:
    """How often the failing case (or rule sequence) fails again, run afresh `tries` times;
    `failed_once`, where a decoder's case was already run once afresh (`diagnosed_again`), is that
    run's outcome, counted as the first of the tries."""
    if is_engine(failure):
        from specaudit.commands.replay import replay_engine_rules

        return sum(bool(replay_engine_rules(failure)) for _ in range(tries)), tries
    from specaudit.commands.replay import replay_failures
    from specaudit.contracts.case import Case

    case, done = Case.from_json(failure["case"]), int(failed_once is not None)
    return int(bool(failed_once)) + replay_failures(failure["decoder"], case, n=tries - done), tries


def known_failure(item: pytest.Item, failure: dict) -> str | None:
    """The --specaudit-xfails lines covering every violation of this failure, or None when one is new."""
    known = item.config.stash.get(KNOWN_FAILURES, None)
    params = getattr(getattr(item, "callspec", None), "params", {})
    subject = params.get("specaudit_decoder") or failure.get("decoder") or failure["engine"]
    model = params.get("specaudit_model") or failure.get("model") or "*"
    evidence = failure.get("evidence") or []
    if known is None or not evidence:
        return None
    pairs = sorted({(v["check"], v["rule"]) for v in evidence})
    listed = [known.matches(subject, model, check, rule) for check, rule in pairs]  # type: ignore[attr-defined]
    return ", ".join(f"{check} {rule}" for check, rule in pairs) if all(listed) else None


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On an xdist worker: hand the entries that matched to the controller."""
    known = session.config.stash.get(KNOWN_FAILURES, None)
    workeroutput = getattr(session.config, "workeroutput", None)
    if known is not None and workeroutput is not None:
        workeroutput[USED_ENTRIES] = sorted(known.used)  # type: ignore[attr-defined]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """On the xdist controller: fold in what a finished worker saw matching."""
    known = node.config.stash.get(KNOWN_FAILURES, None)  # type: ignore[attr-defined]
    used = getattr(node, "workeroutput", {}).get(USED_ENTRIES)
    if known is not None and used is not None:
        known.mark_used(used)  # type: ignore[attr-defined]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """The --specaudit-xfails entries that matched no failure (not an error: the exit status stays)."""
    known = config.stash.get(KNOWN_FAILURES, None)
    if known is None or hasattr(config, "workerinput"):
        return
    lines = known.unused_lines()  # type: ignore[attr-defined]
    if lines:
        terminalreporter.section("specaudit: known failures that matched nothing", sep="-")
        for line in lines:
            terminalreporter.write_line(line)
