"""How far the conformance suite explores (issue 27, point 7): its eight properties share one stream
of cases per decoder x model, and the runs that saves go to more distinct cases
(`specaudit.config.profiles.SUITE_EXAMPLES`), so a bug that needs a long generation is caught."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.errors import UnsatisfiedAssumption

import specaudit.running.runner  # noqa: F401 (torch first imported outside pytester: see test_plugin.py)
from specaudit.config.profiles import PROFILE_EXAMPLES, SUITE_EXAMPLES
from specaudit.contracts.case import Case

ROOT = Path(__file__).resolve().parents[2]
PROPERTIES = ROOT / "properties"
LATE_BUG = "tests.decoders.late_bug:LateBug"

CI_WITHOUT_SHRINKING = """
import pytest
from hypothesis import Phase, settings


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    # after the suite's conftest: specaudit-ci itself (its name, hence its budget), minus the shrink phase
    ci = settings.get_profile("specaudit-ci")
    settings.register_profile("specaudit-ci", parent=ci, phases=(Phase.explicit, Phase.reuse, Phase.generate))
    settings.load_profile("specaudit-ci")
"""


@pytest.mark.slow
def test_the_suite_catches_a_bug_that_needs_a_long_generation(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/decoders/late_bug.py goes wrong only once a row has generated more than 40 tokens; the
    equivalence property catches it under specaudit-ci (shrinking left out, for time). With 30 cases
    per decoder x model, as before SUITE_EXAMPLES, its stream holds no such row and it passes."""
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makepyfile(specaudit_ci_without_shrinking=CI_WITHOUT_SHRINKING)
    result = pytester.runpytest_subprocess(
        str(PROPERTIES),
        "-p",
        "specaudit_ci_without_shrinking",
        "-p",
        "no:cacheprovider",
        "--decoder",
        LATE_BUG,
        "--models",
        "transparent",
        "-k",
        "test_output_equivalence",
    )
    text = result.stdout.str() + result.stderr.str()
    assert result.ret == 1 and result.parseoutcomes().get("failed") == 1, text[-3000:]
    assert "[equivalence: first-divergence]" in text, text[-3000:]


def property_item(model: str | None = "transparent", own_settings: bool = False) -> SimpleNamespace:
    """A stand-in pytest item for a conformance property on `model` (None: a plain test)."""

    @given(st.integers())
    def prop(n: int) -> None: ...

    if model is not None:
        prop.specaudit_check = "I1"  # type: ignore[attr-defined]
    if own_settings:
        settings(max_examples=2)(prop)
    return SimpleNamespace(obj=prop, callspec=SimpleNamespace(params={"specaudit_model": model}))


def test_conformance_properties_draw_the_suite_budget() -> None:
    """`suite_settings`: under specaudit-ci a conformance property gets 240 distinct cases on the
    transparent model (eight times the profile's 30, what the eight properties drew apart before
    they shared) and 60 on a tiny real one; under any other profile that profile's max_examples; a
    plain test, or a property with @settings of its own, is left alone."""
    from specaudit.config.profiles import REAL_MODEL_SHARE, register_profiles
    from specaudit.properties.conftest import suite_settings

    register_profiles()
    before = settings.get_current_profile_name()
    try:
        settings.load_profile("specaudit-ci")
        exact, real = (suite_settings(property_item(model)) for model in ("transparent", "llama"))
        assert exact is not None and exact.max_examples == SUITE_EXAMPLES["specaudit-ci"] == 240, exact
        assert SUITE_EXAMPLES["specaudit-ci"] >= 8 * PROFILE_EXAMPLES["specaudit-ci"]
        assert real is not None and real.max_examples == 240 // REAL_MODEL_SHARE == 60, real
        assert exact.derandomize, "the profile's other settings should be kept"
        settings.load_profile("specaudit-dev")
        dev = suite_settings(property_item("gpt2"))
        assert dev is not None and dev.max_examples == PROFILE_EXAMPLES["specaudit-dev"] == 15, "dev stays fast"
        settings.register_profile("few-of-ci", parent=settings.get_profile("specaudit-ci"), max_examples=3)
        settings.load_profile("few-of-ci")
        few = suite_settings(property_item("transparent"))
        assert few is not None and few.max_examples == 3, few
        assert suite_settings(property_item(None)) is None, "a plain test should keep its settings"
        assert suite_settings(property_item(own_settings=True)) is None, "its own @settings should win"
    finally:
        settings.load_profile(before)


@pytest.mark.filterwarnings("ignore:Using `reject` outside a property-based test")
def test_a_property_rejects_a_case_it_has_seen_pass(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repeat of a passing case (drawn again from other choices) is rejected, not counted as an
    example: the budget buys distinct cases. The case runs once; another check reads the same run."""
    from specaudit.properties import test_conformance as suite
    from specaudit.running import runner

    case = Case(((5, 6, 7, 211), (8, 9)), ("1111", "0101"), 2, 4, None, 0)
    decoder = "specaudit.reference.eqspec:EqSpec"
    runs: list[Case] = []
    real = runner.run_case

    def counting(spec: str, drawn: Case, **kwargs: object) -> runner.Run:
        runs.append(drawn)
        return real(spec, drawn, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "run_case", counting)
    suite.assert_check("I1", decoder, case, request)  # passes
    with pytest.raises(UnsatisfiedAssumption):
        suite.assert_check("I1", decoder, case, request)
    suite.assert_check("I2", decoder, case, request)  # another check: not a repeat for its property
    # other checks the session selects may run their own variants (order independence: rotated rows)
    assert runs.count(case) == 1, f"the case ran {runs.count(case)} times, should run once"
