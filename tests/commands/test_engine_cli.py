"""The engine state machine from the command line: `specaudit audit|gate|suite --engine`, and
`replay`/`minimize` on engine reproducers (files with "ops"). A reference engine passes (exit 0),
a planted engine bug fails (exit 1) with a reproducer that replays and shrinks; bad input exits
2 with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from specaudit.artifacts.reproducer import load_engine_reproducer
from specaudit.artifacts.tables import short_name
from specaudit.audits.decoders import audit_plan
from specaudit.audits.engines import audit_engine, engine_plan, planted_engine_bugs
from specaudit.commands.cli import main
from specaudit.config.settings import AuditSettings
from specaudit.contracts.builtins import MODELS
from specaudit.reference.engine_mutants import ENGINE_CATALOG
from specaudit.search.engine_machine import DEFAULT_ENGINES, ENGINE_CHECKS
from specaudit.search.engine_replay import replay

EQSPEC_ENGINE = "specaudit.reference.engines:EqSpecEngine"
ADMIT_POSITIONS = "specaudit.reference.engine_mutants:AdmitPositionsFromWidth"
FREE_LIST = "specaudit.reference.engine_mutants:FreeListOffByOne"  # caught and shrunk in about a second
REPO = Path(__file__).resolve().parents[2]


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specaudit: error: ") and "Traceback" not in err, err
    return err


def only_json(directory: Path) -> Path:
    (path,) = sorted(directory.glob("*.json"))
    return path


# ---------------------------------------------------------------------------------------
# audit --engine, then replay and minimize on what it wrote


@pytest.mark.slow
def test_audit_of_a_reference_engine_passes(capsys: pytest.CaptureFixture[str]) -> None:
    """On every built-in model: the transparent one and the tiny real ones (K/V read by I2)."""
    assert main(["audit", "--engine", EQSPEC_ENGINE, "--examples", "5", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert short_name(EQSPEC_ENGINE) in out and "PASS" in out and f"{len(MODELS)} as expected, 0 not" in out, out
    assert all(model in out for model in MODELS), out
    assert "align%" not in out, "--engine alone audits no decoder (no decoder table)"


@pytest.mark.slow
def test_planted_engine_bug_fails_replays_and_minimizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """audit writes the shrunk rules; replay reproduces them (the reference engine passes them);
    minimize shrinks a padded copy back and writes a regression test that fails on the bug only."""
    argv = ["audit", "--engine", FREE_LIST, "--models", "transparent", "--examples", "10", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "contract" in out and "has-unfinished" in out, out
    report = json.loads((tmp_path / "a" / "report.json").read_text())["entries"]
    assert [r["kind"] for r in report] == ["engine"] and report[0]["rule"] == "has-unfinished", report
    assert report[0]["first"]["rule"] == "has-unfinished" and report[0]["signature"] == "contract", report[0]
    reproducer = only_json(tmp_path / "a" / "repro")
    written = json.loads(reproducer.read_text())
    assert written["kind"] == "engine-ops" and written["payload"]["ops"], written
    assert written["evidence"]["first_check"] == "contract", written

    assert main(["replay", str(reproducer)]) == 1, "the file names its engine: --engine may be left out"
    assert "has-unfinished" in capsys.readouterr().out
    assert main(["replay", str(reproducer), "--engine", FREE_LIST, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["rule"] == "has-unfinished"
    assert main(["replay", str(reproducer), "--engine", EQSPEC_ENGINE]) == 0
    assert "passes every check" in capsys.readouterr().out

    extra = [{"op": "add", "id": 7, "prompt": [40, 41], "max_new_tokens": 3, "accept": "1100000"}, {"op": "step"}]
    padded = dict(written, payload=dict(written["payload"], ops=extra + written["payload"]["ops"]))
    source = tmp_path / "padded.json"
    source.write_text(json.dumps(padded))
    assert main(["minimize", str(source), "--engine", FREE_LIST, "--out", str(tmp_path / "m")]) == 1
    out = capsys.readouterr().out
    assert f"{len(padded['payload']['ops'])} rules -> " in out, out
    minimized = load_engine_reproducer(tmp_path / "m" / "padded.json")
    assert len(minimized["ops"]) < len(padded["payload"]["ops"]), minimized["ops"]
    assert replay(minimized)[0].rule == "has-unfinished"
    (test,) = (tmp_path / "m").glob("test_regression_*.py")
    compile(test.read_text(), str(test), "exec")
    assert main(["minimize", str(source), "--engine", EQSPEC_ENGINE, "--out", str(tmp_path / "m2")]) == 0
    assert "nothing to minimize" in capsys.readouterr().out


def test_default_audit_adds_the_engines() -> None:
    """No --decoder and no --engine: the reference engines (must pass) and every planted engine
    bug (must be caught); --decoder alone runs no engine, --engine alone no decoder."""
    plan = engine_plan(AuditSettings())
    assert [(s, m) for s, expect, m in plan if not expect] == [(s, m) for s in DEFAULT_ENGINES for m in MODELS]
    assert sorted(s for s, expect, _ in plan if expect) == sorted(planted_engine_bugs())
    assert {m for _, expect, m in plan if expect} == {MODELS[0]}, "planted engine bugs: searched on the first model"
    named = engine_plan(AuditSettings(engines=(EQSPEC_ENGINE,), models=("gpt2",)))
    assert named == [(EQSPEC_ENGINE, False, "gpt2")]
    assert len(planted_engine_bugs()) == len(ENGINE_CATALOG) >= 8
    assert engine_plan(AuditSettings(decoders=("specaudit.reference.eqspec:EqSpec",))) == []
    assert audit_plan(AuditSettings(engines=(EQSPEC_ENGINE,))) == []


@pytest.mark.parametrize("name", sorted(ENGINE_CATALOG))
def test_default_audit_catches_each_planted_engine_bug_cheaply(name: str) -> None:
    """The default audit's engine section: each planted bug caught without Hypothesis's shrinking
    (ddmin over the rules instead) in a few seconds, its reproducer replaying the same failure.
    (Unshrunk, a bug may first show through another check than the catalog's, measured on
    Hypothesis's shrunk sequence: FreeListOffByOne also attends a retired row.)"""
    verdict = audit_engine(f"specaudit.reference.engine_mutants:{name}", 30, 0, expect_failure=True, shrink=False)
    assert verdict.as_expected, f"{name}: not caught in {verdict.run.runs} runs"
    first = verdict.violations[0]
    assert first.check in ENGINE_CHECKS, f"{name}: {first}"
    assert verdict.reproducer is not None and len(verdict.reproducer["ops"]) <= 12, verdict.reproducer
    replayed = replay(verdict.reproducer)
    assert replayed and (replayed[0].check, replayed[0].rule) == (first.check, first.rule), f"{name}: {replayed[:1]}"
    assert verdict.run.seconds < 20, f"{name}: {verdict.run.seconds:.1f} s"


# ---------------------------------------------------------------------------------------
# Usage errors


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["audit", "--engine", "nope.nothing:X"], "engine module 'nope.nothing' not found"),
        (["audit", "--engine", "specaudit.reference.engines:Nope"], "has no attribute 'Nope'"),
        (["audit", "--engine", "specaudit.reference.engines"], "not of the form module:attr"),
        (["gate", "--engine", "nope.nothing:X"], "engine module 'nope.nothing' not found"),
        (["audit", "--target", "t", "--engine", EQSPEC_ENGINE], "--engine has no real-model mode"),
        (["minimize", "missing.json", "--engine", EQSPEC_ENGINE], "cannot read reproducer missing.json"),
    ],
)
def test_bad_engine_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(argv) == 2
    assert message in one_error_line(capsys)


def test_engine_reproducer_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file with "ops" is an engine reproducer: --decoder is refused, a malformed rule is named."""
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"engine": EQSPEC_ENGINE, "num_draft_tokens": 1, "eos_token_id": None,
                                "pad_token_id": 0, "ops": [{"op": "add", "id": 0}]}))  # fmt: skip
    assert main(["replay", str(path), "--decoder", "specaudit.reference.eqspec:EqSpec"]) == 2
    assert "engine reproducer" in one_error_line(capsys)
    assert main(["replay", str(path)]) == 2
    assert "rule 0 (add) lacks prompt, max_new_tokens, accept" in one_error_line(capsys)
    path.write_text(json.dumps({"ops": []}))
    assert main(["replay", str(path), "--engine", "nope.nothing:X"]) == 2
    assert "lacks engine" in one_error_line(capsys)
    path.write_text(json.dumps({"engine": EQSPEC_ENGINE, "num_draft_tokens": 1, "eos_token_id": None,
                                "pad_token_id": 0, "model": "gpt7", "ops": []}))  # fmt: skip
    assert main(["replay", str(path)]) == 2
    assert "model 'gpt7' is not a built-in model" in one_error_line(capsys)


@pytest.mark.slow
def test_a_tiny_model_failure_replays_on_its_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An engine failure on tiny GPT-2 leaves a reproducer and a regression test that name the
    model, so both replay it there (on the transparent model the rules would be another test)."""
    argv = ["audit", "--engine", ADMIT_POSITIONS, "--models", "gpt2", "--examples", "10", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 1
    reproducer = only_json(tmp_path / "a" / "repro")
    assert json.loads(reproducer.read_text())["subject"]["model"] == "gpt2"
    (test,) = (tmp_path / "a" / "repro").glob("test_regression_*.py")
    assert "'model': 'gpt2'" in test.read_text()
    capsys.readouterr()
    assert main(["replay", str(reproducer), "--json"]) == 1
    assert '"position-ids"' in capsys.readouterr().out


# ---------------------------------------------------------------------------------------
# gate --engine and suite --engine


@pytest.mark.slow  # the engine state machine's search per engine
def test_gate_runs_engines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One JUnit testcase per engine; the planted bug fails the gate with its reproducer written,
    unless --xfails lists its failure (model `transparent`)."""
    junit, out = tmp_path / "junit.xml", tmp_path / "out"
    argv = ["gate", "--engine", FREE_LIST, "--engine", EQSPEC_ENGINE, "--examples", "8", "--quiet"]
    argv += ["--models", "transparent"]
    assert main([*argv, "--junit", str(junit), "--out", str(out)]) == 1
    assert "gate FAILED" in capsys.readouterr().out
    cases = ET.parse(junit).getroot().findall(".//testcase")
    assert [(c.get("classname"), c.get("name")) for c in cases] == [
        (f"specaudit.{FREE_LIST}", "engine-machine[transparent]"),
        (f"specaudit.{EQSPEC_ENGINE}", "engine-machine[transparent]"),
    ]
    failure = cases[0].find("failure")
    assert failure is not None and failure.get("type") == "contract", ET.tostring(cases[0])
    assert cases[1].find("failure") is None
    assert replay(load_engine_reproducer(only_json(out)))[0].rule == "has-unfinished"

    xfails = tmp_path / "xfails.txt"
    xfails.write_text(f"{FREE_LIST}  transparent  contract  has-unfinished\n")
    assert main([*argv, "--junit", str(junit), "--out", str(tmp_path / "o2"), "--xfails", str(xfails)]) == 0
    assert "1 known failure(s), 0 failed" in capsys.readouterr().out
    skipped = ET.parse(junit).getroot().findall(".//testcase")[0].find("skipped")
    assert skipped is not None and skipped.get("type") == "xfail"


@pytest.mark.slow
def test_suite_runs_the_engine_property_only(tmp_path: Path) -> None:
    """`specaudit suite --engine X` runs the shipped engine property on X (not the batch properties)."""
    env = dict(os.environ, CI="")
    command = [sys.executable, "-m", "specaudit", "suite", "--engine", FREE_LIST, "-q", "-p", "no:randomly"]
    command += ["--models", "transparent,gpt2"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "test_engines.py::test_engine_matches_oracle_at_every_step" in done.stdout, done.stdout[-2000:]
    assert "test_conformance" not in done.stdout and "2 failed" in done.stdout, done.stdout[-2000:]
    assert "FreeListOffByOne-gpt2]" in done.stdout, "--models reaches the engine property"
