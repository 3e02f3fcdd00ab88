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

Drafts are what the draft proposed, not whatever the target attends past c. The draft's calls
are observed (`CallRecord.proposals`, with its cache), so for each request the harness knows
which token the draft proposed after which of the request's own prefixes; an entry counts as
an accepted draft only where the draft proposed it after exactly the entries before it. A
target that verifies by decoding greedily itself (Hugging Face `generate` from the committed
context: one forward, then one per token, with no draft call in between) attends its own
tokens past c: those continue the round, and are not drafts. Such a decoder recomputes what a
single forward would give; it is slower, not wrong. Its next round, re-fed without a cache, must
re-feed at least the c + v tokens verified so far, as a cached round must still hold them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from specaudit.checks.contract import check_contract
from specaudit.checks.i2 import row_views
from specaudit.checks.observe import NO_TOKEN, common_prefixes, draft_between, input_mask, observe
from specaudit.checks.rows import RowView
from specaudit.contracts.violation import Violation
from specaudit.fixtures.transparent import RequestScript, Script
from specaudit.running.instrument import CallRecord
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


@dataclass(frozen=True)
class Proposals:
    """What the draft proposed after each request's own prefixes: `after[r][n]` holds the tokens
    its greedy top-1 named after the first n tokens of request r's oracle sequence (prompt and
    continuation), read from every observed draft call. `observed` False: the run kept no draft
    evidence, and every target entry past the committed ones is taken for a draft."""

    after: list[dict[int, set[int]]] = field(default_factory=list)
    observed: bool = False

    def proposed(self, request: int, n: int, token: int) -> bool:
        """Did the draft propose `token` after the first n tokens of the request's sequence?"""
        return not self.observed or token in self.after[request].get(n, ())


def draft_proposals(run: Run, sequences: Sequence[tuple[int, ...]]) -> Proposals:
    """Every draft call's proposals, each filed under the requests whose sequence its context is."""
    calls = [c for c in run.recording.draft_calls if c.proposals is not None and readable(c)]
    if not calls:
        return Proposals()
    width = max(map(len, sequences))
    table = torch.tensor([list(s) + [NO_TOKEN] * (width - len(s)) for s in sequences])  # [R, Ls]
    lengths = torch.tensor([len(s) for s in sequences])  # [R]
    after: list[dict[int, set[int]]] = [{} for _ in sequences]
    for call in calls:
        file_call(call, table, lengths, after)
    return Proposals(after, True)


def readable(call: CallRecord) -> bool:
    """A draft call whose attended context can be read: 2-D inputs, and its cache kept if it had one."""
    ids = call.input_ids
    return ids is not None and ids.dim() == 2 and (call.past_length == 0 or bool(call.cache_after))


def file_call(call: CallRecord, table: torch.Tensor, lengths: torch.Tensor, after: list[dict[int, set[int]]]) -> None:
    """File one draft call's top-1 at each attended input under every request whose sequence
    fills that input's whole context (its attended entries at positions 0..n-1). A call that
    kept logits for its last columns only (`logits_to_keep`, as `generate` asks) files those."""
    assert call.input_ids is not None and call.proposals is not None
    width = call.input_ids.shape[1]
    kept = call.proposals.shape[1]  # [B, T'] top-1 of the last T' <= T columns
    obs = observe(call, exact=True)
    held = common_prefixes(obs, table, lengths, exact=True)  # [B, R] leading entries that are r's sequence
    own = input_mask(call)  # [B, T]
    context = (obs.past[:, None] + own.long().cumsum(1))[:, width - kept :]  # [B, T'] entries each input attends
    own = own[:, width - kept :]
    fits = own[:, None, :] & (context[:, None, :] <= held[:, :, None]) & (context[:, None, :] > 0)  # [B, R, T']
    entries, proposed = context.tolist(), call.proposals.tolist()  # lists: cheap per-element reads
    for b, r, j in fits.nonzero().tolist():
        after[r].setdefault(entries[b][j], set()).add(proposed[b][j])


def rounds(run: Run, views: list[RowView]) -> list[list[RowView]]:
    """One request's views grouped into rounds: a starting call, then the calls that continue it
    with no draft call in between (its chunks, and a target decoding on from its own tokens)."""
    orders = sorted(c.order for c in run.recording.draft_calls)
    calls = run.recording.target_calls
    out: list[list[RowView]] = []
    for view in views:
        if out and (view.chunk or continues(out[-1][-1], view, orders, calls)):
            out[-1].append(view)
        else:
            out.append([view])
    return out


def continues(before: RowView, view: RowView, draft_orders: list[int], calls: list[CallRecord]) -> bool:
    """The call's cached past is exactly the request's previous call, and the draft was not called since."""
    return (
        view.cached
        and view.past == len(before.stream)
        and view.stream[: view.past] == before.stream
        and not draft_between(draft_orders, calls[before.call].order, calls[view.call].order)
    )


def check_token_preservation(run: Run) -> list[Violation]:
    """Each round keeps exactly the drafts the schedule allows: none thrown away, none extra."""
    if run.outputs is None:
        return check_contract(run)
    if run.case.draft != "scripted":
        return []
    views, _ = row_views(run)
    schedule = Schedule(run.scripts)
    proposals = draft_proposals(run, schedule.full)
    per_request: dict[int, list[RowView]] = {}
    for view in views:
        per_request.setdefault(view.request, []).append(view)
    violations: list[Violation] = []
    for request, seen in sorted(per_request.items()):
        copy = Copy(len(run.case.prompts[request]))
        for round_ in rounds(run, seen):
            if not copy.judged:
                break
            copy = judge_round(run, schedule, proposals, request, round_, copy, violations)
    return violations


def judge_round(
    run: Run,
    schedule: Schedule,
    proposals: Proposals,
    request: int,
    round_: list[RowView],
    copy: Copy,
    violations: list[Violation],
) -> Copy:
    """Judge one round of one request; returns the request's record after it."""
    start, last = round_[0], round_[-1]
    script = run.scripts[request]
    prompt = len(script.prompt)
    c = copy.committed
    where = dict(call=start.call, row=start.row, request=request)
    if not (start.consistent and last.consistent):
        return replace(copy, judged=False)  # I2 reports the corrupted cache
    held = kept(start, c, prompt)
    # a cached call short of the pending token prefills (a prompt's rest after a crop to a shared prefix)
    prefilling = start.cached and len(start.stream) < c
    if held is not None and held < c - 1 and not prefilling:
        holding = "a cache holding" if start.cached else "a call without a cache re-feeding"
        violations.append(
            Violation(
                "token-preservation",
                "verified-kept",
                f"{holding} {held_entries(held, prompt)}",
                f"{needed(c - 1, prompt)}: tokens committed before this round were thrown away"
                " (recomputed or re-drafted: a cost, not a wrong output)",
                evidence={
                    "accepted": max(held - prompt, 0),
                    "scheduled": c - 1 - prompt,
                    "drafts": None,
                    "index": None,
                    "held": held,
                    "prompt": prompt,
                },
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
    drafts, v = len(stream) - c, accepted_drafts(proposals, request, stream, c, right - b)
    left = len(run.oracle[request].tokens) - b  # tokens the request still needs: past its end nothing counts
    want = schedule.accepted(request, c, drafts)
    if not_asked(proposals, request, stream, c, v, right - b):
        want = min(want, v)  # the entry after the drafts is the target's own token: the draft was never asked there
    v, want = min(v, left), min(want, left)
    if v != want:
        violations.append(
            Violation(
                "token-preservation",
                "accepted-as-scheduled",
                f"{v} of {drafts} drafts from index {b} matching the oracle",
                f"{want} (the schedule accepts {script.lead(b)} from index {b}; {direction(v, want)})",
                evidence={"accepted": v, "scheduled": want, "drafts": drafts, "index": b},
                call=last.call,
                row=last.row,
                request=request,
            )
        )
    return replace(copy, committed=c + v + 1)


def held_entries(held: int, prompt: int) -> str:
    """Entries of a request in words: generated tokens, or, short of the whole prompt (a crop
    into the prompt: a cache cropped to a prefix shared with another request, a verified token
    recomputed), the prompt tokens; never a negative count."""
    if held >= prompt:
        return f"{held - prompt} generated tokens"
    return f"no generated token and {held} of the prompt's {prompt} tokens"


def needed(entries: int, prompt: int) -> str:
    """What a round's start should hold, in the words of `held_entries`."""
    return f"at least {entries - prompt}" if entries >= prompt else f"{entries} of the prompt's {prompt} tokens"


def kept(start: RowView, c: int, prompt: int) -> int | None:
    """Entries of the request a round starts from: its cached past, or, for a round re-fed
    without a cache after the first (a target verifying with `generate` from the committed
    context), the entries its first call re-feeds. None: nothing to hold it to (a first round,
    whose prefill may come in chunks)."""
    if start.cached:
        return start.past
    return len(start.stream) if c > prompt else None


def accepted_drafts(proposals: Proposals, request: int, stream: tuple[int, ...], c: int, matching: int) -> int:
    """Of the `matching` entries past c that lead the oracle's continuation, how many in a row are
    drafts: proposed by the draft after exactly the entries before them (the rest, if any, are the
    target's own tokens, or drafts proposed after a context that was not the request's)."""
    n = 0
    while n < matching and proposals.proposed(request, c + n, stream[c + n]):
        n += 1
    return n


def not_asked(proposals: Proposals, request: int, stream: tuple[int, ...], c: int, v: int, matching: int) -> bool:
    """Whether the round's entry after its v accepted drafts is the target's own token, not a draft:
    it leads the oracle, and no observed draft call was ever asked after exactly the entries before
    it (split verification forwards the bonus in the next call, which continues the round's cache).
    The schedule cannot hold a round to drafts the draft was never asked for."""
    return proposals.observed and v < matching and (c + v) not in proposals.after[request]


def direction(found: int, want: int) -> str:
    """What a count off the schedule means, by which way it is off."""
    if found > want:
        return "a higher count means drafts the schedule rejects were kept: more accepted than the draft got right"
    return (
        "a lower count means verified drafts were thrown away, or the draft saw a rejected or missing token "
        "and proposed wrong ones"
    )
