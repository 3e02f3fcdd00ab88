"""What a transformers CB run exercised: the coverage every report entry carries, and preemptions.

A passing verdict says little unless the run reached what paged engines get wrong (page
boundaries, arrivals, aborts, EOS stops, preemption); these figures say whether it did.
"""

from __future__ import annotations

from specaudit.adapters.transformers_cb.verdict import CbVerdict
from specaudit.checks.coverage import Coverage
from specaudit.running.paged import PagedTrace


def preemptions(trace: PagedTrace) -> int:
    """Requests transformers preempted and recomputed (each later incarnation)."""
    return trace.preemptions()


def coverage(verdict: CbVerdict) -> Coverage:
    """What the run exercised: requests, forwards, outputs, EOS stops, arrivals, aborts, preemptions."""
    run, trace = verdict.run, verdict.run.trace
    requests = run.workload.requests
    outputs = [len(a or ()) for a in run.answers.values()]
    eos = run.workload.eos_token_id
    return Coverage(
        level="calls",
        runs=1,
        requests=len(requests),
        batch_sizes=tuple(sorted({len(c.request_ids) for c in trace.calls})),
        k_values=(0,),
        target_calls=len(trace.calls),
        rounds=sum(1 for c in trace.calls if any(c.past(r) > 0 for r in range(len(c.request_ids)))),
        longest_sequence=max((len(r.prompt) + len(run.answers.get(r.id) or ()) for r in requests), default=0),
        longest_output=max(outputs, default=0),
        highest_position=max((int(c.positions.max()) for c in trace.calls if c.positions.numel()), default=-1),
        eos_stops=sum(1 for a in run.answers.values() if a and eos is not None and a[-1] == eos),
        arrivals=sum(1 for r in requests if r.arrival > 0),
        in_flight=max((len(c.request_ids) for c in trace.calls), default=0),
        aborts=len({trace.request_of(t) for t in trace.aborted}),
        duplicate_prompts=len(requests) - len({r.prompt for r in requests}),
    )
