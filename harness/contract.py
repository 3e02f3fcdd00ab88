"""The decoder contract (DESIGN.md): loading `module:attr`, calling it, validating what it returns."""

from __future__ import annotations

import importlib
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch


class Decoder(Protocol):
    def generate(
        self,
        target: Any,
        draft: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        num_draft_tokens: int,
        max_new_tokens: int,
        eos_token_id: int | None,
        pad_token_id: int,
    ) -> list[list[int]]: ...


class DecoderLoadError(Exception):
    """A `module:attr` spec that does not name a usable decoder."""


class ContractError(Exception):
    """The decoder broke a rule of the contract; `rule` names it."""

    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(f"decoder broke the contract rule '{rule}': {detail}")
        self.rule = rule
        self.detail = detail


def load_decoder(spec: str) -> Any:
    """Resolve `module:attr` to a class or zero-argument factory; errors say which part failed."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise DecoderLoadError(
            f"decoder spec {spec!r} is not of the form module:attr (e.g. specaudit.reference.eqspec:EqSpec)"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == module_name or module_name.startswith(exc.name + ".")):
            raise DecoderLoadError(f"decoder module {module_name!r} not found (is it on sys.path?)") from exc
        raise DecoderLoadError(f"decoder module {module_name!r} failed to import: {exc}") from exc
    except Exception as exc:  # a module that raises on import is the user's bug, shown in one line
        raise DecoderLoadError(f"decoder module {module_name!r} failed to import: {type(exc).__name__}: {exc}") from exc
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise DecoderLoadError(f"decoder module {module_name!r} has no attribute {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise DecoderLoadError(f"{spec!r} is neither a class nor a zero-argument callable")
    probe = factory if isinstance(factory, type) else None
    if probe is not None and not callable(getattr(probe, "generate", None)):
        raise DecoderLoadError(f"{spec!r} has no generate() method (see the decoder contract in DESIGN.md)")
    return factory


def instantiate(factory: Any, spec: str) -> Decoder:
    decoder = factory()
    if not callable(getattr(decoder, "generate", None)):
        raise DecoderLoadError(f"{spec!r} returned an object without a generate() method")
    return decoder


def decoder_name(decoder: Any, spec: str) -> str:
    return str(getattr(decoder, "name", None) or spec)


class DecoderTimeout(Exception):
    pass


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise DecoderTimeout in the main thread after `seconds` (a hung decoder fails, not hangs)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise DecoderTimeout(f"generate() did not return within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


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
) -> list[list[int]]:
    """Call generate() under the contract; any breach becomes a ContractError naming the rule."""
    try:
        with time_limit(timeout_s):
            out = decoder.generate(
                target,
                draft,
                input_ids.clone(),
                attention_mask.clone(),
                num_draft_tokens=num_draft_tokens,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos_token_id,
                pad_token_id=pad_token_id,
            )
    except DecoderTimeout as exc:
        raise ContractError("generate-returns", f"{exc} (a hang or a row that never finishes)") from exc
    except Exception as exc:
        raise ContractError("generate-returns", f"generate() raised {type(exc).__name__}: {exc}") from exc
    return validate_output(out, int(input_ids.shape[0]), max_new_tokens, eos_token_id)


def validate_output(out: Any, batch: int, max_new_tokens: int, eos_token_id: int | None) -> list[list[int]]:
    if isinstance(out, torch.Tensor) or not isinstance(out, (list, tuple)):
        raise ContractError("returns-lists", f"got {type(out).__name__}, but should be a list of {batch} lists of int")
    if len(out) != batch:
        raise ContractError(
            "one-list-per-row", f"got {len(out)} rows, but should be {batch} (one per input row, in order)"
        )
    rows: list[list[int]] = []
    for r, row in enumerate(out):
        if isinstance(row, torch.Tensor) or not isinstance(row, (list, tuple)):
            raise ContractError("returns-lists", f"row {r} is a {type(row).__name__}, but should be a list of int")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
            bad = next(t for t in row if not isinstance(t, int) or isinstance(t, bool))
            raise ContractError(
                "returns-lists", f"row {r} holds {type(bad).__name__} {bad!r}, but should hold int token ids"
            )
        if len(row) > max_new_tokens:
            raise ContractError("max-new-tokens", f"row {r} has {len(row)} new tokens, but at most {max_new_tokens}")
        if eos_token_id is not None and eos_token_id in row[:-1]:
            raise ContractError("ends-at-eos", f"row {r} goes on after EOS at index {list(row).index(eos_token_id)}")
        rows.append(list(row))
    return rows
