"""The checks: I1, I2, equivalence with the oracle, token preservation.

Each check reads a Run and returns evidence (Violation records); nothing here prints or
asserts. pytest, the CLI and (later) delta debugging call these same functions.

Rounds are counted in target calls: "target call c" is the decoder's c-th call of the target
(call 0 is usually the prefill, call c >= 1 the verification of round c).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specaudit.fixtures.pairs import DTYPES, KV_TOLERANCE, TIE_TOLERANCE, is_exact
from specaudit.fixtures.transparent import fit_mask, read_slots
from specaudit.instrument import CallRecord
from specaudit.reference.oracle import greedy_oracle, reference_kv
from specaudit.runner import Run
from specaudit.violation import Violation


def check_contract(run: Run) -> list[Violation]:
    if run.error is None:
        return []
    return [Violation("contract", run.error.rule, run.error.detail, "a run that keeps the decoder contract")]


# ---------------------------------------------------------------------------------------
# I1: rectangular alignment


def implied_positions(call: CallRecord, batch: int, width: int) -> torch.Tensor:
    """Position ids the model used: the ones passed, or HF's default past length + arange. [B, T]"""
    if call.position_ids is not None and call.position_ids.dim() == 2:
        return call.position_ids.expand(batch, width).long()
    return (call.past_length + torch.arange(width)).expand(batch, width)


def i1_call_violations(call: CallRecord) -> list[Violation]:
    """I1 for one target call: shapes agree, mask is [B, P + T], every row attends something."""
    v = []

    def bad(rule: str, found: str, expected: str, row: int | None = None) -> None:
        v.append(Violation("I1", rule, found, expected, call=call.index, row=row))

    ids = call.input_ids
    if ids is None or ids.dim() != 2:
        bad("input-shape", f"input_ids of shape {None if ids is None else tuple(ids.shape)}", "[B, T]")
        return v
    batch, width = ids.shape
    if len(set(call.layer_lengths)) > 1:
        bad("cache-length", f"cache layers of lengths {list(call.layer_lengths)}", "one length P in every layer")
    past = call.past_length
    if call.cache_batch is not None and call.cache_batch != batch:
        bad("cache-batch", f"a cache of {call.cache_batch} rows", f"{batch} rows like input_ids")
    pos = call.position_ids
    if pos is not None and (pos.dim() != 2 or pos.shape[-1] != width or pos.shape[0] not in (1, batch)):
        bad("position-shape", f"position_ids of shape {tuple(pos.shape)}", f"[{batch}, {width}]")
    mask = call.attention_mask
    if mask is None:
        return v
    if tuple(mask.shape) != (batch, past + width):
        bad(
            "mask-shape",
            f"attention_mask of shape {tuple(mask.shape)}",
            f"[{batch}, {past + width}] (P={past} + T={width})",
        )
        return v
    if not bool(((mask == 0) | (mask == 1)).all()):
        bad("mask-values", "attention_mask values other than 0 and 1", "a 0/1 mask")
    for row in (mask.sum(1) == 0).nonzero()[:, 0].tolist():
        bad("row-attends-nothing", "a row whose mask is all zeros", "at least one attended slot", row=row)
    return v


def check_i1(run: Run) -> list[Violation]:
    if not run.recording.target_calls and run.error is None:
        return [Violation("I1", "target-called", "no call of the target model", "at least one target forward")]
    return [v for call in run.recording.target_calls for v in i1_call_violations(call)]


# ---------------------------------------------------------------------------------------
# I2: position / KV correspondence


@dataclass(frozen=True)
class RowView:
    """What one batch row of one target call attends, resolved to a request of the case."""

    call: int
    row: int
    request: int
    past: int  # attended past slots
    consistent: bool  # past slots hold the request's tokens at positions 0..past-1
    stream: tuple[int, ...]  # attended tokens in order, past then current (drafts included)
    slots: tuple[int, ...]  # the cache slot of each stream entry


class SlotReader:
    """Compares attended past slots with what the request's sequence should put there."""

    def __init__(self, run: Run) -> None:
        assert run.outputs is not None
        self.run = run
        self.exact = is_exact(run.case.model)
        self.sequences = [p + tuple(o) for p, o in zip(run.case.prompts, run.outputs)]
        self._refs: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.rtol, self.atol = KV_TOLERANCE[DTYPES[run.case.dtype]]

    def reference(self, sequence: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if sequence not in self._refs:
            self._refs[sequence] = reference_kv(self.run.target, sequence)
        return self._refs[sequence]

    def matches(self, call: CallRecord, row: int, slots: list[int], sequence: tuple[int, ...]) -> torch.Tensor:
        """bool [m]: does attended past slot i hold sequence[i] at position i (m = min length)."""
        m = min(len(slots), len(sequence))
        index = torch.tensor(slots[:m], dtype=torch.long)
        if self.exact:
            tokens, positions = read_slots(call.cache_after[0][0][row : row + 1])
            want = torch.tensor(sequence[:m], dtype=torch.long)
            return (tokens[0, index] == want) & (positions[0, index] == torch.arange(m))
        ok = torch.ones(m, dtype=torch.bool)
        for (k, v), (rk, rv) in zip(call.cache_after, self.reference(sequence)):
            for found, want in ((k[row][:, index], rk[:, :m]), (v[row][:, index], rv[:, :m])):  # [H, m, D]
                close = torch.isclose(found.double(), want.double(), rtol=self.rtol, atol=self.atol)
                ok &= close.all(dim=-1).all(dim=0).cpu()
        return ok

    def describe(self, call: CallRecord, row: int, slot: int, index: int, sequence: tuple[int, ...]) -> tuple[str, str]:
        expected = f"token {sequence[index]} at position {index}" if index < len(sequence) else "nothing attended"
        if self.exact:
            tokens, positions = read_slots(call.cache_after[0][0][row : row + 1])
            token, position = int(tokens[0, slot]), int(positions[0, slot])
            note = " (the pad id)" if token == self.run.case.pad_token_id else ""
            return f"slot {slot} holding token {token}{note} at position {position}", expected
        if index >= len(sequence):
            return f"an extra attended slot {slot}", expected
        diff = max(
            float((k[row][:, slot].double() - rk[:, index].double()).abs().max())
            for (k, _), (rk, _) in zip(call.cache_after, self.reference(sequence))
        )
        return f"slot {slot} whose K/V differ from the batch-size-1 run by up to {diff:.3g}", f"the K/V of {expected}"


def _prefix(flags: torch.Tensor) -> int:
    return int(flags.long().cumprod(0).sum())


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def row_views(run: Run) -> tuple[list[RowView], list[Violation]]:
    """Resolve every row of every target call to a request and check I2 on it (memoized)."""
    if "views" not in run.memo:
        run.memo["views"] = _row_views(run)
    return run.memo["views"]


def _row_views(run: Run) -> tuple[list[RowView], list[Violation]]:
    reader = SlotReader(run)
    views: list[RowView] = []
    violations: list[Violation] = []
    for call in run.recording.target_calls:
        if call.input_ids is None or call.input_ids.dim() != 2:
            continue
        if not call.sampled:
            continue  # I2 sampled out for this call (real-model mode bounds its cost)
        if call.past_length and not call.cache_after:
            violations.append(
                Violation("I2", "cache-readable", "a target call whose output has no cache", "a cache", call.index)
            )
            continue
        batch, width = call.input_ids.shape
        past = call.past_length
        mask = fit_mask(call.attention_mask, batch, past + width)  # what the model applied
        positions = implied_positions(call, batch, width)
        used: set[int] = set()  # duplicate prompts: give each batch row its own request
        for row in range(batch):
            attended = mask[row].nonzero()[:, 0].tolist()
            past_slots = [s for s in attended if s < past]
            current = [s - past for s in attended if s >= past]
            current_tokens = [int(call.input_ids[row, t]) for t in current]
            best = None
            for r, sequence in enumerate(reader.sequences):
                matched = _prefix(reader.matches(call, row, past_slots, sequence)) if past_slots else 0
                whole = matched == min(len(past_slots), len(sequence))
                extra = common_prefix(current_tokens, sequence[len(past_slots) :]) if whole else 0
                prompt_fits = len(run.case.prompts[r]) <= len(past_slots) + len(current_tokens)
                score = (matched + extra, prompt_fits, len(run.case.prompts[r]) if prompt_fits else 0, r not in used)
                if best is None or score > best[0]:
                    best = (score, r, matched, whole)
            assert best is not None
            _, r, matched, whole = best
            used.add(r)
            sequence = reader.sequences[r]
            if not whole:
                slot = past_slots[matched]
                found, expected = reader.describe(call, row, slot, matched, sequence)
                violations.append(Violation("I2", "attends-wrong-slot", found, expected, call.index, row, slot, r))
            elif len(past_slots) < len(sequence):
                for j, t in enumerate(current):
                    want, got = len(past_slots) + j, int(positions[row, t])
                    if got != want:
                        found = f"current input {t} (slot {past + t}, token {current_tokens[j]}) at position {got}"
                        violations.append(
                            Violation("I2", "position-ids", found, f"position {want}", call.index, row, past + t, r)
                        )
                        break
            if reader.exact and call.cache_after:
                tokens, _ = read_slots(call.cache_after[0][0][row : row + 1])
                stream = tuple(int(tokens[0, s]) for s in attended)
            else:
                stream = sequence[: len(past_slots)] + tuple(current_tokens)
            views.append(RowView(call.index, row, r, len(past_slots), whole, stream, tuple(attended)))
    return views, violations


def check_i2(run: Run) -> list[Violation]:
    if run.outputs is None:
        return check_contract(run)
    return row_views(run)[1]


# ---------------------------------------------------------------------------------------
# Equivalence with the oracle


@dataclass(frozen=True)
class RowEquivalence:
    row: int
    expected: tuple[int, ...]  # the batch-size-1 oracle
    found: tuple[int, ...]
    expected_stop: str
    found_stop: str
    first_divergence: int | None  # first divergence that is not a numerical tie; None if equivalent
    ties: tuple[int, ...] = ()  # indices where the decoder took the other side of a tie
    resynced: tuple[int, ...] | None = None  # the oracle re-synced across those ties (None: no ties)

    @property
    def reference(self) -> tuple[int, ...]:
        """What the decoder is held to: the oracle, re-synced at each tie."""
        return self.expected if self.resynced is None else self.resynced

    @property
    def exact(self) -> bool:
        return self.found == self.expected

    @property
    def equivalent(self) -> bool:
        return self.first_divergence is None

    @property
    def verdict(self) -> str:
        if self.exact:
            return "exact"
        return f"equivalent modulo {len(self.ties)} tie(s)" if self.equivalent else "diverged"

    @property
    def partial(self) -> float:
        """Common prefix over oracle length (the paper's partial match)."""
        return common_prefix(self.found, self.expected) / max(len(self.expected), 1)


@dataclass(frozen=True)
class Equivalence:
    rows: tuple[RowEquivalence, ...]

    @property
    def exact_match(self) -> float:
        return sum(r.exact for r in self.rows) / max(len(self.rows), 1)

    @property
    def partial_match(self) -> float:
        return sum(r.partial for r in self.rows) / max(len(self.rows), 1)

    @property
    def ties(self) -> int:
        return sum(len(r.ties) for r in self.rows)

    @property
    def verdict(self) -> str:
        if all(r.exact for r in self.rows):
            return "exact"
        if all(r.equivalent for r in self.rows):
            return f"equivalent modulo {self.ties} tie(s)"
        return "diverged"


def stop_reason(tokens: list[int] | tuple[int, ...], max_new_tokens: int, eos: int | None) -> str:
    if tokens and eos is not None and tokens[-1] == eos:
        return "eos"
    return "length" if len(tokens) >= max_new_tokens else "short"


def compare_row(run: Run, r: int) -> RowEquivalence:
    """Tie-aware comparison of one row with the oracle.

    At a divergence where the oracle's top-1/top-2 margin is within the dtype's tolerance the
    decoder merely took the other side of a numerical tie: the comparison re-syncs onto the
    decoder's token (the oracle continues from the decoder's prefix) and goes on. Any other
    divergence is a bug.
    """
    case, oracle = run.case, run.oracle[r]
    found = tuple(run.outputs[r]) if run.outputs is not None else ()
    tolerance = TIE_TOLERANCE[DTYPES[case.dtype]]
    reference, margins, ties = oracle.tokens, oracle.margins, []
    i = common_prefix(found, reference)
    while i < min(len(found), len(reference)) and margins[i] <= tolerance and found[i] != case.eos_token_id:
        ties.append(i)
        prefix = case.prompts[r] + found[: i + 1]
        rest = max(case.max_new_tokens - i - 1, 0)
        resync = (
            greedy_oracle(run.target, prefix, max_new_tokens=rest, eos_token_id=case.eos_token_id) if rest else None
        )
        reference = found[: i + 1] + (resync.tokens if resync else ())
        margins = margins[: i + 1] + (resync.margins if resync else ())
        i = common_prefix(found, reference)
    stop = stop_reason(found, case.max_new_tokens, case.eos_token_id)
    diverged = None if found == reference else i
    resynced = reference if ties else None
    return RowEquivalence(r, oracle.tokens, found, oracle.stop, stop, diverged, tuple(ties), resynced)


def equivalence(run: Run) -> Equivalence:
    assert run.outputs is not None
    if "equivalence" not in run.memo:
        run.memo["equivalence"] = Equivalence(tuple(compare_row(run, r) for r in range(len(run.outputs))))
    return run.memo["equivalence"]


def locate(run: Run, request: int, index: int) -> tuple[int | None, RowView | None]:
    """Where generated token `index` of `request` came from.

    Returns the target call that decided it (the last call before the token sits in the
    cache, not counting a call that merely feeds it back as the pending token) and the first
    view that holds it in the cache (or, for a last token, the last view that attends it).
    """
    views = [v for v in row_views(run)[0] if v.request == request]
    if not all(v.consistent for v in views):
        return None, None  # a corrupted cache (see I2) makes the origin ambiguous
    at = len(run.case.prompts[request]) + index
    cached = next((v for v in views if v.past > at), None)
    before = [v for v in views if cached is None or v.call < cached.call]
    deciders = [v.call for v in before if v.past != at]
    holder = cached or next((v for v in reversed(views) if len(v.stream) > at), None)
    return (deciders[-1] if deciders else None), holder


def check_equivalence(run: Run) -> list[Violation]:
    """One violation per diverging row, placed at the target call that decided the first wrong
    token and the slot where that token then enters the cache."""
    if run.outputs is None:
        return check_contract(run)
    out = []
    for r in equivalence(run).rows:
        if r.equivalent:
            continue
        i = r.first_divergence
        assert i is not None
        if r.ties:
            notes = f" after {len(r.ties)} numerical tie(s) at {list(r.ties)}"
        else:
            notes = ""
        if i < len(r.found):
            found = f"token {r.found[i]} at index {i}{notes}"
        else:
            found = f"the output ending ({r.found_stop}) after {len(r.found)} tokens"
        ref = r.reference
        expected = f"token {ref[i]}" if i < len(ref) else f"the output ending ({r.expected_stop})"
        decided, holder = locate(run, r.row, i) if i < len(r.found) else (None, None)
        if holder is not None and holder.call != decided:
            found += f" (the cache holds it from target call {holder.call})"
        out.append(
            Violation(
                "equivalence",
                "first-divergence",
                f"{found} (partial match {r.partial:.2f})",
                f"{expected} at index {i} like the batch-size-1 oracle",
                call=decided,
                row=holder.row if holder is not None else None,
                slot=holder.slots[len(run.case.prompts[r.row]) + i] if holder is not None else None,
                request=r.row,
            )
        )
    return out


# ---------------------------------------------------------------------------------------
# Token preservation (scripted draft only)


def check_token_preservation(run: Run) -> list[Violation]:
    """Each round keeps exactly the drafts the script allows: none thrown away, none extra.

    For a row of request r at target call c, G is the generated part it attends and
    v = |common prefix of G and the oracle|. With b = v_prev + 1 committed tokens (the
    previous call's verified tokens plus its bonus) the target must see exactly
    v = b + min(lead(b), |G| - b), and the verified tokens' KV must still be there:
    attended past >= v_prev.
    """
    if run.outputs is None:
        return check_contract(run)
    if run.case.draft != "scripted":
        return []
    views, _ = row_views(run)
    copies = Counter(run.case.prompts)
    # Per prompt, one entry per copy of it under way: v of that copy's latest call (None:
    # no longer tracked). Copies of one prompt are told apart by how far they have got.
    progress: dict[tuple[int, ...], list[int | None]] = {}
    violations: list[Violation] = []
    by_call: dict[int, list[RowView]] = {}
    for view in views:
        by_call.setdefault(view.call, []).append(view)
    for call in sorted(by_call):
        cached = run.recording.target_calls[call].past_length > 0  # a cache-free decoder keeps tokens in its inputs
        updates: list[tuple[list[int | None], int, int]] = []
        taken: dict[tuple[int, ...], set[int]] = {}
        for view in by_call[call]:
            script = run.scripts[view.request]
            key = script.prompt
            if not view.consistent:
                continue
            generated = view.stream[len(key) :]
            v = script.consistent_prefix(generated)
            kept = view.past - len(key)  # generated tokens already in the cache
            states, used = progress.setdefault(key, []), taken.setdefault(key, set())
            free = [i for i, p in enumerate(states) if p is not None and i not in used]
            fits = [i for i in free if not cached or kept >= states[i]]  # type: ignore[operator]
            where = dict(call=call, row=view.row, request=view.request)
            if len(states) < copies[key] and (not fits or not generated):  # a copy not seen yet, or its prefill
                states.append(-1)
                copy, previous = len(states) - 1, None
            elif fits:
                copy = max(fits, key=lambda i: states[i])  # type: ignore[arg-type,return-value]
                previous = states[copy]
            elif free:
                copy = max(free, key=lambda i: states[i])  # type: ignore[arg-type,return-value]
                violations.append(
                    Violation(
                        "token-preservation",
                        "verified-kept",
                        f"a cache holding {kept} generated tokens",
                        f"at least {states[copy]}: tokens verified by the previous call were thrown away",
                        **where,
                    )
                )
                states[copy] = None  # its rounds no longer follow the schedule; one report is enough
                continue
            else:
                continue
            used.add(copy)
            b = 0 if previous is None else previous + 1
            if b >= len(run.oracle[view.request].tokens):
                continue  # the row is complete; later calls cannot change it
            if v < b:
                states[copy] = None  # committed tokens differ from the oracle: equivalence reports it
                continue
            drafts = len(generated) - b
            want = b + min(script.lead(b), drafts)
            if v != want:
                violations.append(
                    Violation(
                        "token-preservation",
                        "accepted-as-scheduled",
                        f"{v - b} of {drafts} drafts from index {b} matching the oracle",
                        f"{want - b} (the schedule accepts {script.lead(b)} from index {b}; "
                        "a lower count means the draft saw a rejected or missing token)",
                        **where,
                    )
                )
            updates.append((states, copy, v))
        for states, copy, v in updates:
            if states[copy] is not None:
                states[copy] = v
    return violations
