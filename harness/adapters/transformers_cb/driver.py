"""A `CbWorkload` through one of transformers CB's public entry points, observed throughout.

- `generate_batch`: every prompt at once, one `max_new_tokens`;
- the manager (`init_continuous_batching`): `add_request` after each request's arrival step,
  `cancel_request` after its abort step (`schedule.Schedule`), `get_result` until done;
- `generate(input_ids, attention_mask, cache_implementation="paged")`: prompts of uneven lengths
  left-padded into one `[B, T]` tensor.

The observer needs the `ContinuousBatchingManager` the engine runs on; `generate_batch` and
`generate` build theirs internally, so `_Capture` hands it over. transformers CB does no
speculation (K = 0), and CPU offloading (`cpu_offload_space > 0`) copies blocks behind the slot
mapping, so it is not driven here.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specaudit.adapters.transformers_cb.models import engine_model
from specaudit.adapters.transformers_cb.observer import CbObserver
from specaudit.adapters.transformers_cb.schedule import Schedule
from specaudit.adapters.transformers_cb.workload import CbWorkload
from specaudit.running.paged import PagedTrace

CB_LOGGER = logging.getLogger("ContinuousBatchingLogger")  # transformers' continuous batching's logger

Answers = dict[str, tuple[int, ...] | None]  # request id -> its new tokens (None: nothing came back)
Errors = dict[str, str]  # request id -> what went wrong returning it


def cb_config(workload: CbWorkload) -> Any:
    """Synchronous, eager, no CUDA graph, no decode fast path, no CPU offload: the varlen path
    whose write and read indices the observer reads. The model's attention stays as loaded
    (SDPA, or eager as paged eager): on a CUDA machine with flash-attn installed transformers
    would otherwise switch to flash attention, which has no float32 kernels."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return ContinuousBatchingConfig(
        page_size=workload.page_size,
        num_blocks=workload.num_blocks,
        max_batch_tokens=workload.max_batch_tokens,
        max_requests_per_batch=16,
        max_blocks_per_request=0,
        allow_block_sharing=workload.prefix_sharing,
        use_async_batching=False,
        use_cuda_graph=False,
        cpu_offload_space=0.0,
        auto_switch_to_flash=False,
        seed=0,
    )


def generation_config(workload: CbWorkload, max_new_tokens: int) -> Any:
    """Greedy, to `max_new_tokens`; a workload without EOS gets -1, an id no model produces."""
    from transformers import GenerationConfig

    eos = -1 if workload.eos_token_id is None else workload.eos_token_id
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=None)


@dataclass
class CbRun:
    """One workload through one entry point: the trace, each request's answer, the wall time."""

    workload: CbWorkload
    trace: PagedTrace
    answers: Answers
    errors: Errors
    seconds: float


def without_psutil_notes(record: logging.LogRecord) -> bool:
    """transformers' CB logger reports a missing psutil (memory breakdown, CPU offload cap) at ERROR
    on every manager start: about the host, not the run, and a hundred lines in `make audit`."""
    return "psutil" not in record.getMessage()


def run_workload(workload: CbWorkload, model: torch.nn.Module | None = None, timeout: float = 60.0) -> CbRun:
    """Run `workload` through its entry point on a private tiny Llama, observed throughout."""
    model = engine_model(workload.seed) if model is None else model
    observer = CbObserver(model)
    start = time.perf_counter()
    gc.freeze()  # transformers runs gc.collect() when a manager stops: skip the heap that was there before
    CB_LOGGER.addFilter(without_psutil_notes)
    try:
        answers, errors = DRIVERS[workload.entry](model, observer, workload, timeout)
    finally:
        CB_LOGGER.removeFilter(without_psutil_notes)
        gc.unfreeze()
        observer.close()
    if observer.error is not None:
        raise RuntimeError(f"the observer failed on a forward: {observer.error!r}") from observer.error
    trace = observer.finish()
    return CbRun(workload, trace, answers, errors, time.perf_counter() - start)


class _Capture:
    """The manager `generate_batch` and `generate` build internally, handed to the observer
    (the model's own `init_continuous_batching`, wrapped on this instance only)."""

    def __init__(self, model: torch.nn.Module, observer: CbObserver) -> None:
        self.model, self.observer = model, observer

    def __enter__(self) -> _Capture:
        original = self.model.init_continuous_batching

        def capture(*args: Any, **kwargs: Any) -> Any:
            self.observer.manager = original(*args, **kwargs)
            return self.observer.manager

        self.model.init_continuous_batching = capture
        return self

    def __exit__(self, *exc: object) -> None:
        del self.model.init_continuous_batching


def _one_limit(workload: CbWorkload) -> int:
    """The one `max_new_tokens` of an entry point that takes one for every prompt."""
    limits = {r.max_new_tokens for r in workload.requests}
    assert len(limits) == 1, f"{workload.entry} takes one max_new_tokens for every prompt, got {sorted(limits)}"
    return limits.pop()


def _positional_names(workload: CbWorkload) -> dict[str, str]:
    """transformers' names for prompts given as a list (req_0, req_1, ... in input order) -> the workload's."""
    return {f"req_{i}": r.id for i, r in enumerate(workload.requests)}


def _drive_generate_batch(
    model: torch.nn.Module, observer: CbObserver, workload: CbWorkload, timeout: float
) -> tuple[Answers, Errors]:
    """Every prompt at once; transformers names them req_0, req_1, ... in input order."""
    limit = _one_limit(workload)
    for i, r in enumerate(workload.requests):
        observer.submitted(f"req_{i}", r.prompt)
    with _Capture(model, observer):
        out = model.generate_batch(
            [list(r.prompt) for r in workload.requests],
            generation_config=generation_config(workload, limit),
            continuous_batching_config=cb_config(workload),
            warmup=False,
        )
    answers, errors = {}, {}
    for i, r in enumerate(workload.requests):
        result = out.get(f"req_{i}")
        answers[r.id] = None if result is None else tuple(int(t) for t in result.generated_tokens)
        if result is None or result.error is not None:
            errors[r.id] = "no result" if result is None else f"failed: {result.error}"
    observer.rename(_positional_names(workload))
    return answers, errors


def _left_padded(workload: CbWorkload) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T] prompts left-padded with `pad_token_id`, [B, T] attention mask: 0 on pads)."""
    width = max(len(r.prompt) for r in workload.requests)
    rows = [(workload.pad_token_id,) * (width - len(r.prompt)) + r.prompt for r in workload.requests]
    mask = [[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in workload.requests]
    return torch.tensor(rows), torch.tensor(mask)


def _drive_generate(
    model: torch.nn.Module, observer: CbObserver, workload: CbWorkload, timeout: float
) -> tuple[Answers, Errors]:
    """`generate(input_ids, attention_mask, cache_implementation="paged")`; the returned
    `[1, B, T + output]` sequences give each row's output. The trace holds what the engine was
    given (pads included); each row's output is judged against its unpadded prompt's oracle."""
    limit = _one_limit(workload)
    ids, mask = _left_padded(workload)  # [B, T], [B, T]
    for i, row in enumerate(ids.tolist()):
        observer.submitted(f"req_{i}", row)
    answers: Answers = {r.id: None for r in workload.requests}
    errors: Errors = {}
    try:
        with _Capture(model, observer):
            sequences = model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=generation_config(workload, limit),
                cache_implementation="paged",
                continuous_batching_config=cb_config(workload),
                warmup=False,
            )  # [1, B, T + new]
        for i, r in enumerate(workload.requests):
            answers[r.id] = tuple(int(t) for t in sequences[0, i, ids.shape[1] :])
    except Exception as exc:  # the contract: one sequence per prompt, without raising
        errors = {r.id: f"generate raised {type(exc).__name__}: {exc}" for r in workload.requests}
    observer.rename(_positional_names(workload))
    return answers, errors


def _drive_manager(
    model: torch.nn.Module, observer: CbObserver, workload: CbWorkload, timeout: float
) -> tuple[Answers, Errors]:
    """`init_continuous_batching`: requests added with `add_request` after their arrival step,
    cancelled with `cancel_request` after their abort step (both from the step's forward hook,
    so the schedule is deterministic), results collected with `get_result`."""
    manager = model.init_continuous_batching(
        generation_config=generation_config(workload, max(r.max_new_tokens for r in workload.requests)),
        continuous_batching_config=cb_config(workload),
    )
    observer.manager = manager
    schedule = Schedule(manager, observer, workload)
    observer.on_step = schedule.after_step
    manager.start()
    try:
        results = schedule.collect(timeout)
    finally:
        manager.stop(block=True, timeout=10)
        manager.destroy()
    if schedule.error is not None:
        raise RuntimeError(f"the schedule failed in the engine's thread: {schedule.error!r}") from schedule.error
    return _manager_answers(workload, results, schedule.cancelled, observer.outputs())


def _manager_answers(
    workload: CbWorkload, results: dict[str, Any], cancelled: set[str], outputs: dict[str, tuple[int, ...]]
) -> tuple[Answers, Errors]:
    """Each request's `get_result`; a cancelled one returns none, so its answer is what it had
    committed (`outputs`, the observer's reading of its request states)."""
    answers: Answers = {}
    errors: Errors = {}
    for r in workload.requests:
        result = results.get(r.id)
        if r.id in cancelled and result is None:
            answers[r.id] = outputs.get(r.id, ())
        elif result is None or result.error is not None:
            answers[r.id] = None
            errors[r.id] = "no result" if result is None else f"failed: {result.error}"
        else:
            answers[r.id] = tuple(int(t) for t in result.generated_tokens)
    return answers, errors


Driver = Callable[[torch.nn.Module, CbObserver, CbWorkload, float], tuple[Answers, Errors]]
DRIVERS: dict[str, Driver] = {
    "generate_batch": _drive_generate_batch,
    "manager": _drive_manager,
    "generate": _drive_generate,
}
"""Each entry point's driver, by `CbWorkload.entry`."""
