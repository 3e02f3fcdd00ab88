"""Run one case: oracle first, then the decoder under test on instrumented models."""

from __future__ import annotations

import functools
import sys
import time
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from specaudit.calibration import NoiseFloor
from specaudit.case import Case
from specaudit.contract import (
    ContractError,
    ModelState,
    call_decoder,
    global_hook_changes,
    global_hooks,
    instantiate,
    load_decoder,
    model_changes,
    model_state,
    remove_new_hooks,
)
from specaudit.fixtures.pairs import draft_model, is_exact, target_model
from specaudit.fixtures.transparent import RequestScript
from specaudit.instrument import Recording, breach, instrument
from specaudit.reference.oracle import OracleResult, greedy_oracle, truncate


@dataclass
class Run:
    """Everything the checks need about one decoder run; checks read it, never change it."""

    case: Case
    decoder: str
    outputs: list[list[int]] | None  # None when the decoder broke the contract
    error: ContractError | None
    oracle: list[OracleResult]  # per row: the batch-size-1 greedy output, EOS and limit applied
    scripts: list[RequestScript]  # per row: EOS-blind continuation and accept pattern
    recording: Recording
    target: torch.nn.Module
    seconds: float
    instance: Any = None  # the decoder object, for its declared capabilities (e.g. max_wait_calls)
    factory: Any = None  # what the user gave (class, factory function, configured callable): re-run with this
    noise: NoiseFloor | None = None  # measured batched-arithmetic noise (real models); None: fixed tolerances
    memo: dict[str, Any] = field(default_factory=dict)  # derived views, computed once per run

    @property
    def generated_tokens(self) -> int:
        return sum(map(len, self.outputs or []))

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def outside_models_share(self) -> float:
        """Share of the decoder's time spent outside target and draft forwards: realignment,
        acceptance and bookkeeping (the alignment overhead, as far as hooks can see)."""
        calls = self.recording.target_calls + self.recording.draft_calls
        inside = sum(c.seconds for c in calls)
        return max(0.0, 1.0 - inside / self.seconds) if self.seconds > 0 and calls else 0.0


def oracle_continuation(model: str, dtype: str, prompt: tuple[int, ...], horizon: int) -> OracleResult:
    """The EOS-blind greedy continuation, long enough for the draft to look past the limit.

    Computed in blocks of 16 tokens so shrinking K or max_new_tokens reuses it.
    """
    full = _continuation(model, dtype, prompt, -(-horizon // 16) * 16)
    return OracleResult(full.tokens[:horizon], full.stop, full.margins[:horizon])


@functools.lru_cache(maxsize=4096)
def _continuation(model: str, dtype: str, prompt: tuple[int, ...], horizon: int) -> OracleResult:
    with torch.no_grad():
        return greedy_oracle(target_model(model, dtype), prompt, max_new_tokens=horizon, eos_token_id=None)


def oracle_outputs(case: Case) -> tuple[list[OracleResult], list[RequestScript]]:
    oracle, scripts = [], []
    for prompt, accept in zip(case.prompts, case.accept):
        cont = oracle_continuation(case.model, case.dtype, prompt, case.horizon)
        tokens, stop = truncate(cont.tokens, max_new_tokens=case.max_new_tokens, eos_token_id=case.eos_token_id)
        oracle.append(OracleResult(tokens, stop, cont.margins[: len(tokens)]))
        scripts.append(RequestScript(prompt, cont.tokens, accept))
    return oracle, scripts


TIMEOUT_BASE_S = 20.0
TIMEOUT_PER_TOKEN_S = {"exact": 0.01, "real": 0.25}
"""Default time limit of one decoder run: TIMEOUT_BASE_S plus, per row and position
(rows x (prompt width + max_new_tokens)), 0.01 s on the transparent models and 0.25 s on the
tiny real ones. That is 20 s for one short row, about 35 s for the largest generated
transparent case (16 rows x 91) and 62 s for the largest tiny real-model case (6 rows x 28),
against well under a second for the reference decoders on a quiet CPU and a few seconds on a
2-core machine loaded 4x over; only a hang or a row that never finishes reaches it."""


def default_timeout(case: Case) -> float:
    """The time limit for `case` when the caller gives none (see TIMEOUT_PER_TOKEN_S)."""
    width = max(map(len, case.prompts)) + case.extra_pad_columns
    rate = TIMEOUT_PER_TOKEN_S["exact" if is_exact(case.model) else "real"]
    return TIMEOUT_BASE_S + rate * case.batch_size * (width + case.max_new_tokens)


_HUNG: dict[tuple[str, Any], ContractError] = {}
"""Decoders that hung in this process, by (spec, factory): later runs fail at once with the
same violation, so Hypothesis's shrinking does not wait out the time limit again per step."""


def run_case(
    decoder_spec: str,
    case: Case,
    *,
    factory: Any = None,
    timeout_s: float | None = None,
    instrumented: bool = True,
) -> Run:
    """Run `decoder_spec` (or an already loaded `factory`) on `case` and record everything.

    `timeout_s=None` is `default_timeout(case)`. `instrumented=False` runs without hooks and
    side-effect checks (an empty recording): the baseline for measuring the instrumentation's
    own overhead. A contract break (the decoder's own, an input the checks cannot judge, an
    unobserved target forward, a changed model) leaves `outputs` None and `error` set.
    """
    factory = factory or load_decoder(decoder_spec)
    hung = _HUNG.get((decoder_spec, factory))
    if hung is not None:  # fail at once: waiting out the limit again at every shrink step hangs the suite
        target = target_model(case.model, case.dtype)
        return Run(case, decoder_spec, None, hung, [], [], Recording(), target, 0.0, factory=factory)
    decoder = instantiate(factory, decoder_spec)
    oracle, scripts = oracle_outputs(case)
    target = target_model(case.model, case.dtype)
    draft = draft_model(case.model, case.draft, scripts, case.dtype)
    input_ids, attention_mask = case.batch()
    limit = default_timeout(case) if timeout_s is None else timeout_s
    outputs, error = None, None
    watched = watch_models(target, draft) if instrumented else None
    start = time.perf_counter()
    with instrument(target, draft) if instrumented else nullcontext(Recording()) as recording:
        try:
            outputs = call_decoder(
                decoder,
                target,
                draft,
                input_ids,
                attention_mask,
                num_draft_tokens=case.num_draft_tokens,
                max_new_tokens=case.max_new_tokens,
                eos_token_id=case.eos_token_id,
                pad_token_id=case.pad_token_id,
                timeout_s=limit,
            )
        except ContractError as exc:
            error = exc
    seconds = time.perf_counter() - start
    if watched is not None:
        changed = models_breach(watched, target, draft)  # always: it also repairs the models
        error = breach(recording) or error or changed
    if error is not None:
        outputs = None
        if "timeout_s" in error.evidence:
            _HUNG[(decoder_spec, factory)] = hung_before(error, case)
    return Run(case, decoder_spec, outputs, error, oracle, scripts, recording, target, seconds, decoder, factory)


def hung_before(error: ContractError, case: Case) -> ContractError:
    """The violation later runs of a hung decoder report without running it."""
    return ContractError(
        "generate-returns",
        f"{error.found.removesuffix(' (a hang, or a row that never finishes)')} on {case!r} "
        "(a hang, or a row that never finishes; this decoder is not run again in this process)",
        evidence=dict(error.evidence, hung_case=case.to_json()),
    )


# ---------------------------------------------------------------------------------------
# Side effects on the shared models


def watch_models(target: torch.nn.Module, draft: torch.nn.Module) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """Fingerprints of the models (and torch's global hooks) before the decoder runs."""
    models = {"target": (target, model_state(target))}
    if draft is not target:
        models["draft"] = (draft, model_state(draft))
    return models, global_hooks()


def models_breach(
    watched: tuple[dict[str, tuple[torch.nn.Module, ModelState]], dict[str, tuple[int, ...]]],
    target: torch.nn.Module,
    draft: torch.nn.Module,
) -> ContractError | None:
    """'models-unchanged', after repairing what was changed: hooks left behind are removed;
    a built-in model changed in any other way is dropped from the caches, so the next run
    (and the oracle) gets a freshly built one."""
    models, hooks_before = watched
    changes = global_hook_changes(hooks_before)
    for role, (model, before) in models.items():
        found = model_changes(role, before, model)
        if found:
            remove_new_hooks(before, model)
            if any(" left on " not in change for change in found):
                evict_models()
        changes += found
    if not changes:
        return None
    return ContractError("models-unchanged", "; ".join(changes[:6]), evidence={"changes": changes})


def evict_models() -> None:
    """Forget every cached built-in model and run built on one: a decoder changed a model."""
    target_model.cache_clear()
    tiny = sys.modules.get("specaudit.fixtures.tiny")
    if tiny is not None and hasattr(tiny, "_build"):
        tiny._build.cache_clear()
    _RUNS.clear()


_RUNS: OrderedDict[tuple[str, Case], Run] = OrderedDict()


def cached_run(decoder_spec: str, case: Case) -> Run:
    """The properties share runs: four checks of one case cost one decoder run per process."""
    key = (decoder_spec, case)
    if key in _RUNS:
        _RUNS.move_to_end(key)
        return _RUNS[key]
    run = run_case(decoder_spec, case)
    _RUNS[key] = run
    while len(_RUNS) > 64:
        _RUNS.popitem(last=False)
    return run
