"""The conformance suite's configuration: it applies only where the suite runs.

Adds the short `--decoder`/`--models` spellings of the plugin's `--specaudit-*` options and
`--engine` for continuous-batching engines (`properties/test_engines.py`),
registers and loads specaudit's Hypothesis profiles (`specaudit-ci` when `CI` is set,
`specaudit-dev` otherwise, unless `--hypothesis-profile` says), gives each parametrization of a
derandomized property its own seed (`pytest_runtest_call`) and keeps each xdist worker on one
torch thread.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Generator, Hashable

import pytest

from specaudit.profiles import default_profile, register_profiles

# At import: the suite's conftest loads before Hypothesis's plugin reads --hypothesis-profile.
register_profiles()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("specaudit")
    group.addoption(
        "--decoder",
        dest="specaudit_decoder",
        action="append",
        default=[],
        metavar="MODULE:ATTR",
        help="decoder under test (repeatable), as --specaudit-decoder",
    )
    group.addoption(
        "--models",
        dest="specaudit_models",
        default=None,
        metavar="NAMES",
        help="comma-separated built-in models, as --specaudit-models",
    )
    add_engine_option(parser)


def pytest_configure(config: pytest.Config) -> None:
    from hypothesis import settings

    for warning in ("ignore:.*past_key_values.*:FutureWarning", "ignore:.*past_key_values.*:DeprecationWarning"):
        config.addinivalue_line("filterwarnings", warning)
    if not config.getoption("hypothesis_profile", default=None):
        settings.load_profile(default_profile())
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Tiny models gain nothing from intra-op threads; N workers x N threads thrash the cores.
        import torch

        torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------
# One seed per parametrization: derandomize seeds from the test function alone, so without this
# every decoder x model of a property would draw the same choice sequence (the same cases).


def item_seed(item: pytest.Item) -> Hashable | None:
    """The seed an item's Hypothesis test should run with, or None to leave Hypothesis be.

    Only under a derandomized profile (specaudit-ci): there `--hypothesis-seed N` wins (Hypothesis
    alone would ignore it), else a hash of the item's name (property, decoder, model), stable
    across runs, processes and invocation directories. Under the dev profile Hypothesis keeps its
    randomness (and its own `--hypothesis-seed`); an explicit `@seed` on the test always wins.
    """
    from hypothesis import settings

    if getattr(item, "obj", None) is None or not hasattr(item.obj, "hypothesis") or not settings.default.derandomize:
        return None
    if getattr(item.obj, "_hypothesis_internal_use_seed", None) is not None:  # what @seed sets
        return None
    forced = item.config.getoption("hypothesis_seed", default=None)
    if forced is not None:
        return as_seed(forced)
    return int.from_bytes(hashlib.sha256(item.name.encode()).digest()[:8], "big")


def as_seed(text: str) -> Hashable:
    """`--hypothesis-seed` as Hypothesis's plugin reads it: an int where it parses as one."""
    try:
        return int(text)
    except ValueError:
        return text


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """Seed the item's test for this call only: every parametrization shares the function object."""
    seed = item_seed(item)
    if seed is None:
        yield
        return
    from hypothesis import seed as hypothesis_seed

    test = item.obj
    before = dict(vars(test))
    hypothesis_seed(seed)(test)
    changed = [k for k, v in vars(test).items() if k not in before or before[k] is not v]
    try:
        yield
    finally:
        for key in changed:
            if key in before:
                setattr(test, key, before[key])
            else:
                delattr(test, key)


# ---------------------------------------------------------------------------------------
# Engines (the step-wise contract): `--engine MODULE:ATTR`, default the reference engines


def add_engine_option(parser: pytest.Parser) -> None:
    parser.getgroup("specaudit").addoption(
        "--engine",
        dest="specaudit_engine",
        action="append",
        default=[],
        metavar="MODULE:ATTR",
        help="continuous-batching engine under test (repeatable); default: the reference engines",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "engine_spec" in metafunc.fixturenames:
        from specaudit.engine_machine import DEFAULT_ENGINES

        specs = metafunc.config.getoption("specaudit_engine", default=None) or list(DEFAULT_ENGINES)
        metafunc.parametrize("engine_spec", specs)
