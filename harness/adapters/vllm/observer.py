"""A white-box observer for vLLM run in process: every target forward's paged layout, recorded.

vLLM packs the running requests' tokens into one flat batch and keeps K/V in fixed-size
blocks, so the batch-row evidence of `specaudit.running.instrument` does not exist there. What does:
the attention metadata of each forward (`query_start_loc`, `seq_lens`, `slot_mapping`,
`block_table`), the packed `input_ids` and `positions`, the model runner's request ids in
batch order, and what the engine reports each request has committed after each step. This
module records exactly that, as `PagedCall`s and one `PagedTrace`; the checks that judge them
are pure functions in `specaudit.checks.paged`.

Hooks on vLLM's own target model (reached through the in-process engine core, so
`VLLM_ENABLE_V1_MULTIPROCESSING=0` is required; nothing of vLLM is patched):

- a forward pre-hook records the inputs and the metadata, and compares every past block each
  request attends with the copy taken after the last forward that wrote it (`kv_drift`: a
  block whose K/V changed was written behind the slot mapping's back; blocks are compared
  whole because the CPU kernel's interior layout is its own);
- pre-hooks on a few attention layers keep the K/V (after RoPE) each token is about to have
  written (`written_kv`), for the comparison with a batch-size-1 run (`hf_kv_reference`);
- a forward hook takes the block copies, and the target's greedy token after every packed
  token, computed here as the argmax of the hidden states times the lm head's weight (never
  the logits vLLM chose to sample, nor its `compute_logits`), so committed tokens can be
  checked against greedy acceptance;
- the scheduler's output of every step names the requests it preempted: a preempted request
  gives its blocks back and is recomputed from position 0 when resumed, so the trace shows each
  stretch between preemptions as a request of its own (`running.paged.incarnations`, shared with
  transformers' continuous batching): `a` until its preemption, then `a~1`, whose prompt is
  everything `a` had committed, and so on.

vLLM is imported lazily: this module imports without it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specaudit.running.paged import RESUMED as RESUMED  # re-exported: older callers import them from here
from specaudit.running.paged import PagedCall, PagedRecorder, PagedTrace
from specaudit.running.paged import incarnations as incarnations
from specaudit.running.paged import named as named
from specaudit.running.paged import split_commits as split_commits

IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"


@dataclass
class _Shadow:
    """Each block's K/V (a few layers) as the last forward that wrote it left it, to tell a
    write through the slot mapping from one behind its back."""

    layers: tuple[int, ...]
    written: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> [L', kv_heads, 2B, head_dim]


def hf_kv_reference(directory: str, layers: Sequence[int]) -> Any:
    """tokens -> [n, L', 2, kv_heads, head_dim]: a batch-size-1 Hugging Face run's K/V (after
    RoPE) at positions 0..n-1 in `layers`, what `check_paged(reference=...)` compares writes with."""
    from transformers import AutoModelForCausalLM

    from specaudit.reference.oracle import reference_kv

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()

    def entries(tokens: tuple[int, ...]) -> torch.Tensor:
        per_layer = reference_kv(model, tokens)  # per layer (K, V) [H, n, D]
        picked = [torch.stack(per_layer[i], dim=0).permute(2, 0, 1, 3) for i in layers]  # [n, 2, H, D]
        return torch.stack(picked, dim=1)

    return entries


def in_process_core(llm: Any) -> Any:
    """The engine core of an `LLM` whose engine core runs in this process."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError(f"the engine core runs in another process: set {IN_PROCESS}=0 before building the LLM")
    return core


def in_process_runner(llm: Any) -> Any:
    """The model runner of an `LLM` whose engine core runs in this process."""
    return in_process_core(llm).model_executor.driver_worker.worker.model_runner


def attention_layers(model: torch.nn.Module) -> list[Any]:
    """The target's attention layers, in order (vLLM `Attention` modules: `layer_name`, `kv_cache`)."""
    from vllm.model_executor.layers.attention import Attention

    return [m for m in model.modules() if isinstance(m, Attention)]


class VllmObserver(PagedRecorder):
    """Drives an in-process `vllm.LLM` step by step (`add_request`, `step`, `abort`) and records
    every target forward; `trace()` gives the run to `specaudit.checks.paged.check_paged`."""

    def __init__(self, llm: Any, kv_layers: Sequence[int] = (0, -1), read_kv: bool = True) -> None:
        self.engine = llm.llm_engine
        self.runner = in_process_runner(llm)
        self.model = self.runner.get_model()
        self.layers = attention_layers(self.model)
        picked = sorted({i % len(self.layers) for i in kv_layers})
        self.shadow = _Shadow(tuple(picked)) if read_kv else None
        spec = self.runner.vllm_config.speculative_config
        super().__init__(int(spec.num_speculative_tokens) if spec is not None else 0, tuple(picked) if read_kv else ())
        self.outputs: dict[str, tuple[int, ...]] = {}
        self.finish: dict[str, str | None] = {}  # request -> vLLM's finish reason ("stop", "length", "abort")
        self.external: dict[str, str] = {}  # vLLM's internal request id -> the caller's
        self.scheduler = in_process_core(llm).scheduler
        self.scheduler.schedule = self._schedule  # an instance attribute over vLLM's own method, removed by close
        self.pending: dict[str, Any] = {}  # the call being recorded, completed by the post-hook
        self.handles = [
            self.model.register_forward_pre_hook(self._before, with_kwargs=True),
            self.model.register_forward_hook(self._after, with_kwargs=True),
        ]
        self.kv_inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> this forward's (K, V)
        for layer in self.shadow.layers if self.shadow is not None else ():
            hook = self._kv_hook(layer)
            self.handles.append(self.layers[layer].register_forward_pre_hook(hook, with_kwargs=True))

    # -- driving the engine ------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Sequence[int], params: Any) -> None:
        internal = self.engine.add_request(request_id, {"prompt_token_ids": list(prompt)}, params)
        self.external[internal] = request_id
        self.prompts[request_id] = tuple(int(t) for t in prompt)
        self.arrivals[request_id] = len(self.commits)

    def abort(self, request_id: str) -> None:
        self.engine.abort_request([request_id])
        self.aborted.add(request_id)
        self.left.setdefault(request_id, len(self.commits))

    def step(self) -> list[Any]:
        outputs = self.engine.step()
        step = len(self.commits) + 1
        for out in outputs:
            self.outputs[out.request_id] = tuple(int(t) for t in out.outputs[0].token_ids)
            if out.finished:
                self.left.setdefault(out.request_id, step)
                self.finish[out.request_id] = out.outputs[0].finish_reason
        self.commits.append(dict(self.outputs))
        return outputs

    def _schedule(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's own scheduling, and the requests it preempted for this step, read from its output."""
        output = type(self.scheduler).schedule(self.scheduler, *args, **kwargs)
        for internal in getattr(output, "preempted_req_ids", None) or ():
            self.preempted.setdefault(self.external.get(internal, internal), []).append(len(self.commits) + 1)
        return output

    def run(
        self,
        arrivals: Iterable[tuple[int, str, Sequence[int], Any]],
        aborts: dict[str, int] | None = None,
        max_steps: int = 1000,
    ) -> PagedTrace:
        """Step until every request is done. `arrivals`: (step, id, prompt, params), added before
        that step (0: before the first); `aborts`: id -> the step after which it is aborted."""
        due = sorted(arrivals, key=lambda a: a[0])
        aborts = dict(aborts or {})
        while due or self.engine.has_unfinished_requests():
            while due and due[0][0] <= len(self.commits):
                _, request_id, prompt, params = due.pop(0)
                self.add_request(request_id, prompt, params)
            self.step()
            for request_id in [r for r, step in aborts.items() if step == len(self.commits)]:
                self.abort(request_id)
            if len(self.commits) >= max_steps:
                raise RuntimeError(f"the engine did not finish within {max_steps} steps")
        return self.trace()

    def close(self) -> None:
        """Remove the hooks and abort what is still running (the engine can be reused)."""
        for handle in self.handles:
            handle.remove()
        self.scheduler.__dict__.pop("schedule", None)
        running = [r for r in self.prompts if r not in self.left]
        if running:
            self.engine.abort_request(running)
            while self.engine.has_unfinished_requests():
                self.engine.step()

    # -- the hooks ---------------------------------------------------------------------

    def _metadata(self) -> Any:
        from vllm.forward_context import get_forward_context

        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):  # micro-batched: one dict per ubatch
            metadata = metadata[0]
        return metadata[self.layers[0].layer_name] if isinstance(metadata, dict) else metadata

    def _cache(self, layer: int) -> torch.Tensor:
        """[num_blocks, kv_heads, 2 * block_size, head_dim]: keys in the first half of each block."""
        kv_cache = self.layers[layer].kv_cache
        cache = kv_cache[0] if isinstance(kv_cache, list) else kv_cache
        blocks, heads, block_size, _ = cache.shape
        return cache.view(blocks, heads, 2 * block_size, -1)

    def _blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """[n, L', kv_heads, 2 * block_size, head_dim] whole blocks of the shadow's layers (the
        kernel's interior layout is its own, so blocks are compared whole, never read per slot)."""
        assert self.shadow is not None
        return torch.stack([self._cache(layer)[blocks] for layer in self.shadow.layers], dim=1).detach().clone()

    def _argmax(self, module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """[N] the target's argmax after every packed token, from the hidden states [N, H] and the
        lm head's weight [V, H] (padding rows past the vocabulary cut off): computed here, not
        taken from the logits vLLM samples, so a fault in what the engine samples shows."""
        weight = getattr(getattr(module, "lm_head", None), "weight", None)
        with torch.no_grad():
            if weight is None or weight.shape[-1] != hidden.shape[-1]:
                return module.compute_logits(hidden).argmax(-1).cpu().long()  # a model without a plain lm head
            vocab = int(self.runner.model_config.get_vocab_size())
            logits = hidden.float() @ weight[:vocab].float().T  # [N, V]
        return logits.argmax(-1).cpu().long()

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        metadata = self._metadata()
        ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        n = int(metadata.num_actual_tokens)
        rows = int(metadata.seq_lens.shape[0])
        req_ids = self.runner.input_batch.req_ids[:rows]
        block_size = int(self._cache(0).shape[2] // 2)
        self.pending = dict(
            index=len(self.calls),
            step=len(self.commits) + 1,
            request_ids=tuple(self.external.get(r, r) for r in req_ids),
            input_ids=ids[:n].detach().cpu().long().clone(),  # [N]
            positions=positions[:n].detach().cpu().long().clone(),  # [N]
            query_start_loc=metadata.query_start_loc[: rows + 1].cpu().long().clone(),  # [R + 1]
            seq_lens=metadata.seq_lens[:rows].cpu().long().clone(),  # [R]
            slot_mapping=metadata.slot_mapping[:n].cpu().long().clone(),  # [N]
            block_table=metadata.block_table[:rows].cpu().long().clone(),  # [R, max_blocks]
            block_size=block_size,
        )
        if self.shadow is not None:
            self.pending["kv_drift"] = self._drift(self.pending)

    def _past_blocks(self, p: dict) -> torch.Tensor:
        """[sum_r ceil(past_r / B)] the blocks holding each request's attended past, by its table."""
        blocks = []
        qsl, seq_lens, table, size = p["query_start_loc"], p["seq_lens"], p["block_table"], p["block_size"]
        for r in range(seq_lens.shape[0]):
            past = max(int(seq_lens[r]) - int(qsl[r + 1] - qsl[r]), 0)
            blocks.append(table[r, : min(-(-past // size), table.shape[1])])
        return torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.long)

    def _drift(self, p: dict) -> torch.Tensor:
        """Per attended past block: how far its K/V moved since the last forward wrote it (nan: never written)."""
        assert self.shadow is not None
        blocks = self._past_blocks(p)
        drift = torch.full((blocks.numel(),), float("nan"))
        if blocks.numel() == 0:
            return drift
        now = self._blocks(blocks.clamp(min=0))  # [n, L', kv_heads, 2B, head_dim]
        for i, block in enumerate(blocks.tolist()):
            before = self.shadow.written.get(block)
            if before is not None:
                drift[i] = (now[i] - before).abs().max().float()
        return drift

    def _kv_hook(self, layer: int) -> Any:
        """A pre-hook on one attention layer: the K/V (after RoPE) it is about to write."""

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            key = args[1] if len(args) > 1 else kwargs["key"]
            value = args[2] if len(args) > 2 else kwargs["value"]
            self.kv_inputs[layer] = (key.detach().cpu().clone(), value.detach().cpu().clone())

        return hook

    def _written_kv(self, n: int) -> torch.Tensor | None:
        """[N, L', 2, kv_heads, head_dim] what this forward computed for each packed token."""
        assert self.shadow is not None
        if set(self.kv_inputs) != set(self.shadow.layers):
            return None
        _, heads, _, width = self._cache(0).shape
        per_layer = []
        for layer in self.shadow.layers:
            key, value = self.kv_inputs[layer]
            per_layer.append(torch.stack([key[:n].reshape(n, heads, width), value[:n].reshape(n, heads, width)], dim=1))
        self.kv_inputs = {}
        return torch.stack(per_layer, dim=1)

    def _after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        p, self.pending = self.pending, {}
        if not p:
            return
        hidden = output[0] if isinstance(output, tuple) else output
        n = p["input_ids"].shape[0]
        p["greedy"] = self._argmax(module, hidden[:n])  # [N]
        if self.shadow is not None:
            slots = p["slot_mapping"]
            blocks = torch.unique(slots[slots >= 0] // p["block_size"])
            for block, kv in zip(blocks.tolist(), self._blocks(blocks)):
                self.shadow.written[block] = kv
            p["written_kv"] = self._written_kv(n)
        self.calls.append(PagedCall(**p))


# ---------------------------------------------------------------------------------------
# A staggered workload, from the command line:
#   .venv-vllm/bin/python -m specaudit observe-vllm MODEL [--draft DIR]

PROMPTS = {
    "a": (11, 12, 13, 14, 11, 12, 13, 14, 11, 12),
    "b": (25, 26, 27, 25, 26, 27, 25, 26),
    "c": (49, 48, 47, 46, 45, 44, 43, 42, 41, 49, 48, 47),
    "d": (33,) * 31,  # crosses its first block boundary at once
}
ARRIVALS = {"a": 0, "b": 2, "c": 4, "d": 5}  # added before that step
ABORTS = {"c": 12}  # aborted after that step
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def staggered(
    llm: Any,
    new_tokens: int = 40,
    prompts: dict[str, tuple[int, ...]] = PROMPTS,
    arrivals: dict[str, int] = ARRIVALS,
    aborts: dict[str, int] = ABORTS,
) -> PagedTrace:
    """Greedy requests arriving at different steps, some aborted midway, observed throughout
    (by default four, one aborted: the workload the tests and `specaudit observe-vllm` run)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    observer = VllmObserver(llm)
    try:
        due = [(step, rid, prompts[rid], params) for rid, step in arrivals.items()]
        return observer.run(due, aborts=aborts, max_steps=20 * new_tokens)
    finally:
        observer.close()


def build_llm(model: str, speculative: dict[str, Any] | None, block_size: int = 32, **engine: Any) -> Any:
    """An in-process float32 `vllm.LLM` with the settings the observer is tested under; `engine`
    overrides vLLM's engine arguments (`max_model_len`, `enable_prefix_caching`,
    `max_num_batched_tokens`, `num_gpu_blocks_override`)."""
    import os

    os.environ.setdefault(IN_PROCESS, "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    settings: dict[str, Any] = dict(
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        enforce_eager=True,
        seed=0,
        block_size=block_size,
        enable_prefix_caching=False,
        speculative_config=speculative,
    )
    return LLM(model=model, **(settings | engine))
