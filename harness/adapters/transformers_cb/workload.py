"""What transformers CB is asked to run: requests, the engine's settings, and the fixed workloads.

A workload is a frozen value with a JSON form (`workload_json` / `workload_from_json`), so the one
Hypothesis drew, the one it shrank to and the one a reproducer file holds are the same thing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from specaudit.adapters.transformers_cb.models import likely_tokens
from specaudit.contracts.subjects import TRANSFORMERS_CB

ENTRY_POINTS = ("generate_batch", "manager", "generate")
"""The public ways into transformers CB the driver runs: `generate_batch`, `init_continuous_batching`
(the manager's `add_request`/`cancel_request`/`get_result`), `generate(cache_implementation="paged")`."""

ENGINE = TRANSFORMERS_CB.name
"""The engine's name in tables, reports and reproducers (its row of `contracts.subjects`)."""


@dataclass(frozen=True)
class CbRequest:
    """One request: `arrival` is the step after which it is added (0: before the first);
    `abort` the step after which it is cancelled (None: never)."""

    id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival: int = 0
    abort: int | None = None


@dataclass(frozen=True)
class CbWorkload:
    """Requests and the engine's settings: a small `page_size` and `num_blocks` make block
    boundaries and preemption happen, a small `max_batch_tokens` chunks prefills."""

    requests: tuple[CbRequest, ...]
    entry: str = "manager"
    page_size: int = 4
    num_blocks: int = 64
    max_batch_tokens: int = 32
    prefix_sharing: bool = True
    eos_token_id: int | None = None
    seed: int = 0  # the tiny Llama's weights
    pad_token_id: int = 0  # `generate` only: left-pads prompts of uneven lengths (with an attention mask)

    def __post_init__(self) -> None:
        assert self.entry in ENTRY_POINTS, self.entry
        assert self.requests and all(r.prompt for r in self.requests), "every request needs a prompt"


def workload_json(workload: CbWorkload) -> dict[str, Any]:
    """The workload as JSON (tuples become lists): what reports and reproducers hold."""
    return asdict(workload)


def workload_from_json(data: dict[str, Any]) -> CbWorkload:
    """The inverse of `workload_json`; unknown keys are an error, missing ones take their defaults."""
    known = {f.name for f in fields(CbWorkload)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"a transformers-cb workload has no fields {unknown}; expected some of {sorted(known)}")
    requests = tuple(request_from_json(r) for r in data.get("requests") or ())
    return CbWorkload(**{**data, "requests": requests})


def request_from_json(data: dict[str, Any]) -> CbRequest:
    return CbRequest(**{**data, "prompt": tuple(int(t) for t in data["prompt"])})


def smoke_workload(entry: str) -> CbWorkload:
    """Block boundaries (pages of 4), chunked prefill (8 tokens a batch) and a duplicate prompt;
    through the manager a late arrival and a cancellation too. `generate` takes one limit for
    every prompt and returns a rectangular tensor, so its prompts have one length."""
    manager = entry == "manager"
    requests = (
        CbRequest("r0", tuple(range(1, 12)), 9),
        CbRequest("r1", (7, 8, 9), 9, arrival=2 if manager else 0),
        CbRequest("r2", tuple(range(1, 12)), 9, arrival=3 if manager else 0, abort=6 if manager else None),
    )
    if entry == "generate":
        requests = (CbRequest("r0", tuple(range(1, 12)), 9), CbRequest("r1", tuple(range(30, 41)), 9))
    return CbWorkload(requests, entry, page_size=4, num_blocks=64, max_batch_tokens=8)


SMOKE: dict[str, CbWorkload] = {entry: smoke_workload(entry) for entry in ENTRY_POINTS}
"""Each entry point once on a small fixed workload (`smoke_workload`)."""


MUTANT_WORKLOADS: dict[str, CbWorkload] = {
    "staggered": CbWorkload(
        (
            CbRequest("r0", tuple(range(1, 12)), 10),
            CbRequest("r1", (7, 8, 9), 10, arrival=1),
            CbRequest("r2", tuple(range(40, 47)), 10, arrival=2, abort=5),
            CbRequest("r3", tuple(range(60, 66)), 8, arrival=3),
        ),
        "manager",
        page_size=4,
        num_blocks=64,
        max_batch_tokens=64,
        prefix_sharing=False,
    ),
    "eos": CbWorkload(
        (CbRequest("r0", (1, 2, 3), 12), CbRequest("r1", (17, 18, 19), 12), CbRequest("r2", (40, 41, 42), 12)),
        "generate_batch",
        page_size=4,
        num_blocks=64,
        max_batch_tokens=64,
        prefix_sharing=False,
    ),
}
"""The workloads the planted bugs (`specaudit.reference.transformers_cb_mutants`) fire on: late
arrivals, a cancellation, prompts and outputs across several pages of 4; and ("eos") three
requests whose EOS is a token the tiny Llama produces early (`mutant_workload`)."""


def mutant_workload(name: str) -> CbWorkload:
    """A planted bug's workload; "eos" stops at the token the tiny Llama produces most."""
    workload = MUTANT_WORKLOADS[name]
    return replace(workload, eos_token_id=likely_tokens(workload.seed)[0]) if name == "eos" else workload
