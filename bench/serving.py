"""A small online-serving simulator: one arrival trace, EQSPEC static batches vs an EXSPEC pool.

The clock is simulated but every step costs its measured wall time: while the decoder works,
simulated time advances by exactly the (synchronized) wall time of the work; while it is idle,
time jumps to the next arrival. So latency = queueing + real compute, without sleeping.

- EQSPEC serves static batches: when idle, it takes up to B arrived requests (oldest first) and
  runs them to completion; a request that arrives meanwhile waits for the next batch. A row's
  latency ends at the round in which it finishes (rows leave the batch as they finish).
- EXSPEC keeps its pool: at every round boundary arrived requests enter its window (up to
  `window` sequences, prefilled in one call), then one round of `ExSpec.schedule` + `round`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specaudit.reference.eqspec import EqSpec
from specaudit.reference.exspec import ExSpec


def pad_prompts(
    prompts: Sequence[Sequence[int]], device: torch.device, pad: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts to their own longest one. Returns input_ids, attention_mask [B, T] on device."""
    width = max(len(p) for p in prompts)
    ids = [[pad] * (width - len(p)) + list(p) for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return (
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(mask, dtype=torch.long, device=device),
    )


def arrival_trace(n: int, mean_gap: float, seed: int) -> list[float]:
    """Poisson arrivals: n exponential gaps with mean `mean_gap`, first request at time 0."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(n):
        times.append(now)
        now += rng.expovariate(1.0 / mean_gap)
    return times


@dataclass
class ServeResult:
    finish: list[float]  # per request, simulated seconds
    arrival: list[float]
    tokens: int
    busy_s: float  # simulated time spent computing
    outputs: list[list[int]] = field(repr=False)

    @property
    def latencies(self) -> list[float]:
        return [f - a for f, a in zip(self.finish, self.arrival)]


def make_clock(sync: Callable[[], None]) -> Callable[[], float]:
    def clock() -> float:
        sync()
        return time.perf_counter()

    return clock


class FinishRecorder(EqSpec):
    """EQSPEC that notes the wall time at which each row first counts as finished."""

    clock: Callable[[], float] = staticmethod(time.perf_counter)

    finished_at: dict[int, float]

    def commit(  # an instance method here; EqSpec.generate calls it as self.commit
        self,
        out: list[list[int]],
        rows: torch.Tensor,
        new_tokens: list[list[int]],
        max_new_tokens: int,
        eos_token_id: int | None,
    ) -> torch.Tensor:
        finished = EqSpec.commit(out, rows, new_tokens, max_new_tokens, eos_token_id)
        now = None
        for row, done in zip(rows.tolist(), finished.tolist()):
            if done and row not in self.finished_at:
                now = self.clock() if now is None else now
                self.finished_at[row] = now
        return finished


def serve_eqspec(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    arrival: Sequence[float],
    *,
    batch_size: int,
    k: int,
    max_new_tokens: int,
    device: torch.device,
    sync: Callable[[], None],
    eos_token_id: int | None = None,
) -> ServeResult:
    """Static batches of up to `batch_size` arrived requests, each run to completion by EQSPEC."""
    clock = make_clock(sync)
    decoder = FinishRecorder()
    decoder.clock = clock
    n = len(prompts)
    finish = [0.0] * n
    outputs: list[list[int]] = [[] for _ in range(n)]
    now, busy, next_req, queue = 0.0, 0.0, 0, []
    while next_req < n or queue:
        while next_req < n and arrival[next_req] <= now:
            queue.append(next_req)
            next_req += 1
        if not queue:
            now = arrival[next_req]
            continue
        batch, queue = queue[:batch_size], queue[batch_size:]
        ids, mask = pad_prompts([prompts[i] for i in batch], device)
        decoder.finished_at = {}
        start = clock()
        out = decoder.generate(
            target,
            draft,
            ids,
            mask,
            num_draft_tokens=k,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=0,
        )
        elapsed = clock() - start
        for row, req in enumerate(batch):
            finish[req] = now + decoder.finished_at[row] - start
            outputs[req] = out[row]
        now += elapsed
        busy += elapsed
    return ServeResult(finish, list(arrival), sum(map(len, outputs)), busy, outputs)


class ExSpecServer(ExSpec):
    """EXSPEC with an arrival trace: the reference `generate` loop, admitting only arrived requests."""

    def serve(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        prompts: Sequence[Sequence[int]],
        arrival: Sequence[float],
        *,
        k: int,
        max_new_tokens: int,
        device: torch.device,
        sync: Callable[[], None],
        eos_token_id: int | None = None,
    ) -> ServeResult:
        clock = make_clock(sync)
        n = len(prompts)
        finish = [0.0] * n
        out: list[list[int]] = [[] for _ in range(n)]
        now, busy, next_req, waiting, active = 0.0, 0.0, 0, [], []
        while next_req < n or waiting or active:
            while next_req < n and arrival[next_req] <= now:
                waiting.append(next_req)
                next_req += 1
            if not waiting and not active:
                now = arrival[next_req]
                continue
            start = clock()
            room = self.window - len(active)
            admitted, waiting = waiting[:room], waiting[room:]
            done_rows: list[int] = []
            if admitted:
                ids, mask = pad_prompts([prompts[i] for i in admitted], device)
                fresh = self.prefill_rows(target, draft, ids, mask, admitted)
                done = self.commit(
                    out, torch.tensor(admitted), [[s.pending] for s in fresh], max_new_tokens, eos_token_id
                )
                active += [s for s, d in zip(fresh, done.tolist()) if not d]
                done_rows += [s.row for s, d in zip(fresh, done.tolist()) if d]
            if active:
                batch = self.schedule(active)
                finished = self.round(target, draft, batch, k, out, max_new_tokens, eos_token_id)
                for s in active:
                    s.waited = 0 if s in batch else s.waited + 1
                active = [s for s in active if s.row not in finished]
                done_rows += sorted(finished)
            elapsed = clock() - start
            now += elapsed
            busy += elapsed
            for row in done_rows:
                finish[row] = now
        return ServeResult(finish, list(arrival), sum(map(len, out)), busy, out)
