"""Correct engines written independently of the references (tests/engines/) must pass the engine
state machine: a correct engine the harness flags is a false alarm. Each engine is a different
production design (paged KV, static slots, fused admission, per-request caches, chunked prefill
with round-robin scheduling), so a pass is evidence the checks do not assume the references'
layout."""

from __future__ import annotations

import pytest

from specaudit.search.engine_machine import run_machine
from specaudit.search.engine_replay import replay_rules

pytestmark = pytest.mark.usefixtures("one_thread")

EXAMPLES = 15
REAL_EXAMPLES = 10
INDEPENDENT_ENGINES = (
    "tests.engines.paged:PagedEngine",  # block pool, right-padded gathers, lagging draft
    "tests.engines.static_slots:FixedSlotEngine",  # all slots every forward, idle rows attend nothing
    "tests.engines.static_slots:FixedSlotPadEngine",  # the same, idle rows attend a pad input of their own
    "tests.engines.fused_admission:FusedAdmissionEngine",  # newcomer prefilled and verified in one forward
    "tests.engines.solo:SoloEngine",  # batch-size-1 forwards, per-request cache objects
    "tests.engines.chunked:ChunkedRoundRobinEngine",  # 2-token prefill chunks, 2 of 4 rows per step
)
PAD_IDLE = "tests.engines.static_slots:FixedSlotPadEngine"


@pytest.mark.parametrize("spec", INDEPENDENT_ENGINES)
def test_independent_engine_passes(spec: str) -> None:
    result = run_machine(spec, EXAMPLES, seed=0)
    assert result.runs >= EXAMPLES, f"{spec}: {result.runs} runs, but should be at least {EXAMPLES}"
    assert result.passed, f"{spec} is correct but the machine flagged it (false alarm):\n{result.failure}"


@pytest.mark.parametrize("model", ["llama", "gpt2"])
@pytest.mark.parametrize("spec", INDEPENDENT_ENGINES)
def test_independent_engine_passes_on_a_tiny_real_model(spec: str, model: str) -> None:
    """The same engines on HF's real attention and caches, I2 reading the past as K/V."""
    result = run_machine(spec, REAL_EXAMPLES, seed=0, model=model)
    assert result.passed, f"{spec} is correct but the machine flagged it on {model} (false alarm):\n{result.failure}"


@pytest.mark.parametrize(("pad", "prompt"), [(3, [0]), (0, [0])])
@pytest.mark.parametrize("model", ["transparent", "llama"])
def test_idle_rows_attending_a_pad_slot_pass(pad: int, prompt: list[int], model: str) -> None:
    """FixedSlotPadEngine's idle rows attend one pad input of their own (position 0) instead of
    nothing; its outputs are FixedSlotEngine's. Such a row is idle, bound to no request: with a
    pad that no prompt starts with (once flagged row-identity) or that the live prompt starts
    with (once flagged duplicate-row)."""
    reproducer = {
        "engine": PAD_IDLE,
        "num_draft_tokens": 1,
        "eos_token_id": None,
        "pad_token_id": pad,
        "model": model,
        "ops": [{"op": "add", "id": 0, "prompt": prompt, "max_new_tokens": 2, "accept": "0000"}, {"op": "step"}],
    }
    violations = replay_rules(reproducer)
    assert not violations, f"{PAD_IDLE} flagged on {model}: {violations[:2]}"
