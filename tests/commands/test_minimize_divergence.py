"""`specaudit minimize` keeps the symptom, not only the class (issue 38, point 7): a two-row case whose
output diverges shrinks to a case whose output still diverges, and every file goes into --out.

`mask_not_updated_after_repad` on this case attends a pad through a stale mask (I2, kv-drift) with a
wrong output on two rows; its one-row cases only carry a mask one column too long that changes no
logit (I1 mask-shape, exact output), which is what the minimizer kept before the divergence was kept
and the diagnosis put the cause first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specaudit.checks.diagnosis import diagnose
from specaudit.commands.cli import main
from specaudit.contracts.case import Case
from specaudit.running.runner import run_case

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = "specaudit.reference.mutants:mask_not_updated_after_repad"
CASE = Case(((0,), (119,)), ("0000000", "0100000"), 1, 4, None, 0)


def minimized(tmp_path: Path, *flags: str) -> Case:
    """The case `specaudit minimize` writes to --out (run from an empty working directory)."""
    source = CASE.save(tmp_path / "case.json")
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    cwd.mkdir()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        assert main(["minimize", str(source), "--decoder", SPEC, "--out", str(out), "--budget", "60", *flags]) == 1
    finally:
        os.chdir(here)
    assert list(cwd.iterdir()) == [], "minimize wrote into the working directory, not --out"
    (written,) = [p for p in out.glob("*.json")]
    assert (out / f"test_regression_{written.stem}.py").exists()
    return Case.load(written)


def test_the_case_diverges_on_two_rows() -> None:
    """The cause comes first: the pad attended through the stale mask, not the over-long mask."""
    d = diagnose(run_case(SPEC, CASE))
    assert d.first_check == "I2" and d.exact_match < 1 and any(v.check == "equivalence" for v in d.violations)
    assert any(d.is_silent(v) for v in d.violations if v.rule == "mask-shape"), d.render()


@pytest.mark.slow
def test_a_diverging_case_shrinks_to_a_diverging_case(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """By default the minimal case still diverges from the oracle."""
    d = diagnose(run_case(SPEC, minimized(tmp_path)))
    assert any(v.check == "equivalence" for v in d.violations) and d.exact_match < 1, d.render()
    assert "every smaller case kept must diverge too" in capsys.readouterr().out


@pytest.mark.slow
def test_allow_exact_output_keeps_the_class_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With the divergence not required, the class alone is kept: here (I2, kv-drift), which only
    diverging cases of this decoder reach once the diagnosis puts the cause first (the one-row,
    exact cases' silent mask is another class). Shrinking under `counts` is tested in test_ddmin."""
    case = minimized(tmp_path, "--allow-exact-output")
    d = diagnose(run_case(SPEC, case))
    assert "must diverge too" not in capsys.readouterr().out
    assert (d.first_check, d.signature) == ("I2", "kv-drift") and case.batch_size <= CASE.batch_size, d.render()
