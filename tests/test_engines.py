"""The engine state machine's own tests: planted engine bugs are caught with their expected first
check and a short shrunk rule sequence that replays; correct engines (the references and one
written independently of them) pass; contract breaches are reported with the rule they break."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch
from hypothesis.stateful import run_state_machine_as_test

from specaudit.determinism import without_local_constants
from specaudit.engine import EngineLoadError, load_engine
from specaudit.engine_machine import (
    EngineFailure,
    EngineSession,
    Request,
    machine_for,
    machine_settings,
    replay,
    run_machine,
)
from specaudit.reference.engine_mutants import ENGINE_CATALOG
from specaudit.reference.engines import EqSpecEngine
from specaudit.registry import SIGNATURES
from specaudit.strategies import pattern_from_rounds

CORRECT_ENGINES = (
    "specaudit.reference.engines:EqSpecEngine",
    "specaudit.reference.engines:ExSpecEngine",
    "specaudit.reference.engines:LazySpecEngine",
    "tests.engines.recompute:RecomputeEngine",
    "tests.engines.split_verify:SplitVerifyEngine",  # verifies each round in two forwards
)
KILL_EXAMPLES = 30  # the ci profile's budget
KILL_STEPS = 12
MAX_SHRUNK_RULES = 8


def kill(spec: str) -> EngineFailure | None:
    """Run the machine deterministically (derandomized, no database); the shrunk failure or None."""
    try:
        with without_local_constants():  # what is drawn must not depend on what the worker imported before
            run_state_machine_as_test(
                machine_for(spec), settings=machine_settings(KILL_EXAMPLES, KILL_STEPS, derandomize=True, database=None)
            )
    except EngineFailure as failure:
        return failure
    return None


@pytest.mark.parametrize("name", sorted(ENGINE_CATALOG))
def test_planted_engine_bug_is_caught(name: str) -> None:
    bug = ENGINE_CATALOG[name].bug
    assert bug.signature in SIGNATURES, f"{name}: signature {bug.signature!r} not in {SIGNATURES}"
    started = time.perf_counter()
    failure = kill(f"specaudit.reference.engine_mutants:{name}")
    assert failure is not None, f"{name}: not caught within {KILL_EXAMPLES} runs of {KILL_STEPS} rules"
    first = failure.violations[0]
    assert (first.check, first.rule) == (bug.first_check, bug.rule), (
        f"{name}: first broken check {first.check}/{first.rule}, but should be {bug.first_check}/{bug.rule}\n{failure}"
    )
    rules = len(failure.reproducer["ops"])
    assert rules <= MAX_SHRUNK_RULES, f"{name}: shrunk to {rules} rules, but should be at most {MAX_SHRUNK_RULES}"
    replayed = replay(json.loads(json.dumps(failure.reproducer)))
    assert replayed and (replayed[0].check, replayed[0].rule) == (first.check, first.rule), (
        f"{name}: replay of the reproducer gave {replayed[:1]}, but should fail {first.check}/{first.rule}"
    )
    print(f"{name}: {first.check}/{first.rule} in {time.perf_counter() - started:.1f} s, shrunk to {rules} rules")


@pytest.mark.parametrize("spec", CORRECT_ENGINES)
def test_correct_engine_passes(spec: str) -> None:
    failure = kill(spec)
    assert failure is None, f"{spec} is correct but failed:\n{failure}"


# ---------------------------------------------------------------------------------------
# Tiny real models: I2 reads the past as K/V against each request's batch-size-1 run


@pytest.mark.parametrize("name", sorted(ENGINE_CATALOG))
def test_planted_engine_bug_is_caught_on_a_tiny_real_model(name: str, one_thread: None) -> None:
    """Negative controls for the K/V reading: every planted engine bug is caught on tiny Llama
    (RoPE, GQA, HF's cache), unshrunk, by its catalog's first check, and its reproducer (which
    names the model) replays the same failure."""
    bug = ENGINE_CATALOG[name].bug
    run = run_machine(
        f"specaudit.reference.engine_mutants:{name}", KILL_EXAMPLES, KILL_STEPS, model="llama", shrink=False
    )
    assert run.failure is not None, f"{name}: not caught on llama within {KILL_EXAMPLES} runs"
    first = run.failure.violations[0]
    assert first.check == bug.first_check, (
        f"{name} on llama: first broken check {first.check}, not {bug.first_check}\n{run.failure}"
    )
    reproducer = json.loads(json.dumps(run.failure.reproducer))
    assert reproducer["model"] == "llama", reproducer
    replayed = replay(reproducer)
    assert replayed and (replayed[0].check, replayed[0].rule) == (first.check, first.rule), f"{name}: {replayed[:1]}"


@pytest.mark.parametrize("model", ["llama", "gpt2"])
@pytest.mark.parametrize("spec", CORRECT_ENGINES)
def test_correct_engine_passes_on_a_tiny_real_model(spec: str, model: str, one_thread: None) -> None:
    run = run_machine(spec, 10, KILL_STEPS, model=model)
    assert run.passed, f"{spec} is correct but failed on {model}:\n{run.failure}"


def test_a_real_model_slot_is_judged_by_its_kv(one_thread: None) -> None:
    """A retired row on a tiny real model is named by K/V: the row's slot holds the aborted
    request's entry within tolerance, and the violation says so (positive and negative in one)."""
    ops = [
        {"op": "add", "id": 0, "prompt": [5, 6], "max_new_tokens": 4, "accept": "0000000"},
        {"op": "add", "id": 1, "prompt": [7], "max_new_tokens": 4, "accept": "0000000"},
        {"op": "step"},
        {"op": "abort", "id": 0},
        {"op": "step"},
    ]
    base = {"num_draft_tokens": 1, "eos_token_id": None, "pad_token_id": 0, "model": "llama"}
    assert replay({**base, "engine": CORRECT_ENGINES[0], "ops": ops}) == []
    found = replay({**base, "engine": "specaudit.reference.engine_mutants:AbortLeavesRowAttended", "ops": ops})
    assert found and (found[0].check, found[0].rule) == ("I2", "retired-row"), found
    assert "holding request 0's entry at position 0" in found[0].found, found[0].found
    assert found[0].evidence["kv_distance"] is not None and found[0].evidence["kv_distance"] < 1e-9, found[0].evidence


def test_replay_reads_a_reproducer_file(tmp_path: Any) -> None:
    reproducer = {
        "engine": "specaudit.reference.engine_mutants:AbortLeavesRowAttended",
        "num_draft_tokens": 1,
        "eos_token_id": None,
        "pad_token_id": 0,
        "ops": [
            {"op": "add", "id": 0, "prompt": [0], "max_new_tokens": 3, "accept": "000000"},
            {"op": "step"},
            {"op": "abort", "id": 0},
            {"op": "step"},
        ],
    }
    path = tmp_path / "engine-case.json"
    path.write_text(json.dumps(reproducer))
    assert replay(path)[0].rule == "retired-row"
    assert replay(str(path))[0].check == "I2"
    reproducer["engine"] = "specaudit.reference.engines:EqSpecEngine"
    assert replay(reproducer) == [], "the reference engine passes the same rules"


# ---------------------------------------------------------------------------------------
# Contract breaches, each with the rule it breaks


def request(request_id: int = 0, prompt: tuple[int, ...] = (5, 6, 7), max_new: int = 4) -> Request:
    return Request(request_id, prompt, max_new, pattern_from_rounds(True, (1,), max_new + 4))


class Raises(EqSpecEngine):
    def step(self) -> dict[int, list[int]]:
        raise RuntimeError("boom")


class ReturnsList(EqSpecEngine):
    def step(self) -> Any:
        return list(super().step().values())


class UnknownId(EqSpecEngine):
    def step(self) -> dict[int, list[int]]:
        return {**super().step(), 99: [1]}


class PastLimit(EqSpecEngine):
    def step(self) -> dict[int, list[int]]:
        return {r: tokens + [0] * 9 for r, tokens in super().step().items()}


class Hangs(EqSpecEngine):
    def step(self) -> dict[int, list[int]]:
        while True:
            time.sleep(0.01)


class ForgetsWaiting(EqSpecEngine):
    def has_unfinished(self) -> bool:
        return self.running() > 0


class TalksAfterAbort(EqSpecEngine):
    def abort(self, request_id: int) -> None:
        pass


class TrainsTheTarget(EqSpecEngine):
    def step(self) -> dict[int, list[int]]:
        self.target.train()
        return super().step()


class CallsForwardDirectly(EqSpecEngine):
    def step(self) -> dict[int, list[int]]:
        self.target.forward(input_ids=torch.tensor([[1]]))
        return super().step()


CONTRACT_CASES = {
    "TrainsTheTarget": "models-unchanged",
    "CallsForwardDirectly": "unobserved-forward",
    "Raises": "step-returns",
    "ReturnsList": "step-result",
    "UnknownId": "known-request",
    "PastLimit": "max-new-tokens",
    "Hangs": "step-returns",
    "ForgetsWaiting": "has-unfinished",
}


@pytest.mark.parametrize("name", sorted(CONTRACT_CASES))
def test_contract_breach_names_its_rule(name: str) -> None:
    session = EngineSession(f"{__name__}:{name}", 2, None, 0, timeout_s=1.0)
    try:
        with pytest.raises(EngineFailure) as caught:
            session.add(request())
            session.step()
    finally:
        session.close()
    first = caught.value.violations[0]
    assert (first.check, first.rule) == ("contract", CONTRACT_CASES[name]), str(caught.value)


def test_tokens_after_abort_break_the_contract() -> None:
    session = EngineSession(f"{__name__}:TalksAfterAbort", 2, None, 0)
    try:
        session.add(request(max_new=8))
        session.step()
        session.abort(0)
        with pytest.raises(EngineFailure) as caught:
            session.step()
    finally:
        session.close()
    assert caught.value.violations[0].rule == "aborted-silent", str(caught.value)


def test_abort_of_unknown_or_finished_ids_does_nothing() -> None:
    session = EngineSession("specaudit.reference.engines:EqSpecEngine", 2, None, 0)
    try:
        session.add(request(max_new=1))
        session.step()  # request 0 finishes at its first token
        session.abort(0)
        session.abort(42)
        session.add(request(1, (9, 9), 3))
        session.step()
        session.drain()
        assert session.book.requests[1].tokens == list(session.tracked[1].expected)
    finally:
        session.close()


def test_load_errors_say_which_part_failed() -> None:
    with pytest.raises(EngineLoadError, match="not of the form"):
        load_engine("no-colon")
    with pytest.raises(EngineLoadError, match="not found"):
        load_engine("specaudit.no_such_module:Engine")
    with pytest.raises(EngineLoadError, match="no attribute"):
        load_engine("specaudit.reference.engines:NoSuchEngine")
    with pytest.raises(EngineLoadError, match="lacks"):
        load_engine("specaudit.reference.eqspec:EqSpec")
