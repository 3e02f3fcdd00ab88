"""Planted bugs in transformers' continuous batching: monkeypatches of its own functions.

Each is a slip a paged, continuous-batching engine makes (positions, write and read indices,
context lengths, block allocation, which logits are sampled, cancellation, stopping), applied
in process with `planted`, and each names the check and rule that must catch it first on its
workload (named here, built by `specaudit.adapters.transformers_cb.workload.MUTANT_WORKLOADS`;
`tests/adapters/test_transformers_cb.py` runs the table). `output_visible` says
whether the output comparison with the batch-size-1 oracle also sees it there; the last two
change only what is returned, so only the output checks catch them.

transformers is imported lazily (when a bug is planted): this module imports without it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

CB = "transformers.generation.continuous_batching"
IOS = f"{CB}.input_outputs:ContinuousBatchingIOs"
ALLOCATOR = f"{CB}.cache_allocators.full_attention:FullAttentionCacheAllocator"
SCHEDULER = f"{CB}.scheduler:Scheduler"
STATE = f"{CB}.requests:RequestState"


@dataclass(frozen=True)
class CbMutant:
    """One planted transformers CB bug: what it patches, and the check and rule that must catch it."""

    name: str
    description: str
    target: str  # "module:Class.method" patched
    rule: str  # the first rule of `check` it breaks
    output_visible: bool  # the output comparison with the oracle also catches it (on `workload`)
    make: Callable[[Callable[..., Any]], Callable[..., Any]]  # the original -> the planted replacement
    check: str = "paged"
    workload: str = "staggered"  # its workload (`adapters.transformers_cb.workload.MUTANT_WORKLOADS`)
    also: tuple[tuple[str, Callable[[Callable[..., Any]], Callable[..., Any]]], ...] = ()  # patched together

    def __repr__(self) -> str:
        return f"CbMutant({self.name!r} -> {self.check}/{self.rule})"


def resolve(target: str) -> tuple[Any, str]:
    """(class, attribute) of "pkg.module:Class.method"."""
    module, path = target.split(":")
    owner: Any = importlib.import_module(module)
    *classes, attribute = path.split(".")
    for name in classes:
        owner = getattr(owner, name)
    return owner, attribute


@contextmanager
def planted(mutant: CbMutant) -> Iterator[CbMutant]:
    """The bug in place, in this process (the engine's thread included), for the block's duration."""
    undo = []
    try:
        for target, make in ((mutant.target, mutant.make), *mutant.also):
            owner, attribute = resolve(target)
            original = owner.__dict__[attribute]
            setattr(owner, attribute, make(original))
            undo.append((owner, attribute, original))
        yield mutant
    finally:
        for owner, attribute, original in reversed(undo):
            setattr(owner, attribute, original)


# ---------------------------------------------------------------------------------------
# After `prepare_batch_tensors`: the packed inputs of the forward being prepared


def spans(ios: Any) -> list[tuple[Any, int, int, int]]:
    """(state, start, end, past length) of each request of the prepared batch."""
    qsl = ios.cumulative_seqlens_q[: len(ios.requests_in_batch) + 1].tolist()
    out = []
    for i, future in enumerate(ios.requests_in_batch):
        start, end = qsl[i], qsl[i + 1]
        out.append((future.state, start, end, future.state.position_offset - (end - start)))
    return out


def after_prepare(edit: Callable[[Any], None]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def prepare_batch_tensors(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            edit(self)
            return out

        return prepare_batch_tensors

    return make


def position_off_at_page_start(ios: Any) -> None:
    """A decode token opening a new page gets position + 1 (RoPE; its write slot stays)."""
    page = ios.cache.cache_allocators["full_attention"].tokens_per_page
    for _state, start, end, past in spans(ios):
        if end - start == 1 and past > 0 and past % page == 0:
            ios.position_ids[start] += 1


def stale_first_decode_token(ios: Any) -> None:
    """The first decode step feeds the prompt's last token again instead of the first output."""
    for state, start, end, _past in spans(ios):
        if end - start == 1 and len(state.generated_tokens) == 1 and not state._true_initial_tokens:
            ios.input_ids[start] = state.initial_tokens[-1]


def logits_one_early(ios: Any) -> None:
    """After a multi-token prefill, the token is sampled from the logits of the second-to-last prompt token."""
    for i, (_state, start, end, _past) in enumerate(spans(ios)):
        if end - start > 1 and ios.requests_in_batch[i].has_new_token:
            row = sum(1 for f in ios.requests_in_batch[:i] if f.has_new_token)
            ios.logits_indices[row] = end - 2


# ---------------------------------------------------------------------------------------
# The allocator's indices and blocks, the scheduler, the request's stopping rule


def write_over_previous_page(original: Callable[..., Any]) -> Callable[..., Any]:
    """A token opening a new page is written at the start of the previous page (over position p - B)."""

    def get_write_indices(self: Any, request_id: str, past_length: int, query_length: int) -> list[int]:
        rows = original(self, request_id, past_length, query_length)
        table = self.block_table[request_id]
        for i in range(query_length):
            position = past_length + i
            if position > 0 and position % self.tokens_per_page == 0:
                rows[i] = table[position // self.tokens_per_page - 1] * self.block_physical_stride
        return rows

    return get_write_indices


def read_page_twice(original: Callable[..., Any]) -> Callable[..., Any]:
    """The last whole page of the past is read from the page before it (that page read twice)."""

    def get_read_indices(self: Any, request_id: str, past_length: int, query_length: int) -> list[int]:
        rows = original(self, request_id, past_length, query_length)
        page, whole = self.tokens_per_page, past_length // self.tokens_per_page
        if whole >= 2:
            last = (whole - 1) * page
            rows[last : last + page] = rows[last - page : last]
        return rows

    return get_read_indices


def context_one_long(original: Callable[..., Any]) -> Callable[..., Any]:
    """A decode step's context counts one slot too many (the mask grows by an unwritten slot; with
    `read_one_more` the read does too)."""

    def get_seqlen_k(self: Any, past_length: int, query_length: int) -> int:
        length = original(self, past_length, query_length)
        return length + 1 if query_length == 1 and past_length > 0 else length

    return get_seqlen_k


def read_one_more(original: Callable[..., Any]) -> Callable[..., Any]:
    """A decode step also reads the slot after its query's (never written for it)."""

    def get_read_indices(self: Any, request_id: str, past_length: int, query_length: int) -> list[int]:
        rows = original(self, request_id, past_length, query_length)
        return rows + [rows[-1] + 1] if query_length == 1 and past_length > 0 else rows

    return get_read_indices


def live_block_handed_out(original: Callable[..., Any]) -> Callable[..., Any]:
    """Once, a request's new block is the last block of another request that still holds it."""
    fired: list[bool] = []

    def allocate_cache_to_request(self: Any, request_id: str, past_length: int, query_length: int) -> None:
        before = len(self.block_table.get(request_id, []))
        original(self, request_id, past_length, query_length)
        table = self.block_table[request_id]
        others = [t for r, t in self.block_table.items() if r != request_id and t]
        if not fired and before > 0 and len(table) > before and others:
            fired.append(True)
            table[-1] = others[0][-1]

    return allocate_cache_to_request


def zeroes_live_block(original: Callable[..., Any]) -> Callable[..., Any]:
    """Giving a newcomer its first blocks zeroes the first block of a running request instead of its own."""

    def allocate_cache_to_request(self: Any, request_id: str, past_length: int, query_length: int) -> None:
        newcomer = request_id not in self.block_table
        original(self, request_id, past_length, query_length)
        others = [t for r, t in self.block_table.items() if r != request_id and t]
        if newcomer and others:
            stride = self.block_physical_stride
            rows = self.cache_tensor.view(-1, self.cache_tensor.shape[-2], self.cache_tensor.shape[-1])
            rows[others[0][0] * stride : (others[0][0] + 1) * stride] = 0

    return allocate_cache_to_request


def cancel_keeps_running(original: Callable[..., Any]) -> Callable[..., Any]:
    """A cancelled request that is running is never removed: it keeps being scheduled."""

    def clear_cancelled_requests(self: Any) -> list[Any]:
        with self._cancellation_lock:
            self._requests_to_cancel = {r for r in self._requests_to_cancel if r not in self.active_requests}
        return original(self)

    return clear_cancelled_requests


def one_token_too_many(original: Callable[..., Any]) -> Callable[..., Any]:
    """The length limit is checked before the token is counted: max_new_tokens + 1 tokens."""

    def update_and_check_completion(self: Any, token_id: int, logprob: float | None) -> bool:
        self._new_tokens_limit += 1
        try:
            return original(self, token_id, logprob)
        finally:
            self._new_tokens_limit -= 1

    return update_and_check_completion


def token_after_eos(original: Callable[..., Any]) -> Callable[..., Any]:
    """EOS stops the request one token late: one token follows it."""

    def update_and_check_completion(self: Any, token_id: int, logprob: float | None) -> bool:
        eos = self._eos_token_ids
        if self.generated_tokens and self.generated_tokens[-1] in eos:
            self._eos_token_ids = set()
            try:
                original(self, token_id, logprob)
            finally:
                self._eos_token_ids = eos
            self.status = type(self.status).FINISHED
            return True
        self._eos_token_ids = set()
        try:
            finished = original(self, token_id, logprob)
        finally:
            self._eos_token_ids = eos
        return finished

    return update_and_check_completion


MUTANTS: tuple[CbMutant, ...] = (
    CbMutant(
        "position-at-page-start",
        "a decode token opening a new page gets position + 1",
        f"{IOS}.prepare_batch_tensors",
        "query-positions",
        True,
        after_prepare(position_off_at_page_start),
    ),
    CbMutant(
        "write-over-previous-page",
        "a token opening a new page is written at the start of the previous page",
        f"{ALLOCATOR}.get_write_indices",
        "slot-mapping",
        True,
        write_over_previous_page,
    ),
    CbMutant(
        "read-page-twice",
        "the last whole page of the past is read from the page before it",
        f"{ALLOCATOR}.get_read_indices",
        "kv-provenance",
        True,
        read_page_twice,
    ),
    CbMutant(
        "context-one-long",
        "a decode step's context length counts one unwritten slot too many",
        f"{ALLOCATOR}.get_seqlen_k",
        "context-length",
        True,
        context_one_long,
        also=((f"{ALLOCATOR}.get_read_indices", read_one_more),),
    ),
    CbMutant(
        "stale-first-decode-token",
        "the first decode step feeds the prompt's last token instead of the first output",
        f"{IOS}.prepare_batch_tensors",
        "query-tokens",
        True,
        after_prepare(stale_first_decode_token),
    ),
    CbMutant(
        "logits-one-early",
        "after a prefill the first token is sampled from the second-to-last prompt token's logits",
        f"{IOS}.prepare_batch_tensors",
        "greedy-commit",
        True,
        after_prepare(logits_one_early),
    ),
    CbMutant(
        "live-block-reused",
        "a block still held by a live request handed to another request",
        f"{ALLOCATOR}.allocate_cache_to_request",
        "block-shared",
        True,
        live_block_handed_out,
    ),
    CbMutant(
        "zeroes-live-block",
        "giving a newcomer its blocks zeroes a running request's first block",
        f"{ALLOCATOR}.allocate_cache_to_request",
        "kv-overwritten",
        True,
        zeroes_live_block,
    ),
    CbMutant(
        "cancel-ignored",
        "a running request that is cancelled keeps being scheduled",
        f"{SCHEDULER}.clear_cancelled_requests",
        "live-request",
        False,
        cancel_keeps_running,
    ),
    CbMutant(
        "one-token-too-many",
        "max_new_tokens + 1 tokens: the limit is checked before the token is counted",
        f"{STATE}.update_and_check_completion",
        "max-new-tokens",
        True,
        one_token_too_many,
        check="contract",
    ),
    CbMutant(
        "token-after-eos",
        "EOS stops the request one token late",
        f"{STATE}.update_and_check_completion",
        "ends-at-eos",
        True,
        token_after_eos,
        check="contract",
        workload="eos",
    ),
)

BY_NAME = {m.name: m for m in MUTANTS}
