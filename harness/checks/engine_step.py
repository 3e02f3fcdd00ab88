"""An engine step as evidence: what the registry's ENGINE implementations read.

`checks.engine.EngineJudge` makes one `EngineStep` after every step of a session and hands it to
`registry.evaluate(ENGINE, step)`. The judge keeps what spans steps (the row follower, the wait
ledger), so each implementation here asks it for its part of the step's judgement:

  contract     the session's own guard (its breaches; a step that broke the contract never
               reaches the judge, so there are none here)
  I1           every target forward of the step is one rectangular batch (`checks.i1`); idle
               rows that attend nothing are allowed (`IDLE_ROW_RULES`)
  I2           the judge's row follower on the step's forwards
  equivalence  each request's tokens so far against its oracle
  liveness     the declared wait bound over the judge's ledger
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from specaudit.checks.i1 import i1_call_violations
from specaudit.contracts.violation import Violation
from specaudit.running.instrument import CallRecord

IDLE_ROW_RULES = frozenset({"row-attends-nothing"})
"""I1 rules an engine may break on purpose: a fixed-size engine runs idle rows (empty slots,
CUDA-graph batches) that attend nothing, or only the pad token (`RowFollower.idle_rows`). Such a
row is bound to no request; an engine that used its output would emit a wrong token
(equivalence) or starve its request (liveness)."""


class StepReader(Protocol):
    """The judge's memory across steps, read by the implementations (`checks.engine.EngineJudge`)."""

    def i2(self, calls: list[CallRecord], eligible: set[int], committed: dict[int, int]) -> list[Violation]: ...

    def equivalence(self) -> list[Violation]: ...

    def liveness(self, eligible: set[int], emitted: dict[int, list[int]], crowded: bool) -> list[Violation]: ...


@dataclass(frozen=True)
class EngineStep:
    """One step of an engine session: its target forwards, which requests were live (eligible)
    and how many tokens each had committed before it, whether more requests were unfinished than
    the declared batch size (crowded), and what each request emitted."""

    reader: StepReader
    calls: tuple[CallRecord, ...]
    eligible: frozenset[int]
    committed: dict[int, int]
    crowded: bool
    emitted: dict[int, list[int]]
    breaches: tuple[Violation, ...] = field(default=())  # the session's contract breaches in this step


def step_contract(step: EngineStep) -> list[Violation]:
    return list(step.breaches)


def step_i1(step: EngineStep) -> list[Violation]:
    return [v for call in step.calls for v in i1_call_violations(call) if v.rule not in IDLE_ROW_RULES]


def step_i2(step: EngineStep) -> list[Violation]:
    return step.reader.i2(list(step.calls), set(step.eligible), step.committed)


def step_equivalence(step: EngineStep) -> list[Violation]:
    return step.reader.equivalence()


def step_liveness(step: EngineStep) -> list[Violation]:
    return step.reader.liveness(set(step.eligible), step.emitted, step.crowded)
