"""Driving the step API through a workload: requests added at their arrival steps, cancelled at
their cancel steps, stepped until none is unfinished; what each request emitted is the evidence
both the greedy audit (`audit`) and the sampling one (`sampling`) judge."""

from __future__ import annotations

from typing import Any

from specaudit.adapters.engine_blackbox import contract_violation
from specaudit.adapters.openvino.engine import OpenVinoEngine
from specaudit.adapters.openvino.workloads import Workload
from specaudit.contracts.violation import Violation

Drive = tuple[dict[int, list[int]], dict[int, int], dict[int, int], dict[int, int], Violation | None, int]


def drive(engine: OpenVinoEngine, workload: Workload, stops: dict[int, Any]) -> Drive:
    """Add each request at its arrival step, cancel at its cancel step, step until nothing is unfinished.
    Returns tokens, added step, finished step, tokens held when cancelled (per request), the engine's
    error and the steps."""
    tokens: dict[int, list[int]] = {i: [] for i in range(len(workload.prompts))}
    added: dict[int, int] = {}
    done: dict[int, int] = {}
    cancelled: dict[int, int] = {}
    last = max(workload.arrivals)
    budget = last + 8 + sum(workload.limits) + max((c or 0 for c in workload.cancels), default=0)
    step = 0
    try:
        for step in range(budget):
            for i, arrival in enumerate(workload.arrivals):
                if arrival == step:
                    stop = stops.get(i)
                    text, include = (None, False) if stop is None else (stop.text, stop.include)
                    engine.add_request(i, workload.prompts[i], workload.limits[i], workload.ks[i], text, include)
                    added[i] = step
                cancel = workload.cancels[i]
                if cancel is not None and i in added and added[i] + cancel == step and i not in done:
                    engine.abort(i)
                    cancelled[i] = len(tokens[i])
            for rid, new in engine.step().items():
                tokens[rid].extend(new)
            for i in added:
                if i not in done and engine.finished(i):
                    done[i] = step
            if step >= last and len(done) == len(workload.prompts) and not engine.has_unfinished():
                break
    except Exception as exc:  # the engine's failure is evidence
        said = " ".join(str(exc).split())
        error = contract_violation("step-returns", f"the pipeline raising {type(exc).__name__}: {said}"[:400], None)
        return tokens, added, done, cancelled, error, step + 1
    return tokens, added, done, cancelled, None, step + 1


def out_of_vocabulary(got: list[int], vocab: int, request: int) -> tuple[int, Violation] | None:
    """The first emitted id outside [0, vocab) (the engine's -1 among them) and its `token-ids`
    violation; None when every id is in the vocabulary."""
    bad = next((j for j, t in enumerate(got) if not 0 <= t < vocab), None)
    if bad is None:
        return None
    found = f"token id {got[bad]} at index {bad} of {got[: bad + 2]}, outside the vocabulary [0, {vocab})"
    expected = f"token ids in the target's vocabulary [0, {vocab})"
    return bad, Violation("contract", "token-ids", found, expected, request=request)
