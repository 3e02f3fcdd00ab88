"""The harness's own tests never write to the user's model cache (~/.cache/specaudit)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibrations and built models of a test go to a per-session temporary cache."""
    monkeypatch.setenv("SPECAUDIT_CACHE", str(tmp_path_factory.getbasetemp() / "specaudit-cache"))
