"""vLLM's drafts shaped on purpose: fewer per step than the engine's K, and a chosen share wrong.

The drafter's proposals reach vLLM's scheduler through `Scheduler.update_draft_token_ids` (the
synchronous path; vLLM's CPU platform turns async scheduling off); the next step verifies what
the scheduler holds. Shaping them there changes only which drafts are verified, never what a
correct engine must output: a proposer that proposes fewer than K (ngram without a match, a
token budget running out) or proposes wrong tokens is normal. So the white box can draw each
workload's K from 1 to the engine's (vLLM fixes K when it builds the engine) and turn the target
drafting for itself (every draft accepted) into a draft that disagrees at a chosen rate: long
accepted runs whose lengths differ between requests. Whether a drafted token is spoiled is a hash of its position,
the token before it and the seed: deterministic, so a workload replays. A served vLLM is shaped
through the `vllm.general_plugins` entry point `shape_from_env` (`SPECAUDIT_VLLM_DRAFTS`).

vLLM is imported lazily: this module imports without it.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

DRAFTS_ENV = "SPECAUDIT_VLLM_DRAFTS"
"""`disagree=0.3,k=4,seed=0,ragged=1` (any of them): the shape `shape_from_env` puts on every vLLM process."""


@dataclass(frozen=True)
class DraftShape:
    """At most `k` drafts per request per step (None: the engine's K), each drafted token replaced
    by a wrong one with probability `disagree`."""

    disagree: float = 0.0
    k: int | None = None
    seed: int = 0
    ragged: bool = False  # each request's drafts cut to a count of its own each step (1 to what it proposed)

    def __post_init__(self) -> None:
        if not 0.0 <= self.disagree <= 1.0:
            raise ValueError(f"disagree must be in [0, 1], got {self.disagree}")
        if self.k is not None and self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")

    @property
    def inert(self) -> bool:
        return self.disagree == 0.0 and self.k is None and not self.ragged

    def spoiled(self, position: int, previous: int) -> bool:
        """Whether the draft at `position` (after token `previous`) is replaced: a seeded hash, not a draw."""
        digest = zlib.crc32(f"{self.seed}:{position}:{previous}".encode())
        return digest < self.disagree * 2**32

    def shape(self, tokens: Sequence[int], drafts: Sequence[int]) -> list[int]:
        """The drafts of a request whose committed tokens are `tokens`, as the scheduler gets them."""
        kept = list(drafts if self.k is None else drafts[: self.k])
        if self.ragged and kept:  # requests verifying together carry different draft counts
            kept = kept[: 1 + zlib.crc32(f"{self.seed}:{len(tokens)}:{tokens[-1]}".encode()) % len(kept)]
        shaped, previous = [], tokens[-1]
        for i, token in enumerate(kept):
            if self.spoiled(len(tokens) + i, previous):
                token = token + 1 if token == 0 else token - 1  # any other id is a wrong draft
            shaped.append(token)
            previous = token
        return shaped


def shaped_update(original: Callable[..., Any], shape: DraftShape) -> Callable[..., Any]:
    """`Scheduler.update_draft_token_ids` with every request's drafts shaped first."""
    from vllm.v1.outputs import DraftTokenIds

    def update_draft_token_ids(scheduler: Any, drafts: Any) -> None:
        rows = []
        for request_id, proposed in zip(drafts.req_ids, drafts.draft_token_ids):
            request = scheduler.requests.get(request_id)
            if request is None or not proposed:
                rows.append(proposed)
                continue
            rows.append(shape.shape(request.all_token_ids, proposed))
        original(scheduler, DraftTokenIds(list(drafts.req_ids), rows))

    return update_draft_token_ids


def install(shape: DraftShape) -> Callable[[], None]:
    """The shape on this process's scheduler class; a function that takes it off."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.__dict__["update_draft_token_ids"]
    Scheduler.update_draft_token_ids = shaped_update(original, shape)
    return lambda: setattr(Scheduler, "update_draft_token_ids", original)


@contextmanager
def drafts_shaped(shape: DraftShape) -> Iterator[None]:
    """The shape on an in-process engine's scheduler for the block's duration."""
    undo = (lambda: None) if shape.inert else install(shape)
    try:
        yield
    finally:
        undo()


def parse_shape(text: str) -> DraftShape:
    """`disagree=0.3,k=4,seed=0` (any subset, any order) as a `DraftShape`."""
    fields: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        if key not in ("disagree", "k", "seed", "ragged") or not value:
            raise ValueError(f"{DRAFTS_ENV}={text!r}: expected disagree=RATE, k=N, seed=N, ragged=0|1, got {item!r}")
        fields[key] = float(value) if key == "disagree" else bool(int(value)) if key == "ragged" else int(value)
    return DraftShape(**fields)


def shape_from_env() -> None:
    """vLLM's general plugin (entry point `vllm.general_plugins` in pyproject.toml), loaded once in
    each vLLM process: with `SPECAUDIT_VLLM_DRAFTS` set, that shape is on the process's scheduler
    for its life (so a served vLLM's engine core drafts the way the white box's does). Without it,
    nothing."""
    text = os.environ.get(DRAFTS_ENV)
    if not text:
        return
    shape = parse_shape(text)
    if not shape.inert:
        install(shape)
