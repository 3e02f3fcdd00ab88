"""Token preservation (scripted draft only): each round keeps exactly the drafts the schedule allows.

A round of request r is the target call that starts it plus the chunks that continue it
(verification split over several forwards). With c tokens of r's sequence committed before
it (prompt included), its last call attends a stream whose entries past c are drafts; of
those, v lead the oracle's continuation. The scripted draft proposes the oracle's token
exactly where its schedule accepts, so a correct decoder's round accepts

    v = the drafts the draft would get right, one after another, from the context r[:c]

(the draft identifies a request by what it attends, so where two requests' histories
coincide the schedule is the one the draft applies to that content). The round then commits
c + v + 1 tokens (the bonus), and a cached decoder's next round must still hold the first
c + v of them in its cache: verified tokens are never thrown away.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from specaudit.checks.contract import check_contract
from specaudit.checks.i2 import row_views
from specaudit.checks.rows import RowView
from specaudit.contracts.violation import Violation
from specaudit.fixtures.transparent import RequestScript, Script
from specaudit.running.runner import Run


@dataclass(frozen=True)
class Copy:
    """One request (one copy of a prompt) while its rounds are judged."""

    committed: int  # tokens of its sequence committed before its next round, prompt included
    judged: bool = True  # False once its committed tokens leave the oracle or a verified token was lost


class Schedule:
    """The scripted draft's acceptance, replayed: how many drafts a round gets right."""

    def __init__(self, scripts: list[RequestScript]) -> None:
        self.script = Script(scripts)
        self.full = [s.prompt + s.continuation for s in scripts]
        # requests whose prompt starts another's sequence: there the draft may follow either
        self.shared = [
            any(q.prompt != s.prompt and self.full[r][: len(q.prompt)] == q.prompt for q in scripts)
            for r, s in enumerate(scripts)
        ]
        self.scripts = scripts

    def accepted(self, request: int, committed: int, drafts: int) -> int:
        """Drafts accepted by a correct round of `request` from `committed` tokens on."""
        script = self.scripts[request]
        if not self.shared[request]:
            return min(script.lead(committed - len(script.prompt)), drafts)
        full = self.full[request]
        n = 0
        while n < drafts and committed + n < len(full) and self.proposes(full[: committed + n], full[committed + n]):
            n += 1
        return n

    def proposes(self, context: tuple[int, ...], right: int) -> bool:
        """Does the scripted draft propose `right` after `context` (as ScriptedDraft does)?"""
        request = self.script.identify(context)
        if request is None:
            return False
        generated = context[len(request.prompt) :]
        n = len(generated)
        return (
            n < len(request.accept)
            and request.accept[n]
            and request.consistent_prefix(generated) == n
            and request.continuation[n] == right
        )


def rounds(views: list[RowView]) -> list[list[RowView]]:
    """One request's views grouped into rounds: a starting call, then its chunks."""
    out: list[list[RowView]] = []
    for view in views:
        if view.chunk and out:
            out[-1].append(view)
        else:
            out.append([view])
    return out


def check_token_preservation(run: Run) -> list[Violation]:
    """Each round keeps exactly the drafts the schedule allows: none thrown away, none extra."""
    if run.outputs is None:
        return check_contract(run)
    if run.case.draft != "scripted":
        return []
    views, _ = row_views(run)
    schedule = Schedule(run.scripts)
    per_request: dict[int, list[RowView]] = {}
    for view in views:
        per_request.setdefault(view.request, []).append(view)
    violations: list[Violation] = []
    for request, seen in sorted(per_request.items()):
        copy = Copy(len(run.case.prompts[request]))
        for round_ in rounds(seen):
            if not copy.judged:
                break
            copy = judge_round(run, schedule, request, round_, copy, violations)
    return violations


def judge_round(
    run: Run, schedule: Schedule, request: int, round_: list[RowView], copy: Copy, violations: list[Violation]
) -> Copy:
    """Judge one round of one request; returns the request's record after it."""
    start, last = round_[0], round_[-1]
    script = run.scripts[request]
    prompt = len(script.prompt)
    c = copy.committed
    where = dict(call=start.call, row=start.row, request=request)
    if not (start.consistent and last.consistent):
        return replace(copy, judged=False)  # I2 reports the corrupted cache
    if start.cached and start.past < c - 1:
        violations.append(
            Violation(
                "token-preservation",
                "verified-kept",
                f"a cache holding {start.past - prompt} generated tokens",
                f"at least {c - 1 - prompt}: tokens verified by an earlier round were thrown away",
                evidence={"accepted": start.past - prompt, "scheduled": c - 1 - prompt, "drafts": None, "index": None},
                **where,
            )
        )
        return replace(copy, judged=False)  # its rounds no longer follow the schedule; one report is enough
    stream = last.stream
    if len(stream) < c:
        return copy  # a prefill chunk, or a prompt's last token kept pending: no new token yet
    b = c - prompt
    if b >= len(run.oracle[request].tokens):
        return replace(copy, judged=False)  # the request is complete; later calls cannot change it
    right = script.consistent_prefix(stream[prompt:])
    if right < b:
        return replace(copy, judged=False)  # committed tokens left the oracle: equivalence reports it
    drafts, v = len(stream) - c, right - b
    want = schedule.accepted(request, c, drafts)
    if v != want:
        violations.append(
            Violation(
                "token-preservation",
                "accepted-as-scheduled",
                f"{v} of {drafts} drafts from index {b} matching the oracle",
                f"{want} (the schedule accepts {script.lead(b)} from index {b}; "
                "a lower count means the draft saw a rejected or missing token)",
                evidence={"accepted": v, "scheduled": want, "drafts": drafts, "index": b},
                call=last.call,
                row=last.row,
                request=request,
            )
        )
    return replace(copy, committed=c + v + 1)
