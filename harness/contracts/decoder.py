"""The decoder contract (docs/decoders.md): loading `module:attr`, calling it, validating what it returns."""

from __future__ import annotations

import ctypes
import importlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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


# ---------------------------------------------------------------------------------------
# The watchdog: a slow decoder is not a hung one
#
# generate() runs in a worker thread while the caller watches its progress (forwards of the
# models completed, read from the instrumentation). It is stopped, and breaks
# 'generate-returns', when no forward completes for `idle_s` (a hang) or when it has made more
# than `max_forwards` target forwards (rows that never finish). Without a progress reading
# (an un-instrumented run) `idle_s` bounds the whole call. Stopping raises DecoderTimeout in
# the worker; a decoder that does not stop within STOP_GRACE_S (stuck in native code) is
# still running, and `still_running` says so to whoever would run the same decoder next:
# its forwards would land in that run's recording.

STOP_GRACE_S = 5.0
POLL_S = 0.25
_STILL_RUNNING: dict[Any, tuple[threading.Thread, str]] = {}


@dataclass(frozen=True)
class Watchdog:
    """How a decoder call is watched: see the section comment above."""

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
) -> list[list[int]]:
    """Call generate() under the contract; any breach becomes a ContractError naming the rule.

    `watchdog` (default: `timeout_s` on the whole call) says when a call is a hang. The decoder
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
# Side effects: the caller's inputs and the shared models stay as they were handed over


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


HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
GLOBAL_HOOK_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_hooks")


@dataclass(frozen=True)
class ModelState:
    """A cheap fingerprint of a model: enough to see that a decoder changed it.

    Per tensor: shape, dtype, device, storage address, version counter and float64 sum (one
    reduction per tensor, one device sync in all), so replaced tensors, in-place writes and
    `.data` writes show; plus the config as a dict, the train/eval mode of every module,
    instance-level `forward` overrides and the keys of every hook dict.
    """

    tensors: dict[str, tuple[Any, ...]]
    config: dict[str, Any]
    training: tuple[str, ...]  # modules in training mode
    overrides: tuple[str, ...]  # modules with a `forward` of their own instance
    hooks: dict[tuple[str, str], tuple[int, ...]]  # (module, hook dict) -> hook ids


def model_state(model: torch.nn.Module) -> ModelState:
    named = [(f"parameter {n}", t) for n, t in model.named_parameters(remove_duplicate=False)]
    named += [(f"buffer {n}", t) for n, t in model.named_buffers(remove_duplicate=False)]
    with torch.no_grad():
        sums = torch.stack([_tensor_sum(t) for _, t in named]).tolist() if named else []
    tensors = {
        name: (tuple(t.shape), str(t.dtype), str(t.device), t.data_ptr(), _version(t), total)
        for (name, t), total in zip(named, sums)
    }
    modules = list(model.named_modules(remove_duplicate=False))
    config = getattr(model, "config", None)
    return ModelState(
        tensors,
        _config_dict(config),
        tuple(name or "<model>" for name, m in modules if m.training),
        tuple(name or "<model>" for name, m in modules if "forward" in vars(m)),
        {(name or "<model>", d): tuple(getattr(m, d, {})) for name, m in modules for d in HOOK_DICTS},
    )


def _tensor_sum(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.double() if t.is_complex() or t.dtype == torch.bool else t).sum(dtype=torch.float64).cpu()


def _version(t: torch.Tensor) -> int:
    try:
        return int(t._version)
    except RuntimeError:  # inference tensors keep no version counter
        return -1


def _config_dict(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    try:
        return config.to_dict()
    except Exception:
        return dict(vars(config))


def model_changes(role: str, before: ModelState, model: torch.nn.Module) -> list[str]:
    """What differs between `before` and the model now, one phrase per kind of change."""
    after = model_state(model)
    out: list[str] = []
    for name in sorted(before.tensors.keys() | after.tensors.keys()):
        was, now = before.tensors.get(name), after.tensors.get(name)
        if was != now and not (was and now and was[:5] == now[:5] and _same_sum(was[5], now[5])):
            kind, _, path = name.partition(" ")
            out.append(f"{kind} {_where(role, path)} {_tensor_difference(was, now)}")
    for key in sorted(before.config.keys() | after.config.keys()):
        was, now = before.config.get(key, "<unset>"), after.config.get(key, "<unset>")
        if was != now:
            out.append(f"{role}.config.{key} = {now!r} (was {was!r})")
    if before.training != after.training:
        out.append(f"{role} modules in training mode: {list(after.training)} (were {list(before.training)})")
    if before.overrides != after.overrides:
        out.append(f"{role} forward replaced on the instance of {list(after.overrides)} (was {list(before.overrides)})")
    for (module, kind), ids in after.hooks.items():
        extra = set(ids) - set(before.hooks.get((module, kind), ()))
        if extra:
            what = kind.strip("_").replace("_", " ")[:-1]
            out.append(f"{len(extra)} {what}{'s' if len(extra) > 1 else ''} left on {_where(role, module)}")
    return out


def _where(role: str, path: str) -> str:
    return role if path in ("", "<model>") else f"{role}.{path}"


def _same_sum(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)  # NaN sums compare equal to themselves


def _tensor_difference(was: tuple[Any, ...] | None, now: tuple[Any, ...] | None) -> str:
    if was is None:
        return "added"
    if now is None:
        return "removed"
    if was[:3] != now[:3]:
        return f"now {list(now[0])} {now[1]} on {now[2]} (was {list(was[0])} {was[1]} on {was[2]})"
    if was[3] != now[3]:
        return "replaced by another tensor"
    return f"written in place (sum {now[5]:.6g}, was {was[5]:.6g})"


def remove_new_hooks(before: ModelState, model: torch.nn.Module) -> int:
    """Remove every hook the decoder left on `model` (so later runs see the model as built)."""
    removed = 0
    for name, module in model.named_modules(remove_duplicate=False):
        for kind in HOOK_DICTS:
            hooks = getattr(module, kind, None)
            if not hooks:
                continue
            for hook_id in set(hooks) - set(before.hooks.get((name or "<model>", kind), ())):
                del hooks[hook_id]
                removed += 1
    return removed


def global_hooks() -> dict[str, tuple[int, ...]]:
    """Ids of torch's global module hooks, which act on every model in the process."""
    from torch.nn.modules import module

    return {kind: tuple(getattr(module, kind, {})) for kind in GLOBAL_HOOK_DICTS}


def global_hook_changes(before: dict[str, tuple[int, ...]]) -> list[str]:
    """Describe and remove global hooks registered since `before`."""
    from torch.nn.modules import module

    out = []
    for kind, ids in before.items():
        hooks = getattr(module, kind, {})
        extra = set(hooks) - set(ids)
        for hook_id in extra:
            del hooks[hook_id]
        if extra:
            out.append(f"{len(extra)} global {kind.strip('_').replace('_', ' ')[7:-1]} left registered")
    return out
