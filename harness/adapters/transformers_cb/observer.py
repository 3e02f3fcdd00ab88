"""Hooks on transformers CB's target that record every forward as paged evidence.

Nothing of transformers is patched. On the target alone:

- a forward pre-hook (with keyword arguments) reads the packed tokens, positions, query spans,
  context lengths, the slot of every write and each request's blocks as the forward reads them
  (`layout.packed`), binds rows to requests by the batch processor's own `requests_in_batch`,
  and compares every attended past block with the copy taken after the last forward that wrote
  it (`kv_drift`);
- a forward hook on the decoder keeps its last hidden states, and one on the model applies the
  target's own lm head at every packed token (`greedy`, never the engine's sampled logits, which
  `logits_to_keep` limits to one per request), copies the blocks written and reads back the K/V
  each token left in the cache (`written_kv`).

Per step each request's committed tokens are read from its `RequestState`. A preempted request
(the cache ran out: transformers frees its blocks and requeues it with its output appended to its
prompt, the same request id) is followed as transformers defines it: the request leaves, and a
new incarnation (`<id>#1`) arrives whose prompt is everything committed so far, so its
recomputation from position 0 and its fresh blocks are normal, not flagged. The result is the
same evidence vLLM's observer records (`running.paged.PagedCall`, `PagedTrace`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specaudit.adapters.transformers_cb.layout import Layout, packed
from specaudit.running.paged import PagedCall, PagedTrace


@dataclass
class _Shadow:
    """Each block (every layer) as the last forward that wrote it left it."""

    written: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> [stride, kv_heads, head_dim]


class CbObserver:
    """Hooks on the engine's target; `manager` (a `ContinuousBatchingManager`) is set by the
    driver before the first forward. `on_step(k)` runs after the forward of step k, in the
    engine's thread, before the step's update (what it adds or cancels takes effect at step k + 1)."""

    def __init__(self, model: torch.nn.Module, kv_layers: Sequence[int] = (0, -1), read_kv: bool = True) -> None:
        self.model = model
        self.manager: Any = None
        self.on_step: Callable[[int], None] | None = None
        layers = model.config.num_hidden_layers
        self.kv_layers = tuple(sorted({i % layers for i in kv_layers}))
        self.shadow = _Shadow() if read_kv else None
        self.calls: list[PagedCall] = []
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.arrivals: dict[str, int] = {}
        self.left: dict[str, int] = {}
        self.aborted: set[str] = set()
        self.commits: list[dict[str, tuple[int, ...]]] = []
        self.states: dict[str, Any] = {}  # trace id -> its RequestState
        self.current: dict[str, str] = {}  # engine request id -> its current trace id (incarnation)
        self.origin: dict[str, str] = {}  # trace id -> the engine request id it incarnates
        self.cancelled: dict[str, int] = {}  # engine request id -> the step after which the driver cancelled it
        self.error: BaseException | None = None
        self.pending: dict[str, Any] = {}  # the forward about to run, as PagedCall fields (`layout.packed`)
        self.hidden: torch.Tensor | None = None  # [1, N_padded, hidden] the decoder's last output
        self.handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.get_decoder().register_forward_hook(self._keep_hidden),
            model.register_forward_hook(self._after, with_kwargs=True),
        ]

    # -- the caller's side -------------------------------------------------------------

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    def rename(self, names: dict[str, str]) -> None:
        """The trace's request ids as the workload's (`generate_batch` and `generate` name them
        req_0, req_1, ...); an incarnation `req_i#n` becomes `<id>#n`."""

        def rename(tid: str) -> str:
            base, _, rest = tid.partition("#")
            return names.get(base, base) + (f"#{rest}" if rest else "")

        self.prompts = {rename(k): v for k, v in self.prompts.items()}
        self.arrivals = {rename(k): v for k, v in self.arrivals.items()}
        self.left = {rename(k): v for k, v in self.left.items()}
        self.aborted = {rename(k) for k in self.aborted}
        self.states = {rename(k): v for k, v in self.states.items()}
        self.origin = {rename(k): names.get(v, v) for k, v in self.origin.items()}
        self.current = {names.get(k, k): rename(v) for k, v in self.current.items()}
        self.commits = [{rename(k): v for k, v in c.items()} for c in self.commits]
        self.calls = [
            PagedCall(**{**c.__dict__, "request_ids": tuple(rename(r) for r in c.request_ids)}) for c in self.calls
        ]

    def submitted(self, request_id: str, prompt: Sequence[int]) -> None:
        """A request handed to the engine now (it can run from the next step on)."""
        self.prompts.setdefault(request_id, tuple(int(t) for t in prompt))
        self.arrivals.setdefault(request_id, len(self.calls))
        self.current.setdefault(request_id, request_id)
        self.origin.setdefault(request_id, request_id)

    def finish(self) -> PagedTrace:
        """The run is over: the last step's commits, and every request still in flight left after it."""
        if self.calls and len(self.commits) < len(self.calls):
            self.commits.append(self._snapshot())
        last = len(self.commits)
        for request in self.prompts:
            if request not in self.left:
                self._leave(request, last)
        return self.trace()

    def trace(self) -> PagedTrace:
        return PagedTrace(
            tuple(self.calls),
            dict(self.prompts),
            dict(self.arrivals),
            dict(self.left),
            frozenset(self.aborted),
            tuple(self.commits),
            0,
            self.kv_layers,
        )

    def outputs(self) -> dict[str, tuple[int, ...]]:
        """Each engine request's whole output so far (its incarnations joined), as transformers reports it."""
        out: dict[str, tuple[int, ...]] = {}
        for engine_id, trace_id in self.current.items():
            state = self.states.get(trace_id)
            out[engine_id] = tuple(state.to_generation_output().generated_tokens) if state is not None else ()
        return out

    # -- per step: commits, departures, incarnations --------------------------------------

    def _finished(self, trace_id: str) -> bool:
        from transformers.generation.continuous_batching import RequestStatus

        state = self.states.get(trace_id)
        return state is not None and state.status == RequestStatus.FINISHED

    def _snapshot(self) -> dict[str, tuple[int, ...]]:
        return {tid: tuple(int(t) for t in state.generated_tokens) for tid, state in self.states.items()}

    def _settle(self, scheduler: Any) -> None:
        """Before the forward of step s: what step s - 1 committed, who left after it (finished,
        cancelled, or preempted and requeued as a new incarnation)."""
        done = len(self.calls)
        for trace_id, state in list(self.states.items()):
            if trace_id in self.left:
                continue
            engine_id = state.request_id
            now = scheduler.active_requests.get(engine_id) or scheduler.waiting_requests.get(engine_id)
            if now is not None and now is not state:  # preempted: requeued as a new request state
                self.left[trace_id] = done
                self._incarnate(engine_id, now, done)
            elif now is None or self._finished(trace_id):
                self._leave(trace_id, done)
        if done:
            self.commits.append(self._snapshot())

    def _leave(self, trace_id: str, step: int) -> None:
        """Finished, or cancelled: after the step the caller cancelled it in, whatever the engine did since."""
        cancel = self.cancelled.get(self.origin.get(trace_id, trace_id))
        if cancel is not None and not (self._finished(trace_id) and step <= cancel):
            self.aborted.add(trace_id)
            step = min(step, max(cancel, self.arrivals.get(trace_id, 0)))
        self.left[trace_id] = step

    def _incarnate(self, engine_id: str, state: Any, step: int) -> str:
        """A preempted request requeued with its output as prompt: a new arrival after `step`."""
        number = sum(1 for t in self.origin.values() if t == engine_id)
        trace_id = f"{engine_id}#{number}"
        self.prompts[trace_id] = tuple(int(t) for t in state.initial_tokens)
        self.arrivals[trace_id] = step
        self.origin[trace_id] = engine_id
        self.current[engine_id] = trace_id
        self.states[trace_id] = state
        return trace_id

    def _bind(self, state: Any) -> str:
        """The trace id of a request in the batch (its first appearance registers it)."""
        engine_id = state.request_id
        trace_id = self.current.get(engine_id)
        if trace_id is None:
            self.submitted(engine_id, state.initial_tokens)
            trace_id = engine_id
        if trace_id not in self.states:
            self.states[trace_id] = state
        elif self.states[trace_id] is not state:  # requeued between two of our looks
            self.left.setdefault(trace_id, len(self.calls))
            trace_id = self._incarnate(engine_id, state, len(self.calls))
        return trace_id

    # -- the hooks -----------------------------------------------------------------------

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        try:
            self.pending = self._record(kwargs)
        except Exception as exc:  # never break the engine's thread; the driver re-raises
            self.error = self.error or exc
            self.pending = {}

    def _record(self, kwargs: dict) -> dict[str, Any]:
        """The forward about to run, its rows bound to the batch processor's own requests."""
        if kwargs.get("block_table") is not None:
            raise NotImplementedError("the decode fast path (block_table) is not observed: max_blocks_per_request=0")
        processor = self.manager.batch_processor
        self._settle(processor.scheduler)
        futures = list(processor.inputs_and_outputs.requests_in_batch)
        ids = tuple(self._bind(f.state) for f in futures)
        allocator = kwargs["cache"].cache_allocators["full_attention"]
        pending = packed(kwargs, allocator, [f.state.request_id for f in futures])
        pending.update(index=len(self.calls), step=len(self.calls) + 1, request_ids=ids)
        if self.shadow is not None:
            pending["kv_drift"] = self._drift(allocator, pending["_layout"], pending)
        return pending

    def _drift(self, allocator: Any, layout: Layout, p: dict[str, Any]) -> torch.Tensor:
        """[P] per attended past block (P over the forward's requests, in row order): how far its
        K/V moved since the last forward that wrote it (nan: never written)."""
        assert self.shadow is not None
        blocks = []
        for r in range(len(p["request_ids"])):
            q = int(p["query_start_loc"][r + 1] - p["query_start_loc"][r])
            past = max(int(p["seq_lens"][r]) - q, 0)
            blocks += p["block_table"][r, : min(-(-past // layout.block_size), p["block_table"].shape[1])].tolist()
        drift = torch.full((len(blocks),), float("nan"))
        for i, block in enumerate(blocks):
            before = self.shadow.written.get(block)
            if before is not None and block >= 0:
                drift[i] = (layout.block(allocator, block) - before).abs().max().float()
        return drift

    def _keep_hidden(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self.hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state

    def _after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        p, self.pending = self.pending, {}
        if p:
            try:
                self.calls.append(self._complete(module, p))
            except Exception as exc:
                self.error = self.error or exc
        if self.on_step is not None:
            self.on_step(len(self.calls))

    def _complete(self, module: torch.nn.Module, p: dict[str, Any]) -> PagedCall:
        layout, allocator, writes = p.pop("_layout"), p.pop("_allocator"), p.pop("_writes")
        n = p["input_ids"].shape[0]
        with torch.no_grad():
            assert self.hidden is not None
            logits = module.lm_head(self.hidden[0, :n])  # [N, V]: the target's own head at every packed token
        p["greedy"] = logits.argmax(-1).cpu().long()  # [N]
        if self.shadow is not None:
            slots = p["slot_mapping"]
            for block in torch.unique(slots[slots >= 0] // layout.block_size).tolist():
                self.shadow.written[block] = layout.block(allocator, block).clone()
            p["written_kv"] = layout.written_kv(allocator, writes, self.kv_layers)
        return PagedCall(**p)
