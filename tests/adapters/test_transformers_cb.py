"""transformers' continuous batching as a paged engine (`specaudit.adapters.transformers_cb`).

Unpatched transformers passes every paged rule and every output check through each public entry
point (`generate_batch`, the manager's `add_request`/`cancel_request`/`get_result`,
`generate(cache_implementation="paged")`), under chunked prefill, prefix sharing and preemption;
one small run's trace is checked by hand; each planted bug
(`specaudit.reference.transformers_cb_mutants`) is caught by its check and rule; the two
defects of transformers' own `generate(cache_implementation="paged")` are shown and matched as
known failures. A failure is written as a reproducer that replays to the same check and rule
(shrunk by Hypothesis first, in the slow test); the audit's entries are tested in
tests/audits/test_transformers_cb_audit.py. Pure tests pin the paged rules' handling of blocks
shared by content and of blocks given back, which transformers' de-duplication of completed
blocks needs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specaudit.adapters.transformers_cb import (
    ENTRY_POINTS,
    SMOKE,
    CbRequest,
    CbWorkload,
    known_defects,
    likely_tokens,
    mutant_workload,
    preemptions,
    read_workload,
    replay_workload,
    run_workload,
    search,
    verdict_of,
    write_reproducer,
)
from specaudit.adapters.transformers_cb.driver import CB_LOGGER
from specaudit.audits.transformers_cb import available
from specaudit.checks.paged import check_paged
from specaudit.contracts.errors import UsageError
from specaudit.reference.transformers_cb_mutants import BY_NAME, MUTANTS, CbMutant, planted
from specaudit.running.paged import PagedCall, PagedTrace

# The tests that run the engine; the rest (the paged rules on hand-made traces, the catalog's
# coverage, a reproducer's kind) run on every supported transformers.
needs_cb = pytest.mark.skipif(not available(), reason="this transformers has no continuous batching (5.x has)")


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """The engine's thread and the oracle share two cores: one intra-op thread each (20x faster)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def statuses(workload: CbWorkload) -> tuple[dict[str, str], object]:
    verdict = verdict_of(run_workload(workload))
    return dict(verdict.evaluation.statuses), verdict


# ---------------------------------------------------------------------------------------
# The correct engine


@needs_cb
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_each_entry_point_passes(entry: str) -> None:
    """Block boundaries (pages of 4), chunked prefill (8 tokens a batch), a duplicate prompt, a late
    arrival and a cancellation (the manager): every check passes, every request exact."""
    found, verdict = statuses(SMOKE[entry])
    assert found == {"contract": "pass", "paged": "pass", "equivalence": "pass", "liveness": "pass"}, verdict.render()
    trace = verdict.run.trace
    assert any(int(c.query_start_loc[-1]) == 8 for c in trace.calls), "no chunked prefill"
    assert max(int(c.positions.max()) for c in trace.calls) >= 3 * SMOKE[entry].page_size
    if entry == "manager":
        assert trace.aborted == {"r2"} and trace.arrivals["r1"] == 2


@needs_cb
def test_attention_stays_as_loaded_where_flash_attention_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """With flash-attn installed (as on a CUDA machine) transformers would switch the engine to
    flash attention, which this machine lacks and which has no float32 kernels: the run keeps the
    attention the model was loaded with."""
    from transformers.generation.continuous_batching import continuous_api

    monkeypatch.setattr(continuous_api, "is_flash_attn_3_available", lambda **kwargs: False)
    monkeypatch.setattr(continuous_api, "is_flash_attn_2_available", lambda **kwargs: True)
    found, verdict = statuses(SMOKE["generate_batch"])
    assert found == {"contract": "pass", "paged": "pass", "equivalence": "pass", "liveness": "pass"}, verdict.render()


@needs_cb
def test_preemption_and_prefix_sharing_are_followed() -> None:
    """A cache too small for all four requests: transformers preempts (frees and requeues with the
    output as prompt) and recomputes; with prefix sharing it also de-duplicates completed blocks.
    Both are followed, not flagged, and the outputs are exact."""
    requests = tuple(CbRequest(f"r{i}", tuple(range(10 * i + 1, 10 * i + 9)), 16) for i in range(3))
    requests += (CbRequest("r3", requests[0].prompt, 16),)
    for sharing in (False, True):
        found, verdict = statuses(CbWorkload(requests, "manager", num_blocks=12, prefix_sharing=sharing))
        assert set(found.values()) == {"pass"}, verdict.render()
        assert preemptions(verdict.run.trace) >= 1


# ---------------------------------------------------------------------------------------
# One small run, by hand

HAND = CbWorkload((CbRequest("a", (1, 2, 3, 4, 5), 3), CbRequest("b", (7, 8, 9), 3)), "manager", prefix_sharing=False)


@needs_cb
def test_hand_checked_trace() -> None:
    """Two requests, pages of 4: the prefill packs both, then one decode token each per step."""
    run = run_workload(HAND)
    trace, calls = run.trace, run.trace.calls
    a, b = run.answers["a"], run.answers["b"]
    assert len(calls) == 3 and len(trace.commits) == 3
    first, second, third = calls
    assert first.request_ids == ("a", "b")
    assert first.input_ids.tolist() == [1, 2, 3, 4, 5, 7, 8, 9]
    assert first.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert first.query_start_loc.tolist() == [0, 5, 8] and first.seq_lens.tolist() == [5, 3]
    blocks_a, blocks_b = first.block_table[0].tolist(), first.block_table[1].tolist()
    want = [blocks_a[0] * 4 + i for i in range(4)] + [blocks_a[1] * 4] + [blocks_b[0] * 4 + i for i in range(3)]
    assert first.slot_mapping.tolist() == want and first.block_size == 4
    assert (first.greedy[4], first.greedy[7]) == (a[0], b[0])  # the target's own argmax at each last token
    assert second.input_ids.tolist() == [a[0], b[0]] and second.positions.tolist() == [5, 3]
    assert second.seq_lens.tolist() == [6, 4]
    assert second.slot_mapping.tolist() == [blocks_a[1] * 4 + 1, blocks_b[0] * 4 + 3]
    assert third.positions.tolist() == [6, 4]
    assert third.slot_mapping[1] == int(third.block_table[1, 1]) * 4  # b's position 4 opens its second page
    assert trace.commits[0] == {"a": a[:1], "b": b[:1]} and trace.commits[2] == {"a": a, "b": b}
    assert trace.left == {"a": 3, "b": 3} and trace.arrivals == {"a": 0, "b": 0}
    assert set(dict(verdict_of(run).evaluation.statuses).values()) == {"pass"}


# ---------------------------------------------------------------------------------------
# Planted bugs


@needs_cb
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_planted_bug_is_caught_by_its_rule(mutant: CbMutant) -> None:
    """Each planted bug fails its check with its rule first; `output_visible` is what the
    comparison with the batch-size-1 oracle shows on the same run."""
    with planted(mutant):
        run = run_workload(mutant_workload(mutant.workload), timeout=30)
    verdict = verdict_of(run, reference=False)
    assert verdict.first is not None, f"{mutant!r} passed: {verdict.render()}"
    assert (verdict.first.check, verdict.first.rule) == (mutant.check, mutant.rule), verdict.first.render()
    found = dict(verdict.evaluation.statuses)
    assert (found["equivalence"] == "fail" or mutant.check == "contract") == mutant.output_visible, found


def test_planted_bugs_reach_the_rules() -> None:
    """At least one planted bug per paged rule transformers CB can break (no drafts: not draft-count;
    kv-entry needs a wrong K/V computation, not a layout slip), and two output-only ones."""
    reached = {m.rule for m in MUTANTS if m.check == "paged"}
    assert reached >= {"query-positions", "slot-mapping", "block-shared", "kv-provenance", "kv-overwritten",
                       "context-length", "query-tokens", "greedy-commit", "live-request"}  # fmt: skip
    assert {m.rule for m in MUTANTS if m.check == "contract"} == {"max-new-tokens", "ends-at-eos"}


# ---------------------------------------------------------------------------------------
# A failure on disk: reported, written, replayed


@needs_cb
@pytest.mark.slow
def test_a_shrunk_failure_replays_from_disk(tmp_path: Path) -> None:
    """Hypothesis under a planted bug (one token past max_new_tokens, on every request) shrinks to
    one request of one prompt token and one new token; its reproducer replays to the same check
    and rule. About 20 s: some 45 runs of shrinking."""
    mutant = BY_NAME["one-token-too-many"]
    with planted(mutant):
        found = search(seed=0, examples=10, entries=("generate_batch",))
    assert found.failing is not None and found.failing.first is not None, "the planted bug was not found"
    minimal = found.failing.run.workload
    assert len(minimal.requests) == 1 and minimal.requests[0].max_new_tokens == 1, minimal
    path = write_reproducer(tmp_path, found.failing)
    assert read_workload(path) == minimal
    with planted(mutant):
        again = replay_workload(path)
    assert again.first is not None
    assert (again.first.check, again.first.rule) == (found.failing.first.check, found.failing.first.rule)
    assert (again.first.check, again.first.rule) == ("contract", "max-new-tokens")


def test_a_reproducer_of_another_kind_is_refused(tmp_path: Path) -> None:
    """Another paged engine's reproducer, of the kind both write now or of vLLM's former kind: named as it is."""
    data = Path(__file__).resolve().parents[1] / "data" / "subject_kinds"
    for name, kind in (("paged_engine_vllm_white_box.json", "paged-engine"), ("vllm_paged.json", "vllm-paged")):
        with pytest.raises(UsageError, match=f"a vLLM white-box reproducer \\(kind {kind}\\), expected a transformers"):
            read_workload(data / name)


# ---------------------------------------------------------------------------------------
# Known defects of transformers' generate(cache_implementation="paged")


@needs_cb
def test_generate_paged_raises_on_ragged_eos() -> None:
    """Rows stopping at EOS at different lengths: generate raises building its [1, B, L] tensor;
    generate_batch returns the same requests, exact. Matched as a known defect."""
    eos = likely_tokens()[0]
    requests = (CbRequest("r0", (1, 2, 3), 12), CbRequest("r1", (17, 18, 19), 12), CbRequest("r2", (40, 41, 42), 12))
    found, verdict = statuses(CbWorkload(requests, "generate", eos_token_id=eos))
    assert (verdict.first.check, verdict.first.rule) == ("contract", "generate-returns"), verdict.render()
    assert "ValueError" in verdict.first.found
    assert known_defects(verdict) == ("generate-paged-ragged-eos",)
    found, verdict = statuses(CbWorkload(requests, "generate_batch", eos_token_id=eos))
    assert set(found.values()) == {"pass"}, verdict.render()


@needs_cb
def test_generate_paged_ignores_the_attention_mask() -> None:
    """A left-padded row: generate(cache_implementation="paged") prefills the pads as tokens, so
    its output leaves the unpadded prompt's greedy continuation. Matched as a known defect."""
    requests = (CbRequest("r0", (5, 6, 7), 5), CbRequest("r1", (1, 2, 3, 4, 5), 5))
    found, verdict = statuses(CbWorkload(requests, "generate"))
    assert found["paged"] == "pass" and found["equivalence"] == "fail", verdict.render()
    assert verdict.first.request == 0
    assert known_defects(verdict) == ("generate-paged-ignores-attention-mask",)
    even = CbWorkload((CbRequest("r0", (5, 6, 7), 5), CbRequest("r1", (1, 2, 3), 5)), "generate")
    assert known_defects(replace(verdict, run=replace(verdict.run, workload=even))) == ()  # no pads: a new failure


@needs_cb
def test_hypothesis_workloads_pass() -> None:
    """A few drawn workloads, every entry point: nothing but known defects fails."""
    found = search(seed=1, examples=4)
    assert found.failing is None, found.failing.render()
    assert found.examples == 4 and found.coverage.target_calls > 0


# ---------------------------------------------------------------------------------------
# The paged rules on blocks shared by content and blocks given back (hand-built traces)


def call(index: int, ids: tuple[str, ...], tokens: list[list[int]], starts: list[int], tables: list[list[int]],
         slots: list[list[int]]) -> PagedCall:  # fmt: skip
    """A forward of requests `ids`, each feeding `tokens` from position `starts`, pages of 2."""
    qsl = [0]
    for t in tokens:
        qsl.append(qsl[-1] + len(t))
    return PagedCall(
        index,
        index + 1,
        ids,
        torch.tensor([t for ts in tokens for t in ts]),
        torch.tensor([s + i for s, ts in zip(starts, tokens) for i in range(len(ts))]),
        torch.tensor(qsl),
        torch.tensor([s + len(t) for s, t in zip(starts, tokens)]),
        torch.tensor([s for ss in slots for s in ss]),
        torch.tensor(tables),
        2,
    )


def dedup_trace(b_prompt: tuple[int, ...]) -> PagedTrace:
    """a and b prefill [1, 2 | 3] into their own blocks (a: 0, 1; b: 2, 3); then b's completed
    block 2 is swapped for a's identical block 0, and block 2 goes to a (b takes 4) while b is live."""
    calls = (
        call(0, ("a", "b"), [[1, 2, 3], list(b_prompt)], [0, 0], [[0, 1, -1], [2, 3, -1]], [[0, 1, 2], [4, 5, 6]]),
        call(1, ("a", "b"), [[9], [9]], [3, 3], [[0, 1, -1], [0, 3, -1]], [[3], [7]]),
        call(2, ("a", "b"), [[9], [9]], [4, 4], [[0, 1, 2], [0, 3, 4]], [[4], [8]]),
    )
    commits = ({"a": (9,), "b": (9,)}, {"a": (9, 9), "b": (9, 9)}, {"a": (9, 9, 9), "b": (9, 9, 9)})
    return PagedTrace(calls, {"a": (1, 2, 3), "b": b_prompt}, {"a": 0, "b": 0}, {"a": 3, "b": 3}, frozenset(), commits)


def test_a_block_shared_by_content_and_one_given_back_are_not_flagged() -> None:
    """b reads a's block 0 holding the same tokens at the same positions (de-duplicated), and a
    writes block 2 after b gave it back: neither is a violation."""
    assert check_paged(dedup_trace((1, 2, 3))) == []


def test_a_block_of_other_content_or_still_held_is_flagged() -> None:
    """The same layout when b's prompt differs: reading a's block is kv-provenance; and writing a
    block b still holds is block-shared."""
    found = {v.rule for v in check_paged(dedup_trace((1, 5, 3)))}
    assert "kv-provenance" in found
    trace = dedup_trace((1, 2, 3))
    held = call(2, ("a", "b"), [[9], [9]], [4, 4], [[0, 1, 2], [2, 3, 4]], [[4], [8]])
    rules = [v.rule for v in check_paged(replace(trace, calls=(*trace.calls[:2], held)))]
    assert "block-shared" in rules


# ---------------------------------------------------------------------------------------
# Preemption followed as vLLM's observer follows it (the shared `running.paged.incarnations`)


class _Target(torch.nn.Module):
    """Enough of a model for the observer's hooks; no forward runs here."""

    config = SimpleNamespace(num_hidden_layers=2)

    def get_decoder(self) -> torch.nn.Module:
        return self


def test_a_preempted_request_is_named_and_split_as_vllm_does() -> None:
    """transformers requeues a preempted request as a new `RequestState` (its output appended to
    its prompt); the observer records that as vLLM's does (whole outputs by request, the step
    preempted) and splits it with the same function: the same `a`, `a~1`, prompts, arrivals,
    departures and commits as vLLM's path gives for the same raw evidence."""
    RequestState = pytest.importorskip("transformers.generation.continuous_batching.requests").RequestState
    from specaudit.adapters.transformers_cb.observer import CbObserver
    from specaudit.running.paged import incarnations

    observer = CbObserver(_Target(), read_kv=False)
    a, b = RequestState("a", [1, 2], max_new_tokens=8), RequestState("b", [3], max_new_tokens=8)
    scheduler = SimpleNamespace(active_requests={"a": a, "b": b}, waiting_requests={})

    def step(batch: list[RequestState], new: dict[str, int]) -> None:
        observer._settle(scheduler)
        ids = tuple(observer._bind(state) for state in batch)
        observer.calls.append(call(len(observer.calls), ids, [[0]] * len(ids), [0] * len(ids), [[0]] * len(ids),
                                   [[0]] * len(ids)))  # fmt: skip
        for state in batch:
            state.generated_tokens.append(new[state.request_id])

    step([a, b], {"a": 11, "b": 21})
    step([a, b], {"a": 12, "b": 22})
    resumed = a.create_equivalent_initial_request()  # what transformers' scheduler does on preemption
    scheduler.active_requests, scheduler.waiting_requests = {"b": b}, {"a": resumed}
    step([b], {"b": 23})
    step([resumed, b], {"a": 13, "b": 24})
    followed = observer.finish()

    calls = tuple(call(i, ids, [[0]] * len(ids), [0] * len(ids), [[0]] * len(ids), [[0]] * len(ids))
                  for i, ids in enumerate([("a", "b"), ("a", "b"), ("b",), ("a", "b")]))  # fmt: skip
    commits = ({"a": (11,), "b": (21,)}, {"a": (11, 12), "b": (21, 22)}, {"a": (11, 12), "b": (21, 22, 23)},
               {"a": (11, 12, 13), "b": (21, 22, 23, 24)})  # fmt: skip
    raw = PagedTrace(calls, {"a": (1, 2), "b": (3,)}, {"a": 0, "b": 0}, {"a": 4, "b": 4}, frozenset(), commits)
    assert observer.preempted == {"a": [3]} and observer.raw_trace().commits == raw.commits
    vllm = incarnations(raw, {"a": [3]})

    def shape(t: PagedTrace) -> tuple:
        return [c.request_ids for c in t.calls], list(t.prompts.items()), t.arrivals, t.left, t.aborted, t.commits

    assert shape(followed) == shape(vllm)
    assert followed.prompts["a~1"] == (1, 2, 11, 12) and followed.incarnations_of("a") == ["a", "a~1"]
    assert followed.request_of("a~1") == "a" and followed.resumed("a~1") and preemptions(followed) == 1
    assert observer.outputs()["a"] == (11, 12, 13), "transformers' own reading of the whole output"


@needs_cb
def test_only_the_hosts_psutil_notes_are_dropped_from_the_engines_log(caplog: pytest.LogCaptureFixture) -> None:
    """transformers' CB logger says at ERROR on every manager start that psutil is missing (about
    the host); those lines are dropped while a workload runs, anything else it logs is kept."""
    with caplog.at_level(logging.INFO, logger=CB_LOGGER.name):
        run_workload(HAND)
        CB_LOGGER.error("a request failed")  # not a psutil note: kept, also outside a run
    assert not [r for r in caplog.records if "psutil" in r.getMessage()]
    assert "a request failed" in caplog.text
    assert CB_LOGGER.filters == []  # the filter is gone once the run is over
