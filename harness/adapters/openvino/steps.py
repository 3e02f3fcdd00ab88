"""A workload through the step API: requests added at their arrival steps, cancelled at their cancel
steps, stepped until none is unfinished; what each request emitted is the evidence both the greedy
audit (`audit`) and the sampling one (`sampling`) judge."""

from __future__ import annotations

from typing import Any

from specaudit.adapters.engine_blackbox import Request
from specaudit.adapters.openvino.engine import OpenVinoEngine
from specaudit.adapters.openvino.workloads import Workload
from specaudit.adapters.transports import StepRun, run_steps
from specaudit.contracts.violation import Violation

STEP_SECONDS = 300.0
"""The most one pipeline call may take before it counts as a hang (a compile on first use included)."""


def requests_of(workload: Workload, stops: dict[int, Any]) -> list[Request]:
    """The workload as the step loop's requests: each with its K, cancel step and stop string."""
    return [
        Request(i, prompt, limit, float(arrival), stop.text if stop else None, bool(stop and stop.include), k, cancel)
        for i, (prompt, limit, k, arrival, cancel) in enumerate(
            zip(workload.prompts, workload.limits, workload.ks, workload.arrivals, workload.cancels)
        )
        for stop in [stops.get(i)]
    ]


def drive(engine: OpenVinoEngine, workload: Workload, stops: dict[int, Any]) -> StepRun:
    """The workload through the step loop every step-wise engine shares (`transports.run_steps`), the
    pipeline's every call held to the engine contract."""
    return run_steps(engine, requests_of(workload, stops), engine.eos, STEP_SECONDS)


def out_of_vocabulary(got: list[int], vocab: int, request: int) -> tuple[int, Violation] | None:
    """The first emitted id outside [0, vocab) (the engine's -1 among them) and its `token-ids`
    violation; None when every id is in the vocabulary."""
    bad = next((j for j, t in enumerate(got) if not 0 <= t < vocab), None)
    if bad is None:
        return None
    found = f"token id {got[bad]} at index {bad} of {got[: bad + 2]}, outside the vocabulary [0, {vocab})"
    expected = f"token ids in the target's vocabulary [0, {vocab})"
    return bad, Violation("contract", "token-ids", found, expected, request=request)
