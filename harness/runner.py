"""Run one case: oracle first, then the decoder under test on instrumented models."""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from specaudit.case import Case
from specaudit.contract import ContractError, call_decoder, instantiate, load_decoder
from specaudit.fixtures.pairs import draft_model, target_model
from specaudit.fixtures.transparent import RequestScript
from specaudit.instrument import Recording, instrument
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


def run_case(
    decoder_spec: str, case: Case, *, factory: Any = None, timeout_s: float = 120.0, instrumented: bool = True
) -> Run:
    """Run `decoder_spec` (or an already loaded `factory`) on `case` and record everything.

    `instrumented=False` runs without hooks (an empty recording): the baseline for measuring
    the instrumentation's own overhead.
    """
    factory = factory or load_decoder(decoder_spec)
    decoder = instantiate(factory, decoder_spec)
    oracle, scripts = oracle_outputs(case)
    target = target_model(case.model, case.dtype)
    draft = draft_model(case.model, case.draft, scripts, case.dtype)
    input_ids, attention_mask = case.batch()
    outputs, error = None, None
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
                timeout_s=timeout_s,
            )
        except ContractError as exc:
            error = exc
    seconds = time.perf_counter() - start
    return Run(case, decoder_spec, outputs, error, oracle, scripts, recording, target, seconds, decoder)


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
