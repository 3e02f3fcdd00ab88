"""The paged, variable-length layout of a paged engine (vLLM, transformers' continuous batching),
judged per forward: the registry's `paged` check, on a `running.paged.PagedRun`'s trace.

Reads a `PagedTrace` (`specaudit.running.paged`, recorded by each engine's observer): per target forward the packed
tokens and positions, `query_start_loc`, `seq_lens`, `slot_mapping`, `block_table`, the
request ids in batch order, and per step what each request had committed. Rows are bound to
requests by the engine's own ids, so nothing is guessed. With `before` a request's prompt and
committed tokens before the step, and `c` the number of its leading positions whose K/V hold
`before` (fed in earlier forwards; at most len(before) - 1, whose last token has no K/V yet),
the rules are:

  query-spans      the query spans partition the packed tokens, one per request, in order;
  live-request     every request in the batch was added and has not finished or been aborted;
  context-length   seq_len = c + query length: committed tokens plus the query, no rejected draft;
  query-positions  the query sits at positions c, c + 1, ... (after a rejection, from the
                   committed length, never past a rejected draft);
  query-tokens     query tokens at committed positions are the committed tokens;
  draft-count      at most K drafts follow the committed ones;
  slot-mapping     token at position p is written at block_table[p // B] * B + p % B of its request;
  block-shared     no block is written by two live requests;
  kv-provenance    every past slot a request attends was last written by that request, at that
                   position, with its committed token (not a rejected draft, not another's,
                   unless a shared prefix block: the same tokens, written by an earlier forward
                   or earlier in the layers of this one);
  kv-overwritten   the K/V read from such a slot are the ones written there (nothing wrote
                   behind the slot mapping's back);
  greedy-commit    what the step commits is greedy acceptance of the target's own argmax: the
                   drafts that match, then the target's token (the bonus comes from the target);
  kv-entry         (given a batch-size-1 `reference`) the K/V computed for each token that ends
                   up committed are that request's batch-size-1 entries at its position.

So provenance, no overwrite and kv-entry together say: the K/V read for every attended slot
are the request's batch-size-1 entries, stale K/V of a rejected draft or a reused block being
a violation with its slot.

Pure functions over the recorded tensors; torch only, no vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from specaudit.contracts.rules import PAGED_RULES
from specaudit.contracts.violation import Violation
from specaudit.running.paged import PagedCall, PagedTrace, Reference

CHECK = "paged"
RULES = PAGED_RULES
KV_TOLERANCE = 1e-3  # float32: max |written - batch-size-1| relative to the request's largest entry


@dataclass(frozen=True)
class Write:
    """Who last wrote a cache slot: request, position, token, target forward."""

    request: str
    position: int
    token: int
    call: int


@dataclass
class WriteLedger:
    """What the forwards so far wrote: per slot its last write, per block its last writer,
    per request what was fed at each position (the K/V it holds)."""

    slots: dict[int, Write] = field(default_factory=dict)
    blocks: dict[int, Write] = field(default_factory=dict)
    fed: dict[str, dict[int, int]] = field(default_factory=dict)
    cached_prefix: dict[str, int] = field(default_factory=dict)  # a prefix-cache hit at the first forward
    tables: dict[str, set[int]] = field(default_factory=dict)  # each request's blocks at its latest forward
    forward: dict[int, Write] = field(default_factory=dict)  # the forward being judged: what it writes, per slot
    forward_fed: dict[str, dict[int, int]] = field(default_factory=dict)  # and what it feeds, per request

    def same_prefix(self, writer: str, before: tuple[int, ...], end: int) -> bool:
        """Whether `writer` fed `before`'s tokens wherever it fed positions 0..end-1: a block it
        wrote then holds what the reader's own would (a block shared by content, e.g. transformers
        de-duplicating a completed block into an identical one)."""
        fed = self.fed.get(writer, {})
        return all(fed.get(i, before[i]) == before[i] for i in range(min(end, len(before))))

    def same_prefix_now(self, writer: str, before: tuple[int, ...], end: int) -> bool:
        """`same_prefix`, counting what `writer` feeds in the forward being judged too."""
        fed = {**self.fed.get(writer, {}), **self.forward_fed.get(writer, {})}
        return all(fed.get(i, before[i]) == before[i] for i in range(min(end, len(before))))

    def valid(self, request: str, before: tuple[int, ...]) -> int:
        """Leading positions whose K/V hold the committed tokens."""
        fed, n = self.fed.get(request, {}), self.cached_prefix.get(request, 0)
        while n < len(before) and fed.get(n) == before[n]:
            n += 1
        return n


@dataclass(frozen=True)
class PagedRow:
    """One request of one forward, read as Python values."""

    call: PagedCall
    row: int
    request: str
    number: int  # the request's index in arrival order
    start: int  # its query span in the packed tokens
    end: int
    before: tuple[int, ...]
    due: int  # c: where its query must start

    @property
    def query(self) -> int:
        return self.end - self.start

    def bad(self, rule: str, found: str, expected: str, slot: int | None = None, **evidence: object) -> Violation:
        where = f"step {self.call.step}, request {self.request!r}: "
        evidence = {"request_id": self.request, "step": self.call.step, **evidence}
        return Violation(CHECK, rule, where + found, expected, self.call.index, self.row, slot, self.number, evidence)


def check_paged(
    trace: PagedTrace, reference: Reference | None = None, tolerance: float = KV_TOLERANCE
) -> list[Violation]:
    """Every rule on every target forward, forward by forward, each forward's cause first (one
    violation per request, call and rule; see `cause_first`); kv-entry only with a `reference`
    (e.g. `adapters.vllm.observer.hf_kv_reference`) and recorded K/V."""
    ledger, found = WriteLedger(), []
    entries = Entries(trace, reference, tolerance) if reference is not None else None
    order = {r: i for i, r in enumerate(trace.prompts)}
    last_call = {(rid, c.step): c.index for c in trace.calls for rid in c.request_ids}
    for call in trace.calls:
        spans = span_violations(call, trace)
        if any(v.rule == "query-spans" for v in spans):
            found += spans
            continue
        here = list(spans)
        rows = [bind(call, b, rid, order, trace, ledger) for b, rid in enumerate(call.request_ids)]
        ledger.forward, ledger.forward_fed = forward_writes(call, rows)
        for row in rows:
            here += list(row_violations(row, trace, ledger))
            if last_call[(row.request, call.step)] == call.index:
                here += greedy_violations(row, trace)
            if entries is not None:
                here += entries.violations(row)
        here += block_violations(call, rows, trace, ledger)
        found += cause_first(here)
        record(call, rows, ledger)
    return found


def cause_first(violations: list[Violation]) -> list[Violation]:
    """One forward's violations, causes before effects: in RULES order, layout rules (spans,
    lengths, positions, slots, a block written by two live requests) before the K/V read through
    them (provenance, overwrites, entries that differ from batch size 1), whatever request each
    names; stable, so one rule's violations keep the batch's order."""
    return sorted(violations, key=lambda v: RULES.index(v.rule))


def span_violations(call: PagedCall, trace: PagedTrace) -> list[Violation]:
    """The spans partition the packed tokens, one per request; every request is live."""
    qsl = call.query_start_loc.tolist()
    n, rows = call.input_ids.shape[0], len(call.request_ids)
    out = []

    def bad(rule: str, found: str, expected: str, **evidence: object) -> None:
        out.append(Violation(CHECK, rule, f"step {call.step}: {found}", expected, call.index, evidence=evidence))

    if len(qsl) != rows + 1 or call.seq_lens.shape[0] != rows:
        bad("query-spans", f"{len(qsl)} query starts and {call.seq_lens.shape[0]} seq_lens", f"{rows + 1} and {rows}")
    elif qsl[0] != 0 or qsl[-1] != n or any(b < a for a, b in zip(qsl, qsl[1:])):
        bad("query-spans", f"query_start_loc {qsl} over {n} packed tokens", f"0 = ... <= ... = {n}, nondecreasing")
    if len(set(call.request_ids)) != rows:
        bad("query-spans", f"request ids {list(call.request_ids)}", "each request once")
    for rid in call.request_ids:
        if rid not in trace.prompts or not trace.live(rid, call.step):
            state = "aborted" if rid in trace.aborted else "not running"
            bad("live-request", f"request {rid!r} ({state}) in the batch", "only running requests", request_id=rid)
    return out


def bind(call: PagedCall, b: int, rid: str, order: dict[str, int], trace: PagedTrace, ledger: WriteLedger) -> PagedRow:
    """Row `b` of the call as its request, with where its query must start."""
    start, end = call.span(b)
    before = trace.committed(rid, call.step - 1) if rid in trace.prompts else ()
    actual = int(call.seq_lens[b]) - (end - start)
    if rid not in ledger.fed and 0 < actual < len(before) and actual % call.block_size == 0:
        ledger.cached_prefix[rid] = actual  # its first forward reuses cached prefix blocks
    due = min(ledger.valid(rid, before), max(len(before) - 1, 0))
    return PagedRow(call, b, rid, order.get(rid, -1), start, end, before, due)


def expected_slot(call: PagedCall, row: int, position: int) -> int | None:
    """block_table[p // B] * B + p % B of the request (None: past the end of its table)."""
    index = position // call.block_size
    if index >= call.block_table.shape[1]:
        return None
    return int(call.block_table[row, index]) * call.block_size + position % call.block_size


def row_violations(row: PagedRow, trace: PagedTrace, ledger: WriteLedger) -> Iterator[Violation]:
    """The request's context length, positions, tokens, drafts, slots and attended past."""
    call, q, c = row.call, row.query, row.due
    seq_len = int(call.seq_lens[row.row])
    positions = call.positions[row.start : row.end].tolist()
    tokens = call.input_ids[row.start : row.end].tolist()
    slots = call.slot_mapping[row.start : row.end].tolist()
    committed = len(row.before)
    if seq_len != c + q:
        yield row.bad(
            "context-length",
            f"seq_len {seq_len} for a query of {q}",
            f"{c + q}: {c} committed tokens with K/V plus the query of {q}",
            found_length=seq_len,
            expected_length=c + q,
        )
    wrong = next((i for i, p in enumerate(positions) if p != c + i), None)
    if wrong is not None:
        yield row.bad(
            "query-positions",
            f"query token {wrong} (token {tokens[wrong]}) at position {positions[wrong]}",
            f"position {c + wrong} (the query continues the committed length {c})",
            slots[wrong],
            found_position=positions[wrong],
            expected_position=c + wrong,
            index=wrong,
        )
    wrong = next((i for i in range(min(q, committed - c)) if tokens[i] != row.before[c + i]), None)
    if wrong is not None:
        yield row.bad(
            "query-tokens",
            f"query token {wrong} at position {c + wrong} is token {tokens[wrong]}",
            f"the committed token {row.before[c + wrong]}",
            slots[wrong],
            found_token=tokens[wrong],
            expected_token=row.before[c + wrong],
            expected_position=c + wrong,
        )
    drafts = q - max(committed - c, 0)
    if drafts > trace.num_speculative_tokens:
        yield row.bad("draft-count", f"{drafts} draft tokens in the query", f"at most {trace.num_speculative_tokens}")
    yield from slot_violations(row, slots, tokens)
    yield from past_violations(row, seq_len - q, ledger)


def slot_violations(row: PagedRow, slots: list[int], tokens: list[int]) -> Iterator[Violation]:
    """Each query token written at its own request's slot for its (due) position."""
    for i, slot in enumerate(slots):
        position = row.due + i
        want = expected_slot(row.call, row.row, position)
        if slot != want:
            table = row.call.block_table[row.row]
            block = int(table[min(position // row.call.block_size, table.shape[0] - 1)])
            yield row.bad(
                "slot-mapping",
                f"token {tokens[i]} at position {position} written to slot {slot}",
                f"slot {want} (block {block} * {row.call.block_size} + {position % row.call.block_size})",
                slot,
                found_slot=slot,
                expected_slot=want,
                expected_position=position,
            )
            return


def past_violations(row: PagedRow, past: int, ledger: WriteLedger) -> Iterator[Violation]:
    """Every past slot the request attends holds its own committed entry, as written: by an
    earlier forward, or by another request sharing the block in this very forward (a prefix hit
    on a block registered in the step that allocates it), whose write precedes the read in every
    layer (a paged engine writes each layer's K/V for all packed tokens before that layer's
    attention reads the cache)."""
    for p in range(max(past, 0)):
        slot = expected_slot(row.call, row.row, p)
        write = ledger.slots.get(slot) if slot is not None else None
        now = ledger.forward.get(slot) if slot is not None else None
        want = row.before[p] if p < len(row.before) else None
        shared = p < ledger.cached_prefix.get(row.request, 0)  # a cached prefix block: anyone's, same token
        block_end = (p // row.call.block_size + 1) * row.call.block_size
        if now is not None and now.request != row.request:  # the latest write when this forward's layers read
            write, shared = now, shared or ledger.same_prefix_now(now.request, row.before, block_end)
        shared = shared or (write is not None and ledger.same_prefix(write.request, row.before, block_end))
        if write is None or write.position != p or write.token != want or (write.request != row.request and not shared):
            yield provenance(row, p, slot, write, want)
            return
    yield from drift_violations(row, ledger)


def drift_violations(row: PagedRow, ledger: WriteLedger) -> Iterator[Violation]:
    """The attended past blocks hold what the forwards that wrote them left there."""
    call = row.call
    if call.kv_drift is None:
        return
    offset = call.drift_offsets()[row.row]
    for i in range(call.drift_offsets()[row.row + 1] - offset):
        drift = float(call.kv_drift[offset + i])
        if drift > 0:
            block = int(call.block_table[row.row, i])
            last = ledger.blocks.get(block)
            written = f" since call {last.call} wrote it" if last is not None else ""
            yield row.bad(
                "kv-overwritten",
                f"attended block {block} (positions {i * call.block_size}..) whose K/V moved by {drift:.3g}{written}",
                "the K/V the forwards wrote there through the slot mapping, unchanged",
                block * call.block_size,
                kv_distance=drift,
                block=block,
            )
            return


def provenance(row: PagedRow, p: int, slot: int | None, write: Write | None, want: int | None) -> Violation:
    past_end = f"nothing (position {p} is past its committed {len(row.before)})"
    expected = f"its own token {want} at position {p}" if want is not None else past_end
    if write is None:
        found = f"attended slot {slot} (position {p}) never written"
    else:
        who = "itself" if write.request == row.request else f"request {write.request!r}"
        kind = " (a rejected draft)" if write.request == row.request and write.position == p else ""
        entry = f"token {write.token} at position {write.position}{kind}"
        found = f"attended slot {slot} (position {p}) last written by {who} in call {write.call}: {entry}"
    evidence = {"expected_token": want, "expected_position": p, "other_request": None}
    if write is not None:
        evidence.update(
            found_token=write.token, found_position=write.position, writer=write.request, written_in=write.call
        )
        if write.request != row.request:
            evidence["other_request"] = write.request
    return row.bad("kv-provenance", found, expected, slot, **evidence)


def greedy_violations(row: PagedRow, trace: PagedTrace) -> list[Violation]:
    """The step's new tokens: the drafts matching the target's argmax, then the target's own token."""
    call, c, q = row.call, row.due, row.query
    committed = len(row.before)
    if call.greedy is None or row.request not in trace.prompts or c + q < committed:
        return []
    tokens = call.input_ids[row.start : row.end].tolist()
    greedy = call.greedy[row.start : row.end].tolist()
    j = committed - c - 1  # the last committed token's index in the query
    if j < 0:
        return []
    expected = [greedy[j]]
    while j + 1 < q and tokens[j + 1] == greedy[j]:
        j += 1
        expected.append(greedy[j])
    new = list(trace.committed(row.request, call.step)[committed:])
    ended = trace.left.get(row.request) == call.step
    if new == expected or (ended and new == expected[: len(new)]):
        return []
    at = next((i for i, (a, b) in enumerate(zip(new, expected)) if a != b), min(len(new), len(expected)))
    found = f"committed {new} after a query of {q} (drafts {tokens[committed - c :]})"
    want = f"{expected}: the drafts equal to the target's argmax, then the target's token"
    position = committed + at
    return [
        row.bad(
            "greedy-commit",
            found,
            want,
            found_tokens=new,
            expected_tokens=expected,
            expected_position=position,
            found_token=new[at] if at < len(new) else None,
            expected_token=expected[at] if at < len(expected) else None,
        )
    ]


@dataclass
class Entries:
    """Each request's batch-size-1 K/V over its final committed tokens (computed once), and the
    comparison of what a forward wrote for a token that ended up committed."""

    trace: PagedTrace
    reference: Reference
    tolerance: float
    cache: dict[str, tuple[tuple[int, ...], torch.Tensor, float]] = field(default_factory=dict)

    def of(self, request: str) -> tuple[tuple[int, ...], torch.Tensor, float]:
        if request not in self.cache:
            final = self.trace.committed(request, len(self.trace.commits))
            ref = self.reference(final)  # [n, L', 2, kv_heads, head_dim]
            self.cache[request] = final, ref, float(ref.abs().max()) or 1.0
        return self.cache[request]

    def violations(self, row: PagedRow) -> list[Violation]:
        """The first committed query token whose written K/V are not its batch-size-1 entries."""
        written = row.call.written_kv
        if written is None or row.request not in self.trace.prompts:
            return []
        final, ref, scale = self.of(row.request)
        tokens = row.call.input_ids[row.start : row.end].tolist()
        for i, token in enumerate(tokens):
            p = row.due + i
            if p >= len(final) or token != final[p]:
                return []  # from here on drafts that were rejected (their K/V attended a wrong prefix)
            distance = float((written[row.start + i] - ref[p]).abs().max()) / scale
            if distance > self.tolerance:
                slot = int(row.call.slot_mapping[row.start + i])
                return [
                    row.bad(
                        "kv-entry",
                        f"K/V written for token {token} at position {p} (slot {slot}) differ from the batch-size-1 run "
                        f"by {distance:.3g} of the largest entry",
                        f"its batch-size-1 entries (within {self.tolerance:g})",
                        slot,
                        kv_distance=distance,
                        kv_bound=self.tolerance,
                        expected_token=token,
                        expected_position=p,
                    )
                ]
        return []


def block_violations(call: PagedCall, rows: list[PagedRow], trace: PagedTrace, ledger: WriteLedger) -> list[Violation]:
    """No block written by two live requests: in this forward, or after another live one wrote it."""
    out, writers = [], {}
    for row in rows:
        for slot in call.slot_mapping[row.start : row.end].tolist():
            if slot < 0:
                continue
            block = slot // call.block_size
            other = writers.get(block)
            if other is None:
                last = ledger.blocks.get(block)
                if last is not None and last.request != row.request and trace.live(last.request, call.step):
                    other = last.request if holds(call, rows, ledger, last.request, block) else None
            if other is not None and other != row.request:
                out.append(
                    row.bad(
                        "block-shared",
                        f"block {block} written (slot {slot}) while live request {other!r} holds it",
                        "a block of its own",
                        slot,
                        other_request=other,
                        block=block,
                    )
                )
                break
            writers[block] = row.request
    return out


def holds(call: PagedCall, rows: list[PagedRow], ledger: WriteLedger, request: str, block: int) -> bool:
    """Whether `request` still has `block` in its table (this forward's, else its latest seen):
    a block it gave back (freed, or swapped for an identical shared one) is not its any more."""
    mine = [set(call.block_table[r.row].tolist()) for r in rows if r.request == request]
    table = mine[0] if mine else ledger.tables.get(request)
    return table is None or block in table


def forward_writes(call: PagedCall, rows: list[PagedRow]) -> tuple[dict[int, Write], dict[str, dict[int, int]]]:
    """What a forward writes (per slot, the last write in packed order) and feeds (per request,
    token by position), before its attention reads: what `record` then keeps."""
    writes: dict[int, Write] = {}
    fed: dict[str, dict[int, int]] = {}
    for row in rows:
        positions = call.positions[row.start : row.end].tolist()
        tokens = call.input_ids[row.start : row.end].tolist()
        mine = fed.setdefault(row.request, {})
        for position, token, slot in zip(positions, tokens, call.slot_mapping[row.start : row.end].tolist()):
            mine[position] = token
            if slot >= 0:
                writes[slot] = Write(row.request, position, token, call.index)
    return writes, fed


def record(call: PagedCall, rows: list[PagedRow], ledger: WriteLedger) -> None:
    """What this forward wrote: each token's K/V at its slot, at the position the model computed."""
    for row in rows:
        ledger.tables[row.request] = set(call.block_table[row.row].tolist())
        fed = ledger.fed.setdefault(row.request, {})
        positions = call.positions[row.start : row.end].tolist()
        tokens = call.input_ids[row.start : row.end].tolist()
        for position, token, slot in zip(positions, tokens, call.slot_mapping[row.start : row.end].tolist()):
            fed[position] = token
            if slot >= 0:
                write = Write(row.request, position, token, call.index)
                ledger.slots[slot] = write
                ledger.blocks[slot // call.block_size] = write
