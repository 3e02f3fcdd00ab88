"""The pytest plugin, run as a user runs it: `--decoder`, `--models`, the profiles, and the real properties.

Every run is a subprocess: the plugin loads Hypothesis profiles and imports decoders, state that
must not leak into this session. Runs cost seconds each, so there are few of them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specaudit.models import DEFAULT_DECODERS
from specaudit.models import MODELS as DEFAULT_MODELS

CONFORMANCE = Path(__file__).resolve().parents[1] / "properties" / "test_conformance.py"
EQSPEC = "specaudit.reference.eqspec:EqSpec"
MUTANT = "specaudit.reference.mutants:rejected_kv_attended"

SMALL = """
import pytest

pytestmark = pytest.mark.specaudit


def test_decoder(decoder_spec: str) -> None:
    from specaudit.contract import instantiate, load_decoder

    assert callable(instantiate(load_decoder(decoder_spec), decoder_spec).generate)


def test_model(decoder_spec: str, model: str) -> None:
    from specaudit.models import MODELS as DEFAULT_MODELS

    assert model in DEFAULT_MODELS
"""

PROFILE = """
from hypothesis import settings


def test_profile() -> None:
    print("PROFILE", settings.get_current_profile_name(), settings.default.max_examples)
    assert settings.get_current_profile_name() == "dev" and settings.default.max_examples == 15
"""


NO_SHRINK = """
import pytest
from hypothesis import Phase, settings


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    # after specaudit's own pytest_configure: its dev profile, minus the (slow) shrink phase
    phases = (Phase.explicit, Phase.reuse, Phase.generate)
    settings.register_profile("specaudit-no-shrink", parent=settings.get_profile("dev"), phases=phases)
    settings.load_profile("specaudit-no-shrink")
"""


@pytest.fixture
def small(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A pytester dir holding a small specaudit test file; CI unset, so the plugin's default profile is dev."""
    monkeypatch.delenv("CI", raising=False)
    pytester.makepyfile(test_small=SMALL)
    return pytester


def output(result: pytest.RunResult) -> str:
    return result.stdout.str() + "\n" + result.stderr.str()


def nothing_ran(result: pytest.RunResult) -> bool:
    """No test passed or failed (a usage or collection error has no summary counts of either)."""
    return re.search(r"\d+ (passed|failed)", result.stdout.str()) is None


def test_default_decoders_are_the_references(small: pytest.Pytester) -> None:
    """Without --decoder, `decoder_spec` runs each reference decoder (EqSpec first), `model` each built-in model."""
    assert DEFAULT_DECODERS[0] == EQSPEC
    result = small.runpytest_subprocess("-v", "--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=len(DEFAULT_DECODERS) * (1 + len(DEFAULT_MODELS)))
    for spec in DEFAULT_DECODERS:
        result.stdout.fnmatch_lines([f"*test_decoder?{spec}? PASSED*"])
        for model in DEFAULT_MODELS:
            result.stdout.fnmatch_lines([f"*test_model?{spec}-{model}? PASSED*"])


def test_repeated_decoder_parametrizes_each(small: pytest.Pytester) -> None:
    """`--decoder` given twice replaces the default and parametrizes every test with both, in order."""
    mutant = "specaudit.reference.mutants:bonus_from_draft"
    result = small.runpytest_subprocess(
        "-v", "-p", "no:cacheprovider", "--decoder", EQSPEC, "--decoder", mutant, "--models", "transparent"
    )
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(
        [
            f"*test_decoder?{EQSPEC}? PASSED*",
            f"*test_decoder?{mutant}? PASSED*",
            f"*test_model?{EQSPEC}-transparent? PASSED*",
            f"*test_model?{mutant}-transparent? PASSED*",
        ]
    )


def test_missing_decoder_module_fails_naming_it(small: pytest.Pytester) -> None:
    """`--decoder` of a module that does not exist stops the run with a message naming the module."""
    result = small.runpytest_subprocess("-p", "no:cacheprovider", "--decoder", "specaudit_nosuchmod:X")
    assert result.ret != 0
    text = output(result)
    assert "'specaudit_nosuchmod' not found" in text
    assert nothing_ran(result)


def test_missing_decoder_module_is_a_usage_error(small: pytest.Pytester) -> None:
    """`--decoder nosuchmod:X` exits with pytest's usage-error code and names the module on stderr."""
    result = small.runpytest_subprocess("-p", "no:cacheprovider", "--decoder", "specaudit_nosuchmod:X")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "specaudit_nosuchmod" in result.stderr.str()


def test_decoder_module_raising_on_import_fails_clearly(small: pytest.Pytester) -> None:
    """`--decoder` of a module that raises on import stops the run, naming the module and its exception."""
    small.makepyfile(specaudit_badmod="raise RuntimeError('no GPU here')\n")
    result = small.runpytest_subprocess("-p", "no:cacheprovider", "--decoder", "specaudit_badmod:Decoder")
    assert result.ret != 0
    text = output(result)
    assert "'specaudit_badmod' failed to import: RuntimeError: no GPU here" in text
    assert nothing_ran(result)


def test_hypothesis_profile_option_selects_dev(pytester: pytest.Pytester) -> None:
    """`--hypothesis-profile dev` loads specaudit's dev profile (15 examples)."""
    pytester.makepyfile(test_profile=PROFILE)
    result = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider", "--hypothesis-profile", "dev")
    result.assert_outcomes(passed=1)


def test_each_decoder_is_judged_by_the_properties(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run on the real properties, EqSpec passes all four while a planted bug fails I2 and equivalence with evidence."""
    monkeypatch.delenv("CI", raising=False)
    # Shrinking the planted bug's failing case takes 20-90 s; the evidence is there without it.
    pytester.makepyfile(specaudit_no_shrink=NO_SHRINK)
    result = pytester.runpytest_subprocess(
        str(CONFORMANCE),
        "-p",
        "specaudit_no_shrink",
        "--models",
        "transparent",
        "--decoder",
        EQSPEC,
        "--decoder",
        MUTANT,
        "--hypothesis-seed",
        "0",
        "-p",
        "no:cacheprovider",
        "-v",
    )
    result.stdout.fnmatch_lines(["*hypothesis profile*specaudit-no-shrink*"])
    for prop in (
        "i1_rectangular_alignment",
        "i2_position_kv_correspondence",
        "output_equivalence",
        "token_preservation",
    ):
        result.stdout.fnmatch_lines([f"*test_{prop}?{EQSPEC}-transparent? PASSED*"])
    result.stdout.fnmatch_lines(
        [
            f"*test_i2_position_kv_correspondence?{MUTANT}-transparent? FAILED*",
            f"*test_output_equivalence?{MUTANT}-transparent? FAILED*",
        ]
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) >= 2 and outcomes.get("passed", 0) >= 4
    assert f"decoder {MUTANT} on Case(" in result.stdout.str()
    result.stdout.fnmatch_lines(
        ["*[[]I2: attends-wrong-slot[]] target call *, row *, slot *: got slot * holding token * at position *"]
    )
    result.stdout.fnmatch_lines(["*[[]equivalence: first-divergence[]] *got token * at index *"])
