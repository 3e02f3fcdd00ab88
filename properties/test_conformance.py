"""The conformance suite: one property per check of the registry (`specaudit.checks.registry`), run
for every decoder under test (`--decoder module:attr`, default: the reference decoders) on
every built-in model. Each property states its check's sentence and calls that check by name;
the decoder contract is part of every property. A failing example is noted on the property's own
pytest item (`request.node`), where the plugin finds the shrunk one to write and to xfail.

The eight properties of one decoder x model draw the same cases (`properties/conftest.py`), and
each case is run once and judged once per check (`judged`): the first property to draw a case
runs it (`cached_run`) and judges it by the checks of every property this session runs, the
others read their check's outcome (a property that has failed judges its shrink candidates by its
own check only). A property rejects a case it has already seen pass (a repeat drawn from other
choices), so the profile's examples are distinct cases (`specaudit.config.profiles.suite_examples`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import event, given, reject
from hypothesis import strategies as st
from hypothesis.errors import UnsatisfiedAssumption

from specaudit.audits.sampling import samples
from specaudit.checks.registry import BATCH_ORDER, NOT_APPLICABLE, CheckOutcome, check_named, outcome_of
from specaudit.commands.pytest_notes import remember_failure
from specaudit.contracts.case import Case
from specaudit.contracts.violation import explain
from specaudit.running.runner import Run, cached_run
from specaudit.search.strategies import cases

pytestmark = pytest.mark.specaudit


def conformance(name: str) -> Callable[[Any], Any]:
    """Mark a property as the one for registry check `name`; its docstring is the check's statement."""
    check = check_named(name)

    def mark(test: Any) -> Any:
        test.specaudit_check = check.name
        test.__doc__ = check.statement[0].upper() + check.statement[1:] + "."
        return test

    return mark


# ---------------------------------------------------------------------------------------
# One run per case, one judgement per check: kept for the session, where runs are not (a
# parametrization draws a few hundred cases; `cached_run` keeps the last 64 runs)


@dataclass(frozen=True)
class Judgement:
    """One check's outcome on one case; for a check that does not apply, whether the decoder is why."""

    outcome: CheckOutcome
    of_decoder: bool = False


_JUDGED: dict[tuple[str, Case], dict[str, Judgement]] = {}
_PASSED: set[tuple[str, str, Case]] = set()  # (check, decoder, case) a property has seen not fail
_DRAWN: dict[str, list[Case]] = {}  # item node id -> the cases its property judged, in order (not shrinking)
_STREAMS: dict[Hashable, tuple[Case, ...]] = {}  # stream key -> the cases a property drew and passed on
SHRINKING = pytest.StashKey[bool]()
"""On a property's item once it has failed: the cases it draws next are the shrinker's candidates,
judged by its own check only (the other properties draw them only if they fail alike)."""


def judgement(name: str, run: Run) -> Judgement:
    """Check `name` on `run` after the contract: a contract violation is every property's failure."""
    outcome = outcome_of("contract", run)
    if not outcome.violations:
        outcome = outcome_of(name, run)
    unmet = check_named(name).unmet(run) if outcome.status == NOT_APPLICABLE else None
    return Judgement(outcome, unmet is not None and unmet.of_decoder)


def judged(decoder: str, case: Case, names: Iterable[str]) -> dict[str, Judgement]:
    """The judgements of `names` on `case`, each made once per session from one run of it."""
    known = _JUDGED.setdefault((decoder, case), {})
    missing = [name for name in names if name not in known]
    if missing:
        run = cached_run(decoder, case)
        known.update((name, judgement(name, run)) for name in missing)
    return known


def session_checks(request: pytest.FixtureRequest, name: str) -> tuple[str, ...]:
    """`name`, then the checks of every property this session runs: what a case's first property
    judges for all of them, so its run is not needed again after it leaves `cached_run`."""
    session = request.session
    selected = getattr(session, "_specaudit_checks", None)
    if selected is None:
        checks = (getattr(getattr(item, "obj", None), "specaudit_check", None) for item in session.items)
        selected = tuple(dict.fromkeys(check for check in checks if check is not None))
        session._specaudit_checks = selected  # type: ignore[attr-defined]
    return (name, *(check for check in selected if check != name))


def assert_check(name: str, decoder: str, case: Case, request: pytest.FixtureRequest) -> None:
    """The contract, then check `name`: a violation fails (noted on the test's item for the
    plugin); a check the decoder cannot be judged by skips the test, one this case does not
    allow is noted as a Hypothesis event; a case this property has seen pass is a repeat, rejected."""
    if (name, decoder, case) in _PASSED:
        reject()
    shrinking = request.node.stash.get(SHRINKING, False)
    if not shrinking:
        _DRAWN.setdefault(request.node.nodeid, []).append(case)
    verdict = judged(decoder, case, (name,) if shrinking else session_checks(request, name))[name]
    outcome = verdict.outcome
    if outcome.status == NOT_APPLICABLE:
        if verdict.of_decoder:
            pytest.skip(f"{name} not applicable to {decoder}: {outcome.why}")
        event(f"{name} not applicable: {outcome.why}")
    violations = list(outcome.violations)
    if not violations:
        _PASSED.add((name, decoder, case))
        return
    request.node.stash[SHRINKING] = True
    run = cached_run(decoder, case)
    remember_failure(run, violations, request.node)
    raise AssertionError(explain(run, violations))


def check_drawn(name: str, decoder: str, model: str, data: st.DataObject, request: pytest.FixtureRequest) -> None:
    if samples(decoder):
        pytest.skip(f"{decoder} samples: it is judged in distribution (properties/test_sampling.py)")
    assert_check(name, decoder, data.draw(cases(model), label="case"), request)


def conformance_property(name: str) -> Callable[..., None]:
    """The property of registry check `name`, called after its title (`test_i1_rectangular_alignment`)."""

    @conformance(name)
    @given(data=st.data())
    def prop(specaudit_decoder: str, specaudit_model: str, data: st.DataObject, request: pytest.FixtureRequest) -> None:
        check_drawn(name, specaudit_decoder, specaudit_model, data, request)

    prop.__name__ = prop.__qualname__ = "test_" + re.sub(r"[^a-z0-9]+", "_", check_named(name).title.lower())
    return prop


# One property per check that judges a decoder's run, generated from the registry: a new check needs none written.
globals().update({prop.__name__: prop for prop in map(conformance_property, BATCH_ORDER)})


# ---------------------------------------------------------------------------------------
# One draw per stream: the properties of one decoder x model draw the same cases (one seed, one
# budget), and drawing a case costs as much as judging it by all eight checks (Hypothesis
# draws a prompt token by token). Once one property has passed on its stream, another whose
# check passes on every case of that stream has its outcome: Hypothesis would draw the same
# cases for it (the engine is deterministic given the seed and the same outcomes: a pass, or the
# rejection of a repeat). Where its check fails on a case, or no stream is known, it draws.


def stream_passed(item: pytest.Item, key: Hashable) -> None:
    """`item`'s property passed: its drawn cases are the stream of `key` (the first one kept)."""
    drawn = _DRAWN.pop(item.nodeid, [])
    if drawn:
        _STREAMS.setdefault(key, tuple(drawn))


def passes_known_stream(item: pytest.Item, key: Hashable) -> bool:
    """True when a stream of `key` is known and `item`'s check passes on each of its cases
    (judged from the runs of the cases, run again where they left `cached_run`): the property's
    outcome without drawing. False where it must draw: no stream, or a case its check does not pass."""
    stream = _STREAMS.get(key)
    name = getattr(getattr(item, "obj", None), "specaudit_check", None)
    decoder = getattr(getattr(item, "callspec", None), "params", {}).get("specaudit_decoder")
    if not stream or name is None or decoder is None:
        return False
    for case in stream:
        try:
            verdict = judged(decoder, case, (name,))[name]
        except UnsatisfiedAssumption:  # `cached_run` gave up on a hanging decoder: draw, as the property would
            return False
        if verdict.outcome.violations or verdict.of_decoder:
            return False
    return True
