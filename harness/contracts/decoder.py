"""The decoder contract (docs/decoders.md): loading `module:attr` and validating what a call returns.

The types and rules only. Calling a decoder under a watchdog (threads, ctypes) is
`specaudit.running.watchdog`; the models' fingerprints, by which a changed model is seen, are
`specaudit.running.fingerprint`. `time_limit` (SIGALRM) stays here while the engine contract's
`EngineBook` (`specaudit.contracts.engine`) times its calls with it.
"""

from __future__ import annotations

import importlib
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from specaudit.contracts.errors import UsageError
from specaudit.contracts.violation import Violation


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


class DecoderLoadError(UsageError):
    """A `module:attr` spec that does not name a usable decoder."""


RULES: dict[str, str] = {
    "generate-returns": (
        "generate() returning without raising, with a forward of the models at least every idle limit "
        "and no more target forwards than the case can need"
    ),
    "returns-lists": "a list holding one list of int token ids per row",
    "one-list-per-row": "one list per input row, in order",
    "max-new-tokens": "at most max_new_tokens new tokens per row",
    "ends-at-eos": "a row that ends at its first EOS (included)",
    "inputs-unchanged": "the caller's input_ids and attention_mask left as they were handed to generate()",
    "models-unchanged": (
        "target and draft left as they were handed to generate(): parameters, buffers, config, mode and hooks"
    ),
    "unobserved-forward": (
        "every target forward made through target(...) or its base model's __call__, where the harness's hooks see it"
    ),
    "unsupported-input": "target calls with 2-D input_ids, a 2-D attention_mask (or none) and a readable cache",
}
"""Each contract rule and what it wants: the `expected` half of a ContractError."""


class ContractError(Exception):
    """The decoder broke a rule of the contract: `rule` names it, `found` says what was seen,
    `expected` what the rule wants (by default its entry in RULES)."""

    def __init__(
        self, rule: str, found: str, expected: str | None = None, evidence: dict[str, Any] | None = None
    ) -> None:
        self.rule = rule
        self.found = found
        self.expected = expected or RULES.get(rule, "a run that keeps the decoder contract")
        self.evidence = dict(evidence or {})
        super().__init__(f"decoder broke the contract rule '{rule}': {self.detail}")

    @property
    def detail(self) -> str:
        """One sentence: what was found and what the rule wants."""
        return f"got {self.found}, but should be {self.expected}"

    def violation(self, **evidence: Any) -> Violation:
        """The breach as the contract check's violation (the one conversion every subject uses)."""
        return Violation("contract", self.rule, self.found, self.expected, evidence={**self.evidence, **evidence})


def resolve_spec(spec: str, kind: str, example: str, error: type[UsageError]) -> Any:
    """`module:attr` to the object it names (a decoder's or an engine's factory); `error` says
    which part failed, in one line."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise error(f"{kind} spec {spec!r} is not of the form module:attr (e.g. {example})")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == module_name or module_name.startswith(exc.name + ".")):
            raise error(f"{kind} module {module_name!r} not found (is it on sys.path?)") from exc
        raise error(f"{kind} module {module_name!r} failed to import: {exc}") from exc
    except Exception as exc:  # a module that raises on import is the user's bug, shown in one line
        raise error(f"{kind} module {module_name!r} failed to import: {type(exc).__name__}: {exc}") from exc
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise error(f"{kind} module {module_name!r} has no attribute {attr!r}")
        factory = getattr(factory, part)
    return factory


def load_decoder(spec: str) -> Any:
    """Resolve `module:attr` to a class or zero-argument factory; errors say which part failed."""
    factory = resolve_spec(spec, "decoder", "specaudit.reference.eqspec:EqSpec", DecoderLoadError)
    if not callable(factory):
        raise DecoderLoadError(f"{spec!r} is neither a class nor a zero-argument callable")
    probe = factory if isinstance(factory, type) else None
    if probe is not None and not callable(getattr(probe, "generate", None)):
        raise DecoderLoadError(f"{spec!r} has no generate() method (see the decoder contract in docs/decoders.md)")
    return factory


def instantiate(factory: Any, spec: str) -> Decoder:
    decoder = factory()
    if not callable(getattr(decoder, "generate", None)):
        raise DecoderLoadError(f"{spec!r} returned an object without a generate() method")
    return decoder


class DecoderTimeout(BaseException):
    """Raised in a decoder's thread to stop it (a BaseException: its `except Exception` cannot swallow it)."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise DecoderTimeout in the main thread after `seconds` (an engine method that hangs fails, not hangs)."""
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


def validate_output(out: Any, batch: int, max_new_tokens: int, eos_token_id: int | None) -> list[list[int]]:
    if isinstance(out, torch.Tensor) or not isinstance(out, (list, tuple)):
        raise ContractError("returns-lists", f"a {type(out).__name__}", f"a list of {batch} lists of int")
    if len(out) != batch:
        raise ContractError(
            "one-list-per-row",
            _rows(len(out)),
            f"{_rows(batch)} (one per input row, in order)",
            {"rows": len(out)},
        )
    rows: list[list[int]] = []
    for r, row in enumerate(out):
        if isinstance(row, torch.Tensor) or not isinstance(row, (list, tuple)):
            raise ContractError("returns-lists", f"row {r} as a {type(row).__name__}", "a list of int", {"row": r})
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
            bad = next(t for t in row if not isinstance(t, int) or isinstance(t, bool))
            raise ContractError(
                "returns-lists", f"row {r} holding {type(bad).__name__} {bad!r}", "int token ids only", {"row": r}
            )
        if len(row) > max_new_tokens:
            raise ContractError(
                "max-new-tokens",
                f"row {r} with {len(row)} new tokens",
                f"at most {max_new_tokens} (max_new_tokens)",
                {"row": r, "tokens": len(row)},
            )
        if eos_token_id is not None and eos_token_id in row[:-1]:
            index = list(row).index(eos_token_id)
            raise ContractError(
                "ends-at-eos",
                f"row {r} going on after EOS at index {index}",
                f"the row ending at index {index} (EOS included)",
                {"row": r, "index": index},
            )
        rows.append(list(row))
    return rows


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


# ---------------------------------------------------------------------------------------
# Side effects: the caller's inputs stay as they were handed over (the models: specaudit.running.fingerprint)


def tensor_change(name: str, now: torch.Tensor, before: torch.Tensor) -> str | None:
    """What changed in a tensor the decoder was handed, or None."""
    if now.shape != before.shape or now.dtype != before.dtype:
        shapes = f"{tuple(now.shape)} {now.dtype} (was {tuple(before.shape)} {before.dtype})"
        return f"{name} of shape {shapes} after generate()"
    changed = (now != before).nonzero()  # [n, 2]
    if not changed.numel():
        return None
    r, c = changed[0].tolist()
    return (
        f"{name}[{r}, {c}] = {now[r, c].item()} after generate() (was {before[r, c].item()}; "
        f"{changed.shape[0]} entries written)"
    )


def check_inputs_unchanged(tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """'inputs-unchanged': every (tensor after, copy before) pair still equal."""
    changes = [c for name, (now, before) in tensors.items() if (c := tensor_change(name, now, before))]
    if changes:
        raise ContractError("inputs-unchanged", "; ".join(changes), evidence={"changes": changes})
