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
)
from specaudit.reference.engine_mutants import ENGINE_CATALOG
from specaudit.reference.engines import EqSpecEngine
from specaudit.registry import SIGNATURES
from specaudit.strategies import pattern_from_rounds

CORRECT_ENGINES = (
    "specaudit.reference.engines:EqSpecEngine",
    "specaudit.reference.engines:ExSpecEngine",
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
