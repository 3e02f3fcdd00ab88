"""Evidence stays on the model's device until a check needs it (issue 40 item 1), held on the CPU.

No GPU is at hand, so residency is traced (`DeviceTrace`): every tensor the hooks read from the
model (its cache, logits and inputs) counts as on the device, and so does whatever is computed
from one or created for one (`device=` / `.to(device)` with the evidence's device), as it would
be on a GPU; `.cpu()` and `.to("cpu")` are the crossings to the host. A host synchronisation is
then any read of a device tensor's values on the host (`.item()`, `.tolist()`, `.numpy()`,
`bool()`, `int()`, `float()`, an index) and any op whose output size depends on its values
(`nonzero`, a boolean mask): on a GPU each one waits for the device. Counted over the recording
hooks and the I1 + I2 checks of one audited run, per observed target forward, on two tiny Llamas
that differ only in their number of layers.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from specaudit.checks import check_i1, check_i2
from specaudit.checks.kv import PREFIX_CHUNK
from specaudit.checks.registry import check_named
from specaudit.checks.scheduling import first_moved_slot
from specaudit.contracts.case import Case
from specaudit.contracts.errors import UsageError
from specaudit.running import instrument, runner
from specaudit.running.instrument import CallRecord, EvidenceBudget, device_budget
from specaudit.running.runner import Run, run_case

pytestmark = pytest.mark.usefixtures("one_thread")

EQSPEC = "specaudit.reference.eqspec:EqSpec"
MUTANTS = ("rejected_kv_attended", "realign_off_by_one", "pads_attended", "verify_position_off_by_one")
T = torch.Tensor
READS = {T.item, T.tolist, T.numpy, T.__bool__, T.__int__, T.__float__, T.__index__}
SIZED = {T.nonzero, torch.nonzero, T.argwhere, torch.argwhere, T.masked_select, torch.masked_select}
BINARY = {"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift"}


class DeviceTrace(TorchFunctionMode):
    """Which tensors are on the (pretend) device, and every host synchronisation on one."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: dict[int, weakref.ref] = {}  # device tensors by id, while they live
        self.syncs: Counter[tuple[str, str]] = Counter()  # (phase, kind)
        self.local = threading.local()  # `phase`: what this thread runs ("hooks", "checks", ...), if traced

    def mark(self, *tensors: Any) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and not self.holds(t):
                key = id(t)
                self.tensors[key] = weakref.ref(t, lambda _, key=key: self.tensors.pop(key, None))

    def holds(self, t: torch.Tensor) -> bool:
        ref = self.tensors.get(id(t))
        return ref is not None and ref() is t

    def count(self, phase: str) -> int:
        return sum(n for (where, _), n in self.syncs.items() if where == phase)

    def on_device(self, value: Any) -> bool:
        return any(isinstance(t, torch.Tensor) and self.holds(t) for t in tree_flatten(value)[0])

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        device = self.on_device((args, kwargs))
        target = kwargs.get("device", args[1] if func is T.to and len(args) > 1 else None)
        if func is T.cpu or (func is T.to and isinstance(target, str)):  # host code names the host "cpu"
            if device:
                self.syncs[self.local.phase, "to host"] += 1
            return out.clone() if out is args[0] else out  # on the host now (a GPU's copy is a new tensor)
        indexed = func is T.__getitem__ and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_flatten(args[1:])[0]
        )
        if device and (func in READS or func in SIZED or indexed):
            self.syncs[self.local.phase, getattr(func, "__name__", str(func))] += 1
        if in_place(func):
            if self.on_device((args[1:], kwargs)):
                self.mark(args[0])  # written in place with device values
        elif device or isinstance(target, torch.device):  # computed from, or created for, the device
            inputs = {id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            self.mark(
                *[t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and (device or id(t) not in inputs)]
            )
        return out


def in_place(func: Any) -> bool:
    """Whether `func` writes its first argument: `x.add_(...)`, `x[i] = ...`, `x |= ...`."""
    name = getattr(func, "__name__", "")
    if name.startswith("__"):
        return name == "__setitem__" or (name.startswith("__i") and name[3:-2] in BINARY)
    return name.endswith("_")


def traced(trace: DeviceTrace, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
    """`fn` counted under `phase`, in whichever thread it runs (the decoder's hooks run in the
    watchdog's); a traced call inside another counts under its own phase."""

    def call(*args: Any, **kwargs: Any) -> Any:
        outer = getattr(trace.local, "phase", None)
        trace.local.phase = phase
        try:
            if outer is not None:
                return fn(*args, **kwargs)
            with trace:
                return fn(*args, **kwargs)
        finally:
            trace.local.phase = outer

    return call


@pytest.fixture
def layers(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int], None]]:
    """Set the tiny Llama target's number of layers (built afresh; the shared ones come back after)."""
    from specaudit.fixtures import tiny

    def use(n: int) -> None:
        monkeypatch.setitem(tiny._LAYERS, "target", n)
        runner.evict_models()
        runner._continuation.cache_clear()

    yield use
    monkeypatch.undo()
    runner.evict_models()
    runner._continuation.cache_clear()


def case(dtype: str = "float32") -> Case:
    """Two rows, one left-padded, 24 tokens of past at the end: two rounds of the chunked comparison."""
    prompts = (tuple(range(3, 21)), (5, 6, 7))
    return Case(prompts, ("1101101", "0110111"), 3, 7, None, 0, 0, "llama", dtype=dtype)


def audited(trace: DeviceTrace, monkeypatch: pytest.MonkeyPatch, spec: str = EQSPEC) -> tuple[Run, list[Any]]:
    """One audited run and its I1 + I2 violations, with the hooks and the checks traced."""
    layers_of, arguments_of, top1 = instrument.filled_layers, instrument.call_arguments, instrument._top1

    def filled(cache: Any) -> Any:
        kv = layers_of(cache)
        trace.mark(*[x for pair in kv for x in pair])
        return kv

    def arguments(*args: Any) -> Any:
        bound = arguments_of(*args)
        trace.mark(*[bound.get(k) for k in ("input_ids", "attention_mask", "position_ids")])
        return bound

    def logits(output: Any) -> Any:
        trace.mark(getattr(output, "logits", None))
        return top1(output)

    monkeypatch.setattr(instrument, "filled_layers", filled)
    monkeypatch.setattr(instrument, "call_arguments", arguments)
    monkeypatch.setattr(instrument, "_top1", logits)
    for name in ("record", "finish", "head_output"):
        monkeypatch.setattr(instrument._Watch, name, traced(trace, getattr(instrument._Watch, name), "hooks"))
    monkeypatch.setattr(Run, "entries", traced(trace, Run.entries, "references"))
    run = run_case(spec, case())
    violations = traced(trace, lambda: [*check_i1(run), *check_i2(run)], "checks")()
    return run, violations


def rounds(past: int) -> int:
    """Chunks of `KVReader.past_prefixes` over `past` slots: PREFIX_CHUNK, then doubling."""
    n, covered, chunk = 0, 0, PREFIX_CHUNK
    while covered < past:
        n, covered, chunk = n + 1, covered + chunk, 2 * chunk
    return n


def test_host_syncs_per_forward_do_not_grow_with_layers(layers, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 and 6 layers: the same host synchronisations per observed forward, none per layer. The
    hooks: one crossing of a call's inputs, one of its top-1 tokens, every snapshot kept on the
    device (no budget set on the CPU). The checks: per sampled call with a past, one crossing of
    the per-row outcome and one wait per round of the chunked K/V comparison (its pairs left).
    The batch-size-1 references stay on the model's device (`reference.oracle.reference_kv`)."""
    monkeypatch.delenv("SPECAUDIT_DEVICE_EVIDENCE_MB", raising=False)
    seen = {}
    for n in (2, 6):
        layers(n)
        trace = DeviceTrace()
        run, violations = audited(trace, monkeypatch)
        assert not violations, violations
        calls = run.recording.target_calls
        assert len(calls[0].cache_after) == n and all(c.sampled for c in calls)
        recorded = len(calls) + len(run.recording.draft_calls)
        assert trace.syncs["hooks", "to host"] == trace.count("hooks") == 2 * recorded, trace.syncs
        judged = [c.past_length for c in calls if c.past_length]
        assert trace.syncs["checks", "to host"] == len(judged), trace.syncs
        assert trace.syncs["checks", "nonzero"] <= sum(map(rounds, judged)), (judged, trace.syncs)
        assert trace.count("checks") == trace.syncs["checks", "to host"] + trace.syncs["checks", "nonzero"]
        seen[n] = {key: count for key, count in trace.syncs.items() if key[0] != "references"}
        assert trace.count("references") == 0, trace.syncs
    assert seen[2] == seen[6], seen


def test_budget_zero_takes_the_host_path(layers, monkeypatch: pytest.MonkeyPatch) -> None:
    """`$SPECAUDIT_DEVICE_EVIDENCE_MB=0`: every sampled snapshot goes to the host; a large budget
    keeps them all on the device, with their bytes counted."""
    budgets: list[EvidenceBudget] = []
    monkeypatch.setattr(instrument, "EvidenceBudget", lambda: budgets.append(EvidenceBudget()) or budgets[-1])
    layers(2)
    for mb, host in (("0", True), ("4096", False)):
        monkeypatch.setenv("SPECAUDIT_DEVICE_EVIDENCE_MB", mb)
        budgets.clear()
        run = run_case(EQSPEC, case())
        target = budgets[0]
        snapshots = sum(bool(c.cache_after) for c in run.recording.target_calls)
        assert snapshots == len(run.recording.target_calls) > 0
        assert (target.host, target.kept > 0) == ((snapshots, False) if host else (0, True)), (mb, vars(target))


def test_budget_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The setting in megabytes, read as the run starts; unset: no limit on the CPU (host memory
    already), none kept on a device whose free memory is not read."""
    cpu = torch.device("cpu")
    monkeypatch.delenv("SPECAUDIT_DEVICE_EVIDENCE_MB", raising=False)
    assert EvidenceBudget().mb is None and device_budget(cpu, None) is None
    assert device_budget(torch.device("meta"), None) == 0
    monkeypatch.setenv("SPECAUDIT_DEVICE_EVIDENCE_MB", "1.5")
    assert device_budget(cpu, EvidenceBudget().mb) == 3 * 2**19
    for bad in ("-1", "nan", "lots"):
        monkeypatch.setenv("SPECAUDIT_DEVICE_EVIDENCE_MB", bad)
        with pytest.raises(UsageError, match="SPECAUDIT_DEVICE_EVIDENCE_MB"):
            EvidenceBudget()
    budget = EvidenceBudget.__new__(EvidenceBudget)
    budget.limit, budget.resolved, budget.kept, budget.host = 100, True, 0, 0
    assert budget.admit([torch.zeros(20)]) and not budget.admit([torch.zeros(10)]) and budget.admit([torch.zeros(5)])
    assert (budget.kept, budget.host) == (100, 1)


def test_inputs_cross_together() -> None:
    """A call's inputs come back as they were (values, dtypes, shapes), from one copy, sliced or
    expanded ones too."""
    ids = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])[:, 3:]  # [2, 1], rows 4 apart (a last column)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    positions = torch.arange(3, dtype=torch.int32).expand(2, 3)
    trace = DeviceTrace()
    trace.mark(ids, mask, positions)
    out = traced(trace, instrument._to_host, "hooks")(ids, None, mask, positions, 3)
    assert out[1] is None and out[4] is None
    for found, want in zip([out[0], out[2], out[3]], [ids, mask, positions]):
        assert found.dtype == want.dtype and torch.equal(found, want) and found.data_ptr() != want.data_ptr()
    assert trace.syncs == {("hooks", "to host"): 1}, trace.syncs


def verdicts(run: Run) -> list[str]:
    """Every I1 + I2 violation in full: rule, message, evidence."""
    return [repr(v) for v in [*check_i1(run), *check_i2(run)]]


@pytest.mark.parametrize("spec", [EQSPEC, *(f"specaudit.reference.mutants:{m}" for m in MUTANTS)])
def test_verdicts_are_the_same_on_either_path(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same violations and messages with every snapshot on the host and with every one kept."""
    out = {}
    for mb in ("0", "4096"):
        monkeypatch.setenv("SPECAUDIT_DEVICE_EVIDENCE_MB", mb)
        out[mb] = verdicts(run_case(spec, case()))
    assert out["0"] == out["4096"]
    kv = [v for v in out["0"] if "'kv_distance': " in v and "'kv_distance': None" not in v]  # K/V evidence
    assert bool(kv) == bool(out["0"]) == (spec != EQSPEC), out["0"]


def slot_by_slot(now: CallRecord, row: int, then: CallRecord, then_row: int, rtol: float, atol: float) -> int | None:
    """`first_moved_slot` as it was: layer by layer on the host."""
    past = min(now.past_length, then.past_length)
    changed = torch.zeros(past, dtype=torch.bool)
    for (k, v), (k0, v0) in zip(now.cache_after, then.cache_after):
        for a, b in ((k[row][:, :past], k0[then_row][:, :past]), (v[row][:, :past], v0[then_row][:, :past])):
            changed |= ~torch.isclose(a.double(), b.double(), rtol=rtol, atol=atol).all(dim=-1).all(dim=0)
    hits = changed.nonzero()
    return int(hits[0]) if hits.numel() else None


@pytest.mark.parametrize("depth", [2, 6])
def test_first_moved_slot_reads_once_per_pair(depth: int) -> None:
    """The grouped check's comparison: as layer by layer on the host, with one value crossing."""
    gen = torch.Generator().manual_seed(depth)
    cache = [(torch.randn(3, 2, 9, 4, generator=gen), torch.randn(3, 2, 9, 4, generator=gen)) for _ in range(depth)]

    def call(kv: list[tuple[torch.Tensor, torch.Tensor]], past: int) -> CallRecord:
        return CallRecord("target", 0, None, None, None, (past,) * depth, 3, cache_after=kv)

    for moved, layer, tolerance in ((None, 0, 0.0), (4, depth - 1, 0.0), (2, 0, 0.1), (None, 0, 1e3)):
        later = [(k.clone(), v.clone()) for k, v in cache]
        if moved is not None or tolerance:
            later[layer][1][1, :, moved or 2] += 0.5
        then, now = call(cache, 7), call(later, 9)
        trace = DeviceTrace()
        trace.mark(*[x for kv in cache + later for x in kv])
        found = traced(trace, first_moved_slot, "checks")(now, 1, then, 1, 0.0, tolerance)
        expected = slot_by_slot(now, 1, then, 1, 0.0, tolerance)
        assert found == expected == (None if tolerance >= 1e3 else moved if tolerance == 0 else 2), (found, expected)
        assert sum(trace.syncs.values()) == 1, trace.syncs
    assert check_named("grouped-no-realignment") is not None
