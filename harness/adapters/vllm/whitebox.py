"""vLLM's white box under property-based search: drawn workloads through an in-process engine,
every target forward judged by the paged rules and every request by its outputs.

One engine per configuration (block size, chunked prefill through a small
`max_num_batched_tokens`, preemption through a small KV cache, prefix caching, K, the drafter)
and Hypothesis drawing workloads on it: arrivals between steps, aborts, duplicate prompts and
shared prefixes, prompts and outputs crossing block boundaries, `max_tokens` per request (so
that some land inside an accepted run), and a stop token among the model's likely tokens. Each
workload's evidence is a `running.paged.PagedRun`: the trace (`adapters.vllm.observer`, with
preemptions followed) and a `running.record.Record` of each request's tokens against its
batch-size-1 greedy oracle, judged by the registry's PAGED checks (paged layout, contract,
equivalence, liveness). A failure is shrunk by Hypothesis (requests, tokens, steps) within a
budget in minutes and written as a reproducer that `specaudit replay` runs again.

Run with the vLLM venv's python; vLLM and Hypothesis are imported lazily where they are needed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specaudit.adapters.vllm.drafts import DraftShape, drafts_shaped
from specaudit.checks.registry import PAGED, evaluate
from specaudit.contracts.errors import UsageError
from specaudit.contracts.subjects import EVIDENCE_PAGED
from specaudit.contracts.violation import Violation
from specaudit.running.paged import PagedRun, PagedTrace
from specaudit.search.drawn import drawn_search

SMALL_BLOCK = 32
"""The smallest block size vLLM's CPU attention takes (`MultipleOf(32)`; 16 is refused there)."""
NGRAM_LOOKUP = {"prompt_lookup_max": 3, "prompt_lookup_min": 1}
FIRST_TOKEN = 4  # past the tiny Llama's specials
RAGGED_FLOOR = 0.05
"""A speculative configuration whose verify steps with several drafting requests rarely accept
different counts never exercised per-request acceptance: it is flagged."""


# ---------------------------------------------------------------------------------------
# What runs: the engine's settings (one per configuration) and a workload (one per example


@dataclass(frozen=True)
class EngineOptions:
    """One white-box configuration: the drafter, K, and the engine settings that shape the layout."""

    method: str = "ngram"  # "ngram", "draft" (a draft model), "self-draft" (the target as its own draft), "none"
    k: int = 3
    block_size: int = SMALL_BLOCK
    max_num_batched_tokens: int | None = None  # small: prefills are chunked
    kv_blocks: int | None = None  # small: requests are preempted and recomputed
    prefix_caching: bool = False
    max_model_len: int = 512
    disagree: float = 0.0  # share of drafted tokens made wrong (`adapters.vllm.drafts`): ragged acceptance

    def __post_init__(self) -> None:
        if self.kv_blocks is not None and self.kv_blocks * self.block_size < self.max_model_len:
            raise UsageError(
                f"--kv-blocks {self.kv_blocks} of --block-size {self.block_size} hold fewer tokens than "
                f"--max-model-len {self.max_model_len}: vLLM refuses to start; give a --max-model-len of at most "
                f"{(self.kv_blocks - 1) * self.block_size} (one block is vLLM's null block)"
            )

    def speculative(self, target: str, draft: str | None) -> dict[str, Any] | None:
        if self.method == "none":
            return None
        if self.method == "ngram":
            return {"method": "ngram", "num_speculative_tokens": self.k, **NGRAM_LOOKUP}
        model = target if self.method == "self-draft" else draft
        if model is None:
            raise ValueError("a draft-model configuration needs a draft model")
        return {"method": "draft_model", "model": str(model), "num_speculative_tokens": self.k}

    def engine_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {"block_size": self.block_size, "enable_prefix_caching": self.prefix_caching,
                                "max_model_len": self.max_model_len}  # fmt: skip
        if self.max_num_batched_tokens is not None:
            args["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.kv_blocks is not None:
            args["num_gpu_blocks_override"] = self.kv_blocks
        return args

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> EngineOptions:
        return cls(**(data or {}))


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a workload: added before step `arrival` (0: before the first), aborted
    after step `abort` (None: runs to its end)."""

    prompt: tuple[int, ...]
    arrival: int
    max_tokens: int
    abort: int | None = None
    name: str = ""  # its request id ("": `r<i>`, by its place)


@dataclass(frozen=True)
class Workload:
    """Requests (`r0`, `r1`, ... unless named), the stop token they share (None: EOS ignored), and
    the drafts a request verifies a step at most (None: the engine's K)."""

    requests: tuple[PlannedRequest, ...]
    eos: int | None = None
    k: int | None = None

    @property
    def ids(self) -> list[str]:
        return [r.name or f"r{i}" for i, r in enumerate(self.requests)]

    def to_payload(self) -> dict[str, Any]:
        """The reproducer's payload (older readers take `new_tokens`, `prompts`, `arrivals`, `aborts`)."""
        pairs = list(zip(self.ids, self.requests))
        return {
            "new_tokens": max((r.max_tokens for r in self.requests), default=0),
            "prompts": {rid: list(r.prompt) for rid, r in pairs},
            "arrivals": {rid: r.arrival for rid, r in pairs},
            "aborts": {rid: r.abort for rid, r in pairs if r.abort is not None},
            "max_tokens": {rid: r.max_tokens for rid, r in pairs},
            "eos": self.eos,
            "k": self.k,
        }

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> Workload:
        """A reproducer's payload, older ones (one `new_tokens` for all, EOS ignored) included."""
        limits, aborts = payload.get("max_tokens", {}), payload.get("aborts", {})
        requests = tuple(
            PlannedRequest(
                tuple(int(t) for t in prompt),
                int(payload["arrivals"][rid]),
                int(limits.get(rid, payload["new_tokens"])),
                aborts.get(rid),
                rid,
            )
            for rid, prompt in payload["prompts"].items()
        )
        return cls(requests, payload.get("eos"), payload.get("k"))


# ---------------------------------------------------------------------------------------
# One workload through the engine, judged


@dataclass(frozen=True)
class Observed:
    """What one workload left: the trace with preemptions followed, and each request's tokens."""

    trace: PagedTrace
    outputs: dict[str, tuple[int, ...]]
    preempted: dict[str, list[int]]
    aborted: frozenset[str]  # aborted before they finished (an abort after the end changes nothing)
    left: dict[str, int]  # request -> the step after which it finished or was aborted


def run_workload(llm: Any, workload: Workload, disagree: float = 0.0, max_steps: int = 600) -> Observed:
    """The workload step by step through an in-process `vllm.LLM`, every target forward observed,
    the drafts shaped (the workload's K, `disagree` of them wrong)."""
    from vllm import SamplingParams

    from specaudit.adapters.vllm.observer import VllmObserver

    def params(r: PlannedRequest) -> Any:
        if workload.eos is None:
            return SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
        # the drawn EOS is the only stop: the model's own EOS id would end a request the oracle continues
        return SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True, stop_token_ids=[workload.eos])

    forget_cached_prefixes(llm)
    due = [(r.arrival, rid, r.prompt, params(r)) for rid, r in zip(workload.ids, workload.requests)]
    aborts = {rid: r.abort for rid, r in zip(workload.ids, workload.requests) if r.abort is not None}
    observer = VllmObserver(llm)
    try:
        try:
            with drafts_shaped(DraftShape(disagree, workload.k)):
                observer.run(due, aborts=aborts, max_steps=max_steps)
        except RuntimeError:  # not finished within max_steps: the liveness check says which request
            pass
        ended = {r for r, why in observer.finish.items() if why in ("stop", "length")}
        return Observed(observer.trace(), dict(observer.outputs), {r: list(s) for r, s in observer.preempted.items()},
                        frozenset(observer.aborted - ended), dict(observer.left))  # fmt: skip
    finally:
        observer.close()


def forget_cached_prefixes(llm: Any) -> None:
    """Each workload starts from an empty prefix cache, as its reproducer does in a fresh engine: a
    hit on blocks an earlier workload wrote lies outside this workload's trace (its K/V provenance
    unseen), and would make the verdict depend on what was drawn before."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM did not reset its prefix cache: an earlier workload's requests still hold blocks")


def output_record(observed: Observed, workload: Workload, target: torch.nn.Module) -> Any:
    """Each request's tokens against its batch-size-1 greedy oracle (found by checking the answer,
    `reference.oracle.answer_oracles`), as the `running.record.Record` every subject's outputs are."""
    from specaudit.reference.oracle import answer_oracles
    from specaudit.running.record import Entry, Record

    wanted = [
        (r.prompt, observed.outputs.get(rid, ()), r.max_tokens) for rid, r in zip(workload.ids, workload.requests)
    ]
    with torch.no_grad():
        oracles = answer_oracles(target, wanted, workload.eos, cut=True)
    record = Record("vllm", EVIDENCE_PAGED, "steps", workload.eos)
    for i, (rid, r) in enumerate(zip(workload.ids, workload.requests)):
        tokens = list(observed.outputs.get(rid, ()))
        entry = Entry(i, r.prompt, r.max_tokens, oracles[i], tokens, r.arrival, observed.left.get(rid))
        entry.aborted = rid in observed.aborted
        record.admit(entry)
    return record


def paged_violations(run: PagedRun) -> list[Violation]:
    """Every PAGED check of the registry on the run (layout, contract, equivalence, liveness)."""
    return list(evaluate(PAGED, run).violations)


# ---------------------------------------------------------------------------------------
# Acceptance: how much of the accept path a configuration exercised


@dataclass
class Acceptance:
    """Drafted and accepted tokens over the verify steps, and how many of the steps in which
    several requests had drafts saw them accept different counts (ragged)."""

    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0  # forwards where at least one request verified drafts
    shared_steps: int = 0  # ... where at least two did
    ragged_steps: int = 0  # ... and accepted different counts
    lengths: dict[int, int] = field(default_factory=dict)  # drafts verified in one query -> how many queries

    @property
    def rate(self) -> float | None:
        return None if self.drafted == 0 else self.accepted / self.drafted

    @property
    def ragged_share(self) -> float | None:
        return None if self.shared_steps == 0 else self.ragged_steps / self.shared_steps

    def add(self, other: Acceptance) -> None:
        for name in ("drafted", "accepted", "verify_steps", "shared_steps", "ragged_steps"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for length, n in other.lengths.items():
            self.lengths[length] = self.lengths.get(length, 0) + n

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"rate": self.rate, "ragged_share": self.ragged_share}


def acceptance(trace: PagedTrace) -> Acceptance:
    """Per target forward, each request's drafts (query tokens past its committed length), how
    many of them the step committed, and how many queries verified each number of drafts."""
    out = Acceptance()
    for call in trace.calls:
        counts = []
        for b, rid in enumerate(call.request_ids):
            start, end = call.span(b)
            before = len(trace.committed(rid, call.step - 1))
            drafts = int(call.positions[start]) + (end - start) - before
            if drafts > 0:
                new = len(trace.committed(rid, call.step)) - before
                counts.append(min(max(new - 1, 0), drafts))
                out.drafted += drafts
                out.lengths[drafts] = out.lengths.get(drafts, 0) + 1
        out.accepted += sum(counts)
        out.verify_steps += bool(counts)
        out.shared_steps += len(counts) >= 2
        out.ragged_steps += len(set(counts)) >= 2
    return out


FEATURES = ("chunked prefills", "preemptions", "prefix hits in the step", "prefix hits across steps",
            "accepted runs crossing a block")  # fmt: skip
"""What a configuration's draws must reach when its engine enables it (`Features.enabled`)."""


@dataclass
class Features:
    """How often the draws exercised each paged feature: requests whose prompt was fed over several
    forwards, preemptions, a request's first forward reading cached blocks written in that same
    forward or earlier, and steps that committed an accepted run across a block boundary."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FEATURES, 0))

    def add(self, other: Features) -> None:
        for name, n in other.counts.items():
            self.counts[name] = self.counts.get(name, 0) + n

    @staticmethod
    def enabled(options: EngineOptions) -> tuple[str, ...]:
        """The features the engine's settings turn on: a small token budget chunks, a small cache
        preempts, prefix caching hits, speculation accepts runs (the last two only where a request
        can outgrow a block: not with vLLM's CPU block of 128 at a `max_model_len` of 128)."""
        crossable = options.block_size < options.max_model_len  # a full block with a token after it fits
        on = {"chunked prefills": options.max_num_batched_tokens is not None,
              "preemptions": options.kv_blocks is not None,
              "prefix hits in the step": options.prefix_caching and crossable,
              "prefix hits across steps": options.prefix_caching and crossable,
              "accepted runs crossing a block": options.method != "none" and crossable}  # fmt: skip
        return tuple(f for f in FEATURES if on[f])

    def unexercised(self, options: EngineOptions) -> list[str]:
        return [f for f in self.enabled(options) if not self.counts.get(f)]


def features(trace: PagedTrace, preemptions: int = 0) -> Features:
    """The paged features one workload's trace exercised (`Features`)."""
    out = Features()
    out.counts["preemptions"] = preemptions
    chunked, first = set(), set()
    last_call = {(rid, c.step): c.index for c in trace.calls for rid in c.request_ids}
    for call in trace.calls:
        size = call.block_size
        for b, rid in enumerate(call.request_ids):
            start, end = call.span(b)
            prompt = len(trace.prompts.get(rid, ()))
            if end > start and int(call.positions[end - 1]) + 1 < prompt:
                chunked.add(rid)  # fed only part of its prompt in this forward
            if rid not in first:
                first.add(rid)
                hit = set(call.block_table[b, : max(call.past(b), 0) // size].tolist())
                if hit:
                    others = [call.slot_mapping[slice(*call.span(o))] for o in range(len(call.request_ids)) if o != b]
                    written = {int(s) // size for slots in others for s in slots.tolist() if s >= 0}
                    key = "prefix hits in the step" if hit & written else "prefix hits across steps"
                    out.counts[key] += 1
            before = len(trace.committed(rid, call.step - 1))
            after = len(trace.committed(rid, call.step))
            run = after - before >= 2 and before // size != (after - 1) // size  # committed tokens cross a block
            if run and call.index == last_call[(rid, call.step)]:
                out.counts["accepted runs crossing a block"] += 1
    out.counts["chunked prefills"] = len(chunked)
    return out


# ---------------------------------------------------------------------------------------
# Drawn workloads


def likely_tokens(target: torch.nn.Module, prompts: Sequence[tuple[int, ...]], steps: int = 12) -> tuple[int, ...]:
    """The tokens the target's greedy continuations of `prompts` emit: stop tokens drawn from these end
    requests early (an EOS nobody produces would never be tested)."""
    from specaudit.reference.oracle import greedy_oracle

    seen: dict[int, None] = {}
    with torch.no_grad():
        for prompt in prompts:
            seen.update(dict.fromkeys(greedy_oracle(target, prompt, max_new_tokens=steps, eos_token_id=None).tokens))
    return tuple(seen)


@dataclass(frozen=True)
class Shape:
    """What the strategy may draw: the vocabulary's range, block size, lengths, stop tokens."""

    vocab: int
    block_size: int
    max_prompt: int
    max_tokens: int
    eos_choices: tuple[int, ...] = ()
    max_requests: int = 5
    max_k: int = 0  # the workload's K drawn from 1..max_k (0: no speculation, nothing drawn)


def workloads(shape: Shape) -> Any:
    """A Hypothesis strategy of `Workload`s: prompts from repeated motifs (ngram finds drafts),
    some a duplicate of an earlier one or an earlier one with a new tail (shared prefixes), lengths
    up to past a block boundary, staggered arrivals, aborts, `max_tokens` per request, a stop token
    among the model's likely ones or none, and K."""
    from hypothesis import strategies as st

    @st.composite
    def draw_workload(draw: st.DrawFn) -> Workload:
        motif = st.lists(st.integers(FIRST_TOKEN, shape.vocab - 1), min_size=1, max_size=4)
        motifs = draw(st.lists(motif, min_size=1, max_size=3))
        planned: list[PlannedRequest] = []
        for _ in range(draw(st.integers(1, shape.max_requests))):
            prompt = draw_prompt(draw, st, motifs, planned, shape.max_prompt)
            arrival = draw(st.integers(0, 6))
            abort = draw(st.none() | st.integers(arrival + 1, arrival + 12))
            planned.append(PlannedRequest(prompt, arrival, draw(st.integers(1, shape.max_tokens)), abort))
        eos = draw(st.none() | st.sampled_from(shape.eos_choices)) if shape.eos_choices else None
        return Workload(tuple(planned), eos, draw(st.integers(1, shape.max_k)) if shape.max_k else None)

    return draw_workload()


def tour(shape: Shape, options: EngineOptions) -> Workload:
    """The fixed workload judged before the draws (`search.drawn`), built to reach every feature
    the engine enables, which a handful of draws may all miss: two identical prompts of a full block
    and two tokens arriving together (a prefix hit in the step), the same prompt at step 3 (across
    steps), a prompt longer than a step's token budget (chunked), each with as many tokens as
    `max_model_len` leaves (runs crossing blocks; together more blocks than a small cache holds, so
    requests are preempted)."""
    room = options.max_model_len - options.k - 1  # vLLM holds K slots past the context for the drafts
    motif = [FIRST_TOKEN + i % (shape.vocab - FIRST_TOKEN) for i in (7, 3, 11)]
    shared = tuple((motif * room)[: min(options.block_size + 2, room // 2)])
    budget = options.max_num_batched_tokens or options.block_size
    chunked = tuple(reversed((motif * room)[: min(budget + 8, room - 8)]))

    def request(prompt: tuple[int, ...], arrival: int, name: str) -> PlannedRequest:
        return PlannedRequest(prompt, arrival, min(shape.max_tokens, room - len(prompt)), name=name)

    requests = (request(shared, 0, "a0"), request(shared, 0, "a1"), request(chunked, 1, "c"), request(shared, 3, "a2"))
    return Workload(requests, None, shape.max_k or None)


def draw_prompt(
    draw: Any, st: Any, motifs: list[list[int]], planned: list[PlannedRequest], longest: int
) -> tuple[int, ...]:
    """A motif repeated, an earlier prompt again, or an earlier prompt with a motif after it."""
    kind = draw(st.sampled_from(["motif", "duplicate", "shared"])) if planned else "motif"
    if kind == "duplicate":
        return draw(st.sampled_from(planned)).prompt
    head = draw(st.sampled_from(planned)).prompt if kind == "shared" else ()
    tail = tuple(draw(st.sampled_from(motifs)) * draw(st.integers(1, 24)))
    return (head + tail)[:longest] or tail[:1]


# ---------------------------------------------------------------------------------------
# The search


@dataclass
class WhiteBoxResult:
    """One configuration's white box: what ran, the examples drawn, acceptance, and the
    minimal failing workload with its violations (none: passed)."""

    subject: dict[str, Any]
    options: EngineOptions
    examples: int = 0
    shrink_runs: int = 0
    seconds: float = 0.0
    preemptions: int = 0
    acceptance: Acceptance = field(default_factory=Acceptance)
    workload: Workload | None = None  # the minimal failing workload (None: passed)
    violations: list[Violation] = field(default_factory=list)
    trace: PagedTrace | None = None
    reproducer: str | None = None
    features: Features = field(default_factory=Features)  # what the draws exercised (not the shrinking)

    @property
    def passed(self) -> bool:
        return not self.violations

    @property
    def warnings(self) -> list[str]:
        return self.acceptance_warnings() + self.feature_warnings()

    def acceptance_warnings(self) -> list[str]:
        share = self.acceptance.ragged_share
        if self.options.method == "none" or self.acceptance.verify_steps == 0:
            return [] if self.options.method == "none" else ["nothing was drafted: the accept path never ran"]
        if share is None or share < RAGGED_FLOOR:
            shown = "no step with two drafting requests" if share is None else f"{share:.2f}"
            return [f"ragged acceptance {shown} (below {RAGGED_FLOOR:g}): requests rarely accepted different counts"]
        return []

    def feature_warnings(self) -> list[str]:
        """An enabled feature no draw reached: the pass says nothing about it (only once workloads were drawn)."""
        missed = self.features.unexercised(self.options) if self.examples else []
        return [f"the draws never exercised {', '.join(missed)}, which this engine enables"] if missed else []

    def render(self) -> str:
        a = self.acceptance
        rate = "-" if a.rate is None else f"{a.rate:.2f}"
        ragged = "-" if a.ragged_share is None else f"{a.ragged_share:.2f}"
        o, lengths = self.options, sorted(a.lengths)
        wrong = f", {o.disagree:g} of drafts wrong" if o.disagree else ""
        verified = f", {lengths[0]}-{lengths[-1]} drafts verified a query" if lengths else ""
        head = f"white box ({o.method}, K {o.k}{wrong}{verified}): {self.examples} workloads drawn, "
        lines = [head + f"{self.preemptions} preemptions, acceptance {rate}, ragged {ragged}, {self.seconds:.0f} s"]
        lines.append("coverage: " + ", ".join(f"{n} {f}" for f, n in self.features.counts.items()))
        lines += [f"warning: {w}" for w in self.warnings]
        lines += [v.render() for v in self.violations[:10]]
        lines.append(f"{len(self.violations)} violation(s)" if self.violations else "no paged or output rule broken")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        payload = self.workload.to_payload() if self.workload is not None else {}
        return {**self.subject, **payload, "passed": self.passed, "engine": self.options.to_json(),
                "examples": self.examples, "shrink_runs": self.shrink_runs, "seconds": self.seconds,
                "preemptions": self.preemptions, "acceptance": self.acceptance.to_json(), "warnings": self.warnings,
                "features": dict(self.features.counts),
                "violations": [asdict(v) for v in self.violations], "reproducer": self.reproducer}  # fmt: skip


@dataclass
class Probe:
    """One engine and its target under drawn workloads: runs and judges each, keeps the figures
    (`search.drawn.Judge`)."""

    llm: Any
    target: torch.nn.Module
    reference: Any
    result: WhiteBoxResult

    def judge_workload(self, workload: Workload, shrinking: bool = False) -> list[Violation]:
        observed = run_workload(self.llm, workload, self.result.options.disagree)
        record = output_record(observed, workload, self.target)
        oracle = oracle_from(self.target, workload.eos)
        run = PagedRun(observed.trace, record=record, reference=self.reference, dtype="float32", oracle_from=oracle)
        if not shrinking:
            self.result.acceptance.add(acceptance(observed.trace))
            preempted = sum(len(s) for s in observed.preempted.values())
            self.result.preemptions += preempted
            self.result.features.add(features(observed.trace, preempted))
        self.result.trace = observed.trace
        return paged_violations(run)

    def __call__(self, workload: Workload, shrinking: bool) -> tuple[list[Violation] | None, None]:
        found = self.judge_workload(workload, shrinking)
        self.result.shrink_runs += shrinking
        self.result.examples += not shrinking
        return found or None, None


SHRINK_MARGIN = 4.0
"""A shrunk case keeps a measured distance (kv-entry's) of at least this many times its tolerance
(the noise bound): a smaller one might not fail again on another machine, so it is not reported."""


def clear_margin(violation: Violation) -> bool:
    """Whether a violation judged against a tolerance exceeds it by `SHRINK_MARGIN` (others: always)."""
    distance, bound = violation.evidence.get("kv_distance"), violation.evidence.get("kv_bound")
    return distance is None or bound is None or float(distance) >= SHRINK_MARGIN * float(bound)


def oracle_from(target: torch.nn.Module, eos: int | None) -> Callable[[tuple[int, ...], int], Any]:
    from specaudit.reference.oracle import greedy_oracle

    def continue_from(prefix: tuple[int, ...], n: int) -> Any:
        with torch.no_grad():
            return greedy_oracle(target, prefix, max_new_tokens=n, eos_token_id=eos)

    return continue_from


def search(
    llm: Any, probe_target: torch.nn.Module, reference: Any, shape: Shape, result: WhiteBoxResult,
    examples: int, minutes: float, seed: int = 0,
) -> WhiteBoxResult:  # fmt: skip
    """Hypothesis draws up to `examples` workloads within `minutes`; the first failure is shrunk
    (same check and rule, a clear margin) until the budget ends (`search.drawn`); `result` gets
    the minimal workload."""
    start = time.monotonic()
    probe = Probe(llm, probe_target, reference, result)
    found = drawn_search(workloads(shape), probe, examples, seed, 60.0 * minutes, keep=clear_margin,
                         first=[tour(shape, result.options)])  # fmt: skip
    if found.failure is None and found.error is not None:
        raise found.error
    if found.error is not None:
        result.subject = {**result.subject, "search_note": f"{type(found.error).__name__}: {found.error}"[:300]}
    if found.failure is not None:
        result.workload, result.violations = found.failure.workload, found.failure.violations
    result.seconds = time.monotonic() - start
    return result


# ---------------------------------------------------------------------------------------
# One fixed workload (the command line's and a reproducer's)


def default_payload(new_tokens: int) -> dict[str, Any]:
    """The observer's staggered workload (`observer.PROMPTS`, one aborted) as a payload."""
    from specaudit.adapters.vllm.observer import ABORTS, ARRIVALS, PROMPTS

    prompts = {rid: list(p) for rid, p in PROMPTS.items()}
    return {"new_tokens": new_tokens, "prompts": prompts, "arrivals": dict(ARRIVALS), "aborts": dict(ABORTS)}


def resolve_model(name: str | None) -> str | None:
    from specaudit.models.pretrained import resolve

    return None if name is None else str(resolve(name))


def observe_in_process(
    model: str, draft: str | None, payload: dict[str, Any], settings: dict[str, Any] | None = None
) -> WhiteBoxResult:
    """A workload (`Workload.to_payload`: prompts, arrival and abort steps, tokens per request, a
    stop token) through an in-process `vllm.LLM` built with the engine's `settings` (`EngineOptions`;
    None: ngram, or a draft model when one is given), judged like a drawn one. Run with the vLLM
    venv's python (`VLLM_ENABLE_V1_MULTIPROCESSING=0` is set before vLLM is imported)."""
    from specaudit.adapters.vllm.observer import build_llm, hf_kv_reference

    path, draft_path = resolve_model(model), resolve_model(draft)
    assert path is not None
    options = EngineOptions.from_json(settings) if settings else EngineOptions(
        method="ngram" if draft_path is None else "draft", k=3 if draft_path is None else 4)  # fmt: skip
    llm = build_llm(path, options.speculative(path, draft_path), **options.engine_args())
    target = load_target(path)
    workload = Workload.from_payload(payload)
    subject = {"model": path, "draft": draft_path, "speculative": options.method}
    observed = run_workload(llm, workload, options.disagree)
    record = output_record(observed, workload, target)
    reference = hf_kv_reference(path, observed.trace.kv_layers)
    run = PagedRun(observed.trace, record=record, reference=reference, dtype="float32",
                   oracle_from=oracle_from(target, workload.eos))  # fmt: skip
    found = paged_violations(run)
    preemptions = sum(len(s) for s in observed.preempted.values())
    return WhiteBoxResult(subject, options, 1, 0, 0.0, preemptions, acceptance(observed.trace), workload, found,
                          observed.trace)  # fmt: skip


def load_target(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def write_failure(directory: Path, result: WhiteBoxResult) -> Path:
    """`DIR/vllm-paged-<method>.json`: a paged-engine reproducer `specaudit replay` runs again (with vLLM installed)."""
    from specaudit.artifacts.reproducer import paged_reproducer, save
    from specaudit.contracts.subjects import VLLM_WHITE_BOX

    assert result.workload is not None
    subject = {k: result.subject[k] for k in ("model", "draft", "speculative") if k in result.subject}
    found = paged_reproducer(VLLM_WHITE_BOX, subject, result.workload.to_payload(), result.violations,
                             settings=result.options.to_json())  # fmt: skip
    path = save(directory, f"vllm-paged-{result.options.method}", found)
    result.reproducer = str(path)
    return path
