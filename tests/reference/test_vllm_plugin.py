"""The vLLM plugin that plants a catalog bug in a served vLLM: declared, inert by default, and
clear about a name it does not know. Planting itself needs vLLM: tests/adapters/test_vllm_observer.py."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from specaudit.reference.vllm_mutants import PLANT_ENV, plant_from_env


def test_the_plugin_is_declared_for_vllm() -> None:
    """vLLM loads `vllm.general_plugins` entry points in each of its processes: ours is one."""
    found = [ep.value for ep in entry_points(group="vllm.general_plugins") if ep.name == "specaudit_planted"]
    assert found == ["specaudit.reference.vllm_mutants:plant_from_env"], found


@pytest.mark.parametrize("value", [None, ""])
def test_the_plugin_is_inert_without_its_variable(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    """Unset or empty, nothing is planted (no vLLM here: planting would import it and fail)."""
    monkeypatch.delenv(PLANT_ENV, raising=False)
    if value is not None:
        monkeypatch.setenv(PLANT_ENV, value)
    plant_from_env()


def test_an_unknown_bug_name_is_refused_with_the_known_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PLANT_ENV, "no-such-bug")
    with pytest.raises(ValueError, match="'no-such-bug' names no planted vLLM bug; known: .*bonus-from-draft"):
        plant_from_env()
