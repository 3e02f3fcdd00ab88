"""The planted bugs, one module per family; `specaudit.reference.mutants` is their catalog.

Import them through `specaudit.reference.mutants` (its `CATALOG`, and `--decoder
specaudit.reference.mutants:NAME`); the modules here only group their source by what the harness must catch.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil


def planted(record: type) -> dict[str, type]:
    """Every class of this package's modules whose own `bug` is a `record` (`info.BugInfo` for the
    greedy catalog, `sampling.SamplingBug` for the sampling one), by its `name`, in module then
    source order: writing a planted class with its record is what catalogues it."""
    found: dict[str, type] = {}
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        for cls in vars(module).values():
            if inspect.isclass(cls) and cls.__module__ == module.__name__ and isinstance(vars(cls).get("bug"), record):
                found[cls.name] = cls
    return found
