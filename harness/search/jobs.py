"""Independent items of work in worker processes, with the results in input order.

`specaudit audit` runs dozens of independent searches (a decoder or an engine on one model),
each a pure function of its arguments and the seed; spread over the cores they take a
fraction of the serial time, and collecting the results by index keeps every output the same
whatever the number of workers. Workers are spawned, not forked (the parent has torch loaded,
and a forked OpenMP runtime can hang), and every item runs with one torch thread, in a worker
or in process: intra-op threads only contend on tiny models, and a thread count that changed
with the number of workers could change the float rounding and so the results.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from typing import TypeVar

from specaudit.contracts.errors import UsageError

T = TypeVar("T")
R = TypeVar("R")


JOBS_VARIABLE = "SPECAUDIT_JOBS"
"""Environment variable with the default number of workers (the harness's own tests set 1: their
pytest-xdist workers already take the cores)."""


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def default_jobs() -> int:
    """$SPECAUDIT_JOBS when set, else one worker per available core."""
    text = os.environ.get(JOBS_VARIABLE)
    if text is None:
        return available_cores()
    try:
        jobs = int(text)
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise UsageError(f"{JOBS_VARIABLE}={text!r} is not a number of workers; should be an integer >= 1")
    return jobs


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch with one intra-op thread inside the block, as in a worker."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _worker_init() -> None:
    import torch

    torch.set_num_threads(1)


def run_all(
    fn: Callable[[T], R],
    items: Sequence[T],
    jobs: int,
    on_done: Callable[[int, R], None],
    first: Callable[[T], float] | None = None,
) -> list[R]:
    """`fn` on every item, on up to `jobs` worker processes (in process when one is enough);
    `on_done(index, result)` runs in this process as each finishes. Items are started in
    descending `first` (longest first keeps the last worker from finishing alone), and the
    results come back in item order."""
    if jobs <= 1 or len(items) <= 1:
        with one_torch_thread():
            return [_done(i, fn(item), on_done) for i, item in enumerate(items)]
    order = sorted(range(len(items)), key=lambda i: -first(items[i])) if first else list(range(len(items)))
    results: dict[int, R] = {}
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(items)), mp_context=context, initializer=_worker_init)
    try:
        futures: dict[Future[R], int] = {pool.submit(fn, items[i]): i for i in order}
        for future in as_completed(futures):
            index = futures[future]
            results[index] = _done(index, future.result(), on_done)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # after an error: drop what has not started
    return [results[i] for i in range(len(items))]


def _done(index: int, result: R, on_done: Callable[[int, R], None]) -> R:
    on_done(index, result)
    return result
