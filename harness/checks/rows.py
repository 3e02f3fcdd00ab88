"""Row identity: which request each row of each target call holds, followed by construction,
for a decoder's rows and an engine's.

The decoder receives the case's rows in order, so the first call that holds a request binds
it (batch row b to request b at a full prefill; the next requests in case order for a pool
that admits them in turns), and the request's next call confirms the prefill: a row whose
cached past is exactly what a prefill wrote continues that prefill. From then on each
request is followed through compaction, reordering and removal. At every target call the
rows are matched one to one with the requests (a permutation of the rows still running),
ranking each (row, request) pair by, in this order:

  1. continuation: the row's past slots hold the request's history at positions 0..m-1 and
     its first input is the request's next token (a new round), or its past repeats the
     request's previous call exactly and no draft call came in between (the next chunk of a
     verification split over several target forwards);
  2. the row's past alone is the request's history;
  3. the request is still running;
  4. feasibility: the row holds at most K entries past the request's committed tokens, and
     any only after a draft call (drafts come from the draft);
  5. progress: a cached round starts at the request's committed length, and the row attends
     all of the request's committed tokens (a cache-free decoder re-feeds them);
  6. how many of the row's entries are the request's tokens;
  7. continuity: the row the request held before, or its rank in case order if not yet seen;
     among twins (one sequence, one progress: no call tells them apart), the longest waiting.

On a real model the past slots are K/V, not tokens: they are read against every request's
batch-size-1 entries (`KVReader.past_prefixes`, the reader I2 judges with), so a row's past
names its request as the transparent model's tokens do. A call without a cache re-feeds the
committed history as inputs (progress: it holds all of it). A row attending nothing (an
all-pad prefill row) keeps its place's request after every real row is matched.

Content never re-picks a request on its own: requests whose histories coincide (a prompt
that is a prefix of another's history, duplicate prompts) are told apart by progress and
continuity. What a row attends against what its request needs is then judged from the
facts gathered here (`Fault`, phrased by `specaudit.checks.i2`).

An engine's calls are followed the same way (`specaudit.checks.engine`), with what its book
says added per step (`Book`): which requests are live, and their committed lengths, which a
decoder's calls only imply. A row may then bind only a live request whose history it holds by
content; an engine's idle row (a fixed-size engine's empty slot: pad tokens only) is skipped,
and a row the matching leaves over is a fault of its own (`RowFollower.unbound`).

Reading is vectorized: per call one [B, W] stream of attended (token, position, slot), and
one [B, R, W] comparison with every request's sequence; Python only walks the B matches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from specaudit.checks.agreement import common_prefix, equivalence
from specaudit.checks.cache import cached
from specaudit.checks.kv import Alternative, KVReader
from specaudit.checks.observe import (
    NO_TOKEN,
    UNKNOWN,
    Observation,
    common_prefixes,
    draft_between,
    input_mask,
    observe,
)
from specaudit.fixtures.pairs import is_exact
from specaudit.running.instrument import CallRecord
from specaudit.running.runner import Run


@dataclass(frozen=True)
class RowView:
    """What one batch row of one target call attends, bound to a request of the case."""

    call: int
    row: int
    request: int
    past: int  # attended past slots
    consistent: bool  # past slots hold the request's history (or, in a chunk, the round's earlier inputs)
    stream: tuple[int, ...]  # attended tokens in order, past then current (drafts included)
    slots: tuple[int, ...]  # the cache slot (past + current) of each stream entry
    chunk: bool = False  # continues the request's previous call within one round (chunked verification)
    cached: bool = True  # the call had a cache; False: a cache-free decoder re-feeds the whole sequence


@dataclass(frozen=True)
class Fault:
    """The first I2 breach of one row: what sits at stream index `index` against what should."""

    rule: str  # "attends-wrong-slot", "row-identity", "position-ids", "input-token", "cache-readable";
    # an engine's rows also "retired-row" and "duplicate-row"
    call: int
    row: int | None = None
    request: int | None = None
    slot: int | None = None
    found_token: int | None = None  # None: a real model's K/V cannot say
    found_position: int | None = None
    expected_token: int | None = None  # None: nothing should be attended there
    expected_position: int | None = None
    other: int | None = None  # another request whose history or next token the row holds
    kv_difference: float | None = None  # real models: largest K/V deviation from the batch-size-1 run
    input: int | None = None  # index among the call's attended current inputs
    kv_bound: float | None = None  # real models with a noise floor: the bound the deviation is held to
    nearest: Alternative | None = None  # real models: the alternative entry nearest to what the slot holds
    nearest_distance: float | None = None
    holder: int | None = None  # engines, duplicate-row: the row that holds the request already
    left: str | None = None  # engines, retired-row: how the request left ("aborted", "finished")


@dataclass(frozen=True)
class Book:
    """What an engine's book says for one step: the requests live in it and their committed
    lengths (prompt plus tokens emitted), by follower index. A decoder has none: its requests'
    progress is inferred from the calls alone."""

    live: frozenset[int]
    committed: dict[int, int]


@dataclass(frozen=True)
class RowTrace:
    views: tuple[RowView, ...]
    faults: tuple[Fault, ...]


@dataclass(frozen=True)
class Followed:
    """One request while its rows are followed."""

    known: int  # committed history length (prompt included): the stream's entries known to be real
    stream: tuple[int, ...] | None = None  # what its last call attended, past then inputs
    row: int | None = None  # its row in that call
    order: int | None = None  # that call's place among all calls (CallRecord.order)


# ---------------------------------------------------------------------------------------
# Matching rows to requests


def assign(score: torch.Tensor) -> list[tuple[int, int]]:
    """The one matching of rows to requests, for a decoder's rows and an engine's: [B, R] scores,
    a pair allowed where its score is >= 0. Best pairs first (greedy, one to one), then an
    augmenting path for each row left over (Kuhn's), so a row whose only request an earlier row
    took while it had another still gets one: as many rows bound as the allowed pairs permit.
    Returns (row, request) in row order. A decoder's scores allow every pair, so its matching is
    the greedy one; an engine's allow a row only the live requests whose history it holds."""
    batch, requests = score.shape
    values = score.tolist()
    owner: dict[int, int] = {}  # request -> row
    bound: dict[int, int] = {}  # row -> request
    flat = score.flatten()
    for k in torch.argsort(flat, descending=True, stable=True).tolist():
        b, r = divmod(k, requests)
        if values[b][r] < 0 or len(bound) == batch or len(owner) == requests:
            break
        if b not in bound and r not in owner:
            bound[b], owner[r] = r, b

    def augment(b: int, seen: set[int]) -> bool:
        for r in sorted(range(requests), key=lambda r: -values[b][r]):
            if values[b][r] < 0 or r in seen:
                continue
            seen.add(r)
            if r not in owner or augment(owner[r], seen):
                bound[b], owner[r] = r, b
                return True
        return False

    for b in range(batch):
        if b not in bound and len(owner) < requests:
            augment(b, set())
    return sorted(bound.items())


# ---------------------------------------------------------------------------------------
# Following rows


class RowFollower:
    """Walks target calls once, binding rows to requests and noting the first fault of each row:
    a decoder run's calls after the run (`of_run`, `follow`), an engine session's after every step
    (`specaudit.checks.engine`), with the requests added so far (`add`) and the live set and
    committed lengths the engine's book gives (`visit`). Requests are indices in order of `add`."""

    def __init__(self, exact: bool, k: int, pad: int, calls: list[CallRecord]) -> None:
        self.exact, self.k, self.pad = exact, k, pad
        self.calls = calls  # every target call, by index (a prefill confirmed later re-reads its call)
        self.kv: KVReader | None = None  # a real model's reader over `sequences`
        self.prompts: list[tuple[int, ...]] = []
        self.sequences: list[tuple[int, ...]] = []  # per request: the history its rows are read against
        self.oracles: list[tuple[int, ...]] = []  # per request: prompt + the oracle's tokens (what a fault expects)
        self.lengths = torch.zeros(0, dtype=torch.long)  # [R]
        self.table = torch.zeros(0, 0, dtype=torch.long)  # [R, Ls]
        self.state: list[Followed] = []
        self.seen: list[bool] = []
        self.history: list[list[int]] = []  # per request, its views' indices
        self.draft_orders: Sequence[float] = []  # where no round can span (draft calls; an engine's steps)
        self.views: list[RowView] = []
        self.faults: list[Fault] = []
        self.last_batch = 0  # rows of the call visited last (`expected_rows`)

    @classmethod
    def of_run(cls, run: Run, sequences: Sequence[tuple[int, ...]], oracles: Sequence[tuple[int, ...]]) -> RowFollower:
        """A decoder run's follower: every request of the case, each read against `sequences`
        (its prompt and the tokens its cache should hold, `held_histories`), known from the
        start; a fault names the oracle's token where the history so far is the oracle's."""
        assert run.outputs is not None
        exact = is_exact(run.case.model)
        follower = cls(exact, run.case.num_draft_tokens, run.case.pad_token_id, run.recording.target_calls)
        follower.add(list(run.case.prompts), sequences, oracles)
        follower.kv = None if exact else KVReader.of_run(run, list(sequences))
        follower.draft_orders = sorted(c.order for c in run.recording.draft_calls)
        return follower

    def add(
        self,
        prompts: Sequence[tuple[int, ...]],
        sequences: Sequence[tuple[int, ...]],
        oracles: Sequence[tuple[int, ...]] | None = None,
    ) -> None:
        """Requests arriving (all of a decoder's at once, an engine's as they are added);
        `oracles`: prompt + oracle tokens per request (None: the sequences are the reference)."""
        self.prompts += prompts
        self.sequences += sequences
        self.oracles += oracles if oracles is not None else sequences
        self.state += [Followed(len(p)) for p in prompts]
        self.seen += [False] * len(prompts)
        self.history += [[] for _ in prompts]
        self.lengths = torch.tensor([len(s) for s in self.sequences])
        width = int(self.lengths.max())
        self.table = torch.tensor([list(s) + [NO_TOKEN] * (width - len(s)) for s in self.sequences])

    def follow(self) -> RowTrace:
        for call in self.calls:
            if call.input_ids is None or call.input_ids.dim() != 2:
                continue  # I1 reports a malformed call
            if call.sampled and call.past_length and not call.cache_after:
                self.faults.append(Fault("cache-readable", call.index))
                continue
            self.visit(call)
        return RowTrace(tuple(self.views), tuple(self.faults))

    def chunks(self, call: CallRecord, obs: Observation, past_match: torch.Tensor | None) -> torch.Tensor:
        """[B, R] row b repeats request r's previous call as its past, with no draft call since."""
        batch, requests = obs.past.shape[0], len(self.state)
        out = torch.zeros(batch, requests, dtype=torch.bool)
        by_past: dict[int, list[int]] = {}
        for b, m in enumerate(obs.past.tolist()):
            by_past.setdefault(m, []).append(b)
        for r, s in enumerate(self.state):
            if s.stream is None or len(s.stream) not in by_past:
                continue
            if draft_between(self.draft_orders, s.order, call.order):
                continue
            rows = torch.tensor(by_past[len(s.stream)])
            m = len(s.stream)
            if not self.exact:  # K/V: the previous call's entries that are the request's own must be there
                if past_match is None:
                    out[rows, r] = True  # no snapshot: judged by the inputs alone
                else:
                    out[rows, r] = past_match[rows, r] >= min(m, common_prefix(s.stream, self.sequences[r]))
                continue
            want = torch.tensor(s.stream)
            same = (obs.tokens[rows, :m] == want).all(1) & (obs.positions[rows, :m] == torch.arange(m)).all(1)
            out[rows, r] = same
        return out

    def drafted(self, call: CallRecord) -> torch.Tensor:
        """[R] was the draft called since each request's last call (since the start if unseen)?"""
        return torch.tensor(
            [draft_between(self.draft_orders, -1 if s.order is None else s.order, call.order) for s in self.state]
        )

    def fits(self, obs: Observation) -> torch.Tensor:
        """[B, R] whether request r's history can fill row b's past: always on an exact model;
        a real model's past is unread, so a request shorter than the row's past cannot hold it."""
        if self.exact:
            return torch.ones(obs.past.shape[0], len(self.state), dtype=torch.bool)
        return obs.past[:, None] <= self.lengths[None, :]

    def scores(self, call: CallRecord, obs: Observation, cp: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
        """[B, R] preference of binding row b to request r (see the module docstring)."""
        m, length = obs.past[:, None], obs.length[:, None]  # [B, 1]
        lengths = self.lengths[None, :]  # [1, R]
        known = torch.tensor([s.known for s in self.state])[None, :]
        first = torch.minimum(m + (length > m).long(), lengths)  # past plus the first input
        fits = self.fits(obs)
        fresh = (cp >= first) & fits
        own_past = (cp >= torch.minimum(m, lengths)) & fits
        own_past = own_past | chunk  # a chunk's past is its round's earlier entries
        running = known < lengths
        # entries past the committed ones are drafts: at most K, and only after a draft call
        feasible = (length <= known + self.k * self.drafted(call)[None, :]) | chunk
        # a cached round starts at the committed length; a cache-free call re-feeds the committed history
        at_progress = torch.where(m == 0, cp >= torch.minimum(known, length), fresh & (m == known - 1)) | chunk
        covers = length >= known
        flags = (fresh | chunk, own_past, running, feasible, at_progress, covers)
        base = torch.zeros_like(cp)
        for flag in flags:  # lexicographic: each flag outweighs all the ones after it
            base = 2 * base + flag.long()
        continuity = self.continuity(cp.shape)
        # the history held, through the first input: entries past it are drafts, which say nothing of whose
        # row it is (under sampling a draft may come true in a twin's future, one of the same prompt)
        held = torch.minimum(cp, first)
        real = (base * (cp.max() + 1) + held).double() + continuity + 1.0
        # a row attending nothing (an all-pad prefill row) keeps its place's request, after every real row
        return torch.where(length > 0, real, continuity / 2)

    def continuity(self, shape: torch.Size) -> torch.Tensor:
        """[B, R] in [0, 1): the row a request held before (`expected_rows`), else its rank in case
        order if unseen; among twins (see `twin_ranks`), the one served longest ago first."""
        batch, requests = shape
        rows = torch.arange(batch)[:, None].double()
        before = self.expected_rows(batch)[None, :]
        unseen = torch.tensor(self.seen).logical_not()
        rank = (unseen.long().cumsum(0) - 1).double()[None, :]  # rank among requests not yet seen
        spread = 4.0 * (batch + requests + 1)
        by_row = torch.where(rows == before, 0.9, 0.4 - (rows - before).abs() / spread)
        twin_rank, twins = self.twin_ranks()
        by_age = 0.5 + (0.4 - twin_rank[None, :] / requests) + (by_row - 0.4) / (10 * spread)
        seen = torch.where(twins[None, :], by_age, by_row)
        return torch.where(unseen[None, :], 0.8 - (rows - rank).abs() / spread, seen)

    def expected_rows(self, batch: int) -> torch.Tensor:
        """[R] where each seen request is expected (-1: unseen): its row before, or, when the batch
        shrank to exactly the requests still running, its rank among them (finished rows removed,
        the rest kept in order: EQSPEC's realignment). Only a tie of content reads it: twins, which
        under sampling share a history and then part, would otherwise be taken for each other."""
        before = [-1 if s.row is None else s.row for s in self.state]
        running = sorted(
            (s.row, r) for r, s in enumerate(self.state) if s.row is not None and s.known < int(self.lengths[r])
        )
        if len(running) == batch < self.last_batch:
            for rank, (_, r) in enumerate(running):
                before[r] = rank
        return torch.tensor(before).double()

    def twin_ranks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[R] rank by last call among a request's twins, [R] whether it has any. Twins are seen
        requests with the same sequence in the same state: no observation can tell which of them
        a row holds (identical prompts, outputs and progress), so the one waiting longest is taken
        to be served, as a fair scheduler would. Row continuity would credit the newest twin and
        starve the others in the ledger (a false liveness alarm)."""
        classes: dict[tuple, list[int]] = {}
        for r, s in enumerate(self.state):
            if self.seen[r]:
                classes.setdefault((self.sequences[r], s.known, s.stream), []).append(r)
        rank, twins = torch.zeros(len(self.state)), torch.zeros(len(self.state), dtype=torch.bool)
        for members in classes.values():
            if len(members) > 1:
                for i, r in enumerate(sorted(members, key=lambda r: (self.state[r].order, r))):
                    rank[r], twins[r] = i, True
        return rank.double(), twins

    def past_match(self, call: CallRecord, obs: Observation) -> torch.Tensor | None:
        """[B, R] a real model's past read as K/V against every request's entries (None: an exact
        model, whose past is read as tokens, or a call that kept no snapshot)."""
        if self.kv is None or not (call.sampled and call.cache_after):
            return None
        return self.kv.past_prefixes(call, obs)

    def visit(self, call: CallRecord, book: Book | None = None) -> None:
        """Bind the call's rows to requests and judge each. A decoder's rows may hold any request
        (every row is one); an engine's (`book`: its live requests and committed lengths) bind only
        to a live request whose history they hold, its idle rows not at all, and a row left over
        is a fault of its own (`unbound`)."""
        obs = observe(call, self.exact)
        past_match = self.past_match(call, obs)
        cp = common_prefixes(obs, self.table, self.lengths, self.exact, past_match)  # [B, R]
        chunk = self.chunks(call, obs, past_match)
        if book is not None:
            self.catch_up(book)
        score = self.scores(call, obs, cp, chunk)  # [B, R]
        if book is not None:
            held = self.held(obs, past_match)  # [B, R]
            idle = self.idle_rows(call, obs, held)  # [B]
            live = torch.tensor([r in book.live for r in range(len(self.state))], dtype=torch.bool)  # [R]
            score = torch.where((held > 0) & live[None, :] & ~idle[:, None], score, -1.0)
        pairs = assign(score)
        self.last_batch = int(obs.past.shape[0])
        tokens, positions, slots = obs.tokens.tolist(), obs.positions.tolist(), obs.slots.tolist()
        own_past = cp >= torch.minimum(obs.past[:, None], self.lengths[None, :])
        self.confirm_prefills(pairs, obs.past.tolist(), tokens, own_past)
        for b, r in pairs:
            m, length = int(obs.past[b]), int(obs.length[b])
            row = Row(call, b, r, m, length, tokens[b][:length], positions[b][:length], slots[b][:length])
            fault, is_chunk, stream = self.judge_row(row, int(cp[b, r]), bool(chunk[b, r]), own_past[b])
            if fault is not None:
                self.faults.append(fault)
            self.history[r].append(len(self.views))
            self.views.append(
                RowView(
                    call.index,
                    b,
                    r,
                    m,
                    fault is None or fault.rule in ("position-ids", "input-token"),
                    stream,
                    tuple(row.slots),
                    is_chunk,
                    call.past_length > 0,
                )
            )
            self.advance(r, call, b, stream)
        if book is not None:
            self.unbound(call, obs, pairs, held, idle, score, book)

    # -- an engine's rows (`visit` with a book) ------------------------------------------------

    def catch_up(self, book: Book) -> None:
        """The committed lengths the engine's book gives: what a decoder's calls only imply."""
        for r, n in book.committed.items():
            if n > self.state[r].known:
                self.state[r] = replace(self.state[r], known=n)

    def held(self, obs: Observation, past_match: torch.Tensor | None) -> torch.Tensor:
        """[B, R] how many leading entries of row b hold request r's history by content, positions
        judged apart (a wrong position is not a wrong request)."""
        by_content = replace(obs, positions=torch.arange(obs.tokens.shape[1]).expand_as(obs.tokens))
        return common_prefixes(by_content, self.table, self.lengths, self.exact, past_match)

    def idle_rows(self, call: CallRecord, obs: Observation, held: torch.Tensor) -> torch.Tensor:
        """[B] an engine's idle rows, the empty slots of a fixed-size engine: attending nothing, or
        inputs of the pad token only over a past of pads (a real model's: no past, no request's
        history, or the pad token's entries). Neither bound nor judged: an engine that used one's
        output would emit a wrong token (equivalence) or starve a request (liveness)."""
        out = []
        for b in range(obs.past.shape[0]):
            m, length = int(obs.past[b]), int(obs.length[b])
            tokens = obs.tokens[b, :length].tolist()
            if length == 0 or any(t != self.pad for t in tokens[m:]):
                out.append(length == 0)
            elif self.kv is None:
                out.append(all(t == self.pad for t in tokens[:m]))
            else:
                slots = obs.slots[b, :m].tolist()
                out.append(not m or most_held(held, b) == 0 or self.kv.holds(call, b, slots, (self.pad,) * m))
        return torch.tensor(out, dtype=torch.bool)

    def unbound(
        self,
        call: CallRecord,
        obs: Observation,
        pairs: list[tuple[int, int]],
        held: torch.Tensor,
        idle: torch.Tensor,
        score: torch.Tensor,
        book: Book,
    ) -> None:
        """An engine's rows the matching left over, each a fault at its first entry: the history of
        a request retired before this step ('retired-row'), of a live request another row holds
        ('duplicate-row'), or of no request at all ('row-identity')."""
        owner = {r: b for b, r in pairs}
        for b in range(obs.past.shape[0]):
            if b in owner.values() or bool(idle[b]):
                continue
            most = most_held(held, b)
            tied = [r for r in range(len(self.state)) if most and int(held[b, r]) == most]
            tied.sort(key=lambda r: (r in book.live, float(score[b, r])), reverse=True)  # live, then best scored
            retired = [r for r in tied if r not in book.live and r not in owner]
            if retired or tied:
                r = retired[0] if retired else tied[0]
                holder = owner.setdefault(r, b)
                rule = "duplicate-row" if r in book.live else "retired-row"
                self.faults.append(self.entry_fault(rule, call, obs, b, r, holder if holder != b else None))
            else:
                self.faults.append(self.entry_fault("row-identity", call, obs, b, None))

    def entry_fault(
        self, rule: str, call: CallRecord, obs: Observation, b: int, r: int | None, holder: int | None = None
    ) -> Fault:
        """A fault at row b's first entry (a real model's past slot: its K/V against the request's first entry)."""
        m = int(obs.past[b])
        slot, token, position = int(obs.slots[b, 0]), int(obs.tokens[b, 0]), int(obs.positions[b, 0])
        distance = None
        if token == UNKNOWN and r is not None and self.kv is not None:
            want = self.kv.kept(self.sequences[r], 0, compute=True)
            found = self.kv.flat(call)[b, slot]  # [F] on the snapshot's device
            distance = math.inf if want is None else float((found - want.to(found.device)).abs().max())
        known = token != UNKNOWN
        return Fault(
            rule,
            call.index,
            b,
            r,
            slot,
            token if known else None,
            position if known else None,
            expected_position=0 if rule == "row-identity" else None,
            kv_difference=distance,
            input=0 if m == 0 else None,
            holder=holder,
        )

    def confirm_prefills(
        self, pairs: list[tuple[int, int]], past: list[int], tokens: list[list[int]], own_past: torch.Tensor
    ) -> None:
        """A prefill binds for now; the next call confirms it. A row whose cached past is exactly
        the stream some request's prefill wrote continues that prefill, so the prefill is its
        request's (prompts that are prefixes of one another, the last token kept pending)."""
        prefills = {h[0]: r for r, h in enumerate(self.history) if len(h) == 1 and self.views[h[0]].past == 0}
        claims: dict[int, int] = {}  # prefill view -> the request whose row continues it
        for b, r in pairs:
            m = past[b]
            history = self.sequences[r][:m]
            holds = tuple(tokens[b][:m]) == history if self.exact else bool(own_past[b, r])
            if m == 0 or not prefills or not holds:
                continue
            mine = self.history[r][0] if len(self.history[r]) == 1 else None
            if mine in prefills and self.views[mine].stream == history:
                continue
            claim = next((i for i in prefills if i not in claims and self.views[i].stream == history), None)
            if claim is not None:
                claims[claim] = r
        moved = {prefills[i] for i in claims} | set(claims.values())
        # the prefill rows left to a claiming request's old view go to the requests that lost theirs (a swap)
        displaced = sorted(i for i, r in prefills.items() if i not in claims and r in claims.values())
        orphans = sorted(prefills[i] for i in claims if prefills[i] not in claims.values())
        for i, r in [*claims.items(), *zip(displaced, orphans)]:
            self.views[i] = replace(self.views[i], request=r)
        for r in moved:
            mine = [i for i in prefills if self.views[i].request == r]
            self.history[r] = mine
            self.seen[r] = bool(mine)
            self.state[r] = Followed(len(self.prompts[r]))
            if mine:
                view = self.views[mine[0]]
                self.advance(r, self.calls[view.call], view.row, view.stream)

    def advance(self, r: int, call: CallRecord, b: int, stream: tuple[int, ...]) -> None:
        """The request's committed length after this call: its verified prefix plus the bonus."""
        sequence = self.sequences[r]
        known = max(self.state[r].known, min(len(sequence), common_prefix(stream, sequence) + 1))
        self.state[r] = replace(self.state[r], known=known, stream=stream, row=b, order=call.order)
        self.seen[r] = True

    def judge_row(self, row: Row, cp: int, chunk: bool, own_past: torch.Tensor) -> tuple[Fault | None, bool, tuple]:
        """The row's first fault (None if it attends what its request needs), whether it is a
        chunk of its request's round, and its stream (a real model's past read as its request's)."""
        sequence = self.sequences[row.request]
        n = len(sequence)
        m, length = row.past, row.length
        first = min(m + (length > m), n)
        fresh = cp >= first
        if not self.exact:
            return self.judge_kv(row, fresh, chunk)
        stream = tuple(row.tokens)
        if not fresh and not chunk:
            if cp < min(m, n):
                others = [q for q in own_past.nonzero()[:, 0].tolist() if q != row.request]
                rule = "row-identity" if others else "attends-wrong-slot"
                return self.slot_fault(rule, row, cp, sequence, others[0] if others else None), False, stream
        fault = self.input_fault(row, sequence, check_token=not fresh and not chunk)
        return fault, chunk and not fresh, stream

    def judge_kv(self, row: Row, fresh: bool, chunk: bool) -> tuple[Fault | None, bool, tuple]:
        """A real model: the past is read as the request's history (or, for a chunk, as its
        previous call's stream) and its K/V compared with a batch-size-1 run of that."""
        assert self.kv is not None
        sequence = self.sequences[row.request]
        m = row.past
        previous = self.state[row.request].stream
        past_slots = row.slots[:m]
        history = sequence[:m]
        # an unsampled call (real-model mode) kept no snapshot: it binds rows, its K/V go unjudged
        judged = m and row.call.sampled
        miss = self.kv.first_mismatch(row.call, row.row, past_slots, sequence) if judged else None  # causal: a prefix
        if miss is not None and chunk and previous is not None:
            if self.kv.first_mismatch(row.call, row.row, past_slots, previous) is None:
                return self.input_fault(row, sequence, check_token=False), True, previous + tuple(row.tokens[m:])
        stream = tuple(history) + tuple(row.tokens[m:]) if m <= len(sequence) else tuple(row.tokens)
        if miss is not None:
            fault = Fault(
                "attends-wrong-slot",
                row.call.index,
                row.row,
                row.request,
                past_slots[miss.index],
                expected_token=self.expected_at(row.request, miss.index),
                expected_position=miss.index,
                kv_difference=miss.distance,
                kv_bound=miss.bound,
                nearest=miss.nearest,
                nearest_distance=miss.nearest_distance,
            )
            return fault, False, stream
        return self.input_fault(row, sequence, check_token=not fresh and not chunk), chunk and not fresh, stream

    def slot_fault(
        self, rule: str, row: Row, index: int, sequence: tuple[int, ...], other: int | None, input: int | None = None
    ) -> Fault:
        """The fault of stream entry `index` against the request's entry there (`input`: its
        index among the call's current inputs, when it is one)."""
        inside = index < len(sequence)
        return Fault(
            rule,
            row.call.index,
            row.row,
            row.request,
            row.slots[index],
            row.tokens[index],
            row.positions[index],
            self.expected_at(row.request, index, other) if inside else None,
            index if inside else None,
            other,
            input=input,
        )

    def input_fault(self, row: Row, sequence: tuple[int, ...], check_token: bool) -> Fault | None:
        """Current inputs sit at the next positions; a new round's first input is the request's
        next token (its pending token, or the prompt's last one kept pending)."""
        m, n = row.past, len(sequence)
        if m >= n:
            return None  # the request is complete: later entries cannot change its output
        foreign = check_token and row.length > m and row.tokens[m] != sequence[m]
        if foreign and row.call.past_length:  # not the request's round: where its inputs sit says no more
            return self.token_fault(row, sequence)
        for j in range(m, row.length):
            if row.positions[j] != j:
                return Fault(
                    "position-ids",
                    row.call.index,
                    row.row,
                    row.request,
                    row.slots[j],
                    row.tokens[j],
                    row.positions[j],
                    self.expected_at(row.request, j) if j < n else None,
                    j,
                    input=j - m,
                )
        history = self.history_fault(row, sequence)
        if history is not None:
            return history
        return self.token_fault(row, sequence) if foreign else None

    def token_fault(self, row: Row, sequence: tuple[int, ...]) -> Fault:
        """'input-token': the round's first input is not the request's next token (whose it is, if anyone's)."""
        m = row.past
        return self.slot_fault("input-token", row, m, sequence, self.pending_of(row.tokens[m], row.request), 0)

    def history_fault(self, row: Row, sequence: tuple[int, ...]) -> Fault | None:
        """A call without a cache re-feeds the request's history as inputs: its first entries, up
        to the request's committed length, are what the row attends as its past, and must be the
        request's own tokens (a dropped, duplicated or foreign token shifts or replaces them)."""
        if row.call.past_length:
            return None  # a cached call: its past is judged slot by slot
        committed = min(self.state[row.request].known, row.length, len(sequence))
        j = common_prefix(row.tokens[:committed], sequence)
        if j >= committed:
            return None
        other = next(
            (q for q, s in enumerate(self.sequences) if q != row.request and s[: j + 1] == tuple(row.tokens[: j + 1])),
            None,
        )
        return self.slot_fault("history-token", row, j, sequence, other, j)

    def expected_at(self, request: int, index: int, other: int | None = None) -> int:
        """The token entry `index` of the request should hold, one fact for every message: the
        oracle's while the request's history up to it is the oracle's (so at the first
        divergence, the oracle's token, not the decoder's wrong commit), the history's after.
        A row holding `other` request's entry is a mix-up of rows, judged by what each request
        committed: the history's token."""
        sequence, oracle = self.sequences[request], self.oracles[request]
        if other is None and index < len(oracle) and common_prefix(sequence, oracle) >= index:
            return oracle[index]
        return sequence[index]

    def pending_of(self, token: int, request: int) -> int | None:
        """Another running request whose next token this is (rows mixed up), if any."""
        for q, s in enumerate(self.state):
            sequence = self.sequences[q]
            if q != request and self.seen[q] and s.known < len(sequence) and sequence[s.known - 1] == token:
                return q
        return None


@dataclass(frozen=True)
class Row:
    """One row of one call, read as Python lists (entries 0..length-1 of its stream)."""

    call: CallRecord
    row: int
    request: int
    past: int
    length: int
    tokens: list[int]
    positions: list[int]
    slots: list[int]


def most_held(held: torch.Tensor, b: int) -> int:
    """The longest history row b holds of any request (`RowFollower.held`), 0 with none."""
    return int(held[b].max()) if held.shape[1] else 0


def follow_rows(run: Run) -> RowTrace:
    """Bind every row of every target call to its request (memoized per run): each request
    read against what its cache should hold (`held_histories`)."""

    def follow() -> RowTrace:
        assert run.outputs is not None
        oracles = [p + eq.reference for p, eq in zip(run.case.prompts, equivalence(run).rows)]
        committed = [p + tuple(o) for p, o in zip(run.case.prompts, run.outputs)]
        trace = RowFollower.of_run(run, committed, oracles).follow()
        held = held_histories(committed, oracles, trace)
        if held != committed:
            trace = RowFollower.of_run(run, held, oracles).follow()
        return without_wasted(trace, run.recording.target_calls, committed)

    return cached(run, "I2", "rows", follow)


# ---------------------------------------------------------------------------------------
# Which forwards chose the committed tokens

WASTE_RULES = frozenset({"input-token", "history-token"})  # a draft fed where the target's token is known


def without_wasted(trace: RowTrace, calls: Sequence[CallRecord], committed: Sequence[tuple[int, ...]]) -> RowTrace:
    """The trace without the faults of forwards whose logits chose no committed token.

    A decoder may verify over several forwards and waste some: split verification forwards the
    pending token alone, then drafts alone, even after the first call's logits already rejected the
    first draft (an input at a position not yet committed is a draft, whatever the target predicted
    there). Such a forward's logits are thrown away, so its inputs cannot change the output. A row's
    'input-token' or 'history-token' fault is dropped when every committed token of its request from
    the fault on was chosen elsewhere: by a faultless row whose attended stream up to that input is
    the request's history at positions 0, 1, 2, ... and whose top-1 there is the committed token
    (`CallRecord.choices`). A fault whose forward could have chosen any of them stays; so does a
    row mix-up (another request's token) and every fault of a run whose target returned no logits."""
    faulty = {(f.call, f.row) for f in trace.faults}
    chosen = chosen_tokens(trace.views, calls, committed, faulty)

    def wasted(fault: Fault) -> bool:
        if fault.rule not in WASTE_RULES or fault.other is not None or fault.request is None:
            return False
        start = fault.expected_position
        sequence = committed[fault.request]
        return start is not None and all((fault.request, j) in chosen for j in range(start, len(sequence)))

    dropped = {(f.call, f.row) for f in trace.faults if wasted(f)}
    if not dropped:
        return trace
    views = tuple(replace(v, consistent=True) if (v.call, v.row) in dropped else v for v in trace.views)
    return RowTrace(views, tuple(f for f in trace.faults if (f.call, f.row) not in dropped))


def chosen_tokens(
    views: Sequence[RowView],
    calls: Sequence[CallRecord],
    committed: Sequence[tuple[int, ...]],
    faulty: set[tuple[int | None, int | None]],
) -> set[tuple[int, int]]:
    """(request, index) of every committed token some faultless row's logits chose: its input at
    stream index i - 1 attends the request's history through i - 1 and its top-1 is token i."""
    chosen: set[tuple[int, int]] = set()
    for view in views:
        call = calls[view.call]
        if (view.call, view.row) in faulty or call.choices is None or call.input_ids is None:
            continue
        sequence = committed[view.request]
        clean = common_prefix(view.stream, sequence)
        columns = attended_inputs(call, view.row)
        skipped = call.input_ids.shape[1] - call.choices.shape[1]  # logits kept for the last columns only
        for i in range(view.past, min(clean, len(sequence) - 1, view.past + len(columns))):
            column = columns[i - view.past] - skipped
            if column >= 0 and int(call.choices[view.row, column]) == sequence[i + 1]:
                chosen.add((view.request, i + 1))
    return chosen


def attended_inputs(call: CallRecord, row: int) -> list[int]:
    """The input columns row `row` attends, in order (its current entries of the stream)."""
    return input_mask(call)[row].nonzero()[:, 0].tolist()


def held_histories(
    committed: Sequence[tuple[int, ...]], oracles: Sequence[tuple[int, ...]], trace: RowTrace
) -> list[tuple[int, ...]]:
    """Per request, the history its cache should hold: the prompt and the decoder's output, but
    the oracle's where the output first parts from the oracle while the row's cache holds the
    oracle's token there, and no other request's (an output that drops or changes a token the
    target verified): the cache is then right and the output wrong, which equivalence reports,
    not I2."""
    held = list(committed)
    for fault in trace.faults:
        r, index = fault.request, fault.expected_position
        if r is None or index is None or fault.found_token is None or fault.other is not None:
            continue  # a token that is another request's is a row mix-up, whatever the oracle says
        mine, oracle = committed[r], oracles[r]
        at_divergence = index == common_prefix(mine, oracle) < min(len(mine), len(oracle))
        if at_divergence and (fault.found_token, fault.found_position) == (oracle[index], index):
            held[r] = oracle
    return held
