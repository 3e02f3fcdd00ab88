"""Old import paths of moved modules and names: they keep working for a while, with a DeprecationWarning.

Adapters and the regression tests specaudit wrote into users' repositories import specaudit by
module path; when a module moves (97aaf06: the subpackages per concern) or a name leaves its
module (ceb6d45: the engine machine and the black box split by layer), the old path must not
become an ImportError overnight. The regression tests specaudit writes now import only
`specaudit.__all__` (issue 38), so a new internal move adds nothing here. Each old module is a
file at its old place that calls `alias`; a module a name left calls `forward`. Both look the
new place up here, so docs/api.md and tests/test_public_api.py read one table. Standard library
only: the foundation layer.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

MODULES: dict[str, str] = {
    "specaudit.compat": "specaudit.models.compat",
    "specaudit.case": "specaudit.contracts.case",
    "specaudit.contract": "specaudit.contracts.decoder",
    "specaudit.engine": "specaudit.contracts.engine",
    "specaudit.errors": "specaudit.contracts.errors",
    "specaudit.violation": "specaudit.contracts.violation",
    "specaudit.loading": "specaudit.models.loading",
    "specaudit.runner": "specaudit.running.runner",
    "specaudit.registry": "specaudit.checks.registry",
    "specaudit.diagnosis": "specaudit.checks.diagnosis",
    "specaudit.engine_machine": "specaudit.search.engine_machine",
    "specaudit.reproducer": "specaudit.artifacts.reproducer",
    "specaudit.realmodel": "specaudit.adapters.realmodel",
    "specaudit.replay": "specaudit.commands.replay",
    "specaudit.cli": "specaudit.commands.cli",
}
"""Old module -> where it lives now (97aaf06). Kept: the contracts, the cache layer, the case,
what specaudit's written regression tests imported (runner, registry, violation, reproducer,
engine_machine), the diagnosis and replay, and what the docs' adapter examples imported (loading, realmodel, cli)."""

NAMES: dict[str, str] = {
    "specaudit.engine_machine.replay": "specaudit.search.engine_replay.replay",
    "specaudit.search.engine_machine.replay": "specaudit.search.engine_replay.replay",
    "specaudit.models.MODELS": "specaudit.contracts.builtins.MODELS",
    "specaudit.models.DRAFTS": "specaudit.contracts.builtins.DRAFTS",
    "specaudit.models.DTYPE_NAMES": "specaudit.contracts.builtins.DTYPE_NAMES",
    "specaudit.adapters.engine_blackbox.audit_server": "specaudit.adapters.transports.audit_server",
    "specaudit.adapters.engine_blackbox.audit_callable": "specaudit.adapters.transports.audit_callable",
    "specaudit.adapters.engine_blackbox.CompletionsClient": "specaudit.adapters.transports.CompletionsClient",
    "specaudit.artifacts.reproducer.remember_failure": "specaudit.commands.pytest_notes.remember_failure",
    "specaudit.artifacts.reproducer.remember_engine_failure": "specaudit.commands.pytest_notes.remember_engine_failure",
    "specaudit.reproducer.remember_failure": "specaudit.commands.pytest_notes.remember_failure",
    "specaudit.reproducer.remember_engine_failure": "specaudit.commands.pytest_notes.remember_engine_failure",
}
"""Old dotted name -> where it lives now, for names that left a module: the engine replay (ceb6d45),
the black box's transports (966f2dc), the pytest notes older regression tests call (issue 26), and the
built-in names of `specaudit.models`, now the models subpackage (97aaf06); consulted before MODULES,
so an old module's names follow them too."""

REMOVED_IN = "0.2.0"
"""The release that drops every path below (as Hypothesis dates its deprecations, each says when and
until when: `DEPRECATIONS`). Only the old paths that something outside the package may import are
here: the homes of `specaudit.__all__`'s names before they moved, what regression tests written by
older versions import, and what the docs' adapter examples imported. Paths that only internal moves
created (the audit's, the gate's, the watchdog's, vLLM's adapter split) were removed in issue 38."""

DEPRECATIONS: dict[str, tuple[str, str]] = {
    **{old: ("2026-12-02", REMOVED_IN) for old in MODULES},  # 97aaf06: the subpackages per concern
    "specaudit.engine_machine.replay": ("2026-12-02", REMOVED_IN),  # ceb6d45
    "specaudit.search.engine_machine.replay": ("2026-12-04", REMOVED_IN),  # issue 26
    "specaudit.models.MODELS": ("2026-12-02", REMOVED_IN),  # 97aaf06
    "specaudit.models.DRAFTS": ("2026-12-02", REMOVED_IN),
    "specaudit.models.DTYPE_NAMES": ("2026-12-02", REMOVED_IN),
    "specaudit.adapters.engine_blackbox.audit_server": ("2026-12-02", REMOVED_IN),  # 966f2dc
    "specaudit.adapters.engine_blackbox.audit_callable": ("2026-12-02", REMOVED_IN),
    "specaudit.adapters.engine_blackbox.CompletionsClient": ("2026-12-02", REMOVED_IN),
    "specaudit.artifacts.reproducer.remember_failure": ("2026-12-04", REMOVED_IN),  # issue 26
    "specaudit.artifacts.reproducer.remember_engine_failure": ("2026-12-04", REMOVED_IN),
    "specaudit.reproducer.remember_failure": ("2026-12-04", REMOVED_IN),
    "specaudit.reproducer.remember_engine_failure": ("2026-12-04", REMOVED_IN),
}
"""Old path -> (the date it was deprecated, the release that removes it): one per entry of
MODULES and NAMES (tests/test_public_api.py holds them equal)."""


def schedule(old: str) -> str:
    """ "deprecated since DATE, removed in specaudit VERSION" for an old path."""
    since, removed = DEPRECATIONS[old]
    return f"deprecated since {since}, removed in specaudit {removed}"


Getattr = Callable[[str], Any]


def resolve(dotted: str) -> Any:
    """The object a dotted `package.module.name` path names."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def moved_away(module: str) -> dict[str, str]:
    """The names that left `module`, each with its new dotted path."""
    return {old.rpartition(".")[2]: new for old, new in NAMES.items() if old.rpartition(".")[0] == module}


def alias(old: str) -> tuple[Getattr, Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for the file left at an old module path: importing it warns
    once, naming the new path; every attribute is the new module's own object (no copies)."""
    new, away = MODULES[old], moved_away(old)
    moved_names = f" (its {', '.join(f'{name} to {path}' for name, path in sorted(away.items()))})" if away else ""
    warnings.warn(
        f"{old} is deprecated: it moved to {new}{moved_names}; import from there ({schedule(old)})",
        DeprecationWarning,
        stacklevel=3,  # alias, the old module's body, then (past importlib's frames) the importing line
    )

    def __getattr__(name: str) -> Any:
        if name == "__all__":
            target = importlib.import_module(new)
            return list(getattr(target, "__all__", [n for n in vars(target) if not n.startswith("_")]))
        if name.startswith("__"):  # __path__, __wrapped__, ...: probes, not names a user imports
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        if name in away:
            return resolve(away[name])
        try:
            return getattr(importlib.import_module(new), name)
        except AttributeError:
            raise AttributeError(f"module {old!r} (now {new!r}) has no attribute {name!r}") from None

    def __dir__() -> list[str]:
        return sorted(set(dir(importlib.import_module(new))) | set(away))

    return __getattr__, __dir__


def forward(module: str) -> Getattr:
    """`__getattr__` for a module some names left: each still resolves, with a DeprecationWarning
    naming its new path at every use."""
    away = moved_away(module)

    def __getattr__(name: str) -> Any:
        if name not in away:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} is deprecated: it moved to {away[name]}; import it from there "
            f"({schedule(f'{module}.{name}')})",
            DeprecationWarning,
            stacklevel=2,
        )
        return resolve(away[name])

    return __getattr__
