"""The pytest plugin and the suite's conftest, run as users run them.

Every run is a subprocess: profiles, options and imported decoders are process state that
must not leak into this session. Runs cost seconds each, so there are few of them.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import specaudit.running.runner  # noqa: F401 (torch, imported before any pytester test: see below)
from specaudit.contracts.builtins import DEFAULT_DECODERS, MODELS

# pytester restores sys.modules after each test, and a torch first imported inside one (by an
# in-process `specaudit replay`) cannot be imported again by a later test: its operator libraries
# stay registered. Imported here, it is in the snapshot and stays.

PROPERTIES = Path(__file__).resolve().parents[2] / "properties"
EQSPEC = "specaudit.reference.eqspec:EqSpec"
MUTANT = "specaudit.reference.mutants:rejected_kv_attended"
FREE_LIST = "specaudit.reference.engine_mutants:FreeListOffByOne"  # a planted engine bug, caught in about a second

SMALL = """
import pytest

pytestmark = pytest.mark.specaudit


def test_decoder(specaudit_decoder: str) -> None:
    from specaudit.contracts.decoder import instantiate, load_decoder

    assert callable(instantiate(load_decoder(specaudit_decoder), specaudit_decoder).generate)


def test_model(specaudit_decoder: str, specaudit_model: str) -> None:
    from specaudit.contracts.builtins import MODELS

    assert specaudit_model in MODELS
"""

UNRELATED = """
import sys

import pytest
from hypothesis import given, settings, strategies as st


@pytest.fixture
def decoder_spec() -> str:
    return "mine"


@pytest.fixture
def model() -> str:
    return "mine"


def test_unrelated(decoder_spec: str, model: str) -> None:
    print("MAX_EXAMPLES", settings.default.max_examples, "PROFILE", settings.get_current_profile_name())
    print("TORCH", "torch" in sys.modules)
    assert (decoder_spec, model) == ("mine", "mine")
"""

NO_SHRINK = """
import pytest
from hypothesis import Phase, settings


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    # after the suite's conftest: its dev profile, minus the (slow) shrink phase
    phases = (Phase.explicit, Phase.reuse, Phase.generate)
    settings.register_profile("no-shrink", parent=settings.get_profile("specaudit-dev"), phases=phases)
    settings.load_profile("no-shrink")
"""

RECORD_CASES = """
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import settings

import specaudit.running.runner


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    # after the suite's conftest: its ci profile (derandomized), fewer examples
    settings.register_profile("ci-few", parent=settings.get_profile("specaudit-ci"), max_examples=3)
    settings.load_profile("ci-few")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    real, drawn, runs, draws = item.module.judged, [], [], []
    real_run, real_draw = specaudit.running.runner.run_case, item.module.check_drawn

    def recording(spec, case, *checks):
        # what was drawn, but the model and the EOS and pad ids (picked from the model's oracle)
        drawn.append(repr(replace(case, model="?", eos_token_id=None, pad_token_id=0)))
        return real(spec, case, *checks)

    def counting(spec, case):
        runs.append(1)
        return real_run(spec, case)

    def drawing(*args):
        draws.append(1)
        return real_draw(*args)

    item.module.judged, specaudit.running.runner.run_case, item.module.check_drawn = recording, counting, drawing
    try:
        yield
    finally:
        item.module.judged, specaudit.running.runner.run_case, item.module.check_drawn = real, real_run, real_draw
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        record = {"item": item.name, "cases": drawn, "runs": len(runs), "draws": len(draws), "worker": worker}
        with Path("drawn.jsonl").open("a") as out:
            out.write(json.dumps(record) + "\\n")
"""


@pytest.fixture
def small(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A pytester dir holding a small specaudit test file (CI unset)."""
    monkeypatch.delenv("CI", raising=False)
    pytester.makepyfile(test_small=SMALL)
    return pytester


def output(result: pytest.RunResult) -> str:
    return result.stdout.str() + "\n" + result.stderr.str()


def nothing_ran(result: pytest.RunResult) -> bool:
    """No test passed or failed (a usage or collection error has no summary counts of either)."""
    return re.search(r"\d+ (passed|failed)", result.stdout.str()) is None


def test_default_decoders_are_the_references(small: pytest.Pytester) -> None:
    """Without a decoder option, `specaudit_decoder` runs each reference decoder, `specaudit_model` each model."""
    assert DEFAULT_DECODERS[0] == EQSPEC
    result = small.runpytest_subprocess("-v", "--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=len(DEFAULT_DECODERS) * (1 + len(MODELS)))
    for spec in DEFAULT_DECODERS:
        result.stdout.fnmatch_lines([f"*test_decoder?{spec}? PASSED*"])
        for model in MODELS:
            result.stdout.fnmatch_lines([f"*test_model?{spec}-{model}? PASSED*"])


def test_repeated_decoder_parametrizes_each(small: pytest.Pytester) -> None:
    """`--specaudit-decoder` given twice replaces the default and parametrizes every test with both, in order."""
    mutant = "specaudit.reference.mutants:bonus_from_draft"
    result = small.runpytest_subprocess(
        "-v",
        "-p",
        "no:cacheprovider",
        "--specaudit-decoder",
        EQSPEC,
        "--specaudit-decoder",
        mutant,
        "--specaudit-models",
        "transparent",
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


def test_missing_decoder_module_is_a_usage_error(small: pytest.Pytester) -> None:
    """A decoder module that does not exist: pytest's usage-error exit, the module named on stderr, nothing run."""
    result = small.runpytest_subprocess("-p", "no:cacheprovider", "--specaudit-decoder", "specaudit_nosuchmod:X")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "'specaudit_nosuchmod' not found" in result.stderr.str()
    assert nothing_ran(result)


def test_decoder_module_raising_on_import_fails_clearly(small: pytest.Pytester) -> None:
    """A decoder module that raises on import stops the run, naming the module and its exception."""
    small.makepyfile(specaudit_badmod="raise RuntimeError('no GPU here')\n")
    result = small.runpytest_subprocess("-p", "no:cacheprovider", "--specaudit-decoder", "specaudit_badmod:Decoder")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "'specaudit_badmod' failed to import: RuntimeError: no GPU here" in output(result)
    assert nothing_ran(result)


def test_unknown_model_is_a_usage_error(small: pytest.Pytester) -> None:
    """`--specaudit-models` naming no built-in model stops the run and lists the built-in ones."""
    result = small.runpytest_subprocess("-p", "no:cacheprovider", "--specaudit-models", "transparent,gpt7")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "unknown model(s) gpt7" in result.stderr.str() and "transparent" in result.stderr.str()


def test_plugin_is_inert_in_an_unrelated_project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """With CI=true in a project that does not use specaudit: Hypothesis keeps its own profile (100 examples),
    torch is not imported, no unprefixed option is added and a test with `decoder_spec`/`model` is not parametrized."""
    monkeypatch.setenv("CI", "true")
    pytester.makepyfile(test_unrelated=UNRELATED)
    result = pytester.runpytest_subprocess("-s", "-v", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*MAX_EXAMPLES 100 PROFILE ci", "TORCH False"])
    assert "test_unrelated[" not in result.stdout.str(), "the test was parametrized"
    assert "specaudit" in pytester.runpytest_subprocess("--trace-config").stdout.str()  # the plugin is loaded
    helped = pytester.runpytest_subprocess("--help").stdout.str()
    assert "--specaudit-decoder" in helped
    assert re.search(r"^\s+--(decoder|models)\b", helped, re.M) is None, "unprefixed options leaked"


@pytest.mark.slow
def test_suite_adds_short_options_and_its_profile(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only where the suite runs: `--decoder`/`--models` exist and specaudit-ci is loaded when CI is set."""
    monkeypatch.setenv("CI", "true")
    helped = pytester.runpytest_subprocess(str(PROPERTIES), "--help").stdout.str()
    assert re.search(r"^\s+--decoder\b", helped, re.M) and re.search(r"^\s+--models\b", helped, re.M)
    collected = pytester.runpytest_subprocess(str(PROPERTIES), "--co", "-v", "-p", "no:cacheprovider")
    collected.stdout.fnmatch_lines(["*hypothesis profile 'specaudit-ci'*"])
    chosen = pytester.runpytest_subprocess(
        str(PROPERTIES), "--co", "-v", "-p", "no:cacheprovider", "--hypothesis-profile", "specaudit-thorough"
    )
    chosen.stdout.fnmatch_lines(["*hypothesis profile 'specaudit-thorough'*"])


DECODERS_ONLY = ("-k", "not test_engines")
"""For a run about decoders: without it the engine property runs too, for the default engines."""


def run_properties(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """The real properties on the transparent model, dev profile without shrinking, seed 0."""
    pytester.makepyfile(specaudit_no_shrink=NO_SHRINK)
    return pytester.runpytest_subprocess(
        str(PROPERTIES),
        "-p",
        "specaudit_no_shrink",
        "--models",
        "transparent",
        "--hypothesis-seed",
        "0",
        "-p",
        "no:cacheprovider",
        "-v",
        *args,
    )


@pytest.mark.slow
def test_each_decoder_is_judged_by_the_properties(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the real properties EqSpec passes every one; a planted bug fails I2 with evidence and leaves
    a reproducer per failing property, its evidence naming the catalog's signature for the bug (as
    an engine's does), which `specaudit replay FILE` fails again with that signature."""
    from specaudit.artifacts.reproducer import load_reproducer
    from specaudit.commands.cli import main
    from specaudit.reference.mutants import CATALOG

    monkeypatch.delenv("CI", raising=False)
    out = pytester.path / "repro"
    result = run_properties(
        pytester, "--decoder", EQSPEC, "--decoder", MUTANT, "--specaudit-out", str(out), *DECODERS_ONLY
    )
    result.stdout.fnmatch_lines(["*hypothesis profile*no-shrink*"])
    text = result.stdout.str()
    assert re.search(rf"\[{re.escape(EQSPEC)}-transparent\] (FAILED|ERROR)", text) is None, "EqSpec failed"
    assert result.parseoutcomes().get("passed", 0) >= 4, "EqSpec should pass every property"
    result.stdout.fnmatch_lines([f"*test_i2_*?{MUTANT}-transparent? FAILED*"])
    assert f"decoder {MUTANT} on Case(" in text
    result.stdout.fnmatch_lines(["*[[]I2: *[]] target call *, row *, slot *: got * but should be *"])
    written = sorted(out.glob("*.json"))
    assert written and all("mutants" in p.name for p in written), written
    bug = CATALOG[MUTANT.rsplit(":", 1)[1]].bug
    for path in written:
        written_back = load_reproducer(path)
        signature = written_back.evidence.get("signature")
        assert written_back.kind == "decoder-case" and written_back.subject["decoder"] == MUTANT, written_back
        assert signature == bug.signature, f"{path}: signature {signature!r}, the catalog's {bug.signature!r}"
        capsys.readouterr()
        assert main(["replay", str(path), "--json"]) == 1, f"the replay of {path} should fail"
        replayed = json.loads(capsys.readouterr().out)
        assert replayed["signature"] == signature, f"replay of {path}: {replayed['signature']!r}, file {signature!r}"


@pytest.mark.slow
def test_known_failures_file_turns_listed_failures_into_xfail(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--specaudit-xfails`: failures whose every violation is listed are xfailed (exit 0); others still fail."""
    monkeypatch.delenv("CI", raising=False)
    everything = pytester.makefile(".txt", known=f"# the planted bug, as known\n{MUTANT} transparent * *\n")
    result = run_properties(pytester, "--decoder", MUTANT, "--specaudit-xfails", str(everything), *DECODERS_ONLY)
    assert result.ret == 0, output(result)
    assert result.parseoutcomes().get("xfailed", 0) >= 1
    only_i1 = pytester.makefile(".txt", partial=f"{MUTANT} transparent I1 *\n")
    result = run_properties(pytester, "--decoder", MUTANT, "--specaudit-xfails", str(only_i1), "-k", "test_i2")
    assert result.ret == 1 and result.parseoutcomes().get("failed", 0) >= 1


@pytest.mark.slow
def test_an_efficiency_finding_is_xfail_unless_strict(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Token preservation alone (the output and invariants right) is a cost: the property reports it as
    xfail, with its reproducer, and `--strict-efficiency` makes it a failure (issue 38, point 3)."""
    monkeypatch.delenv("CI", raising=False)
    wasteful = "specaudit.reference.mutants:acceptance_one_short"
    args = ("--decoder", wasteful, "-k", "test_token_preservation", "-rx")
    result = run_properties(pytester, *args)
    assert result.ret == 0 and result.parseoutcomes().get("xfailed") == 1, output(result)
    assert "efficiency finding" in output(result)
    result = run_properties(pytester, *args, "--strict-efficiency")
    assert result.ret == 1 and result.parseoutcomes().get("failed") == 1, output(result)


def run_engine_property(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """The engine property alone on the planted FreeListOffByOne, transparent model, seed 0."""
    return run_properties(pytester, "-k", "test_engine_matches_oracle", "--engine", FREE_LIST, *args)


def test_failing_engine_property_writes_a_replayable_reproducer(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A failing engine property writes its shrunk rule sequence to --specaudit-out, with the engine
    diagnosis in the evidence (where a decoder's signature goes): the catalog's signature, check and
    rule for the planted bug. `specaudit replay FILE` (its own engine, or --engine SPEC) fails it
    again with the same check and rule."""
    from specaudit.commands.cli import main
    from specaudit.reference.engine_mutants import ENGINE_CATALOG

    monkeypatch.delenv("CI", raising=False)
    out = pytester.path / "repro"
    result = run_engine_property(pytester, "--specaudit-out", str(out))
    assert result.ret == 1 and result.parseoutcomes().get("failed") == 1, output(result)
    written = sorted(out.glob("*.json")) if out.is_dir() else []
    assert len(written) == 1 and "FreeListOffBy" in written[0].name, f"{out} holds {written}, should hold one"
    assert f"reproducer written to {written[0]}" in result.stdout.str(), output(result)
    from specaudit.artifacts.reproducer import load_reproducer

    written_back = load_reproducer(written[0])
    record = {**written_back.engine_rules(), **written_back.evidence}
    assert written_back.kind == "engine-ops" and record["engine"] == FREE_LIST, record
    assert record["model"] == "transparent" and record["ops"], record
    bug = ENGINE_CATALOG[FREE_LIST.rsplit(":", 1)[1]].bug
    assert record.get("signature") == bug.signature, f"{written[0]}: signature {record.get('signature')!r}"
    diagnosis = record.get("diagnosis") or {}
    where = ("first_check", "rule", "step", "call", "request", "row", "slot", "signature", "reason")
    assert set(where) <= set(diagnosis), f"{written[0]}: the evidence's diagnosis {diagnosis} lacks fields"
    assert (diagnosis["first_check"], diagnosis["rule"], diagnosis["signature"]) == (
        bug.first_check,
        bug.rule,
        bug.signature,
    ), diagnosis
    assert (record["first_check"], record["rule"]) == (bug.first_check, bug.rule), record
    for engine in ([], ["--engine", FREE_LIST]):
        capsys.readouterr()
        assert main(["replay", str(written[0]), *engine, "--json"]) == 1, f"the replay {engine} should fail"
        replayed = json.loads(capsys.readouterr().out)
        found, expected = (replayed["first_check"], replayed["rule"]), (record["first_check"], record["rule"])
        assert found == expected, f"replay of {written[0]} {engine} failed {found}, the property {expected}"


@pytest.mark.slow
def test_known_engine_failure_is_xfail(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """An xfails line `ENGINE MODEL CHECK RULE` covering the engine property's failure makes it xfail
    (exit 0), like a decoder's; a line for another rule leaves it failing."""
    monkeypatch.delenv("CI", raising=False)
    listed = pytester.makefile(".txt", known=f"{FREE_LIST} transparent contract has-unfinished\n")
    result = run_engine_property(pytester, "--specaudit-xfails", str(listed), "-rx")
    assert result.ret == 0 and result.parseoutcomes().get("xfailed") == 1, output(result)
    result.stdout.fnmatch_lines(["*known failure (contract has-unfinished); reproducer *"])
    other = pytester.makefile(".txt", other=f"{FREE_LIST} transparent I2 *\n")
    result = run_engine_property(pytester, "--specaudit-xfails", str(other))
    assert result.ret == 1 and result.parseoutcomes().get("failed") == 1, output(result)


def test_malformed_known_failures_file_is_a_usage_error(small: pytest.Pytester) -> None:
    """A known-failures line without four fields stops the run, naming the file and line."""
    bad = small.makefile(".txt", bad="one two\n")
    result = small.runpytest_subprocess("-p", "no:cacheprovider", "--specaudit-xfails", str(bad))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "bad.txt:1" in result.stderr.str()


def test_nondeterministic_decoder_gets_its_own_verdict(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decoder that fails a case only sometimes fails the suite, told as nondeterminism with its replay rate."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    result = run_properties(pytester, "--decoder", "decoders.flaky:Flaky", "-k", "equivalence")
    assert result.ret == 1, output(result)
    result.stdout.fnmatch_lines(["*nondeterministic decoder: the failing case failed again in ? of 3 fresh runs*"])


def drawn_cases(pytester: pytest.Pytester, *args: str) -> dict[str, list[str]]:
    """{item name: the cases it drew, model blanked} for a run of the real properties under specaudit-ci."""
    pytester.makepyfile(specaudit_record_cases=RECORD_CASES)
    (pytester.path / "drawn.jsonl").unlink(missing_ok=True)
    result = pytester.runpytest_subprocess(
        str(PROPERTIES), "-p", "specaudit_record_cases", "-p", "no:cacheprovider", *args
    )
    assert result.ret == 0, output(result)
    return {name: record["cases"] for name, record in drawn_records(pytester).items()}


def drawn_records(pytester: pytest.Pytester) -> dict[str, dict]:
    lines = (pytester.path / "drawn.jsonl").read_text().splitlines()
    return {record["item"]: record for record in map(json.loads, lines)}


@pytest.mark.slow
def test_each_parametrization_draws_its_own_cases(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the derandomized ci profile, gpt2 and llama (same strategy bounds) draw different cases
    for one property, and each draws the same cases again in a second run; `--hypothesis-seed`
    overrides the per-parametrization seed (both models then draw alike)."""
    monkeypatch.setenv("CI", "true")
    select = ("-k", "test_decoder_contract", "--decoder", EQSPEC, "--models", "gpt2,llama")
    first, again = drawn_cases(pytester, *select), drawn_cases(pytester, *select)
    gpt2, llama = (first[f"test_decoder_contract[{EQSPEC}-{model}]"] for model in ("gpt2", "llama"))
    assert gpt2 and llama, f"no case recorded: {first}"
    assert gpt2 != llama, f"gpt2 and llama drew the same {len(gpt2)} cases, should differ; the last: {gpt2[-1][:300]}"
    assert again == first, f"a second run drew {again}, should repeat the first run's {first}"
    forced = drawn_cases(pytester, *select, "--hypothesis-seed", "7")
    assert len(set(map(tuple, forced.values()))) == 1, f"--hypothesis-seed 7 should draw alike for each model: {forced}"


@pytest.mark.slow
def test_a_parametrizations_properties_judge_the_same_runs(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cases drawn once are judged by every check: under `-n 2` the contract and I1 properties of one
    decoder x model run on one worker, judge the same cases, and the second runs none of its own
    and draws none (it passes on the first one's stream)."""
    monkeypatch.setenv("CI", "true")
    pytester.makepyfile(specaudit_record_cases=RECORD_CASES)
    (pytester.path / "drawn.jsonl").unlink(missing_ok=True)
    select = ("-k", "test_decoder_contract or test_i1_rectangular", "--decoder", EQSPEC, "--models", "gpt2,llama")
    result = pytester.runpytest_subprocess(
        str(PROPERTIES), "-p", "specaudit_record_cases", "-p", "no:cacheprovider", "-n", "2", *select
    )
    assert result.ret == 0, output(result)
    records = drawn_records(pytester)
    for model in ("gpt2", "llama"):
        first, second = (
            records[f"{name}[{EQSPEC}-{model}]"] for name in ("test_decoder_contract", "test_i1_rectangular_alignment")
        )
        assert first["worker"] == second["worker"], (
            f"{model}: the two properties ran on workers {first['worker']}, {second['worker']}"
        )
        assert first["cases"] == second["cases"], f"{model}: the properties drew different cases"
        ran = sorted((first["runs"], second["runs"]))
        assert ran[0] == 0 < ran[1], (
            f"{model}: decoder runs per property {ran}, expected the second to reuse the first's"
        )
        draws = sorted((first["draws"], second["draws"]))
        assert draws[0] == 0 < draws[1], f"{model}: cases drawn per property {draws}, expected one draw per stream"


def test_item_seed_is_shared_by_a_parametrizations_properties() -> None:
    """`item_seed`: a stable hash of the item's parametrization under a derandomized profile, the
    same for two properties of one decoder x model and different across models; `--hypothesis-seed`
    instead where given; under a random profile a seed per run (still shared by the properties);
    None for an explicit `@seed` or a plain test."""
    from hypothesis import given, seed, settings
    from hypothesis import strategies as st

    from specaudit.properties.conftest import item_seed

    @given(st.integers())
    def prop(n: int) -> None: ...

    def item(name: str, obj: object = prop, forced: str | None = None, config: object = None) -> SimpleNamespace:
        callspec = SimpleNamespace(id=name.partition("[")[2].rstrip("]"))
        config = config or SimpleNamespace(getoption=lambda *_, **__: forced)
        return SimpleNamespace(obj=obj, name=name, callspec=callspec, config=config)

    before = settings.get_current_profile_name()
    settings.register_profile("test-random", derandomize=False)
    settings.register_profile("test-derandomized", derandomize=True, database=None)
    try:
        settings.load_profile("test-random")
        assert item_seed(item("p[a-gpt2]", forced="7")) is None, "Hypothesis's own --hypothesis-seed should apply"
        run, other_run = (SimpleNamespace(getoption=lambda *_, **__: None) for _ in range(2))
        p, q = item_seed(item("p[a-gpt2]", config=run)), item_seed(item("q[a-gpt2]", config=run))
        assert p == q, f"two properties of one parametrization should share a run's seed: {p}, {q}"
        assert p != item_seed(item("p[a-gpt2]", config=other_run)), "another run should draw anew"
        settings.load_profile("test-derandomized")
        gpt2, llama = item_seed(item("p[a-gpt2]")), item_seed(item("p[a-llama]"))
        assert gpt2 == item_seed(item("q[a-gpt2]")) and gpt2 != llama, f"seeds {gpt2}, {llama}: per parametrization"
        assert gpt2 == int.from_bytes(hashlib.sha256(b"[a-gpt2]").digest()[:8], "big"), f"seed {gpt2} not sha256"
        assert item_seed(item("p[a-gpt2]", forced="7")) == 7, "--hypothesis-seed should win"
        assert item_seed(item("p[a-gpt2]", seed(3)(prop))) is None, "an explicit @seed should win"
        assert item_seed(item("p[a-gpt2]", lambda: None)) is None, "a test without @given should be left alone"
    finally:
        settings.load_profile(before)


def test_a_decoder_reproducer_without_a_diagnosis_is_still_written(tmp_path: Path) -> None:
    """`diagnosed_again`: a case that no longer runs (its decoder gone) gives None, one that passes
    this time (a nondeterministic decoder) no signature; either way the record is written, unsigned,
    and reads back; a signed record's signature lands in the evidence."""
    from specaudit.artifacts.reproducer import load_reproducer
    from specaudit.commands.pytest_plugin import diagnosed_again, write
    from specaudit.contracts.case import Case

    case = Case(((3, 4, 5),), ("1010",), num_draft_tokens=2, max_new_tokens=4, eos_token_id=None, pad_token_id=0)
    gone = {"case": case.to_json(), "decoder": "no_such_module_here:Decoder", "evidence": []}
    assert diagnosed_again(gone) is None
    assert diagnosed_again(dict(gone, decoder=EQSPEC)) == (None, False), "EqSpec passes: no signature"
    unsigned = load_reproducer(write(str(tmp_path), "gone", gone))
    assert unsigned.kind == "decoder-case" and "signature" not in unsigned.evidence, unsigned.evidence
    assert unsigned.case == case
    signed = load_reproducer(write(str(tmp_path), "signed", dict(gone, signature="kv-drift")))
    assert signed.evidence.get("signature") == "kv-drift", signed.evidence
