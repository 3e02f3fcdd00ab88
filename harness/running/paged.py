"""A paged engine's evidence, one target forward at a time: what `checks.paged` judges.

vLLM and transformers' continuous batching both pack the running requests' tokens into one flat
batch and keep K/V in fixed-size blocks, so the batch-row evidence of `running.instrument` does
not exist there. What does: per forward the packed tokens and positions, each request's query
span and context length, the cache slot each token is written to and each request's block
table; per step what each request has committed. Each engine's observer
(`adapters.vllm.observer`, `adapters.transformers_cb`) records exactly that as `PagedCall`s and
one `PagedTrace`, both on `PagedRecorder`; neither imports the other, and the checks import
neither. A driver that also records each request's outputs hands the checks a `PagedRun`.

Both engines preempt alike: a preempted request gives its blocks back and is recomputed from
position 0 with everything it committed as its prompt. Each observer records the run by the
caller's request ids and the steps at which each request was preempted; `incarnations` (one
function for both) splits a preempted request `a` into `a`, `a~1`, `a~2`, ..., so recomputation
is normal for the paged rules, and `PagedTrace.request_of` / `incarnations_of` map back.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from specaudit.contracts.violation import Violation
from specaudit.reference.oracle import OracleResult
from specaudit.running.record import Record

RESUMED = "~"  # `a~1`: request `a` after its first preemption (recomputed from position 0)
LEGACY_RESUMED = "#"  # how transformers-cb traces named incarnations before (`a#1`); still read
_INCARNATION = re.compile(r"^(?P<request>.+)[~#](?P<number>[0-9]+)$")


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

    def request_of(self, trace_id: str) -> str:
        """The caller's request a trace id incarnates (`a~2` -> `a`; `a#2`, the older naming, too).
        An id whose base is not in the trace is a request of its own (a caller may name one `x~1`)."""
        match = _INCARNATION.match(trace_id)
        return match["request"] if match and match["request"] in self.prompts else trace_id

    def resumed(self, trace_id: str) -> bool:
        """Whether the trace id is a request resumed after a preemption (not its first incarnation)."""
        return self.request_of(trace_id) != trace_id

    def incarnations_of(self, request: str) -> list[str]:
        """The request's trace ids in the order they ran: itself, then each resumption."""
        return [t for t in self.prompts if self.request_of(t) == request]

    def preemptions(self) -> int:
        """How many times requests were preempted and resumed (every incarnation after a first)."""
        return sum(1 for t in self.prompts if self.resumed(t))


class PagedRecorder:
    """What every paged engine's observer records by the caller's request ids, and the trace it
    hands the checks: vLLM's and transformers-cb's observers each add only their engine's hooks."""

    def __init__(self, num_speculative_tokens: int, kv_layers: tuple[int, ...]) -> None:
        self.k, self.kv_layers = num_speculative_tokens, kv_layers
        self.calls: list[PagedCall] = []
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.arrivals: dict[str, int] = {}
        self.left: dict[str, int] = {}
        self.aborted: set[str] = set()
        self.commits: list[dict[str, tuple[int, ...]]] = []
        self.preempted: dict[str, list[int]] = {}  # request -> the steps whose scheduling preempted it

    def trace(self) -> PagedTrace:
        """The run as the paged checks read it: preempted requests split into incarnations."""
        return incarnations(self.raw_trace(), self.preempted)

    def raw_trace(self) -> PagedTrace:
        """The run by the caller's request ids, preemptions not followed."""
        return PagedTrace(
            tuple(self.calls),
            dict(self.prompts),
            dict(self.arrivals),
            dict(self.left),
            frozenset(self.aborted),
            tuple(self.commits),
            self.k,
            self.kv_layers,
        )


Bases = dict[str, list[tuple[str, int, int]]]  # request -> (incarnation, first step, outputs before it)


def incarnations(trace: PagedTrace, preempted: dict[str, Sequence[int]]) -> PagedTrace:
    """The trace with each preempted request split where the engine preempted it: `a` leaves after
    the step before its preemption (its blocks are given back), and `a~k` arrives then, with a
    prompt of everything `a` had committed and the tokens committed after it as its outputs.
    `trace` is by the caller's ids (commits: each request's whole output); `preempted` maps a
    request to the steps whose scheduling preempted it. Preemption and recomputation are the
    engine's right; followed this way every paged rule holds across them (the checks need not know)."""
    starts = {r: sorted(set(steps)) for r, steps in preempted.items() if steps and r in trace.prompts}
    if not starts:
        return trace
    prompts, arrivals, left, bases = split_requests(trace, starts)
    aborted = frozenset(bases[r][-1][0] if r in bases else r for r in trace.aborted)
    commits = tuple(split_commits(after, u, bases) for u, after in enumerate(trace.commits, start=1))
    calls = tuple(replace(c, request_ids=tuple(named(r, c.step, bases) for r in c.request_ids)) for c in trace.calls)
    return replace(trace, calls=calls, prompts=prompts, arrivals=arrivals, left=left, aborted=aborted, commits=commits)


def split_requests(
    trace: PagedTrace, starts: dict[str, list[int]]
) -> tuple[dict[str, tuple[int, ...]], dict[str, int], dict[str, int], Bases]:
    """Each incarnation's prompt, arrival and departure, and where each request's split. The
    prompts keep arrival order (a request's index there is the one violations carry): the
    trace's requests, then the resumed ones by the step they arrived."""
    resumed, arrivals, left = {}, dict(trace.arrivals), dict(trace.left)
    bases: Bases = {}
    for r, prompt in trace.prompts.items():
        bases[r] = [(r, 1, 0)]
        for k, step in enumerate(starts.get(r, ()), start=1):
            before = trace.commits[step - 2].get(r, ()) if step >= 2 else ()
            name = f"{r}{RESUMED}{k}"
            left[bases[r][-1][0]] = step - 1
            resumed[name], arrivals[name] = prompt + before, step - 1
            bases[r].append((name, step, len(before)))
        last = bases[r][-1][0]
        if len(bases[r]) > 1 and r in trace.left:  # never before its own arrival (aborted, then requeued)
            left[last] = max(trace.left[r], arrivals[last])
    prompts = dict(trace.prompts) | dict(sorted(resumed.items(), key=lambda item: arrivals[item[0]]))
    return prompts, arrivals, left, bases


def named(request: str, step: int, bases: Bases) -> str:
    """The incarnation of `request` that runs in `step`."""
    return [name for name, first, _ in bases.get(request, [(request, 1, 0)]) if first <= step][-1]


def split_commits(after: dict[str, tuple[int, ...]], step: int, bases: Bases) -> dict[str, tuple[int, ...]]:
    """What each incarnation had committed after `step`: its share of the request's outputs."""
    out: dict[str, tuple[int, ...]] = {}
    for r, tokens in after.items():
        parts = bases.get(r, [(r, 1, 0)])
        for k, (name, first, base) in enumerate(parts):
            if first - 1 <= step:
                end = parts[k + 1][2] if k + 1 < len(parts) else len(tokens)
                out[name] = tokens[base:end]
    return out


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
