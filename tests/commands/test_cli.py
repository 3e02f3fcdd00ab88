"""The command line as a boundary: arguments become typed settings, a UsageError from any layer
becomes one line on stderr and exit 2, `audit`/`replay` exit 0 or 1, and no module below the
CLI sees argparse or builds names lazily."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specaudit.audits.decoders import audit_plan
from specaudit.checks.registry import BATCH_ORDER
from specaudit.commands.cli import main
from specaudit.config.settings import AuditSettings, GateSettings, MinimizeSettings, RealAuditSettings
from specaudit.contracts.builtins import DEFAULT_DECODERS, MODELS
from specaudit.contracts.case import Case
from specaudit.contracts.errors import UsageError
from specaudit.reference.mutants import CATALOG

EQSPEC = "specaudit.reference.eqspec:EqSpec"
MUTANT = "specaudit.reference.mutants:rejected_kv_attended"
HARNESS = Path(__file__).resolve().parents[2] / "harness"


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specaudit: error: ") and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------------------------------
# Usage errors: raised below, told once


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["audit", "--models", "transparent,gpt7"], "unknown model(s) gpt7"),
        (["audit", "--models", " , "], "--models names no model"),
        (["audit", "--examples", "0"], "--examples must be at least 1"),
        (["audit", "--decoder", "specaudit.reference.eqspec"], "not of the form module:attr"),
        (["audit", "--draft", "d", "--prompts", "p"], "--draft, --prompts need --target"),
        (["audit", "--check-rate", "0.5"], "--check-rate needs --target"),
        (["audit", "--target", "t"], "--target needs --draft"),
        (["audit", "--target", "t", "--draft", "d", "--prompts", "p", "--check-rate", "2"], "--check-rate must be"),
        (["replay", "missing.json", "--decoder", EQSPEC], "cannot read reproducer missing.json"),
        (["minimize", "missing.json", "--decoder", EQSPEC, "--budget", "0"], "--budget must be at least 1"),
    ],
)
def test_usage_error_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    """Bad input from any layer (parsing, settings, loading) exits 2 with one line on stderr."""
    assert main(argv) == 2
    assert message in one_error_line(capsys)


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """`specaudit` alone shows the commands and exits 2."""
    assert main([]) == 2
    out = capsys.readouterr().out
    assert all(command in out for command in ("audit", "gate", "replay", "minimize", "suite"))


def test_settings_check_their_ranges() -> None:
    """Settings built in code are checked like the flags: a UsageError naming the flag."""
    with pytest.raises(UsageError, match="--examples"):
        AuditSettings(examples=0)
    with pytest.raises(UsageError, match="--min-exact-match"):
        GateSettings(min_exact_match=1.5)
    with pytest.raises(UsageError, match="--budget"):
        MinimizeSettings(Path("c.json"), EQSPEC, budget=0)
    with pytest.raises(UsageError, match="unknown dtype"):
        RealAuditSettings(Path("t"), Path("d"), Path("p"), dtype="float8")
    assert GateSettings().decoders == DEFAULT_DECODERS and AuditSettings().models == MODELS


# ---------------------------------------------------------------------------------------
# The audit


def test_default_audit_plan() -> None:
    """No --decoder: the reference decoders on every model asked for, each planted bug once, on
    the first model it shows on among them (bugs needing another model are left out)."""
    plan = audit_plan(AuditSettings(models=("transparent", "llama")))
    references = [(spec, model) for spec, expect, model in plan if not expect]
    assert references == [(spec, model) for spec in DEFAULT_DECODERS for model in ("transparent", "llama")]
    bugs = {spec.split(":")[1]: model for spec, expect, model in plan if expect}
    wanted = {name: next(m for m in cls.bug.models if m in ("transparent", "llama")) for name, cls in CATALOG.items()
              if set(cls.bug.models) & {"transparent", "llama"}}  # fmt: skip
    assert bugs == wanted and bugs["rejected_kv_attended"] == "transparent"
    only = audit_plan(AuditSettings(decoders=(MUTANT,), models=("gpt2",)))
    assert only == [(MUTANT, False, "gpt2")]


def test_audit_of_a_passing_decoder_reports_every_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """EqSpec: exit 0; the table and report.json give every registry check's status over the runs."""
    assert main(["audit", "--decoder", EQSPEC, "--models", "transparent", "--examples", "3", "--quiet",
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "1 as expected, 0 not" in out and all(check in out for check in BATCH_ORDER)
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["format"], report["command"], report["passed"]) == ("specaudit-report", "audit", True), report
    (entry,) = report["entries"]
    assert entry["kind"] == "decoder" and entry["passed"] and entry["first"] is None, entry
    assert list(entry["checks"]) == list(BATCH_ORDER) and entry["checks"]["I2"] == "pass"
    assert set(entry["checks"].values()) <= {"pass", "n/a"} and entry["diagnosis"] is None


def test_audit_of_a_failing_decoder_writes_its_reproducer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A decoder given with --decoder that fails: exit 1, its check marked FAIL, and a replayable
    reproducer plus regression test under --out/repro."""
    assert main(["audit", "--decoder", MUTANT, "--models", "transparent", "--examples", "5", "--quiet",
                 "--out", str(tmp_path)]) == 1  # fmt: skip
    out = capsys.readouterr().out
    assert "0 as expected, 1 not" in out and "FAIL" in out
    (entry,) = json.loads((tmp_path / "report.json").read_text())["entries"]
    assert entry["checks"]["I2"] == "fail" and entry["diagnosis"]["first_check"] == "I2"
    assert not entry["passed"] and entry["first"]["check"] == "I2" and entry["signature"] == "bonus", entry
    names = sorted(p.name for p in (tmp_path / "repro").iterdir())
    stem = "specaudit_reference_mutants_rejected_kv_attended_transparent"
    assert names == [f"{stem}.json", f"test_regression_{stem}.py"]
    assert main(["replay", str(tmp_path / "repro" / f"{stem}.json"), "--decoder", MUTANT]) == 1
    assert main(["replay", str(tmp_path / "repro" / f"{stem}.json"), "--decoder", EQSPEC, "--json"]) == 0


def test_replay_json_is_the_diagnosis(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`replay --json` prints the diagnosis with every check's status; exit 1 for a failing case."""
    path = Case(((5,),), ((False,) * 6,), 1, 3, None, 0).save(tmp_path / "case.json")
    assert main(["replay", str(path), "--decoder", MUTANT, "--json"]) == 1
    diagnosis = json.loads(capsys.readouterr().out)
    assert diagnosis["passed"] is False and diagnosis["first_check"] == "I2"
    assert list(diagnosis["checks"]) == list(BATCH_ORDER) and diagnosis["checks"]["I2"] == "fail"


# ---------------------------------------------------------------------------------------
# Structure


def harness_modules() -> list[Path]:
    return sorted(p for p in HARNESS.rglob("*.py") if "__pycache__" not in p.parts)


def test_only_the_cli_sees_argparse() -> None:
    """Configuration crosses the CLI boundary as settings: no other module imports argparse."""
    importers = []
    for path in harness_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if "argparse" in names:
                importers.append(path.relative_to(HARNESS).as_posix())
    assert importers == ["commands/cli.py"], importers


def module_getattr(path: Path) -> str | None:
    """How a module defines `__getattr__`: "def", the source of what it is assigned, or None."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            return "def"
        if isinstance(node, ast.Assign) and "__getattr__" in ast.unparse(node.targets[0]):
            return ast.unparse(node.value)
    return None


def test_no_module_level_getattr() -> None:
    """Every name a module offers is defined in it: no module `__getattr__` building them on access.
    Two kinds only look a name up where it is defined: the package root's public API (loaded on first
    use, so `import specaudit` stays torch-free) and the old paths of moved names (`specaudit._moved`)."""
    lazy = []
    for path in harness_modules():
        module, kind = path.relative_to(HARNESS).as_posix(), module_getattr(path)
        root_api = kind == "def" and module == "__init__.py"
        if kind is not None and not root_api and kind not in ("_alias(__name__)", "_forward(__name__)"):
            lazy.append(f"{module} ({kind})")
    assert lazy == []


@pytest.mark.slow  # an audit in a fresh interpreter
def test_the_console_script_finds_decoders_in_the_working_directory(tmp_path: Path) -> None:
    """`specaudit audit --decoder mine:Mine` from a user's checkout, as `python -m` would find it
    (a console script's sys.path starts at its own directory)."""
    script = Path(sys.executable).with_name("specaudit")
    if not script.exists():
        pytest.skip(f"no console script beside {sys.executable}")
    (tmp_path / "mine.py").write_text("from specaudit.reference.eqspec import EqSpec as Mine\n")
    argv = [str(script), "audit", "--decoder", "mine:Mine", "--models", "transparent", "--examples", "1", "--quiet"]
    env = dict(os.environ, PYTHONPATH="")
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-1500:] + done.stderr[-1500:]
    assert "mine:Mine" in done.stdout, done.stdout[-1500:]
