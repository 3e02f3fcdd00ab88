"""Forward hooks that record every call a decoder makes on the models it was given.

The decoder needs no cooperation: anything built on HF-style `model(...)` calls is seen,
keyword or positional (each call is bound to the model's own forward signature). Target calls
keep a snapshot of the cache after the call, since decoders mutate caches in place and the
checks run after the decoder returns.

Every target forward is observed or the run is refused. Besides the hooks, the target's
`forward` (and its base model's, e.g. `target.model`) is replaced on the instance by a probe
for the duration of the run, so a forward that runs without its hooks having fired
(`target.forward(...)`, `target.model.forward(...)`) is counted as unobserved. The base model
called directly (`target.model(...)` then `target.lm_head(...)`, a split body and head) is
observed: its call is recorded like a target call, since it holds all the attention and the
cache. Inputs the checks cannot judge (`inputs_embeds`, a 4-D or block attention mask, an
unreadable cache) are recorded as unsupported instead of being half-read.
"""

from __future__ import annotations

import copy
import itertools
import os
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from specaudit.config.settings import DEVICE_EVIDENCE_SHARE, device_evidence_mb
from specaudit.contracts.decoder import ContractError
from specaudit.models.compat import (
    cache_argument,
    cache_layers,
    cache_length,
    call_arguments,
    filled_layers,
    forward_signature,
    layer_lengths,
    output_cache,
)
from specaudit.running.layered import Parts, key_mask, model_parts, position_input

_CALL_ORDER = itertools.count()  # interleaves target and draft calls: round boundaries for the checks


@dataclass
class CallRecord:
    role: str  # "target" or "draft"
    index: int  # order among this role's calls
    input_ids: torch.Tensor | None  # [B, T] as passed
    attention_mask: torch.Tensor | None  # [B, P + T] as passed (None: HF attends everything, or unsupported)
    position_ids: torch.Tensor | None  # [B, T] as passed (None: HF uses P + arange(T))
    layer_lengths: tuple[int, ...]  # P (filled slots, not a static cache's capacity) of every layer before the call
    cache_batch: int | None  # rows in the cache before the call (None: empty cache)
    cache_after: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # [B, H, P + T, D]
    sampled: bool = True  # False: I1 only, no snapshot, I2 skipped (bounds the cost on real models)
    seconds: float = 0.0  # wall time of the forward itself
    entry: str = "model"  # "model": model(...); "base": the base model called directly (a split body and head);
    # "layers": the model's parts called one by one (`specaudit.running.layered`)
    unsupported: tuple[str, ...] = ()  # inputs the checks cannot judge, e.g. "inputs_embeds instead of input_ids"
    order: int = field(default_factory=lambda: next(_CALL_ORDER))  # order among all calls, target and draft
    proposals: torch.Tensor | None = None  # [B, T] a draft call's top-1 token at every input (draft evidence only)
    choices: torch.Tensor | None = None  # [B, T] a target call's top-1 token at every input (None: no logits returned)

    @property
    def past_length(self) -> int:
        return self.layer_lengths[0] if self.layer_lengths else 0


@dataclass
class Recording:
    target_calls: list[CallRecord] = field(default_factory=list)
    draft_calls: list[CallRecord] = field(default_factory=list)
    forwards: int = 0  # target forwards that ran: top-level ones, and base-model ones outside a top-level one
    unobserved: list[str] = field(default_factory=list)  # one entry per target forward no hook saw


def breach(recording: Recording) -> ContractError | None:
    """The contract rule a recording shows broken, or None: an input the checks cannot judge
    ('unsupported-input'), or target forwards the hooks did not see ('unobserved-forward')."""
    for call in recording.target_calls:
        if call.unsupported:
            return ContractError(
                "unsupported-input",
                f"target call {call.index} with {'; '.join(call.unsupported)}",
                evidence={"call": call.index, "inputs": list(call.unsupported)},
            )
    if recording.unobserved:
        seen = len(recording.target_calls)
        return ContractError(
            "unobserved-forward",
            f"{len(recording.unobserved)} of {recording.forwards} target forwards unseen by the hooks "
            f"(first: {recording.unobserved[0]}), {seen} observed",
            evidence={"forwards": recording.forwards, "observed": seen, "unobserved": recording.unobserved[:8]},
        )
    return None


def _clone(x: Any) -> torch.Tensor | None:
    return _to_cpu(x) if isinstance(x, torch.Tensor) else None


def _to_cpu(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to("cpu", copy=True)


def _to_host(*values: Any) -> list[torch.Tensor | None]:
    """Host copies of the tensors among `values` (None for the rest), in one copy per device: a
    call's inputs cross together, their bytes side by side, so the hooks wait for a device once
    per call for all of them (not once per tensor)."""
    out: list[torch.Tensor | None] = [None] * len(values)
    groups: dict[torch.device, list[int]] = {}
    for i, x in enumerate(values):
        if isinstance(x, torch.Tensor):
            groups.setdefault(x.device, []).append(i)
    for indices in groups.values():
        if len(indices) == 1:
            out[indices[0]] = _to_cpu(values[indices[0]])
            continue
        flat = [values[i].detach().contiguous().view(-1).view(torch.uint8) for i in indices]  # [n_i x itemsize]
        host = _to_cpu(torch.cat(flat))  # one crossing
        for i, piece in zip(indices, host.split([x.numel() for x in flat])):
            x = values[i]
            out[i] = piece.clone().view(x.dtype).view(x.shape)  # aligned for its dtype
    return out


class EvidenceBudget:
    """Which of a run's snapshots stay on the model's device: while the bytes kept there fit the
    budget (`device_budget`), else the host gets them, as a GPU model's full cache per call
    would not fit beside it. The checks compare a snapshot on whichever device holds it, so
    each one kept there is a host copy saved from the decoder's forward, and the comparisons
    of the checks run there too."""

    def __init__(self) -> None:
        self.mb = device_evidence_mb(os.environ)  # read as the run starts: a bad value is a usage error
        self.limit: int | None = None  # bytes; None: no limit (the CPU without a setting)
        self.resolved = False  # the limit is read at the run's first snapshot, on its device
        self.kept = 0  # bytes of snapshots kept on a device
        self.host = 0  # snapshots copied to the host

    def admit(self, parts: list[torch.Tensor]) -> bool:
        """Whether a snapshot of `parts` (its tensors as they will be kept) may stay where they are."""
        if not self.resolved:
            self.limit, self.resolved = device_budget(parts[0].device, self.mb), True
        size = sum(x.numel() * x.element_size() for x in parts)
        if self.limit is not None and self.kept + size > self.limit:
            self.host += 1
            return False
        self.kept += size
        return True


def device_budget(device: torch.device, mb: float | None) -> int | None:
    """Bytes of snapshots a run may keep on `device`: `mb` megabytes when set
    (`$SPECAUDIT_DEVICE_EVIDENCE_MB`); else on CUDA `DEVICE_EVIDENCE_SHARE` of the memory free
    there now, on the CPU no limit (a snapshot there is in host memory already), and 0 on a
    device whose free memory is not read (the host path, as before)."""
    if mb is not None:
        return int(mb * 2**20)
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(DEVICE_EVIDENCE_SHARE * free)
    return 0


class _Watch:
    """One instrumented model: its calls, which forwards a hook announced, and nesting."""

    def __init__(
        self, role: str, recording: Recording, calls: list[CallRecord], sample: Callable[[int], bool], snapshot: bool
    ) -> None:
        self.role = role
        self.recording = recording
        self.calls = calls
        self.sample = sample
        self.snapshot = snapshot
        self.evidence = EvidenceBudget()  # which of this model's snapshots stay on its device
        self.depth = 0  # forwards of the model or its body running (probed)
        self.announced: set[int] = set()  # modules whose pre-hook fired for the forward about to run
        # one per hooked call in progress: the record and the cache passed in (None: nested, not recorded)
        self.open: list[tuple[CallRecord, Any] | None] = []
        # a forward assembled from the model's parts (`specaudit.running.layered`): what its embedding
        # and position module were given, its record until the last layer returns, then until the head's
        self.pending: dict[str, Any] = {}
        self.layered: tuple[CallRecord, Any] | None = None
        self.awaiting_head: CallRecord | None = None

    def record(self, signature: Any, args: tuple, kwargs: dict[str, Any], entry: str) -> tuple[CallRecord, Any]:
        """Bind the call and keep what the checks read; never raises (a hook must not break the model)."""
        record = CallRecord(self.role, len(self.calls), None, None, None, (), None, entry=entry)
        cache = None
        try:
            cache = self.read(record, call_arguments(signature, args, kwargs))
        except Exception as exc:  # an input the harness cannot read is a refusal, not a crash
            record.unsupported += (f"a call the harness cannot read ({type(exc).__name__}: {exc})",)
        record.sampled = self.sample(len(self.calls))
        record.seconds = -time.perf_counter()
        self.calls.append(record)
        return record, cache

    @staticmethod
    def read(record: CallRecord, arguments: dict[str, Any]) -> Any:
        """Fill `record` from the bound arguments; returns the cache passed in."""
        input_ids, mask = arguments.get("input_ids"), arguments.get("attention_mask")
        unsupported: list[str] = []
        if input_ids is None and arguments.get("inputs_embeds") is not None:
            unsupported.append("inputs_embeds instead of input_ids")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            if isinstance(mask, torch.Tensor):
                unsupported.append(f"a {mask.dim()}-D attention_mask of shape {tuple(mask.shape)} (2-D masks only)")
            else:
                unsupported.append(f"an attention_mask of type {type(mask).__name__} (2-D masks only)")
            mask = None
        cache = cache_argument(arguments)
        if cache is not None:
            try:
                layers = cache_layers(cache)
                record.layer_lengths = layer_lengths(cache)
                record.cache_batch = int(layers[0][0].shape[0]) if layers else None
            except Exception:
                unsupported.append(f"a cache of type {type(cache).__name__} the harness cannot read")
        record.input_ids, record.attention_mask, record.position_ids = _to_host(
            input_ids, mask, arguments.get("position_ids")
        )
        record.unsupported = tuple(unsupported)
        return cache

    def outside(self) -> bool:
        """No call of the model or its body in progress: a part called now is the runner's own call."""
        return not self.open and self.depth == 0

    def open_layered(self, parts: Parts, arguments: dict[str, Any]) -> None:
        """Record a forward assembled from `parts` when its first decoder layer is called, from what
        its embedding and position module were given since the last one and the layer's arguments."""
        if self.layered is not None:  # the previous one never reached its last layer (it raised)
            self.finish(*self.layered, None)
        pending, self.pending = self.pending, {}
        cache, mask = cache_argument(arguments), arguments.get("attention_mask")
        ids, positions = pending.get("input_ids"), pending.get("position_ids")
        unsupported: list[str] = []
        if ids is None:
            unsupported.append("a layer-by-layer forward whose token ids were not read (the embedding not called)")
        if parts.positions is not None and positions is None:
            name = type(parts.positions).__name__
            unsupported.append(f"a layer-by-layer forward whose positions were not read ({name} not called)")
        if cache is None:
            unsupported.append("a layer-by-layer forward without a cache: its K/V cannot be read")
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:
            mask, refusal = _key_mask(mask, cache, ids)
            unsupported += refusal
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "cache": cache}
        record, cache_in = self.record(None, (), inputs, "layers")
        record.unsupported += tuple(unsupported)
        if self.role == "target":
            self.recording.forwards += 1
        self.layered = (record, cache_in)

    def close_layered(self) -> None:
        """The last decoder layer returned: the cache holds this forward's K/V."""
        if self.layered is not None:
            record, cache_in = self.layered
            self.layered = None
            self.finish(record, cache_in, types.SimpleNamespace())
            self.awaiting_head = record

    def head_output(self, logits: Any) -> None:
        """The LM head's output [B, T, V] after a layer-by-layer forward: the tokens it chooses."""
        record, self.awaiting_head = self.awaiting_head, None
        if record is None or (self.role != "target" and not self.snapshot):
            return  # no draft evidence kept: the draft's choices are not read
        top1 = _top1(types.SimpleNamespace(logits=logits))
        if self.role == "target":
            record.choices = top1
        elif self.snapshot:
            record.proposals = top1

    def finish(self, record: CallRecord, cache_in: Any, output: Any) -> None:
        if output is None:  # the forward raised: the decoder's error says so
            record.seconds = 0.0
            return
        cache = output_cache(output)
        cache = cache if cache is not None else cache_in  # caches are updated in place
        if self.snapshot and record.sampled and cache is not None and not record.unsupported:
            try:
                record.cache_after = snapshot(cache, self.evidence)
            except Exception as exc:  # never raise into the decoder's forward
                record.unsupported += (f"a returned cache the harness cannot read ({type(exc).__name__}: {exc})",)
        if self.role == "draft" and self.snapshot:
            record.proposals = _top1(output)
        record.seconds += time.perf_counter()
        if self.role == "target":  # which committed tokens this forward's logits can have chosen (I2)
            record.choices = _top1(output)


def snapshot(cache: Any, budget: EvidenceBudget | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's filled (K, V) [B, H, P, D], copied: on the model's device while `budget`
    admits it, else to the host (no budget: the host). Layers of one shape go side by side into
    one [B, P, F] block on the model's device, which crosses to the host in one copy if it
    must (not one per layer), and are kept as views of it, which the checks read without
    another copy (`checks.kv.flat_cache`)."""
    parts = [x.detach() for kv in filled_layers(cache) for x in kv]  # K0, V0, K1, ...: [B, H, P, D]
    if len({(x.dim(), x.shape[0], x.shape[2], x.dtype, x.device) for x in parts}) != 1 or parts[0].dim() != 4:
        if budget is not None and budget.admit(parts):  # layers of other shapes: a copy each, kept there
            return [(k.clone(), v.clone()) for k, v in zip(parts[0::2], parts[1::2])]
        return [(_to_cpu(k), _to_cpu(v)) for k, v in zip(parts[0::2], parts[1::2])]
    batch, width = parts[0].shape[0], parts[0].shape[2]
    ends = itertools.accumulate(x.shape[1] * x.shape[3] for x in parts)
    shapes = [(x.shape[1], x.shape[3], end) for x, end in zip(parts, ends)]

    def columns(block: torch.Tensor) -> list[torch.Tensor]:  # [B, P, H, D] views, one per part
        return [block[:, :, end - h * d : end].view(batch, width, h, d) for h, d, end in shapes]

    block = parts[0].new_empty(batch, width, shapes[-1][2])  # [B, P, F]
    for x, column in zip(parts, columns(block)):
        for h in range(x.shape[1]):  # head by head, [B, P, D]: 1.5x faster than one transposed copy
            column[:, :, h].copy_(x[:, h])
    if (budget is None or not budget.admit([block])) and block.device.type != "cpu":
        block = _to_cpu(block)  # the host path: one copy per call
    views = [column.transpose(1, 2) for column in columns(block)]  # [B, H, P, D]
    return list(zip(views[0::2], views[1::2]))


def _top1(output: Any) -> torch.Tensor | None:
    """[B, T] the argmax of a call's logits (what a greedy draft proposes at each input), or None."""
    logits = getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        return None
    return _to_cpu(logits.argmax(-1))


def _hooks(watch: _Watch, module: torch.nn.Module, entry: str) -> list[Any]:
    """Pre- and post-hook on `module`; a base-model call inside a top-level one is not recorded again."""
    signature = forward_signature(module)
    key = id(module)

    def pre(mod: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        watch.announced.add(key)
        nested = entry == "base" and watch.depth > 0
        watch.open.append(None if nested else watch.record(signature, args, kwargs, entry))

    def post(mod: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        opened = watch.open.pop() if watch.open else None
        if opened is not None:
            watch.finish(*opened, output)

    return [
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post, with_kwargs=True, always_call=True),
    ]


def _key_mask(mask: torch.Tensor, cache: Any, ids: torch.Tensor | None) -> tuple[torch.Tensor | None, list[str]]:
    """A decoder layer's 4-D mask as its 2-D key mask [B, S], or None and why it cannot be judged."""
    try:
        past = cache_length(cache)
    except Exception:  # an unreadable cache: `record` says so
        past = 0
    batch = int(ids.shape[0]) if ids is not None else int(mask.shape[0])
    reduced = key_mask(mask, past, batch)
    if reduced is None:
        return None, [f"a 4-D attention_mask of shape {tuple(mask.shape)} that is not a key mask under the causal rule"]
    return reduced, []


def _layer_hooks(watch: _Watch, parts: Parts) -> list[Any]:
    """Hooks that record a forward a runner assembles from the model's parts; silent inside a call of
    the model or its body, which is recorded whole."""
    layer_signature = forward_signature(parts.first)

    def embed(mod: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if watch.outside():
            watch.pending["input_ids"] = _clone(args[0] if args else kwargs.get("input"))
            watch.awaiting_head = None

    def positions(mod: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if watch.outside():
            watch.pending["position_ids"] = _clone(position_input(parts, args, kwargs))

    def first(mod: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if watch.outside():
            watch.open_layered(parts, call_arguments(layer_signature, args, kwargs))

    def last(mod: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if watch.outside():
            watch.close_layered()

    def head(mod: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if watch.outside():
            watch.head_output(output)

    hooks = [
        parts.embed.register_forward_pre_hook(embed, with_kwargs=True),
        parts.first.register_forward_pre_hook(first, with_kwargs=True),
        parts.last.register_forward_hook(last, with_kwargs=True),
        parts.head.register_forward_hook(head, with_kwargs=True),
    ]
    if parts.positions is not None:
        hooks.append(parts.positions.register_forward_pre_hook(positions, with_kwargs=True))
    return hooks


class _ForwardProbe:
    """Stands in for `module.forward` during the run: counts forwards and notes those that ran
    without their hooks (called as `module.forward(...)`, which skips `module(...)`)."""

    def __init__(self, watch: _Watch, module: torch.nn.Module, label: str, top: bool) -> None:
        self.watch, self.label, self.top, self.key = watch, label, top, id(module)
        self.previous = vars(module).get("forward")  # an instance-level forward already there (accelerate)
        self.original = module.forward
        self.__wrapped__ = self.original  # inspect.signature(module.forward) stays the model's own

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        watch = self.watch
        announced = self.key in watch.announced
        watch.announced.discard(self.key)
        if self.top or watch.depth == 0:
            watch.recording.forwards += 1
            if not announced:
                watch.recording.unobserved.append(
                    f"{self.label}.forward() called directly, bypassing {self.label}(...)"
                )
        watch.depth += 1  # the parts this forward calls are not the runner's own calls
        try:
            return self.original(*args, **kwargs)
        finally:
            watch.depth -= 1

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A deep copy of the model gets its own forward back, not a probe into this run."""
        twin = memo.get(self.key)
        if self.previous is not None:
            return copy.deepcopy(self.previous, memo)
        return types.MethodType(type(twin).forward, twin) if twin is not None else self.original

    def remove(self, module: torch.nn.Module) -> None:
        if vars(module).get("forward") is not self:
            return  # the decoder replaced it: the models-unchanged rule reports that
        if self.previous is not None:
            module.forward = self.previous
        else:
            del module.forward


def _probe(watch: _Watch, module: torch.nn.Module, label: str, top: bool) -> Callable[[], None]:
    probe = _ForwardProbe(watch, module, label, top)
    module.forward = probe
    return lambda: probe.remove(module)


def base_model(model: torch.nn.Module) -> tuple[torch.nn.Module, str] | None:
    """The body under a causal LM's head (`model.model`, `model.transformer`), if it has one."""
    base = getattr(model, "base_model", None)
    if not isinstance(base, torch.nn.Module) or base is model:
        return None
    prefix = getattr(model, "base_model_prefix", "") or "base_model"
    return base, prefix if getattr(model, prefix, None) is base else "base_model"


def watch_model(
    role: str,
    model: torch.nn.Module,
    calls: list[CallRecord],
    recording: Recording,
    sample: Callable[[int], bool],
    *,
    snapshot: bool,
    probe: bool,
) -> list[Callable[[], None]]:
    """Instrument one model; returns the undo steps."""
    watch = _Watch(role, recording, calls, sample, snapshot)
    undo: list[Callable[[], None]] = [h.remove for h in _hooks(watch, model, "model")]
    body = base_model(model)
    base = body if probe else None  # nesting is known from the top-level probe
    if base is not None:
        undo += [h.remove for h in _hooks(watch, base[0], "base")]
    parts = model_parts(model, body[0]) if body is not None else None
    if parts is not None:
        undo += [h.remove for h in _layer_hooks(watch, parts)]
    if probe:
        undo.append(_probe(watch, model, role, top=True))
    if base is not None:
        undo.append(_probe(watch, base[0], f"{role}.{base[1]}", top=False))
    return undo


def every_call(index: int) -> bool:
    return True


@contextmanager
def instrument(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    sample: Callable[[int], bool] = every_call,
    *,
    draft_evidence: bool = False,
) -> Iterator[Recording]:
    """Record target and draft calls while the block runs; hooks and probes are removed afterwards.

    `sample(i)` says whether target call i keeps a cache snapshot for I2; unsampled calls
    are still recorded and checked for I1. `breach(recording)` says whether the run must be
    refused (an unsupported input or an unobserved target forward). `draft_evidence` also keeps
    every draft call's cache snapshot and top-1 tokens (`CallRecord.proposals`): what the draft
    proposed after which context, which token preservation judges (cheap on the scripted draft).
    """
    recording = Recording()
    undo = watch_model("target", target, recording.target_calls, recording, sample, snapshot=True, probe=True)
    try:
        if draft is not None and draft is not target:
            undo += watch_model(
                "draft", draft, recording.draft_calls, recording, every_call, snapshot=draft_evidence, probe=False
            )
        yield recording
    finally:
        for step in reversed(undo):
            step()
