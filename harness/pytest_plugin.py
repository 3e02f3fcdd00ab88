"""specaudit's pytest plugin: `--decoder module:attr` and the dev / ci / thorough profiles.

Inert unless used: it only adds options and registers profiles, and imports torch only
when a test asks for a decoder or a model.
"""

from __future__ import annotations

import os

import pytest

from harness.profiles import default_profile, register_profiles

# Registered at import, before Hypothesis's own plugin loads --hypothesis-profile.
register_profiles()

DEFAULT_DECODERS = ("reference.eqspec:EqSpec", "reference.exspec:ExSpec", "reference.lazy:LazySpec")
DEFAULT_MODELS = ("transparent", "llama", "qwen3", "gpt2")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("specaudit", "specaudit: conformance of batch speculative decoders")
    group.addoption(
        "--decoder",
        action="append",
        default=[],
        metavar="MODULE:ATTR",
        help="decoder under test (repeatable); replaces the default reference decoders",
    )
    group.addoption(
        "--models",
        default=",".join(DEFAULT_MODELS),
        metavar="NAMES",
        help=f"comma-separated built-in models to run the properties on (default: {','.join(DEFAULT_MODELS)})",
    )
    group.addoption(
        "--specaudit-out",
        default="specaudit-failures",
        metavar="DIR",
        help="where a failing property writes its minimal case as a JSON reproducer (default: specaudit-failures)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("hypothesis_profile", default=None):
        from hypothesis import settings

        settings.load_profile(default_profile())
    config.addinivalue_line("markers", "specaudit: a conformance property run for every decoder under test")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Tiny models gain nothing from intra-op threads; N workers x N threads thrash the cores.
        import torch

        torch.set_num_threads(1)
    if config.getoption("decoder"):
        decoder_specs(config)  # a bad --decoder is a usage error before collection
    model_names(config)


def decoder_specs(config: pytest.Config) -> list[str]:
    """The decoders under test, each checked to load (pytest_configure does it once, early)."""
    from harness.contract import DecoderLoadError, load_decoder

    specs = config.getoption("decoder") or list(DEFAULT_DECODERS)
    for spec in specs:
        try:
            load_decoder(spec)
        except DecoderLoadError as exc:
            raise pytest.UsageError(f"specaudit: {exc}") from None
    return specs


def model_names(config: pytest.Config) -> list[str]:
    names = [m.strip() for m in config.getoption("models").split(",") if m.strip()]
    unknown = [m for m in names if m not in DEFAULT_MODELS]
    if unknown:
        raise pytest.UsageError(f"specaudit: unknown model(s) {unknown}; built-in models are {list(DEFAULT_MODELS)}")
    return names


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "decoder_spec" in metafunc.fixturenames:
        metafunc.parametrize("decoder_spec", decoder_specs(metafunc.config))
    if "model" in metafunc.fixturenames and metafunc.definition.get_closest_marker("specaudit"):
        metafunc.parametrize("model", model_names(metafunc.config))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    """After a property fails, write its shrunk case to --specaudit-out and say where."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when != "call" or item.get_closest_marker("specaudit") is None:
        return
    from harness.reproducer import take_failure, write_reproducer

    failure = take_failure()
    if report.failed and failure is not None:
        path = write_reproducer(item.config.getoption("specaudit_out"), item.nodeid, failure)
        report.sections.append(("specaudit", f"reproducer written to {path}"))
