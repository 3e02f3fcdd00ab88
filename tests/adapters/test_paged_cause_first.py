"""Within one forward of a paged trace the cause is shown before its effects: a block written by
two live requests (block-shared) before the K/V read through it (kv-provenance, kv-entry).

Hand-made traces from the simulated paged engine of `test_vllm_observer` (no vLLM needed)."""

from __future__ import annotations

from test_vllm_observer import BLOCK, fake_trace, reference, with_call

from specaudit.checks.diagnosis import Finding
from specaudit.checks.paged import RULES, check_paged
from specaudit.checks.registry import check_named
from specaudit.running.paged import PagedTrace

LAYOUT_RULES = RULES[: RULES.index("block-shared") + 1]


def shared_block_trace() -> PagedTrace:
    """Request b's block table points at a block live request a holds, from forward 3 on: b
    writes into a's block (the cause) and reads a's K/V there (the effect), in the same forward."""
    trace = fake_trace()
    call = trace.calls[3]
    table = call.block_table.clone()
    table[1, 1] = table[0, 1]
    slots = call.slot_mapping.clone()
    for i in range(int(call.query_start_loc[1]), int(call.query_start_loc[2])):
        p = int(call.positions[i])
        slots[i] = int(table[1, p // BLOCK]) * BLOCK + p % BLOCK
    return with_call(trace, 3, block_table=table, slot_mapping=slots)


def test_the_first_violation_of_a_forward_is_its_cause() -> None:
    """b's kv-provenance in forward 3 is judged before the blocks are, yet block-shared is shown first."""
    found = [v for v in check_paged(shared_block_trace(), reference) if v.call == 3]
    rules = [v.rule for v in found]
    assert rules[0] == "block-shared" and "kv-provenance" in rules, rules
    finding = Finding(found[0], *check_named("paged").signature(found[0], None))
    assert finding.rule == "block-shared" and finding.first.evidence["other_request"] == "a", finding.render()


def test_each_forward_lists_layout_rules_before_kv_rules() -> None:
    """Per forward, in RULES order: every layout rule's violation precedes every K/V rule's."""
    found = check_paged(shared_block_trace(), reference)
    for call in {v.call for v in found}:
        ranks = [RULES.index(v.rule) for v in found if v.call == call]
        assert ranks == sorted(ranks), (call, [v.rule for v in found if v.call == call])
    assert [v.call for v in found] == sorted(v.call for v in found)
    assert any(v.rule in LAYOUT_RULES for v in found) and any(v.rule not in LAYOUT_RULES for v in found)
