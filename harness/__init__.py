"""specaudit: a property-based correctness harness for batch speculative decoding.

The public API is `__all__` (one line per name in docs/api.md): what adapters and users' own
tests may import from `specaudit` and rely on across releases; everything else is internal and
may move. A moved public module or name keeps its old path for a while, with a
DeprecationWarning (`specaudit._moved`).

Every module's import runs this file first, and the pytest plugin is loaded in every pytest run
of an environment that has specaudit, so it imports nothing: each public name is imported from
its home module on first use (a module `__getattr__`, PEP 562), and `import specaudit` loads
neither torch nor any other part of the package.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC: dict[str, str] = {
    # The contracts: what a user implements (a decoder, an engine) and how specaudit loads it.
    "Decoder": "specaudit.contracts.decoder:Decoder",
    "Engine": "specaudit.contracts.engine:Engine",
    "load_decoder": "specaudit.contracts.decoder:load_decoder",
    "load_engine": "specaudit.contracts.engine:load_engine",
    "ContractError": "specaudit.contracts.decoder:ContractError",
    "DecoderLoadError": "specaudit.contracts.decoder:DecoderLoadError",
    "EngineLoadError": "specaudit.contracts.engine:EngineLoadError",
    "UsageError": "specaudit.contracts.errors:UsageError",
    # A case: built by hand or loaded from a reproducer, on a built-in model.
    "Case": "specaudit.contracts.case:Case",
    "CaseFormatError": "specaudit.contracts.case:CaseFormatError",
    "MODELS": "specaudit.contracts.builtins:MODELS",
    "DRAFTS": "specaudit.contracts.builtins:DRAFTS",
    "DTYPE_NAMES": "specaudit.contracts.builtins:DTYPE_NAMES",
    "load_case": "specaudit.artifacts.reproducer:load_case",
    # Sampling decoders: the settings, the target distribution, a sampling case and its runs.
    "Sampling": "specaudit.contracts.sampling:Sampling",
    "SamplingCase": "specaudit.contracts.sampling:SamplingCase",
    "target_distribution": "specaudit.contracts.sampling:target_distribution",
    "run_sampling_case": "specaudit.running.sampling:run_sampling_case",
    # The cache across transformers versions (4.51 to 5.x).
    "cache_layers": "specaudit.models.compat:cache_layers",
    "filled_layers": "specaudit.models.compat:filled_layers",
    "layer_lengths": "specaudit.models.compat:layer_lengths",
    "cache_length": "specaudit.models.compat:cache_length",
    "set_cache_layers": "specaudit.models.compat:set_cache_layers",
    "cache_from_tensors": "specaudit.models.compat:cache_from_tensors",
    "crop_cache": "specaudit.models.compat:crop_cache",
    "select_rows": "specaudit.models.compat:select_rows",
    "cache_keyword": "specaudit.models.compat:cache_keyword",
    "call_model": "specaudit.models.compat:call_model",
    "output_cache": "specaudit.models.compat:output_cache",
    # Running a decoder on a case and judging it.
    "run_case": "specaudit.running.runner:run_case",
    "Run": "specaudit.running.runner:Run",
    "all_violations": "specaudit.checks.registry:all_violations",
    "diagnose": "specaudit.checks.diagnosis:diagnose",
    "Diagnosis": "specaudit.checks.diagnosis:Diagnosis",
    "Violation": "specaudit.contracts.violation:Violation",
    "render": "specaudit.contracts.violation:render",
    "explain": "specaudit.contracts.violation:explain",
    # Reproducers and reports: what a failing run leaves on disk, read back and run again.
    "Reproducer": "specaudit.artifacts.reproducer:Reproducer",
    "load_reproducer": "specaudit.artifacts.reproducer:load_reproducer",
    "replay_reproducer": "specaudit.commands.replay:replay",
    "replay_engine": "specaudit.search.engine_replay:replay",
    "load_report": "specaudit.artifacts.report:load_report",
    # What a regression test specaudit wrote calls on a failure, for the plugin's --specaudit-out.
    "remember_failure": "specaudit.commands.pytest_notes:remember_failure",
    "remember_engine_failure": "specaudit.commands.pytest_notes:remember_engine_failure",
    # The command line and its exit statuses.
    "main": "specaudit.commands.cli:main",
    "EXIT_PASS": "specaudit.contracts.exits:EXIT_PASS",
    "EXIT_FAIL": "specaudit.contracts.exits:EXIT_FAIL",
    "EXIT_USAGE": "specaudit.contracts.exits:EXIT_USAGE",
}
"""Each public name -> `module:attr`, its home (the object is that module's own, not a copy)."""

__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    """A public name, imported from its home on first use and kept here after."""
    home = _PUBLIC.get(name)
    if home is None:
        raise AttributeError(f"module 'specaudit' has no attribute {name!r}")
    module, _, attr = home.partition(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
