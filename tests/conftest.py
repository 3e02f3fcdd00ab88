"""Shared fixtures of the harness's own tests: they never write to the user's model cache
(~/.cache/specaudit), the audit runs in process, and a module may run torch on one thread."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

# Torch calls outlast Hypothesis's 200 ms default deadline on a loaded machine; a test that runs a
# suite property (decorated without settings of its own) gets none, as it would under the suite.
settings.register_profile("specaudit-tests", deadline=None)
settings.load_profile("specaudit-tests")


def pytest_configure(config: pytest.Config) -> None:
    """On an xdist worker, one torch thread here and in the interpreters tests start (the CLI,
    pytester's suite runs): the workers already take the cores, and each subprocess's OpenMP
    threads would spin against them. A value set by the user is kept."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that runs pytest in a fresh interpreter (`pytester`: the suite, the plugin) is slow:
    each start imports torch and transformers and draws its cases anew. `make test-fast` leaves
    them out; `make test` runs them."""
    for item in items:
        if "pytester" in getattr(item, "fixturenames", ()) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibrations and built models of a test go to a per-session temporary cache."""
    monkeypatch.setenv("SPECAUDIT_CACHE", str(tmp_path_factory.getbasetemp() / "specaudit-cache"))


@pytest.fixture(autouse=True)
def serial_audit(monkeypatch: pytest.MonkeyPatch) -> None:
    """`specaudit audit` in one process (SPECAUDIT_JOBS=1): pytest-xdist's workers already take
    the cores, and spawning more would only contend. A test of --jobs passes it explicitly."""
    monkeypatch.setenv("SPECAUDIT_JOBS", "1")


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads; on two shared cores they cost time.
    A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
