"""A plan's cells as Ray tasks: `specaudit audit --ray`, `specaudit gate --ray` (`pip install specaudit[ray]`).

A drop-in for `specaudit.search.jobs.run_all`: every item is one Ray task, one GPU each where the
cluster has GPUs (the audit's models then go where torch finds the device), one CPU otherwise;
the results come back in item order, so the tables, report.json, the JUnit and the reproducers
are the ones a run on worker processes writes (each item is a pure function of its arguments and
the seed). Without a running cluster (`RAY_ADDRESS` unset) a local Ray is started for the run and
stopped after it. Ray pickles the function by reference, so the workers import specaudit as the
driver does; the driver's working directory is put on their path, as the CLI puts it on its own
(`--decoder mypkg.mod:X` from the user's checkout).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from specaudit.contracts.errors import UsageError

T = TypeVar("T")
R = TypeVar("R")

INSTALL_HINT = "--ray needs Ray: pip install 'specaudit[ray]' (or pip install ray)"


def import_ray() -> Any:
    """The `ray` module, or a usage error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UsageError(INSTALL_HINT) from None
    return ray


def one_item(fn: Callable[[T], R], item: T) -> R:
    """What each task runs: `fn(item)` with one torch thread, as a worker process does (the
    float rounding must not depend on how the items were spread)."""
    from specaudit.search.jobs import one_torch_thread

    with one_torch_thread():
        return fn(item)


def start(ray: Any) -> bool:
    """Connect to the cluster in $RAY_ADDRESS, else start a local Ray; True when started here."""
    if ray.is_initialized():
        return False
    path = os.pathsep.join([os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])
    ray.init(
        address=os.environ.get("RAY_ADDRESS"),
        runtime_env={"env_vars": {"PYTHONPATH": path}},
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
        configure_logging=False,
    )
    return True


def task_resources(ray: Any) -> dict[str, float]:
    """One GPU per task where the cluster has GPUs, else one CPU."""
    gpus = ray.cluster_resources().get("GPU", 0)
    return {"num_gpus": 1, "num_cpus": 1} if gpus >= 1 else {"num_gpus": 0, "num_cpus": 1}


def run_all_ray(
    fn: Callable[[T], R],
    items: Sequence[T],
    on_done: Callable[[int, R], None],
    first: Callable[[T], float] | None = None,
) -> list[R]:
    """`fn` on every item as a Ray task; `on_done(index, result)` here as each finishes; the
    results in item order. Items are submitted in descending `first`, as `run_all` starts them."""
    if not items:
        return []
    ray = import_ray()
    started = start(ray)
    try:
        task = ray.remote(**task_resources(ray))(one_item)
        order = sorted(range(len(items)), key=lambda i: -first(items[i])) if first else list(range(len(items)))
        pending = {task.remote(fn, items[i]): i for i in order}
        results: dict[int, R] = {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            index = pending.pop(done[0])
            results[index] = ray.get(done[0])
            on_done(index, results[index])
        return [results[i] for i in range(len(items))]
    finally:
        if started:
            ray.shutdown()


__all__ = ["run_all_ray"]
