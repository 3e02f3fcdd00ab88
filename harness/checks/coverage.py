"""Coverage: what a verdict exercised, read from the evidence the checks already read.

A pass says only that nothing broke on the cases run. What those cases put the subject through
is measured here, from the same evidence (the run's `Record` and the rows bound by
`checks.rows`), never by running anything: a `Coverage` per run, merged over a verdict's runs.

Rounds are counted per target call, as everywhere in the checks. For each request, its rows'
views are grouped into rounds (a starting call plus the chunks that continue it); with c
tokens committed before a round (prompt included), the round's attended stream holds the
committed tokens and then the drafts, so the drafts it accepted are

    accepted = common_prefix(stream, prompt + output) - c        (never below 0)

and it commits up to c' = min(len(prompt + output), common_prefix + 1) (the bonus). A call
after the prefill in which some request starts a round is a *round*; a round in which the rows
accepted different counts is a *ragged round*: the batch turned ragged, the case that
realignment (EQSPEC) or regrouping (EXSPEC) exists for. A pass that exercised none is flagged.

The ledger (`running.record.Entry`: when each request was taken and let go) gives the rest, for
every subject alike: arrivals while another request was in flight, requests in flight together,
aborts, prompts an in-flight request already had, EOS stops; the bound rows give the rows an
arriving request took after their previous request left (an engine's reused rows). A black box
(no forward observed) has the ledger only: its coverage is at the output level.

Coverage is never a verdict: it does not fail. `Coverage.merge` (and `merged`, `coverage_of_runs`)
aggregates over runs, for a verdict over its cases or a suite over its examples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch

from specaudit.checks.i1 import implied_positions
from specaudit.checks.preservation import accepted_drafts, draft_proposals, rounds
from specaudit.checks.rows import RowView, common_prefix, follow_rows
from specaudit.fixtures.transparent import fit_mask
from specaudit.running.instrument import CallRecord
from specaudit.running.record import Entry, Record
from specaudit.running.runner import Run

if TYPE_CHECKING:  # coverage reads a session; running one is the caller's
    from specaudit.checks.engine import EngineJudge
    from specaudit.running.engine_session import EngineSession

CALLS, OUTPUTS = "calls", "outputs"
"""Levels of evidence: every target forward observed (decoders, engines, real-model batches), or
the answers only (black boxes, vLLM servers)."""

CALL_FIELDS = frozenset(
    "batch_sizes k_values target_calls rounds ragged_rounds finished_early highest_position pad_prompts"
    " reused_rows".split()
)
"""What only observed forwards (and a known pad id) can say: left out of an output-level coverage."""

Grouping = Callable[[list[RowView]], list[list[RowView]]] | None
"""A request's views -> its rounds (None: a starting call and its chunks, `grouped`)."""
Drafts = Callable[[int, tuple[int, ...], int, int], int] | None
"""(request, a round's stream, committed c, entries past c matching the output) -> the drafts it
accepted (None: every matching entry is taken for one)."""

NO_RAGGED_ROUND = "no ragged round"
NO_ROUND = "no round after the prefill"
NO_CALL = "no target call observed"
NOTHING_IN_FLIGHT = "no two requests in flight together"
NOT_MEASURED = "coverage not measured"


@dataclass(frozen=True)
class Coverage:
    """What one run, or a verdict's runs merged, exercised. Counts add up over runs; sets unite;
    extremes take the larger. Empty (`runs` 0) until a run is folded in."""

    level: str = CALLS  # CALLS or OUTPUTS (see above); "none" when nothing was measured
    runs: int = 0  # runs (cases, engine sessions, batches) folded in
    requests: int = 0  # rows of a decoder's cases, requests of an engine or black box
    batch_sizes: tuple[int, ...] = ()  # distinct rows per target call, ascending
    k_values: tuple[int, ...] = ()  # distinct num_draft_tokens, ascending
    target_calls: int = 0
    rounds: int = 0  # target calls after the prefill in which some request starts a round
    ragged_rounds: int = 0  # rounds in which the rows accepted different numbers of drafts
    finished_early: int = 0  # requests finished while others went on to later rounds
    longest_sequence: int = 0  # prompt + output, the longest over the requests
    longest_output: int = 0
    highest_position: int = -1  # highest position id of an attended input of a target call (-1: none)
    pad_prompts: int = 0  # prompts holding the pad id as a real token
    eos_stops: int = 0  # requests that ended at EOS
    arrivals: int = 0  # requests that arrived while another was in flight (engines, black boxes)
    in_flight: int = 0  # the most requests in flight together
    aborts: int = 0
    duplicate_prompts: int = 0  # requests whose prompt an in-flight request (a row of the same case) had
    reused_rows: int = 0  # a row given to an arriving request after its previous request left (engines)

    def merge(self, other: Coverage) -> Coverage:
        """Both together (a verdict over its runs; F's suite exploration over a list of runs)."""
        if not other.runs:
            return self
        if not self.runs:
            return other
        out: dict[str, Any] = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "level":
                out[f.name] = a if a == b else OUTPUTS  # the lesser evidence is what the merge can say
            elif isinstance(a, tuple):
                out[f.name] = tuple(sorted(set(a) | set(b)))
            elif f.name in EXTREMES:
                out[f.name] = max(a, b)
            else:
                out[f.name] = a + b
        return Coverage(**out)

    @property
    def flags(self) -> list[str]:
        """What a pass with this coverage did not exercise (empty: nothing to flag)."""
        if self.level == "none":
            return [NOT_MEASURED]
        if not self.runs:
            return []
        if self.level == OUTPUTS:
            return [NOTHING_IN_FLIGHT] if self.in_flight < 2 else []
        if not self.target_calls:  # every forward unseen: the per-call checks judged nothing
            return [NO_CALL]
        if self.drafts_none:  # nothing drafted, nothing to accept unevenly: rows in flight together are its ragged case
            return ([] if self.rounds else [NO_ROUND]) + ([NOTHING_IN_FLIGHT] if self.in_flight < 2 else [])
        if not self.rounds:
            return [NO_ROUND, NO_RAGGED_ROUND]
        return [NO_RAGGED_ROUND] if not self.ragged_rounds else []

    @property
    def drafts_none(self) -> bool:
        """An engine run without speculation (K 0 only: transformers' continuous batching)."""
        return self.k_values == (0,)

    def to_json(self) -> dict[str, Any]:
        """Every figure of the level, then the flags (report.json's `coverage` object)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if self.level == OUTPUTS and f.name in CALL_FIELDS:
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        if "highest_position" in out:
            out["highest_position"] = None if self.highest_position < 0 else self.highest_position
        return {**out, "flags": self.flags}

    def summary(self) -> str:
        """The table's short text, e.g. "ragged 12/40 rounds, B<=4, K 1-3, pos<=71, eos 2"."""
        if self.level == "none":
            return NOT_MEASURED
        if not self.runs:
            return "-"
        parts = []
        if self.level == CALLS and not self.target_calls:
            parts.append(NO_CALL)  # not "B<=0, pos<=-1": nothing was seen to bound
        elif self.level == CALLS:
            rounds = (
                f"{self.rounds} rounds, in flight<={self.in_flight}"
                if self.drafts_none
                else (f"ragged {self.ragged_rounds}/{self.rounds} rounds")
            )
            parts += [rounds] + ([f"B<={max(self.batch_sizes)}"] if self.batch_sizes else [])
            parts.append(f"K {span(self.k_values)}")
            parts += [f"pos<={self.highest_position}"] if self.highest_position >= 0 else []
            if self.finished_early:
                parts.append(f"early {self.finished_early}")
            if self.pad_prompts:
                parts.append(f"pad-prompts {self.pad_prompts}")
        else:
            parts += [f"in flight<={self.in_flight}", f"out<={self.longest_output}"]
        if self.arrivals:
            parts.append(f"arrivals {self.arrivals}")
        for name, count in (("aborts", self.aborts), ("dup", self.duplicate_prompts), ("reused", self.reused_rows)):
            if count:
                parts.append(f"{name} {count}")
        parts.append(f"eos {self.eos_stops}")
        return ", ".join(parts)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Coverage:
        """A coverage read back from report.json (flags are derived, not stored)."""
        names = {f.name for f in fields(cls)}
        kept = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names}
        if kept.get("highest_position") is None:
            kept["highest_position"] = -1
        return cls(**kept)


EXTREMES = frozenset({"longest_sequence", "longest_output", "highest_position", "in_flight"})
"""Figures merged by taking the larger; every other number adds up."""

UNMEASURED = Coverage(level="none")
"""An entry whose subject measured no coverage: it says so (`NOT_MEASURED`) instead of zeros."""


def span(values: Sequence[int]) -> str:
    """A set of ints in short: "2", "1,4,5", a range "1-8" past four values, "-" when empty."""
    if not values:
        return "-"
    return ",".join(map(str, values)) if len(values) <= 4 else f"{min(values)}-{max(values)}"


def merged(coverages: Sequence[Coverage]) -> Coverage:
    """The coverage of a list of runs together."""
    out = Coverage()
    for c in coverages:
        out = out.merge(c)
    return out


# ---------------------------------------------------------------------------------------
# Subjects


def coverage_of_run(run: Run) -> Coverage:
    """A decoder run's coverage (a real-model batch's too). A run that broke the contract has no
    rows to follow: its calls, case and limits are still counted, its rounds are not. Rounds are
    token preservation's: a target decoding on from its own tokens (`generate` verifying) stays
    in its round, and where the draft's proposals were observed only they count as drafts."""
    views = list(follow_rows(run).views) if run.outputs is not None else []
    case = run.case
    proposals = draft_proposals(run, [e.prompt + tuple(e.tokens) for e in run.record.entries.values()])
    drafts = (
        (lambda request, stream, c, matching: accepted_drafts(proposals, request, stream, c, matching))
        if proposals.observed
        else None
    )
    return coverage_of_record(
        run.record, views, case.num_draft_tokens, case.pad_token_id, group=partial(rounds, run), drafts=drafts
    )


def coverage_of_runs(runs: Iterable[Run]) -> Coverage:
    """Decoder runs together (the suite's runs of one decoder and model, a verdict's cases)."""
    return merged([coverage_of_run(run) for run in runs])


def coverage_of_session(session: EngineSession) -> Coverage:
    """An engine session's coverage, read from its record and the rows its judge bound (each
    view's request as the engine's id)."""
    judge = cast("EngineJudge", session.verdict)  # the judge every session is built with (`engine_replay`)
    views = [replace(v, request=judge.ids[v.request]) for v in judge.rows.views]
    return coverage_of_record(session.record, views, session.num_draft_tokens, session.pad_token_id)


def coverage_of_answers(record: Record) -> Coverage:
    """A black box's coverage: its record holds no call, only each request's answer and span."""
    return coverage_of_record(record, [], None, None, level=OUTPUTS)


def coverage_of_record(
    record: Record,
    views: Sequence[RowView],
    k: int | None,
    pad: int | None,
    level: str = CALLS,
    group: Grouping = None,
    drafts: Drafts = None,
) -> Coverage:
    """Any subject's coverage from its record and the views of its bound rows (requests keyed as
    the record's entries are). `group` splits a request's views into rounds (default: a starting
    call and its chunks); `drafts` counts a round's accepted drafts among the entries matching
    the output (default: all of them)."""
    entries = list(record.entries.values())
    finals = {e.request: e.prompt + tuple(e.tokens) for e in entries}
    walk = RoundWalk.of(views, {e.request: len(e.prompt) for e in entries}, finals, group or grouped, drafts)
    eos = record.eos_token_id
    return Coverage(
        level=level,
        runs=1,
        requests=len(entries),
        batch_sizes=tuple(sorted({int(c.input_ids.shape[0]) for c in record.calls if well_formed(c)})),
        k_values=() if k is None else (k,),
        target_calls=len(record.calls),
        rounds=len(walk.accepted),
        ragged_rounds=sum(len(set(counts)) > 1 for counts in walk.accepted.values()),
        finished_early=walk.finished_early({e.request for e in entries if e.aborted}),
        longest_sequence=max((len(s) for s in finals.values()), default=0),
        longest_output=max((len(e.tokens) for e in entries), default=0),
        highest_position=max((highest_position(c) for c in record.calls), default=-1),
        pad_prompts=0 if pad is None else sum(pad in e.prompt for e in entries),
        eos_stops=sum(eos is not None and bool(e.tokens) and e.tokens[-1] == eos and not e.aborted for e in entries),
        arrivals=sum(bool(in_flight_at(entries, e)) for e in entries),
        in_flight=peak_in_flight(entries),
        aborts=sum(e.aborted for e in entries),
        duplicate_prompts=sum(any(q.prompt == e.prompt for q in in_flight_at(entries, e, True)) for e in entries),
        reused_rows=walk.reused_rows(views, {e.request: e.retired for e in entries}),
    )


# ---------------------------------------------------------------------------------------
# Rounds, from the bound rows


@dataclass
class RoundWalk:
    """Each request's rounds walked in call order: the drafts each accepted, per starting call,
    and the call after which each request's output was complete."""

    accepted: dict[int, list[int]]  # round's starting call -> drafts accepted by each request starting one there
    last_round: dict[int, int]  # request -> the starting call of its last round
    done_at: dict[int, int]  # request -> the call after which its output was complete

    @classmethod
    def of(
        cls,
        views: Sequence[RowView],
        prompts: dict[int, int],
        finals: dict[int, tuple[int, ...]],
        group: Callable[[list[RowView]], list[list[RowView]]],
        drafts: Drafts = None,
    ) -> RoundWalk:
        walk = cls({}, {}, {})
        per_request: dict[int, list[RowView]] = {}
        for view in views:
            per_request.setdefault(view.request, []).append(view)
        for request, seen in per_request.items():
            if request in finals:
                walk.follow(request, group(seen), prompts[request], finals[request], drafts)
        walk.accepted = dict(sorted(walk.accepted.items()))
        return walk

    def follow(
        self, request: int, rounds_: list[list[RowView]], prompt: int, final: tuple[int, ...], drafts: Drafts
    ) -> None:
        """One request's rounds: committed `c` from its prompt on (see the module docstring)."""
        c = prompt
        for number, round_ in enumerate(rounds_):
            if c >= len(final):
                break  # complete: later calls that still hold the row change nothing
            start, last = round_[0], round_[-1]
            prefix = common_prefix(last.stream, final)
            accepted = max(0, prefix - c)
            if drafts is not None and prefix > c:
                accepted = drafts(request, last.stream, c, prefix - c)
            if number or len(last.stream) > c:  # a request's first call is its prefill unless it verifies drafts
                self.accepted.setdefault(start.call, []).append(accepted)
                self.last_round[request] = start.call
            c = max(c, min(len(final), c + accepted + 1 if drafts is not None else prefix + 1))
            if c >= len(final):
                self.done_at[request] = last.call

    def finished_early(self, aborted: set[int]) -> int:
        """Requests complete (not aborted) while another request started a round at a later call."""
        return sum(
            any(q != r and later > done for q, later in self.last_round.items())
            for r, done in self.done_at.items()
            if r not in aborted
        )

    def reused_rows(self, views: Sequence[RowView], retired: dict[int, float | None]) -> int:
        """Rows that an arriving request took (its first view) after the row's previous request
        was complete or had left the subject (finished, aborted)."""
        holder: dict[int, int] = {}  # row -> its last request
        seen: set[int] = set()
        count = 0
        for view in views:
            before = holder.get(view.row)
            if before is not None and before != view.request and view.request not in seen:
                done, left = self.done_at.get(before), retired.get(before)
                count += (done is not None and done < view.call) or (left is not None and left <= view.call)
            holder[view.row] = view.request
            seen.add(view.request)
        return count


def grouped(views: list[RowView]) -> list[list[RowView]]:
    """One request's views as rounds: a starting call, then the chunks that continue it."""
    out: list[list[RowView]] = []
    for view in views:
        if view.chunk and out:
            out[-1].append(view)
        else:
            out.append([view])
    return out


# ---------------------------------------------------------------------------------------
# Calls and the ledger


def well_formed(call: CallRecord) -> bool:
    return call.input_ids is not None and call.input_ids.dim() == 2


def highest_position(call: CallRecord) -> int:
    """The highest position id among the call's attended current inputs (-1: none, or a call of a
    shape I1 reports, whose positions cannot be read)."""
    if not well_formed(call):
        return -1
    assert call.input_ids is not None
    batch, width = call.input_ids.shape
    try:
        mask = fit_mask(call.attention_mask, batch, call.past_length + width)[:, -width:].bool()  # [B, T]
        positions = implied_positions(call, batch, width)  # [B, T]
    except (RuntimeError, ValueError):
        return -1
    attended = positions[mask] if width else torch.empty(0)
    return int(attended.max()) if attended.numel() else -1


def in_flight_at(entries: list[Entry], entry: Entry, same_time: bool = False) -> list[Entry]:
    """The requests in flight when `entry` arrived: taken earlier (`same_time`: or at once, a
    decoder's rows) and not yet let go. Times are the record's unit."""
    at = entry.admitted
    if at is None:
        return []
    out = []
    for q in entries:
        if q is entry:
            if same_time:
                break  # rows of one case: the earlier rows only
            continue
        if q.admitted is None or not (q.admitted < at or (same_time and q.admitted == at)):
            continue
        if q.retired is None or q.retired > at:
            out.append(q)
    return out


def peak_in_flight(entries: list[Entry]) -> int:
    """The most requests in flight at one time, spans [admitted, retired] closed (a request let
    go as another is taken counts as overlapping, as `adapters.vllm.report.peak_in_flight`)."""
    spans = [(e.admitted, e.retired) for e in entries if e.admitted is not None]
    if not spans:
        return 0
    end = max((r for _, r in spans if r is not None), default=0.0)
    closed = [(a, end if r is None else r) for a, r in spans]
    return max(sum(a <= t <= r for a, r in closed) for t, _ in closed)
