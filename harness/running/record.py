"""The one shape of a subject's evidence: the target calls observed, and a ledger of requests.

A batch decoder's run (`running.runner.Run`, real-model batches included), an engine session's
steps (`running.engine_session.EngineSession`) and a black box's answers
(`adapters.engine_blackbox.judge_answers`) each keep a `Record`: every target forward the
instrumentation saw (none for a black box, whose models the harness cannot hook) and, per request,
what was asked, the batch-size-1 oracle's answer, the tokens so far, and when the subject took it
and let it go. The checks every subject shares read it whatever made it: equivalence
(`checks.equivalence.compare_request`) and the finishing rule (`checks.liveness.settle`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specaudit.contracts.engine import reached_end
from specaudit.contracts.subjects import EVIDENCE
from specaudit.reference.oracle import OracleResult
from specaudit.running.instrument import CallRecord


@dataclass
class Entry:
    """One request in the ledger."""

    request: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    oracle: OracleResult  # the batch-size-1 greedy output, EOS and limit applied, with its margins
    tokens: list[int] = field(default_factory=list)  # what the subject gave so far
    admitted: float | None = None  # when the subject took it, in the record's unit (None: never)
    retired: float | None = None  # when it finished or was aborted (None: still live, or never answered)
    aborted: bool = False

    def finished(self, eos: int | None) -> bool:
        """EOS or `max_new_tokens` reached (an aborted request is retired, not finished)."""
        return reached_end(self.tokens, self.max_new_tokens, eos)


@dataclass
class Record:
    """A subject's evidence, judged by the same checks whatever made it."""

    subject: str  # the decoder or engine spec, or a black box's label
    kind: str  # the evidence it is: a name of `contracts.subjects.EVIDENCE` ("decoder", "paged engine", ...)
    unit: str  # what `admitted` and `retired` count: "target calls", "steps", "seconds", "calls"
    eos_token_id: int | None
    calls: list[CallRecord] = field(default_factory=list)  # every observed target forward, in order
    entries: dict[int, Entry] = field(default_factory=dict)  # request id -> its entry, in arrival order

    def __post_init__(self) -> None:
        if self.kind not in EVIDENCE:
            raise ValueError(f"a record of {self.kind!r}: the evidence kinds are {', '.join(EVIDENCE)}")

    def admit(self, entry: Entry) -> None:
        self.entries[entry.request] = entry
