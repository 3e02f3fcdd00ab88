"""`specaudit audit-vllm`'s white-box half, without vLLM: the subprocess it starts per configuration,
and what the report gets when that process leaves no result (no vLLM here, so it cannot)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from specaudit.adapters.vllm.report import ConfigurationOutcome, render_markdown
from specaudit.commands.audit_vllm import run_audit_vllm, whitebox_configuration
from specaudit.config.settings import VllmAuditSettings
from specaudit.contracts.errors import UsageError


def test_a_white_box_that_leaves_no_result_fails_its_configuration(tmp_path: Path) -> None:
    """The white box runs in the given python (here one without vLLM): it writes no result, so the
    configuration's white box is a failure naming its log, and the configuration fails both levels."""
    settings = VllmAuditSettings(python=sys.executable, models=("tiny",), out=tmp_path, whitebox_minutes=0.1)
    said: list[str] = []
    found = whitebox_configuration(settings, "tiny", "ngram", tmp_path / "target", tmp_path / "draft", said.append)
    assert found["passed"] is False and "whitebox.log" in found["error"], found
    assert (tmp_path / "tiny-ngram" / "whitebox.log").read_text(), "the white box's output is not kept"
    assert said and "white box" in said[0], said
    outcome = ConfigurationOutcome("tiny", "ngram", {}, True, "exact", whitebox=found)
    assert not outcome.all_passed and "| FAIL | 0 | 0 | - | - | - | 0 |" in render_markdown([outcome])


def test_the_white_box_command_line_names_the_configurations_engine(tmp_path: Path, monkeypatch) -> None:
    """`specaudit whitebox-vllm` with a configuration's arguments builds that configuration's engine."""
    from specaudit.adapters.vllm.server import WHITEBOX, whitebox_arguments
    from specaudit.commands import whitebox_vllm
    from specaudit.commands.cli import main

    seen = []
    monkeypatch.setattr(whitebox_vllm, "run_whitebox", lambda settings: seen.append(settings) or 0)
    for name, options in WHITEBOX.items():
        args = whitebox_arguments(options, tmp_path / "t", tmp_path / "d")
        assert main(["whitebox-vllm", *args, "--json", str(tmp_path / "x")]) == 0
        assert seen[-1].options == options, f"{name}: the white box would run another engine than it names"
        assert seen[-1].draft == (str(tmp_path / "d") if options.method == "draft" else None)


def test_a_planted_bug_reaches_the_white_box_and_an_unknown_one_is_refused(tmp_path: Path) -> None:
    """`--plant NAME`: the white box's process is told to plant it (the servers get it through the
    vLLM plugin's variable); a name the catalog lacks is refused before anything starts."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "argv"}\n')
    python.chmod(0o755)
    settings = VllmAuditSettings(python=str(python), models=("tiny",), out=tmp_path, plant="bonus-from-draft")
    whitebox_configuration(settings, "tiny", "draft", tmp_path / "target", tmp_path / "draft", lambda _: None)
    argv = (tmp_path / "argv").read_text().split()
    assert argv[argv.index("--mutant") + 1] == "bonus-from-draft", argv
    with pytest.raises(UsageError, match="names no planted vLLM bug; known: positions-after-rejection"):
        run_audit_vllm(VllmAuditSettings(python=str(python), plant="nope"))
