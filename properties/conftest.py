"""The conformance suite's configuration: it applies only where the suite runs.

Adds the short `--decoder`/`--models` spellings of the plugin's `--specaudit-*` options and
`--engine` for continuous-batching engines (`properties/test_engines.py`),
registers and loads specaudit's Hypothesis profiles (`specaudit-ci` when `CI` is set,
`specaudit-dev` otherwise, unless `--hypothesis-profile` says), and keeps each xdist worker on
one torch thread.
"""

from __future__ import annotations

import os

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
