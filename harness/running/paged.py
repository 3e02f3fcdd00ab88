"""A paged engine's evidence, one target forward at a time: what `checks.paged` judges.

vLLM and transformers' continuous batching both pack the running requests' tokens into one flat
batch and keep K/V in fixed-size blocks, so the batch-row evidence of `running.instrument` does
not exist there. What does: per forward the packed tokens and positions, each request's query
span and context length, the cache slot each token is written to and each request's block
table; per step what each request has committed. Each engine's observer
(`adapters.vllm_observer`, `adapters.transformers_cb`) records exactly that as `PagedCall`s and
one `PagedTrace`; neither imports the other, and the checks import neither. A driver that also
records each request's outputs hands the checks a `PagedRun`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specaudit.contracts.violation import Violation
from specaudit.reference.oracle import OracleResult
from specaudit.running.record import Record


@dataclass(frozen=True)
class PagedCall:
    """One target forward of a paged engine, as CPU tensors (R requests, N packed tokens)."""

    index: int  # target forward, in order
    step: int  # engine step it ran in (1-based)
    request_ids: tuple[str, ...]  # [R] the caller's request ids, in batch order
    input_ids: torch.Tensor  # [N] int64 packed tokens
    positions: torch.Tensor  # [N] int64
    query_start_loc: torch.Tensor  # [R + 1] int64: request r's query is tokens qsl[r]:qsl[r + 1]
    seq_lens: torch.Tensor  # [R] int64: context length (past + query) each request attends
    slot_mapping: torch.Tensor  # [N] int64: the cache slot each token's K/V is written to (-1: none)
    block_table: torch.Tensor  # [R, max_blocks] int64: each request's blocks
    block_size: int
    greedy: torch.Tensor | None = None  # [N] int64 the target's argmax after each packed token
    # [sum_r ceil(past_r / B)] float: per attended past block, max |now - as last written| (nan: never written)
    kv_drift: torch.Tensor | None = None
    written_kv: torch.Tensor | None = None  # [N, L', 2, kv_heads, head_dim] the K/V computed for each token

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    def span(self, row: int) -> tuple[int, int]:
        """Request `row`'s query tokens in the packed batch: [start, end)."""
        return int(self.query_start_loc[row]), int(self.query_start_loc[row + 1])

    def past(self, row: int) -> int:
        """How many past positions request `row` attends (its context before the query)."""
        start, end = self.span(row)
        return int(self.seq_lens[row]) - (end - start)

    def drift_offsets(self) -> list[int]:
        """Where each request's attended past blocks start in `kv_drift` (R + 1 entries)."""
        offsets = [0]
        for row in range(len(self.request_ids)):
            blocks = -(-max(self.past(row), 0) // self.block_size)
            offsets.append(offsets[-1] + min(blocks, self.block_table.shape[1]))
        return offsets


@dataclass(frozen=True)
class PagedTrace:
    """A whole in-process run: every target forward, and per step what each request committed."""

    calls: tuple[PagedCall, ...]
    prompts: dict[str, tuple[int, ...]]
    arrivals: dict[str, int]  # request -> the step before which it was added (0: before the first)
    left: dict[str, int]  # request -> the step after which it finished or was aborted
    aborted: frozenset[str]
    commits: tuple[dict[str, tuple[int, ...]], ...]  # after step s (index s - 1): request -> new tokens so far
    num_speculative_tokens: int = 0
    kv_layers: tuple[int, ...] = ()  # the target layers `kv_drift` and `written_kv` read

    def committed(self, request: str, step: int) -> tuple[int, ...]:
        """The request's prompt and the tokens it had committed after `step` (0: before any)."""
        outputs = self.commits[step - 1].get(request, ()) if step > 0 else ()
        return self.prompts[request] + outputs

    def live(self, request: str, step: int) -> bool:
        """Whether the request may run in `step`: added before it, not finished or aborted before it."""
        return self.arrivals.get(request, 1 << 30) < step and self.left.get(request, 1 << 30) >= step


Reference = Callable[[tuple[int, ...]], torch.Tensor]  # tokens -> [n, L', 2, kv_heads, head_dim]


@dataclass(frozen=True)
class PagedRun:
    """A paged engine's whole evidence, what the registry's PAGED checks judge: its trace, and
    (when the engine's driver recorded them) each request's outputs against its batch-size-1
    oracle as a `running.record.Record`, with how a divergence is re-synced at a tie.

    Without a record only the layout is judged (`checks.paged`); contract, equivalence and
    liveness are then not applicable, so an observer that records no outputs keeps working."""

    trace: PagedTrace
    record: Record | None = None  # each request's outputs vs its oracle (None: outputs not recorded)
    reference: Reference | None = None  # the batch-size-1 K/V of a token sequence (kv-entry)
    dtype: str = "float32"  # the engine's dtype: the tie tolerance of an oracle margin
    oracle_from: Callable[[tuple[int, ...], int], OracleResult] | None = None  # re-sync after a tie
    errors: dict[int | None, Violation] = field(default_factory=dict)  # request (None: the engine) -> its break
