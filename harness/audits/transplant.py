"""Transplant: turn a real-model run into a CPU reproducer on the exact models.

A batch that fails on a GPU with real weights is replayed with the same *shape* on the
transparent target and the scripted draft: the same number of rows, the same prompt lengths
(and duplicate prompts kept as duplicates), the same K and max_new_tokens, and an acceptance
schedule that makes every round accept exactly as many drafts as the real run did. Bugs in
batch bookkeeping (re-padding, positions, KV realignment) depend on that shape, not on the
weights, so they reappear on the CPU, where I2 reads the cache exactly.

Per-round acceptance is read from the recorded target calls, for every call (sampled for
I2 or not). For a row of target call c that attends P past slots and feeds the tokens x:

    request r:   the row view's request where I2 resolved it, else the request whose
                 committed sequence (prompt + output) continues with x (`identify`)
    drafts:      x from sequence position d0 = max(L_r, P + 1) on (a prefill feeds none;
                 a verify call feeds [pending, d_1..d_K]; HF assisted feeds prompt + drafts),
                 starting at generated index s = d0 - L_r
    accepted:    a = |common prefix of the drafts and the row's output from index s|

When P disagrees with the request's committed count g (the cache holds rejected or missing
entries: the bug under investigation), the round is read as [pending, drafts] starting at
s = g instead, so the schedule follows what the decoder committed.

and the transplanted pattern sets accept[n] = True for n in [d0 - L_r, d0 - L_r + a) and
False elsewhere (`specaudit.search.strategies.pattern_from_rounds` builds the same shape from counts).

Prompts are mapped into the transparent vocabulary token by token (t mod V), then nudged
until distinct prompts stay distinct and no prompt plus its continuation spells another
(the scripted draft could not tell such rows apart). EOS: the transparent continuations
differ from the real ones, so one EOS id is chosen that reproduces as many rows' stopping
points as possible (`Transplant.stops_reproduced` says how many).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import count

from specaudit.checks import common_prefix, row_views
from specaudit.contracts.case import Case
from specaudit.fixtures import VOCAB_SIZE
from specaudit.fixtures.transparent import fit_mask
from specaudit.reference.oracle import truncate
from specaudit.running.runner import Run, oracle_continuation


@dataclass(frozen=True)
class Round:
    """One verification of one request: where its drafts start and how many were kept."""

    call: int  # target call
    row: int  # batch row in that call
    start: int  # generated index of the first draft
    offered: int  # drafts fed to the target
    accepted: int  # leading drafts that became output


@dataclass(frozen=True)
class Transplant:
    case: Case  # on the transparent target and scripted draft
    source: Case  # the real-model case it was taken from
    rounds: tuple[tuple[Round, ...], ...]  # per request of the source: the observed rounds
    stops_reproduced: int  # rows whose stopping point (index and reason) the transplant keeps
    notes: tuple[str, ...] = ()

    def __repr__(self) -> str:
        shape = [[(r.start, r.accepted) for r in rounds] for rounds in self.rounds]
        return f"Transplant({self.case!r}, rounds(start, accepted)={shape}, stops_reproduced={self.stops_reproduced})"


def committed(run: Run) -> list[tuple[int, ...]]:
    """Per request, the tokens the decoder committed (its output; the oracle's if it broke the contract)."""
    if run.outputs is not None:
        return [tuple(o) for o in run.outputs]
    return [o.tokens for o in run.oracle]


def identify(
    current: list[int],
    past: int,
    prompts: tuple[tuple[int, ...], ...],
    outputs: list[tuple[int, ...]],
    generated: dict[int, int],
    used: set[int],
) -> int | None:
    """The request a row most plausibly holds: the one whose committed sequence continues with
    the row's current tokens, read either at the row's attended past length or after the
    request's committed tokens so far (`generated`, which survives a corrupted cache)."""
    best, best_score = None, None
    for r, (prompt, out) in enumerate(zip(prompts, outputs)):
        sequence = prompt + out
        if past + len(current) < len(prompt) and r not in generated:
            continue
        by_position = common_prefix(current, sequence[past:]) if past <= len(sequence) else 0
        by_count = common_prefix(current, sequence[len(prompt) + generated[r] - 1 :]) if generated.get(r, 0) > 0 else 0
        match = max(by_position, by_count)
        if match == 0:
            continue
        score = (match, r not in used, len(prompt))
        if best_score is None or score > best_score:
            best, best_score = r, score
    return best


def observed_rounds(run: Run) -> list[tuple[Round, ...]]:
    """Per request of the run's case, its verification rounds in call order (see the module docstring)."""
    prompts = run.case.prompts
    outputs = committed(run)
    views: dict[tuple[int, int], int] = {}
    if run.outputs is not None:
        views = {(v.call, v.row): v.request for v in row_views(run)[0]}
    rounds: list[list[Round]] = [[] for _ in prompts]
    generated: dict[int, int] = {}  # per request: tokens committed before its next call
    for call in run.recording.target_calls:
        ids = call.input_ids
        if ids is None or ids.dim() != 2:
            continue
        batch, width = ids.shape
        past = call.past_length
        mask = fit_mask(None if call.attention_mask is None else call.attention_mask.cpu(), batch, past + width)
        tokens = ids.cpu().tolist()
        used: set[int] = set()
        for b in range(batch):
            attended = mask[b].tolist()
            past_att = sum(attended[:past])
            current = [tokens[b][t] for t in range(width) if attended[past + t]]
            r = views.get((call.index, b))
            if r is None:
                r = identify(current, past_att, prompts, outputs, generated, used)
            if r is None or not current:
                continue
            used.add(r)
            length = len(prompts[r])
            g = generated.get(r)
            if g is None or past_att == length + g - 1 or past_att == 0:
                # the row attends exactly its committed tokens: read the round from positions
                d0 = max(length, past_att + 1)
                drafts = current[d0 - past_att :]
                start = d0 - length
            else:
                # the cache holds more or less than was committed (a bug): read the round from
                # the committed count, [pending, drafts...] as a verify call feeds them
                drafts, start = current[1:], g
            accepted = min(common_prefix(drafts, outputs[r][start:]), len(drafts))
            if drafts:
                rounds[r].append(Round(call.index, b, start, len(drafts), accepted))
                generated[r] = start + accepted + 1
            else:
                generated[r] = past_att + len(current) - length + 1
    return [tuple(rs) for rs in rounds]


def round_shape(
    rounds: list[tuple[Round, ...]] | tuple[tuple[Round, ...], ...],
) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """(start, offered, accepted) per round per request: what a transplant must reproduce."""
    return tuple(tuple((r.start, r.offered, r.accepted) for r in rs) for rs in rounds)


def acceptance_pattern(rounds: tuple[Round, ...], horizon: int) -> tuple[bool, ...]:
    flags = [False] * horizon
    for r in rounds:
        for n in range(r.start, min(r.start + r.accepted, horizon)):
            flags[n] = True
    return tuple(flags)


def _nudged(base: tuple[int, ...], s: int, vocab: int) -> tuple[int, ...]:
    """The s-th variant of `base`: s written in base `vocab` added to its last tokens."""
    out = list(base)
    j = len(out) - 1
    while s and j >= 0:
        out[j] = (out[j] + s % vocab) % vocab
        s //= vocab
        j -= 1
    return tuple(out)


def _ambiguous_pair(images: list[tuple[int, ...]], horizon: int) -> int | None:
    """Index of a prompt that another prompt plus its transparent continuation spells, if any."""
    for a in set(images):
        for i, b in enumerate(images):
            if len(a) < len(b) and b[: len(a)] == a:
                cont = oracle_continuation("transparent", "float64", a, horizon).tokens
                if b[len(a) :] == cont[: len(b) - len(a)]:
                    return i
    return None


def map_prompts(
    prompts: tuple[tuple[int, ...], ...], horizon: int, vocab: int = VOCAB_SIZE
) -> tuple[tuple[int, ...], ...]:
    """Real prompts as transparent ones: same lengths, duplicates kept, distinct ones distinct."""
    distinct = list(dict.fromkeys(prompts))
    salt = [0] * len(distinct)
    while True:
        images: list[tuple[int, ...]] = []
        for i, p in enumerate(distinct):
            base = tuple(t % vocab for t in p)
            for s in count(salt[i]):
                image = _nudged(base, s, vocab)
                if image not in images:
                    salt[i] = s
                    break
            images.append(image)
        bad = _ambiguous_pair(images, horizon)
        if bad is None:
            break
        salt[bad] += 1
    table = dict(zip(distinct, images))
    return tuple(table[p] for p in prompts)


def choose_eos(images: tuple[tuple[int, ...], ...], run: Run, horizon: int) -> tuple[int | None, int]:
    """The EOS id (or None) that reproduces the most rows' stopping points, and how many."""
    case = run.case
    continuations = [oracle_continuation("transparent", "float64", p, horizon).tokens for p in images]
    wanted = [(len(o.tokens), o.stop) for o in run.oracle]
    candidates: list[int | None] = [None]
    for cont, (n, stop) in zip(continuations, wanted):
        if stop == "eos" and 0 < n <= len(cont) and cont[n - 1] not in candidates:
            candidates.append(cont[n - 1])

    def score(eos: int | None) -> int:
        hits = 0
        for cont, want in zip(continuations, wanted):
            tokens, stop = truncate(cont, max_new_tokens=case.max_new_tokens, eos_token_id=eos)
            hits += (len(tokens), stop) == want
        return hits

    best = max(candidates, key=score)  # max keeps the first of equals: None when nothing helps
    return best, score(best)


def transplant(run: Run, *, vocab: int = VOCAB_SIZE) -> Transplant:
    """The CPU reproducer of a (real-model) run: its batch shape and per-round acceptance on the
    transparent target and scripted draft."""
    source = run.case
    rounds = observed_rounds(run)
    horizon = source.max_new_tokens + source.num_draft_tokens + 2
    images = map_prompts(source.prompts, horizon, vocab)
    patterns: dict[tuple[int, ...], tuple[bool, ...]] = {}
    notes = []
    for image, rs in zip(images, rounds):
        pattern = acceptance_pattern(rs, horizon)
        known = patterns.setdefault(image, pattern)
        if known != pattern:
            notes.append(
                f"duplicate prompts accepted differently; the first row's schedule is used for {list(image)[:8]}"
            )
    eos, reproduced = choose_eos(images, run, horizon)
    if reproduced < len(images):
        notes.append(f"{len(images) - reproduced} row(s) stop at another point than in the source run")
    case = replace(  # same K, max_new_tokens and padding columns; prompts, schedule and models moved
        source,
        prompts=images,
        accept=tuple(patterns[i] for i in images),
        eos_token_id=eos,
        pad_token_id=source.pad_token_id % vocab,
        model="transparent",
        draft="scripted",
        dtype="float64",
    )
    return Transplant(case, source, tuple(rounds), reproduced, tuple(notes))


__all__ = ["Round", "Transplant", "transplant", "observed_rounds", "round_shape", "map_prompts", "acceptance_pattern"]
