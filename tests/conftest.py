"""Shared fixtures of the harness's own tests: they never write to the user's model cache
(~/.cache/specaudit), and a module may run torch on one thread."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibrations and built models of a test go to a per-session temporary cache."""
    monkeypatch.setenv("SPECAUDIT_CACHE", str(tmp_path_factory.getbasetemp() / "specaudit-cache"))


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads; on two shared cores they cost time.
    A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
