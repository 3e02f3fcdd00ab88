"""The side-effect guard: one for every subject that is handed the harness's models.

A decoder's `generate` call (`specaudit.running.runner.guarded_call`, built-in and real models
alike) and an engine session's every step (`specaudit.running.engine_session`) are guarded the
same way: the models' fingerprints (parameters, buffers, config, mode, hooks) and torch's global
hooks are taken before the subject runs; afterwards whatever changed is named and repaired (hooks
left behind are removed, a model changed in any other way is evicted from the caches that built
it, so the next run gets a fresh one), and the change is the contract rule `models-unchanged`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specaudit.contracts.decoder import ContractError
from specaudit.running.fingerprint import (
    ModelState,
    global_hook_changes,
    global_hooks,
    model_changes,
    model_state,
    remove_new_hooks,
)


class ModelGuard:
    """Fingerprints of the models a subject was handed, and what to evict when one is changed."""

    def __init__(self, models: dict[str, torch.nn.Module], evict: Callable[[], None]) -> None:
        self.models: dict[str, tuple[torch.nn.Module, ModelState]] = {}
        for role, model in models.items():
            if all(model is not m for m, _ in self.models.values()):  # a draft that is the target: once
                self.models[role] = (model, model_state(model))
        self.hooks = global_hooks()
        self.evict = evict

    def changes(self) -> list[str]:
        """What the subject changed since the fingerprints, one phrase each, after repairing it:
        hooks left behind are removed; any other change evicts the models for the next run."""
        changes = global_hook_changes(self.hooks)
        for role, (model, before) in self.models.items():
            found = model_changes(role, before, model)
            if found:
                remove_new_hooks(before, model)
                if any(" left on " not in change for change in found):
                    self.evict()
            changes += found
        return changes

    def breach(self, expected: str | None = None) -> ContractError | None:
        """'models-unchanged' (`expected`: the subject's own wording of the rule), or None."""
        changes = self.changes()
        if not changes:
            return None
        return ContractError("models-unchanged", "; ".join(changes[:6]), expected, {"changes": changes})
