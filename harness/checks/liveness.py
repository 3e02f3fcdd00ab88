"""Liveness over a ledger: one rule set for a decoder's requests and an engine's.

A subject's evidence becomes a `WaitLedger`: per request, the ticks it was served in and the ticks
that count as waiting for it (a decoder's target calls, an engine's steps). Each subject says
what counts (`specaudit.checks.scheduling.decoder_ledger`, the engine judge's ledger); the rules
are this module's:

  bounded-queue     more waiting ticks than the declared bound before a request is first served
  bounded-wait      more waiting ticks than the bound between two of its services
  request-finishes  every request finishes (EOS or max_new_tokens)
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

from specaudit.contracts.subjects import EVIDENCE_DECODER
from specaudit.contracts.violation import Violation
from specaudit.running.record import Record


@dataclass
class Tenure:
    """One request in the ledger."""

    request: int
    max_new_tokens: int
    row: int | None = None  # a decoder's request is its case row
    served: list[int] = field(default_factory=list)  # ticks it took part in, ascending
    waiting: set[int] = field(default_factory=set)  # ticks that count as waiting for it
    tokens: int = 0  # tokens so far
    finished: bool = False  # EOS or max_new_tokens (or aborted)


@dataclass
class WaitLedger:
    """Every request's tenure, counted in `unit` against the subject's declared `bound`."""

    unit: str  # "target calls" (a decoder) or "steps" (an engine)
    bound: int | None  # the declared wait bound (None: none declared, only finishing is judged)
    bound_name: str  # what declares it: "max_wait_calls", "max_wait_steps"
    tenures: dict[int, Tenure] = field(default_factory=dict)

    def tenure(self, request: int, max_new_tokens: int, row: int | None = None) -> Tenure:
        return self.tenures.setdefault(request, Tenure(request, max_new_tokens, row))

    @property
    def at_calls(self) -> bool:
        """Ticks are target calls, so a violation names the call it was seen at."""
        return self.unit == "target calls"


def settle(ledger: WaitLedger, record: Record) -> WaitLedger:
    """Each request's tokens so far and whether it is done (finished or aborted), from the
    subject's record (`running.record`): what `unfinished` judges, alike for every subject."""
    for r, entry in record.entries.items():
        tenure = ledger.tenure(r, entry.max_new_tokens, row=r if record.kind == EVIDENCE_DECODER else None)
        tenure.tokens = len(entry.tokens)
        tenure.finished = entry.aborted or entry.finished(record.eos_token_id)
    return ledger


@dataclass(frozen=True)
class Wait:
    """A stretch of ticks without the request: after `since` (None: from its arrival) until
    `until` (None: not served again so far), `counted` of them waiting."""

    request: int
    since: int | None
    until: int | None
    counted: int


def waits(tenure: Tenure) -> Iterator[Wait]:
    """The tenure's stretches between services, the open one after the last included."""
    waiting = sorted(tenure.waiting)
    previous: int | None = None
    for tick in [*tenure.served, None]:  # the waiting ticks strictly between two services, by bisection
        lo = 0 if previous is None else bisect.bisect_right(waiting, previous)
        hi = len(waiting) if tick is None else bisect.bisect_left(waiting, tick)
        yield Wait(tenure.request, previous, tick, max(0, hi - lo))
        previous = tick


def overdue(ledger: WaitLedger) -> list[Violation]:
    """'bounded-queue' and 'bounded-wait': the stretches with more waiting ticks than the bound."""
    if ledger.bound is None:
        return []
    return [
        wait_violation(ledger, w)
        for tenure in ledger.tenures.values()
        for w in waits(tenure)
        if w.counted > ledger.bound
    ]


def wait_violation(ledger: WaitLedger, wait: Wait) -> Violation:
    tick = ledger.unit.removesuffix("s")
    r, first = wait.request, wait.since is None
    found = f"{wait.counted} {ledger.unit} with room without request {r}"
    found += " before it first took part" if first else f" since {tick} {wait.since}"
    found += f" (until {tick} {wait.until})" if wait.until is not None else " (so far)"
    return Violation(
        "liveness",
        "bounded-queue" if first else "bounded-wait",
        found,
        f"at most {ledger.bound} (the declared {ledger.bound_name}), counted from the request's arrival",
        call=wait.until if ledger.at_calls else None,
        request=r,
        evidence={"wait": wait.counted, "since": wait.since, "until": wait.until, "bound": ledger.bound},
    )


def unfinished(ledger: WaitLedger) -> list[Violation]:
    """'request-finishes': every request ends with EOS or its `max_new_tokens` tokens."""
    return [
        Violation(
            "liveness",
            "request-finishes",
            f"request {t.request} unfinished: {t.tokens} tokens without EOS",
            f"EOS or {t.max_new_tokens} tokens",
            row=t.row,
            request=t.request,
            evidence={"tokens": t.tokens, "max_new_tokens": t.max_new_tokens},
        )
        for t in sorted(ledger.tenures.values(), key=lambda t: t.request)
        if not t.finished
    ]
