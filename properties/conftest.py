"""The conformance suite's configuration: it applies only where the suite runs.

Adds the short `--decoder`/`--models` spellings of the plugin's `--specaudit-*` options and
`--engine` for continuous-batching engines (`properties/test_engines.py`),
registers and loads specaudit's Hypothesis profiles (`specaudit-ci` when `CI` is set,
`specaudit-dev` otherwise, unless `--hypothesis-profile` says), seeds each parametrization's
properties alike and gives them the profile's `suite_examples()` (`pytest_runtest_call`), keeps
them on one xdist worker (`pytest_xdist_make_scheduler`) and each worker on one torch thread.

Cases drawn once are judged by every check: each property of one decoder x model draws the same
cases from the same seed, on the same worker, so each case is run once and each check judges it
once (`judged` in test_conformance.py); the suite still reports each check by name. What the
sharing saves goes to more distinct cases: under specaudit-ci 240 per decoder on the transparent
model and 60 on each tiny real one, where each of the eight properties ran 30 of its own before
(`specaudit.config.profiles.SUITE_EXAMPLES`, `REAL_MODEL_SHARE`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Generator, Hashable
from typing import Any

import pytest

from specaudit.config.profiles import default_profile, register_profiles, suite_examples

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


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under `-n N` (`--dist load` or `loadgroup`): a parametrization's properties are one unit of
    work on one worker, where they share one stream of runs; every other test is a unit of its
    own. The groups are the largest units, so xdist hands them out first.

    Grouped by node id on the controller, not by xdist's `xdist_group` mark: pytest-xdist 3.8
    names a group by rewriting `item._nodeid`, which pytest 9 no longer reads, so the mark
    groups nothing there (each property then ran its decoder x model's cases on both workers)."""
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByParametrization(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return property_group(nodeid) or nodeid

    return ByParametrization(config, log)


def property_group(nodeid: str) -> str | None:
    """The unit of work of a conformance property's node id: its parametrization (`[decoder-model]`),
    shared by the eight properties; None for any other test."""
    path, _, name = nodeid.partition("::")
    if not path.endswith("test_conformance.py") or not name.endswith("]") or "[" not in name:
        return None
    return path + "::" + name[name.index("[") :]


# ---------------------------------------------------------------------------------------
# One seed per parametrization, shared by its properties: derandomize seeds from the test
# function alone, so without this every decoder x model of a property would draw the same cases,
# and the eight properties of one decoder x model would each draw, and run, cases of their own.


def parametrization(item: pytest.Item) -> str:
    """What an item's seed and worker are keyed on: its parameters (`[decoder-model]`), not its property."""
    callspec = getattr(item, "callspec", None)
    return f"[{callspec.id}]" if callspec is not None else item.name


def run_seed(config: pytest.Config) -> str:
    """Under a random profile: one seed for the whole run, shared by xdist's workers (its run id)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        return str(workerinput["testrunuid"])
    if not hasattr(config, "_specaudit_run_seed"):
        config._specaudit_run_seed = os.urandom(8).hex()  # type: ignore[attr-defined]
    return config._specaudit_run_seed  # type: ignore[attr-defined]


def item_seed(item: pytest.Item) -> Hashable | None:
    """The seed an item's Hypothesis test runs with, or None to leave Hypothesis be.

    A hash of the item's parametrization (decoder, model), so the properties of one parametrization
    draw alike and different parametrizations differ: under a derandomized profile (specaudit-ci)
    stable across runs, processes and invocation directories, and `--hypothesis-seed N` wins; under
    a random profile (specaudit-dev) mixed with a seed drawn once per run, so each run explores
    anew (and Hypothesis's own `--hypothesis-seed` applies as usual). An explicit `@seed` wins.
    """
    from hypothesis import settings

    if getattr(item, "obj", None) is None or not hasattr(item.obj, "hypothesis"):
        return None
    if getattr(item.obj, "_hypothesis_internal_use_seed", None) is not None:  # what @seed sets
        return None
    forced = item.config.getoption("hypothesis_seed", default=None)
    if not settings.default.derandomize:
        if forced is not None:
            return None
        return digest(run_seed(item.config) + parametrization(item))
    if forced is not None:
        return as_seed(forced)
    return digest(parametrization(item))


def digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def as_seed(text: str) -> Hashable:
    """`--hypothesis-seed` as Hypothesis's plugin reads it: an int where it parses as one."""
    try:
        return int(text)
    except ValueError:
        return text


def suite_settings(item: pytest.Item) -> object | None:
    """A conformance property's settings: the loaded profile's, with `suite_examples()` distinct
    cases for its model (None for any other test, and for one whose own @settings say how many)."""
    from hypothesis import settings

    from specaudit.fixtures.pairs import is_exact

    test = getattr(item, "obj", None)
    if getattr(test, "specaudit_check", None) is None or hasattr(test, "_hypothesis_internal_settings_applied"):
        return None
    model = getattr(getattr(item, "callspec", None), "params", {}).get("specaudit_model", "transparent")
    return settings(settings.default, max_examples=suite_examples(is_exact(model)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, None]:
    """Seed the item's test, and give a property its budget, for this call only: every
    parametrization shares the function object. A property that passes leaves its stream of
    cases to the others of its key (`stream_key`, `pytest_pyfunc_call`)."""
    seed, budget = item_seed(item), suite_settings(item)
    if seed is None and budget is None:
        yield
        return
    from hypothesis import seed as hypothesis_seed

    test = item.obj
    before = dict(vars(test))
    if seed is not None:
        hypothesis_seed(seed)(test)
    if budget is not None:
        budget(test)  # type: ignore[operator]
    changed = [k for k, v in vars(test).items() if k not in before or before[k] is not v]
    key = item.stash[STREAM] = stream_key(item, seed, budget)
    try:
        outcome = yield
        if key is not None and outcome.excinfo is None and hasattr(item.module, "stream_passed"):
            item.module.stream_passed(item, key)
    finally:
        for key in changed:
            if key in before:
                setattr(test, key, before[key])
            else:
                delattr(test, key)


STREAM = pytest.StashKey[Hashable | None]()
"""On a property's item for its call: its `stream_key` (the seed is applied to the test by then)."""


def stream_key(item: pytest.Item, seed: Hashable | None, budget: object | None) -> Hashable | None:
    """What makes two properties draw the same cases: parametrization, seed and budget under a
    profile without an example database (specaudit-ci's). None where a database could put a
    property's own saved failures first, or where the item is no conformance property."""
    from hypothesis import settings

    if seed is None or budget is None or settings.default.database is not None:
        return None
    return (parametrization(item), seed, budget.max_examples)  # type: ignore[attr-defined]


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """A property whose check passes on every case of a stream another property of its key drew
    and passed on has that outcome without drawing the cases again (test_conformance.py,
    `passes_known_stream`): Hypothesis would draw the same cases. None: call the test as usual."""
    key = pyfuncitem.stash.get(STREAM, None)
    known = getattr(pyfuncitem.module, "passes_known_stream", None)
    if key is not None and known is not None and known(pyfuncitem, key):
        return True
    return None


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
    if "sampling_decoder" in metafunc.fixturenames:
        metafunc.parametrize("sampling_decoder", sampling_specs(metafunc.config))
    if "engine_spec" in metafunc.fixturenames:
        from specaudit.search.engine_machine import DEFAULT_ENGINES

        specs = metafunc.config.getoption("specaudit_engine", default=None) or list(DEFAULT_ENGINES)
        metafunc.parametrize("engine_spec", specs)


def sampling_specs(config: pytest.Config) -> list[str]:
    """The sampling decoders under test: those of `--decoder` that sample, else the reference designs."""
    from specaudit.audits.sampling import DESIGNS, samples

    named = config.getoption("specaudit_decoder", default=None)
    return [spec for spec in named if samples(spec)] if named else list(DESIGNS)
