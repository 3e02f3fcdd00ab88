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
(the cache ran out: transformers frees its blocks and requeues it as a new `RequestState`, same
request id, whose prompt is its old prompt and output, `soft_reset`) is recomputed from position
0, exactly vLLM's preemption. So the observer records what it sees, as vLLM's does: the trace by
the engine's request ids (commits: each request's whole output, its requeued prompt's tail
included) and the steps at which each request was requeued (`preempted`); `trace()` splits each
preempted request with the shared `running.paged.incarnations` (`<id>`, `<id>~1`, ...), so its
recomputation and its fresh blocks are normal, not flagged. The result is the same evidence
vLLM's observer records (`running.paged.PagedCall`, `PagedTrace`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from specaudit.adapters.transformers_cb.layout import Layout, packed
from specaudit.running.paged import PagedCall, PagedRecorder, PagedTrace


@dataclass
class _Shadow:
    """Each block (every layer) as the last forward that wrote it left it."""

    written: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> [stride, kv_heads, head_dim]


class CbObserver(PagedRecorder):
    """Hooks on the engine's target; `manager` (a `ContinuousBatchingManager`) is set by the
    driver before the first forward. `on_step(k)` runs after the forward of step k, in the
    engine's thread, before the step's update (what it adds or cancels takes effect at step k + 1)."""

    def __init__(self, model: torch.nn.Module, kv_layers: Sequence[int] = (0, -1), read_kv: bool = True) -> None:
        self.model = model
        self.manager: Any = None
        self.on_step: Callable[[int], None] | None = None
        layers = model.config.num_hidden_layers
        super().__init__(0, tuple(sorted({i % layers for i in kv_layers})))  # transformers CB does no speculation
        self.shadow = _Shadow() if read_kv else None
        self.states: dict[str, Any] = {}  # request -> its current RequestState
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
        req_0, req_1, ...)."""

        def keyed(mapping: dict[str, Any]) -> dict[str, Any]:
            return {names.get(k, k): v for k, v in mapping.items()}

        self.prompts, self.arrivals, self.left = keyed(self.prompts), keyed(self.arrivals), keyed(self.left)
        self.states, self.preempted = keyed(self.states), keyed(self.preempted)
        self.aborted = {names.get(k, k) for k in self.aborted}
        self.commits = [keyed(c) for c in self.commits]
        self.calls = [replace(c, request_ids=tuple(names.get(r, r) for r in c.request_ids)) for c in self.calls]

    def submitted(self, request_id: str, prompt: Sequence[int]) -> None:
        """A request handed to the engine now (it can run from the next step on)."""
        self.prompts.setdefault(request_id, tuple(int(t) for t in prompt))
        self.arrivals.setdefault(request_id, len(self.calls))

    def finish(self) -> PagedTrace:
        """The run is over: the last step's commits, and every request still in flight left after it."""
        if self.calls and len(self.commits) < len(self.calls):
            self.commits.append(self._snapshot())
        last = len(self.commits)
        for request in self.prompts:
            if request not in self.left:
                self._leave(request, last)
        return self.trace()

    def outputs(self) -> dict[str, tuple[int, ...]]:
        """Each engine request's whole output so far (across its preemptions), as transformers reports it."""
        return {r: tuple(state.to_generation_output().generated_tokens) for r, state in self.states.items()}

    # -- per step: commits, departures, preemptions -----------------------------------------

    def _finished(self, request: str) -> bool:
        from transformers.generation.continuous_batching import RequestStatus

        state = self.states.get(request)
        return state is not None and state.status == RequestStatus.FINISHED

    def _output(self, request: str) -> tuple[int, ...]:
        """The request's whole output: a requeued state's prompt holds what it committed before."""
        state = self.states[request]
        carried = tuple(int(t) for t in state.initial_tokens[len(self.prompts[request]) :])
        return carried + tuple(int(t) for t in state.generated_tokens)

    def _snapshot(self) -> dict[str, tuple[int, ...]]:
        return {request: self._output(request) for request in self.states}

    def _settle(self, scheduler: Any) -> None:
        """Before the forward of step s: what step s - 1 committed, who left after it (finished,
        cancelled), who was preempted and requeued for step s."""
        done = len(self.calls)
        for request, state in list(self.states.items()):
            if request in self.left:
                continue
            now = scheduler.active_requests.get(request) or scheduler.waiting_requests.get(request)
            if now is not None and now is not state:  # preempted: requeued as a new request state
                self._requeued(request, now, done + 1)
            elif now is None or self._finished(request):
                self._leave(request, done)
        if done:
            self.commits.append(self._snapshot())

    def _leave(self, request: str, step: int) -> None:
        """Finished, or cancelled: after the step the caller cancelled it in, whatever the engine did since."""
        cancel = self.cancelled.get(request)
        if cancel is not None and not (self._finished(request) and step <= cancel):
            self.aborted.add(request)
            step = min(step, max(cancel, self.arrivals.get(request, 0)))
        self.left[request] = step

    def _requeued(self, request: str, state: Any, step: int) -> None:
        """A preempted request requeued with its output as prompt, for `step` (the one whose
        scheduling preempted it, in vLLM's terms)."""
        self.preempted.setdefault(request, []).append(step)
        self.states[request] = state

    def _bind(self, state: Any) -> str:
        """The request id of a row in the batch (its first appearance registers it)."""
        request = state.request_id
        if request not in self.prompts:
            self.submitted(request, state.initial_tokens)
        known = self.states.setdefault(request, state)
        if known is not state:  # requeued between two of our looks
            self._requeued(request, state, len(self.calls) + 1)
        return request

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
