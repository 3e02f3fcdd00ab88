"""Old import paths of moved modules and names: they keep working for a while, with a DeprecationWarning.

Adapters and the regression tests specaudit wrote into users' repositories import specaudit by
module path; when a module moves (97aaf06: the subpackages per concern) or a name leaves its
module (ceb6d45: the engine machine and the black box split by layer), the old path must not
become an ImportError overnight. Each old module is a file at its old place that calls `alias`;
a module a name left calls `forward`. Both look the new place up here, so docs/api.md and
tests/test_public_api.py read one table. Standard library only: the foundation layer.
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
    "specaudit.artifacts.audit": "specaudit.audits.audit",
    "specaudit.artifacts.gate": "specaudit.audits.gate",
    "specaudit.artifacts.transplant": "specaudit.audits.transplant",
    "specaudit.adapters.realaudit": "specaudit.audits.realaudit",
}
"""Old module -> where it lives now (97aaf06). Kept: the contracts, the cache layer, the case,
what specaudit's written regression tests import (runner, registry, violation, reproducer,
engine_machine), the diagnosis and replay, and what the docs' adapter examples imported (loading, realmodel, cli).
Then (issue 26) what runs an audit left `artifacts` and `adapters` for `specaudit.audits`: the
audit, the gate's run half, the transplant and the real-model audit."""

NAMES: dict[str, str] = {
    "specaudit.engine_machine.replay": "specaudit.search.engine_replay.replay",
    "specaudit.engine_machine.diagnose_engine": "specaudit.search.engine_replay.diagnose_engine",
    "specaudit.engine_machine.engine_signature": "specaudit.search.engine_replay.engine_signature",
    "specaudit.search.engine_machine.replay": "specaudit.search.engine_replay.replay",
    "specaudit.search.engine_machine.engine_signature": "specaudit.search.engine_replay.engine_signature",
    "specaudit.models.MODELS": "specaudit.contracts.builtins.MODELS",
    "specaudit.models.DRAFTS": "specaudit.contracts.builtins.DRAFTS",
    "specaudit.models.DTYPE_NAMES": "specaudit.contracts.builtins.DTYPE_NAMES",
    "specaudit.adapters.engine_blackbox.audit_server": "specaudit.adapters.transports.audit_server",
    "specaudit.adapters.engine_blackbox.audit_callable": "specaudit.adapters.transports.audit_callable",
    "specaudit.adapters.engine_blackbox.CompletionsClient": "specaudit.adapters.transports.CompletionsClient",
    "specaudit.artifacts.reproducer.remember_failure": "specaudit.commands.pytest_notes.remember_failure",
    "specaudit.artifacts.reproducer.remember_engine_failure": "specaudit.commands.pytest_notes.remember_engine_failure",
    "specaudit.artifacts.reproducer.note_on_item": "specaudit.commands.pytest_notes.note_on_item",
    "specaudit.artifacts.reproducer.write_failure": "specaudit.audits.regression.write_failure",
    "specaudit.artifacts.reproducer.write_engine_failure": "specaudit.audits.regression.write_engine_failure",
    "specaudit.artifacts.reproducer.regression_test_source": "specaudit.audits.regression.regression_test_source",
    "specaudit.artifacts.reproducer.engine_regression_test_source": "specaudit.audits.regression.engine_regression_test_source",  # noqa: E501
    "specaudit.artifacts.reproducer.replay_failures": "specaudit.commands.replay.replay_failures",
    "specaudit.artifacts.reproducer.replay_engine_rules": "specaudit.commands.replay.replay_engine_rules",
    "specaudit.reproducer.remember_failure": "specaudit.commands.pytest_notes.remember_failure",
    "specaudit.reproducer.remember_engine_failure": "specaudit.commands.pytest_notes.remember_engine_failure",
    "specaudit.reproducer.note_on_item": "specaudit.commands.pytest_notes.note_on_item",
    "specaudit.reproducer.write_failure": "specaudit.audits.regression.write_failure",
    "specaudit.reproducer.write_engine_failure": "specaudit.audits.regression.write_engine_failure",
    "specaudit.reproducer.regression_test_source": "specaudit.audits.regression.regression_test_source",
    "specaudit.reproducer.engine_regression_test_source": "specaudit.audits.regression.engine_regression_test_source",  # noqa: E501
    "specaudit.reproducer.replay_failures": "specaudit.commands.replay.replay_failures",
    "specaudit.reproducer.replay_engine_rules": "specaudit.commands.replay.replay_engine_rules",
    "specaudit.contracts.decoder.Watchdog": "specaudit.running.watchdog.Watchdog",
    "specaudit.contracts.decoder.call_decoder": "specaudit.running.watchdog.call_decoder",
    "specaudit.contracts.decoder.still_running": "specaudit.running.watchdog.still_running",
    "specaudit.contracts.decoder.watched": "specaudit.running.watchdog.watched",
    "specaudit.contracts.decoder.STOP_GRACE_S": "specaudit.running.watchdog.STOP_GRACE_S",
    "specaudit.contracts.decoder.POLL_S": "specaudit.running.watchdog.POLL_S",
    "specaudit.contracts.decoder.ModelState": "specaudit.running.fingerprint.ModelState",
    "specaudit.contracts.decoder.model_state": "specaudit.running.fingerprint.model_state",
    "specaudit.contracts.decoder.model_changes": "specaudit.running.fingerprint.model_changes",
    "specaudit.contracts.decoder.remove_new_hooks": "specaudit.running.fingerprint.remove_new_hooks",
    "specaudit.contracts.decoder.global_hooks": "specaudit.running.fingerprint.global_hooks",
    "specaudit.contracts.decoder.global_hook_changes": "specaudit.running.fingerprint.global_hook_changes",
    "specaudit.contracts.decoder.HOOK_DICTS": "specaudit.running.fingerprint.HOOK_DICTS",
    "specaudit.contracts.decoder.GLOBAL_HOOK_DICTS": "specaudit.running.fingerprint.GLOBAL_HOOK_DICTS",
    "specaudit.contract.Watchdog": "specaudit.running.watchdog.Watchdog",
    "specaudit.contract.call_decoder": "specaudit.running.watchdog.call_decoder",
    "specaudit.contract.still_running": "specaudit.running.watchdog.still_running",
    "specaudit.contract.watched": "specaudit.running.watchdog.watched",
    "specaudit.contract.STOP_GRACE_S": "specaudit.running.watchdog.STOP_GRACE_S",
    "specaudit.contract.POLL_S": "specaudit.running.watchdog.POLL_S",
    "specaudit.contract.ModelState": "specaudit.running.fingerprint.ModelState",
    "specaudit.contract.model_state": "specaudit.running.fingerprint.model_state",
    "specaudit.contract.model_changes": "specaudit.running.fingerprint.model_changes",
    "specaudit.contract.remove_new_hooks": "specaudit.running.fingerprint.remove_new_hooks",
    "specaudit.contract.global_hooks": "specaudit.running.fingerprint.global_hooks",
    "specaudit.contract.global_hook_changes": "specaudit.running.fingerprint.global_hook_changes",
    "specaudit.contract.HOOK_DICTS": "specaudit.running.fingerprint.HOOK_DICTS",
    "specaudit.contract.GLOBAL_HOOK_DICTS": "specaudit.running.fingerprint.GLOBAL_HOOK_DICTS",
    "specaudit.artifacts.audit.Verdict": "specaudit.audits.decoders.DecoderVerdict",
    "specaudit.artifacts.audit.EngineVerdict": "specaudit.audits.engines.EngineVerdict",
    "specaudit.artifacts.audit.audit_model": "specaudit.audits.decoders.audit_model",
    "specaudit.artifacts.audit.audit_plan": "specaudit.audits.decoders.audit_plan",
    "specaudit.artifacts.audit.planted_bugs": "specaudit.audits.decoders.planted_bugs",
    "specaudit.artifacts.audit.format_table": "specaudit.audits.decoders.format_table",
    "specaudit.artifacts.audit.audit_engine": "specaudit.audits.engines.audit_engine",
    "specaudit.artifacts.audit.engine_plan": "specaudit.audits.engines.engine_plan",
    "specaudit.artifacts.audit.planted_engine_bugs": "specaudit.audits.engines.planted_engine_bugs",
    "specaudit.artifacts.audit.format_engine_table": "specaudit.audits.engines.format_engine_table",
    "specaudit.artifacts.audit.merge_statuses": "specaudit.audits.verdict.merge_statuses",
    "specaudit.adapters.vllm_server.HOST": "specaudit.adapters.vllm_lifecycle.HOST",
    "specaudit.adapters.vllm_server.SERVER_ARGS": "specaudit.adapters.vllm_lifecycle.SERVER_ARGS",
    "specaudit.adapters.vllm_server.SERVER_ENV": "specaudit.adapters.vllm_lifecycle.SERVER_ENV",
    "specaudit.adapters.vllm_server.LOG_TAIL_LINES": "specaudit.adapters.vllm_lifecycle.LOG_TAIL_LINES",
    "specaudit.adapters.vllm_server.ServerError": "specaudit.adapters.vllm_lifecycle.ServerError",
    "specaudit.adapters.vllm_server.free_port": "specaudit.adapters.vllm_lifecycle.free_port",
    "specaudit.adapters.vllm_server.server_command": "specaudit.adapters.vllm_lifecycle.server_command",
    "specaudit.adapters.vllm_server.log_tail": "specaudit.adapters.vllm_lifecycle.log_tail",
    "specaudit.adapters.vllm_server.Server": "specaudit.adapters.vllm_lifecycle.Server",
    "specaudit.adapters.vllm_server.group_members": "specaudit.adapters.vllm_lifecycle.group_members",
    "specaudit.adapters.vllm_server.http_status": "specaudit.adapters.vllm_lifecycle.http_status",
    "specaudit.adapters.vllm_server.stop_on_signals": "specaudit.adapters.vllm_lifecycle.stop_on_signals",
    "specaudit.adapters.vllm_server.serving": "specaudit.adapters.vllm_lifecycle.serving",
    "specaudit.adapters.vllm_server.check_python": "specaudit.adapters.vllm_lifecycle.check_python",
    "specaudit.adapters.vllm_server.NOTHING_ACCEPTED": "specaudit.adapters.vllm_report.NOTHING_ACCEPTED",
    "specaudit.adapters.vllm_server.IN_FLIGHT": "specaudit.adapters.vllm_report.IN_FLIGHT",
    "specaudit.adapters.vllm_server.peak_in_flight": "specaudit.adapters.vllm_report.peak_in_flight",
    "specaudit.adapters.vllm_server.from_report": "specaudit.adapters.vllm_report.from_report",
    "specaudit.adapters.vllm_server.render_markdown": "specaudit.adapters.vllm_report.render_markdown",
    "specaudit.adapters.vllm_server.write_reports": "specaudit.adapters.vllm_report.write_reports",
    "specaudit.adapters.vllm_server.SPEC_METRICS": "specaudit.adapters.vllm_metrics.SPEC_METRICS",
    "specaudit.adapters.vllm_server.SAMPLE": "specaudit.adapters.vllm_metrics.SAMPLE",
    "specaudit.adapters.vllm_server.parse_metrics": "specaudit.adapters.vllm_metrics.parse_metrics",
    "specaudit.adapters.vllm_server.SpecCounts": "specaudit.adapters.vllm_metrics.SpecCounts",
    "specaudit.adapters.vllm_server.fetch_counts": "specaudit.adapters.vllm_metrics.fetch_counts",
    "specaudit.adapters.vllm_server.TINY": "specaudit.adapters.vllm_models.TINY",
    "specaudit.adapters.vllm_server.TINY_RANGE": "specaudit.adapters.vllm_models.TINY_RANGE",
    "specaudit.adapters.vllm_server.TINY_LATER_SCALE": "specaudit.adapters.vllm_models.TINY_LATER_SCALE",
    "specaudit.adapters.vllm_server.TINY_SPECIALS": "specaudit.adapters.vllm_models.TINY_SPECIALS",
    "specaudit.adapters.vllm_server.tiny_tokenizer": "specaudit.adapters.vllm_models.tiny_tokenizer",
    "specaudit.adapters.vllm_server.tiny_llama": "specaudit.adapters.vllm_models.tiny_llama",
    "specaudit.adapters.vllm_server.model_directories": "specaudit.adapters.vllm_models.model_directories",
    "specaudit.adapters.vllm_server.observe_in_process": "specaudit.adapters.vllm_whitebox.observe_in_process",
    "specaudit.adapters.vllm_server.Outcome": "specaudit.adapters.vllm_report.ConfigurationOutcome",
    "specaudit.adapters.vllm_server.PagedRun": "specaudit.adapters.vllm_whitebox.WhiteBoxResult",
    "specaudit.adapters.vllm_server.default_workload": "specaudit.adapters.vllm_whitebox.default_payload",
    "specaudit.adapters.vllm_server.write_paged_failure": "specaudit.adapters.vllm_whitebox.write_failure",
}
"""Old dotted name -> where it lives now, for names that left a module (ceb6d45, 966f2dc; issue 26:
the reproducer's code generation, pytest notes and replays, the decoder contract's watchdog and
fingerprints, the audit's verdicts and plan, the vLLM server's lifecycle, metrics, models and
report) or whose module's path is now a package
(`specaudit.models`, 97aaf06); consulted before MODULES, so an old module's names follow them too."""

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
        f"{old} is deprecated: it moved to {new}{moved_names}; import from there (the old path will be removed)",
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
            "(the old path will be removed)",
            DeprecationWarning,
            stacklevel=2,
        )
        return resolve(away[name])

    return __getattr__
