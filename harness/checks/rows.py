"""Row identity: which request each row of each target call holds, followed by construction.

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
  7. continuity: the row the request held before, or its rank in case order if not yet seen.

Content never re-picks a request on its own: requests whose histories coincide (a prompt
that is a prefix of another's history, duplicate prompts) are told apart by progress and
continuity. What a row attends against what its request needs is then judged from the
facts gathered here (`Fault`, phrased by `specaudit.checks.i2`).

Reading is vectorized: per call one [B, W] stream of attended (token, position, slot), and
one [B, R, W] comparison with every request's sequence; Python only walks the B matches.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from specaudit.checks.i1 import implied_positions
from specaudit.fixtures.pairs import DTYPES, KV_TOLERANCE, is_exact
from specaudit.fixtures.transparent import fit_mask, read_slots
from specaudit.instrument import CallRecord
from specaudit.reference.oracle import reference_kv
from specaudit.runner import Run

UNKNOWN = -1  # a token or position the call does not show (a real model's past; beyond a row's stream)
NO_TOKEN = -2  # beyond a request's sequence


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

    rule: str  # "attends-wrong-slot", "row-identity", "position-ids", "input-token", "cache-readable"
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


@dataclass(frozen=True)
class Observation:
    """One call's rows as streams of attended entries, past then current, left-aligned. [B, W]"""

    tokens: torch.Tensor  # [B, W] UNKNOWN for a real model's past and beyond a row's length
    positions: torch.Tensor  # [B, W]
    slots: torch.Tensor  # [B, W] cache slot of each entry
    past: torch.Tensor  # [B] attended past slots m
    length: torch.Tensor  # [B] attended entries L (past + current)


# ---------------------------------------------------------------------------------------
# Reading one call


def observe(call: CallRecord, exact: bool) -> Observation:
    """The attended stream of every row: one scatter per tensor, no loop over rows."""
    ids = call.input_ids
    assert ids is not None
    batch, width = ids.shape
    past = call.past_length
    mask = fit_mask(call.attention_mask, batch, past + width).bool()  # [B, P + T], what the model applied
    past_tokens = torch.full((batch, past), UNKNOWN, dtype=torch.long)
    past_positions = past_tokens.clone()
    if exact and past and call.cache_after and call.cache_after[0][0].shape[2] >= past:
        tokens, positions = read_slots(call.cache_after[0][0])  # [B, S]
        past_tokens, past_positions = tokens[:, :past], positions[:, :past]
    try:
        current_positions = implied_positions(call, batch, width)  # [B, T]
    except RuntimeError:  # position ids of a shape I1 reports
        current_positions = torch.full((batch, width), UNKNOWN, dtype=torch.long)
    tokens = torch.cat([past_tokens, ids.long()], dim=1)  # [B, P + T]
    positions = torch.cat([past_positions, current_positions], dim=1)
    rank = mask.long().cumsum(1) - 1  # stream index of each attended slot
    length = mask.sum(1)  # [B]
    w = int(length.max()) if batch else 0
    index = torch.where(mask, rank, w)  # unattended slots go to a spill column

    def stream(values: torch.Tensor) -> torch.Tensor:
        return torch.full((batch, w + 1), UNKNOWN, dtype=torch.long).scatter_(1, index, values)[:, :w]

    slots = torch.arange(past + width).expand(batch, -1)
    return Observation(stream(tokens), stream(positions), stream(slots), mask[:, :past].sum(1), length)


def common_prefixes(obs: Observation, sequences: torch.Tensor, lengths: torch.Tensor, exact: bool) -> torch.Tensor:
    """[B, R] how many leading stream entries hold request r's sequence at positions 0, 1, ...

    A real model's past slots are unknown here and count as matching (their K/V are compared
    with the batch-size-1 run once the row is bound); the result never passes the row's
    length or the request's.
    """
    width = obs.tokens.shape[1]
    seq = sequences[:, :width]
    if seq.shape[1] < width:
        seq = torch.cat([seq, seq.new_full((seq.shape[0], width - seq.shape[1]), NO_TOKEN)], dim=1)
    index = torch.arange(width)
    same = (obs.tokens[:, None, :] == seq[None]) & (obs.positions == index)[:, None, :]  # [B, R, W]
    free = index[None, :] >= obs.length[:, None]  # beyond the row's stream
    if not exact:
        free |= index[None, :] < obs.past[:, None]
    bad = ~(same | free[:, None, :])
    first = torch.where(bad.any(-1), bad.int().argmax(-1), width)  # [B, R]
    return torch.minimum(torch.minimum(first, obs.length[:, None]), lengths[None, :])


# ---------------------------------------------------------------------------------------
# Real models: attended K/V against a batch-size-1 run


class KVReader:
    """Compares a row's attended past K/V with what a batch-size-1 run puts there."""

    def __init__(self, run: Run) -> None:
        self.target = run.target
        self.rtol, self.atol = KV_TOLERANCE[DTYPES[run.case.dtype]]
        self._refs: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def reference(self, tokens: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if tokens not in self._refs:
            self._refs[tokens] = reference_kv(self.target, tokens)
        return self._refs[tokens]

    def first_mismatch(
        self, call: CallRecord, row: int, slots: Sequence[int], tokens: tuple[int, ...]
    ) -> tuple[int, float] | None:
        """(index, largest deviation) of the first attended past slot whose K/V differ from the
        batch-size-1 run of `tokens` (slots past the end of `tokens` are not judged)."""
        m = min(len(slots), len(tokens))
        if m == 0:
            return None
        index = torch.tensor(slots[:m], dtype=torch.long)
        ok = torch.ones(m, dtype=torch.bool)
        worst = torch.zeros(m, dtype=torch.float64)
        for (k, v), (rk, rv) in zip(call.cache_after, self.reference(tokens)):
            for found, want in ((k[row][:, index], rk[:, :m]), (v[row][:, index], rv[:, :m])):  # [H, m, D]
                found, want = found.double(), want.double()
                ok &= torch.isclose(found, want, rtol=self.rtol, atol=self.atol).all(-1).all(0).cpu()
                worst = torch.maximum(worst, (found - want).abs().amax(dim=(0, 2)).cpu())
        if bool(ok.all()):
            return None
        i = int((~ok).int().argmax())
        return i, float(worst[i])


# ---------------------------------------------------------------------------------------
# Following rows


class RowFollower:
    """Walks the target calls once, binding rows to requests and noting the first fault of each row."""

    def __init__(self, run: Run) -> None:
        assert run.outputs is not None
        self.run = run
        self.exact = is_exact(run.case.model)
        self.kv = None if self.exact else KVReader(run)
        self.prompts = run.case.prompts
        self.sequences = [p + tuple(o) for p, o in zip(self.prompts, run.outputs)]
        self.lengths = torch.tensor([len(s) for s in self.sequences])  # [R]
        width = int(self.lengths.max())
        self.table = torch.tensor([list(s) + [NO_TOKEN] * (width - len(s)) for s in self.sequences])  # [R, Ls]
        self.state = [Followed(len(p)) for p in self.prompts]
        self.seen = [False] * len(self.prompts)
        self.history: list[list[int]] = [[] for _ in self.prompts]  # per request, its views' indices
        self.draft_orders = sorted(c.order for c in run.recording.draft_calls)
        self.k = run.case.num_draft_tokens
        self.views: list[RowView] = []
        self.faults: list[Fault] = []

    def follow(self) -> RowTrace:
        for call in self.run.recording.target_calls:
            if call.input_ids is None or call.input_ids.dim() != 2 or not call.sampled:
                continue  # I1 reports a malformed call; unsampled calls keep no snapshot (real-model mode)
            if call.past_length and not call.cache_after:
                self.faults.append(Fault("cache-readable", call.index))
                continue
            self.visit(call)
        return RowTrace(tuple(self.views), tuple(self.faults))

    def draft_between(self, before: int | None, after: int) -> bool:
        """Was the draft called between two calls (a new round, so no chunk can span them)?"""
        if before is None:
            return True
        return bisect.bisect_right(self.draft_orders, before) < bisect.bisect_left(self.draft_orders, after)

    def chunks(self, call: CallRecord, obs: Observation) -> torch.Tensor:
        """[B, R] row b repeats request r's previous call as its past, with no draft call since."""
        batch, requests = obs.past.shape[0], len(self.state)
        out = torch.zeros(batch, requests, dtype=torch.bool)
        by_past: dict[int, list[int]] = {}
        for b, m in enumerate(obs.past.tolist()):
            by_past.setdefault(m, []).append(b)
        for r, s in enumerate(self.state):
            if s.stream is None or len(s.stream) not in by_past or self.draft_between(s.order, call.order):
                continue
            rows = torch.tensor(by_past[len(s.stream)])
            m = len(s.stream)
            if not self.exact:
                out[rows, r] = True  # K/V judged once bound
                continue
            want = torch.tensor(s.stream)
            same = (obs.tokens[rows, :m] == want).all(1) & (obs.positions[rows, :m] == torch.arange(m)).all(1)
            out[rows, r] = same
        return out

    def drafted(self, call: CallRecord) -> torch.Tensor:
        """[R] was the draft called since each request's last call (since the start if unseen)?"""
        return torch.tensor([self.draft_between(-1 if s.order is None else s.order, call.order) for s in self.state])

    def scores(self, call: CallRecord, obs: Observation, cp: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
        """[B, R] preference of binding row b to request r (see the module docstring)."""
        m, length = obs.past[:, None], obs.length[:, None]  # [B, 1]
        lengths = self.lengths[None, :]  # [1, R]
        known = torch.tensor([s.known for s in self.state])[None, :]
        first = torch.minimum(m + (length > m).long(), lengths)  # past plus the first input
        fresh = cp >= first
        own_past = (cp >= torch.minimum(m, lengths)) | chunk  # a chunk's past is its round's earlier entries
        running = known < lengths
        # entries past the committed ones are drafts: at most K, and only after a draft call
        feasible = (length <= known + self.k * self.drafted(call)[None, :]) | chunk
        at_progress = (fresh & (m == known - 1)) | chunk
        covers = length >= known
        flags = (fresh | chunk, own_past, running, feasible, at_progress, covers)
        base = torch.zeros_like(cp)
        for flag in flags:  # lexicographic: each flag outweighs all the ones after it
            base = 2 * base + flag.long()
        return torch.where(length > 0, (base * (cp.max() + 1) + cp).double() + self.continuity(cp.shape), -1.0)

    def continuity(self, shape: torch.Size) -> torch.Tensor:
        """[B, R] in [0, 1): the row a request held before, else its rank in case order if unseen."""
        batch, requests = shape
        rows = torch.arange(batch)[:, None].double()
        before = torch.tensor([-1 if s.row is None else s.row for s in self.state]).double()[None, :]
        unseen = torch.tensor(self.seen).logical_not()
        rank = (unseen.long().cumsum(0) - 1).double()[None, :]  # rank among requests not yet seen
        spread = 4.0 * (batch + requests + 1)
        return torch.where(
            unseen[None, :],
            0.8 - (rows - rank).abs() / spread,
            torch.where(rows == before, 0.9, 0.4 - (rows - before).abs() / spread),
        )

    @staticmethod
    def assign(score: torch.Tensor) -> list[tuple[int, int]]:
        """Greedy one-to-one matching, best pairs first: (row, request) in row order."""
        batch, requests = score.shape
        taken_rows: set[int] = set()
        taken: set[int] = set()
        pairs = []
        flat = score.flatten()
        values = flat.tolist()
        for k in torch.argsort(flat, descending=True, stable=True).tolist():
            b, r = divmod(k, requests)
            if values[k] < 0:
                break
            if b in taken_rows or r in taken:
                continue
            taken_rows.add(b)
            taken.add(r)
            pairs.append((b, r))
            if len(taken_rows) == batch or len(taken) == requests:
                break
        return sorted(pairs)

    def visit(self, call: CallRecord) -> None:
        obs = observe(call, self.exact)
        cp = common_prefixes(obs, self.table, self.lengths, self.exact)  # [B, R]
        chunk = self.chunks(call, obs)
        pairs = self.assign(self.scores(call, obs, cp, chunk))
        tokens, positions, slots = obs.tokens.tolist(), obs.positions.tolist(), obs.slots.tolist()
        self.confirm_prefills(pairs, obs.past.tolist(), tokens)
        own_past = cp >= torch.minimum(obs.past[:, None], self.lengths[None, :])
        for b, r in pairs:
            m, length = int(obs.past[b]), int(obs.length[b])
            row = Row(call, b, r, m, length, tokens[b][:length], positions[b][:length], slots[b][:length])
            fault, is_chunk, stream = self.judge(row, int(cp[b, r]), bool(chunk[b, r]), own_past[b])
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

    def confirm_prefills(self, pairs: list[tuple[int, int]], past: list[int], tokens: list[list[int]]) -> None:
        """A prefill binds for now; the next call confirms it. A row whose cached past is exactly
        the stream some request's prefill wrote continues that prefill, so the prefill is its
        request's (prompts that are prefixes of one another, the last token kept pending)."""
        prefills = {h[0]: r for r, h in enumerate(self.history) if len(h) == 1 and self.views[h[0]].past == 0}
        claims: dict[int, int] = {}  # prefill view -> the request whose row continues it
        for b, r in pairs:
            m = past[b]
            history = self.sequences[r][:m]
            if m == 0 or not prefills or (self.exact and tuple(tokens[b][:m]) != history):
                continue
            mine = self.history[r][0] if len(self.history[r]) == 1 else None
            if mine in prefills and self.views[mine].stream == history:
                continue
            claim = next((i for i in prefills if i not in claims and self.views[i].stream == history), None)
            if claim is not None:
                claims[claim] = r
        moved = {prefills[i] for i in claims} | set(claims.values())
        for i, r in claims.items():
            self.views[i] = replace(self.views[i], request=r)
        for r in moved:
            mine = [i for i in prefills if self.views[i].request == r]
            self.history[r] = mine
            self.seen[r] = bool(mine)
            self.state[r] = Followed(len(self.prompts[r]))
            if mine:
                view = self.views[mine[0]]
                self.advance(r, self.run.recording.target_calls[view.call], view.row, view.stream)

    def advance(self, r: int, call: CallRecord, b: int, stream: tuple[int, ...]) -> None:
        """The request's committed length after this call: its verified prefix plus the bonus."""
        sequence = self.sequences[r]
        known = max(self.state[r].known, min(len(sequence), common_prefix(stream, sequence) + 1))
        self.state[r] = replace(self.state[r], known=known, stream=stream, row=b, order=call.order)
        self.seen[r] = True

    def judge(self, row: Row, cp: int, chunk: bool, own_past: torch.Tensor) -> tuple[Fault | None, bool, tuple]:
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
        miss = self.kv.first_mismatch(row.call, row.row, past_slots, sequence) if m else None  # causal: a prefix
        if miss is not None and chunk and previous is not None:
            if self.kv.first_mismatch(row.call, row.row, past_slots, previous) is None:
                return self.input_fault(row, sequence, check_token=False), True, previous + tuple(row.tokens[m:])
        stream = tuple(history) + tuple(row.tokens[m:]) if m <= len(sequence) else tuple(row.tokens)
        if miss is not None:
            index, deviation = miss
            fault = Fault(
                "attends-wrong-slot",
                row.call.index,
                row.row,
                row.request,
                past_slots[index],
                expected_token=sequence[index],
                expected_position=index,
                kv_difference=deviation,
            )
            return fault, False, stream
        return self.input_fault(row, sequence, check_token=not fresh and not chunk), chunk and not fresh, stream

    def slot_fault(self, rule: str, row: Row, index: int, sequence: tuple[int, ...], other: int | None) -> Fault:
        inside = index < len(sequence)
        return Fault(
            rule,
            row.call.index,
            row.row,
            row.request,
            row.slots[index],
            row.tokens[index],
            row.positions[index],
            sequence[index] if inside else None,
            index if inside else None,
            other,
        )

    def input_fault(self, row: Row, sequence: tuple[int, ...], check_token: bool) -> Fault | None:
        """Current inputs sit at the next positions; a new round's first input is the request's
        next token (its pending token, or the prompt's last one kept pending)."""
        m, n = row.past, len(sequence)
        if m >= n:
            return None  # the request is complete: later entries cannot change its output
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
                    sequence[j] if j < n else None,
                    j,
                    input=j - m,
                )
        if check_token and row.length > m and row.tokens[m] != sequence[m]:
            return Fault(
                "input-token",
                row.call.index,
                row.row,
                row.request,
                row.slots[m],
                row.tokens[m],
                row.positions[m],
                sequence[m],
                m,
                self.pending_of(row.tokens[m], row.request),
                input=0,
            )
        return None

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


def follow_rows(run: Run) -> RowTrace:
    """Bind every row of every target call to its request (memoized per run)."""
    if "rows" not in run.memo:
        run.memo["rows"] = RowFollower(run).follow()
    return run.memo["rows"]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
