"""Calling a decoder under a watchdog: a slow decoder is not a hung one.

generate() runs in a worker thread while the caller watches its progress (forwards of the
models completed, read from the instrumentation). It is stopped, and breaks
'generate-returns', when no forward completes for `idle_s` (a hang) or when it has made more
than `max_forwards` target forwards (rows that never finish). Without a progress reading
(an un-instrumented run) `idle_s` bounds the whole call. Stopping raises DecoderTimeout in
the worker; a decoder that does not stop within STOP_GRACE_S (stuck in native code) is
still running, and `still_running` says so to whoever would run the same decoder next:
its forwards would land in that run's recording.

What the call must return is the contract's (`specaudit.contracts.decoder.validate_output`).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specaudit.contracts.decoder import (
    ContractError,
    Decoder,
    DecoderTimeout,
    check_inputs_unchanged,
    validate_output,
)

STOP_GRACE_S = 5.0
POLL_S = 0.25
_STILL_RUNNING: dict[Any, tuple[threading.Thread, str]] = {}


@dataclass(frozen=True)
class Watchdog:
    """How a decoder call is watched (see the module docstring)."""

    idle_s: float
    progress: Callable[[], tuple[int, int]] | None = None  # (target forwards, all forwards) so far
    max_forwards: int | None = None
    owner: Any = None  # who is still running if the decoder cannot be stopped (the runner's decoder key)
    what: str = ""  # the case, for the report of a decoder still running


def still_running(owner: Any) -> str | None:
    """What a decoder that timed out and could not be stopped is still running, or None."""
    entry = _STILL_RUNNING.get(owner)
    if entry is None:
        return None
    if not entry[0].is_alive():
        del _STILL_RUNNING[owner]
        return None
    return entry[1]


def watched(fn: Callable[[], Any], watchdog: Watchdog) -> Any:
    """fn() under the watchdog: its value, its exception, or ContractError 'generate-returns'."""
    box: dict[str, Any] = {}
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def work() -> None:
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):  # thread-local modes
                box["value"] = fn()
        except DecoderTimeout:
            box["stopped"] = True
        except BaseException as exc:  # noqa: B036 -- handed to the caller's thread
            box["error"] = exc

    worker = threading.Thread(target=work, name="specaudit-decoder", daemon=True)
    start = last = time.monotonic()
    seen = (0, 0)
    worker.start()
    while True:
        worker.join(POLL_S)
        if not worker.is_alive():
            break
        now = time.monotonic()
        if watchdog.progress is not None and (count := watchdog.progress()) != seen:
            seen, last = count, now
        if watchdog.max_forwards is not None and seen[0] > watchdog.max_forwards:
            stop(worker, watchdog)
            raise runaway(seen[0], watchdog, now - start)
        if now - last > watchdog.idle_s:
            stopped = stop(worker, watchdog)
            raise hang(watchdog, now - start, stopped, watchdog.progress is not None)
    if "error" in box:
        raise box["error"]
    return box["value"]


def stop(worker: threading.Thread, watchdog: Watchdog) -> bool:
    """Raise DecoderTimeout in the worker and wait for it; False if it is still running (noted)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident or 0), ctypes.py_object(DecoderTimeout))
    worker.join(STOP_GRACE_S)
    if worker.is_alive():
        _STILL_RUNNING[watchdog.owner] = (worker, watchdog.what)
        return False
    return True


def hang(watchdog: Watchdog, seconds: float, stopped: bool, progress: bool) -> ContractError:
    if progress:
        idle = f"making no forward of the models for {watchdog.idle_s:.3g} s"
    else:
        idle = f"not returning within {watchdog.idle_s:.3g} s"
    state = "stopped" if stopped else "could not be stopped and is still running"
    return ContractError(
        "generate-returns",
        f"generate() {idle} (a hang, or a row that never finishes; {state} after {seconds:.3g} s)",
        evidence={"timeout_s": watchdog.idle_s, "seconds": round(seconds, 3), "still_running": not stopped},
    )


def runaway(forwards: int, watchdog: Watchdog, seconds: float) -> ContractError:
    return ContractError(
        "generate-returns",
        f"generate() still running after {forwards} target forwards, more than the "
        f"{watchdog.max_forwards} the case can need (rows that never finish; stopped after {seconds:.3g} s)",
        evidence={"max_forwards": watchdog.max_forwards, "forwards": forwards, "seconds": round(seconds, 3)},
    )


def call_decoder(
    decoder: Decoder,
    target: Any,
    draft: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    num_draft_tokens: int,
    max_new_tokens: int,
    eos_token_id: int | None,
    pad_token_id: int,
    timeout_s: float = 120.0,
    watchdog: Watchdog | None = None,
    sampling: dict[str, Any] | None = None,
) -> list[list[int]]:
    """Call generate() under the contract; any breach becomes a ContractError naming the rule.

    `watchdog` (default: `timeout_s` on the whole call) says when a call is a hang. `sampling`:
    the sampling mode's keywords (`contracts.sampling`: temperature, top_k, top_p, generator),
    passed only to a decoder that samples. The decoder
    gets the caller's own tensors, not copies, so writing into them is seen ('inputs-unchanged');
    the caller must not need them unchanged afterwards.
    """
    ids_before, mask_before = input_ids.clone(), attention_mask.clone()

    def generate() -> Any:
        return decoder.generate(
            target,
            draft,
            input_ids,
            attention_mask,
            num_draft_tokens=num_draft_tokens,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            **(sampling or {}),
        )

    try:
        out = watched(generate, watchdog or Watchdog(timeout_s))
    except ContractError:
        raise
    except Exception as exc:
        raise ContractError("generate-returns", f"generate() raising {type(exc).__name__}: {exc}") from exc
    rows = validate_output(out, int(ids_before.shape[0]), max_new_tokens, eos_token_id)
    check_inputs_unchanged({"input_ids": (input_ids, ids_before), "attention_mask": (attention_mask, mask_before)})
    return rows
