"""The side-effect guard: one for every subject that is handed the harness's models.

A decoder's `generate` call (`specaudit.running.runner.guarded_call`, built-in and real models
alike) and an engine session's every step (`specaudit.running.engine_session`) are guarded the
same way: the models' fingerprints (parameters, buffers, config, mode, hooks) and torch's global
hooks are taken before the subject runs; afterwards whatever changed is named and repaired (hooks
left behind are removed, a model changed in any other way is evicted from the caches that built
it, so the next run gets a fresh one), and the change is the contract rule `models-unchanged`.

The warnings a decoder's run raises (`decoder_warnings`) are shown once each per process, placed
at the decoder's own line that called the model: transformers' deprecation warnings, raised with
a stack level that lands on the harness's hook wrapper, would otherwise be printed on every run
of an audit and blamed on specaudit.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

import torch
import transformers

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


LIBRARIES = tuple(
    os.path.dirname(module.__file__) + os.sep for module in (torch, transformers) if module.__file__ is not None
)
HARNESS = os.path.dirname(os.path.abspath(__file__)) + os.sep  # specaudit.running: the hooks, the watchdog
SHOWN: set[tuple[type[Warning], str]] = set()  # (category, message) already shown in this process

Caught = tuple[Warning | str, type[Warning], str, int]  # (message, category, filename, lineno)


def caller_outside(frame: FrameType | None, skipped: tuple[str, ...]) -> tuple[str, int] | None:
    """(filename, lineno) of the innermost frame from `frame` outwards not in `skipped` (nor in the
    warnings module): the decoder's line that called the model. None if every frame is skipped."""
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if name != os.path.abspath(warnings.__file__) and not name.startswith(skipped):
            return name, frame.f_lineno
        frame = frame.f_back
    return None


@contextmanager
def decoder_warnings(skipped: tuple[str, ...] = (*LIBRARIES, HARNESS)) -> Iterator[list[Caught]]:
    """Inside: every warning that passes the filters is held, not printed, at the decoder's line
    that led to it (`caller_outside` the `skipped` folders: torch, transformers, the hooks); after:
    each distinct (category, message) not shown before in this process is re-emitted there, once.
    The filters are left as they are: an 'error' filter still raises in the decoder, an 'ignore'
    one still hides it. Yields the held warnings, in order."""
    held: list[Caught] = []

    def hold(message: Warning | str, category: type[Warning], filename: str, lineno: int, *_: object) -> None:
        place = caller_outside(sys._getframe(1), skipped) or (filename, lineno)
        held.append((message, category, *place))

    with warnings.catch_warnings():
        warnings.showwarning = hold
        yield held
    for message, category, filename, lineno in held:
        key = (category, str(message))
        if key not in SHOWN:
            SHOWN.add(key)
            warnings.warn_explicit(message, category, filename, lineno)
