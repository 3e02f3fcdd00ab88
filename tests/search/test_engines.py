"""The engine state machine's own tests: planted engine bugs are caught with their expected first
check, a short shrunk rule sequence that replays, and the catalog's signature as the diagnosis
derives it; correct engines (the references and one written independently of them) pass, with
duplicate prompts among concurrent requests drawn; contract breaches are reported with the rule
they break."""

from __future__ import annotations

import json
import pickle
import time
from typing import Any

import pytest
import torch
from hypothesis.stateful import run_state_machine_as_test

from specaudit.checks.engine import EngineFailure
from specaudit.checks.observe import observe
from specaudit.checks.registry import SIGNATURES
from specaudit.contracts.engine import EngineLoadError, load_engine
from specaudit.contracts.engine_rules import AddRequest, EngineRules, op_from_json
from specaudit.fixtures import VOCAB_SIZE
from specaudit.reference.engine_mutants import ENGINE_CATALOG
from specaudit.reference.engines import EqSpecEngine
from specaudit.running.engine_session import EngineSession
from specaudit.search.determinism import without_local_constants
from specaudit.search.engine_machine import (
    DEFAULT_ENGINES,
    distinct_prompt,
    event_shares,
    machine_for,
    machine_settings,
    run_machine,
)
from specaudit.search.engine_replay import engine_session, replay_rules
from specaudit.search.strategies import pattern_from_rounds

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
DUPLICATE = "duplicate prompt among concurrent requests"
MIN_DUPLICATE_SHARE = 0.1


def kill(spec: str, shares: dict[str, float] | None = None) -> EngineFailure | None:
    """Run the machine deterministically (derandomized, no database); the shrunk failure or None.
    `shares` gets the share of runs with each event."""
    machine = machine_for(spec)
    try:
        with without_local_constants():  # what is drawn must not depend on what the worker imported before
            run_state_machine_as_test(
                machine, settings=machine_settings(KILL_EXAMPLES, KILL_STEPS, derandomize=True, database=None)
            )
    except EngineFailure as failure:
        return failure
    finally:
        if shares is not None:
            shares.update(event_shares(machine))
    return None


@pytest.mark.slow
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
    rules = len(failure.reproducer.ops)
    assert rules <= MAX_SHRUNK_RULES, f"{name}: shrunk to {rules} rules, but should be at most {MAX_SHRUNK_RULES}"
    replayed = replay_rules(EngineRules.from_json(json.loads(json.dumps(failure.reproducer.to_json()))))
    assert replayed and (replayed[0].check, replayed[0].rule) == (first.check, first.rule), (
        f"{name}: replay of the reproducer gave {replayed[:1]}, but should fail {first.check}/{first.rule}"
    )
    diagnosis = failure.diagnosis
    assert diagnosis.signature == bug.signature, (
        f"{name}: diagnosed signature {diagnosis.signature} ({diagnosis.reason}), but the catalog says {bug.signature}"
    )
    assert (diagnosis.first_check, diagnosis.rule, diagnosis.request) == (first.check, first.rule, first.request)
    assert diagnosis.step is not None and diagnosis.step >= 0, f"{name}: no engine step in {diagnosis}"
    assert diagnosis.render() in str(failure), f"{name}: the failure message lacks its diagnosis:\n{failure}"
    print(f"{name}: {first.check}/{first.rule} in {time.perf_counter() - started:.1f} s, shrunk to {rules} rules")


@pytest.mark.parametrize("spec", CORRECT_ENGINES)
def test_correct_engine_passes(spec: str) -> None:
    shares: dict[str, float] = {}
    failure = kill(spec, shares)
    assert failure is None, f"{spec} is correct but failed:\n{failure}"
    if spec in DEFAULT_ENGINES:  # the strategy draws duplicate prompts among concurrent requests, and they pass
        share = shares.get(DUPLICATE, 0.0)
        assert share >= MIN_DUPLICATE_SHARE, f"{spec}: {share:.0%} of runs had {DUPLICATE}, want >= 10%: {shares}"


# ---------------------------------------------------------------------------------------
# Duplicate prompts: rows are bound by progress, not by prompt


def add(request_id: int, prompt: list[int], max_new: int, accept: str) -> dict[str, Any]:
    return {"op": "add", "id": request_id, "prompt": prompt, "max_new_tokens": max_new, "accept": accept}


DUPLICATE_OPS = [
    add(0, [5, 6], 10, "0" * 14),
    add(1, [5, 6], 8, "0" * 12),  # the same prompt, another limit
    {"op": "step"},
    add(2, [5, 6], 6, "0" * 10),  # arrives mid-flight with the same prompt again, behind the other two
    add(3, [9], 3, "000000"),
    {"op": "step"},
    {"op": "abort", "id": 0},
    {"op": "step"},
    {"op": "drain"},
]
BASE = {"num_draft_tokens": 2, "eos_token_id": None, "pad_token_id": 0, "model": "transparent"}


def apply(session: EngineSession, ops: list[dict[str, Any]]) -> None:
    """The rules of a reproducer, in their JSON form, on an open session (as `replay_rules` runs them)."""
    for i, op in enumerate(ops):
        session.apply(op_from_json(op, i))


def rows_holding(session: EngineSession, prompt: list[int]) -> int:
    """The most rows of one target call whose attended stream starts with `prompt`."""
    counts = []
    for call in session.recording.target_calls:
        obs = observe(call, exact=True)
        leading = obs.tokens[:, : len(prompt)].tolist()
        counts.append(sum(int(n) >= len(prompt) and t == prompt for t, n in zip(leading, obs.length)))
    return max(counts, default=0)


@pytest.mark.parametrize("spec", DEFAULT_ENGINES)
def test_duplicate_prompts_replay_on_a_reference_engine(spec: str) -> None:
    """Three requests with one prompt run side by side (arrivals, an abort): the reference engines
    pass, with several rows of one target call holding that prompt, each judged."""
    assert replay_rules({**BASE, "engine": spec, "ops": DUPLICATE_OPS}) == []
    session = engine_session(spec, 2, None, 0)
    try:
        apply(session, DUPLICATE_OPS)
        assert session.events[DUPLICATE] == 2, f"{spec}: {session.events}"
        rows = rows_holding(session, [5, 6])
        assert rows >= 2, f"{spec}: at most {rows} row of a target call held prompt [5, 6], want two at once"
        for r in (1, 2):
            got, want = session.book.requests[r].tokens, list(session.record.entries[r].oracle.tokens)
            assert got == want, f"{spec}: request {r} got {got}, but the oracle says {want}"
    finally:
        session.close()


@pytest.mark.parametrize(
    ("name", "ops"),
    [
        ("FinishedKeptInBatch", [add(0, [5, 6], 2, "000000"), add(1, [5, 6], 8, "0" * 12), {"op": "step"}]),
        ("AbortLeavesRowAttended", [add(0, [5, 6], 6, "000000000"), add(1, [5, 6], 6, "000000000"), {"op": "step"}]),
    ],
)
def test_planted_bug_caught_among_duplicate_prompts(name: str, ops: list[dict[str, Any]]) -> None:
    """A retired row beside a live request with the same prompt is still the retired request's
    row (the live one takes one row, the other is left over): caught as on distinct prompts,
    where the reference engine passes the same rules."""
    rules = ops + ([{"op": "abort", "id": 0}] if name == "AbortLeavesRowAttended" else []) + [{"op": "step"}]
    assert replay_rules({**BASE, "engine": DEFAULT_ENGINES[0], "ops": rules}) == []
    found = replay_rules({**BASE, "engine": f"specaudit.reference.engine_mutants:{name}", "ops": rules})
    assert found and (found[0].check, found[0].rule) == ("I2", "retired-row"), f"{name}: {found[:1]}"
    assert found[0].request == 0, f"{name}: the left-over row is bound to {found[0].request}, not retired request 0"


def test_no_drawn_prompt_is_the_pad_token_alone() -> None:
    """A row attending only pads is an idle row (`EngineJudge.idle`), unjudged: a request whose
    prompt were the pad token alone would hide its rows' faults (AdmitPositionsFromWidth's wrong
    positions on prompt [0] with pad 0 went unseen by I2), so the machine moves such a prompt on
    as it does one that collides; a prompt that only contains the pad token is kept."""
    assert distinct_prompt((3,), [], pad=3) == (4,)
    assert distinct_prompt((3, 3), [], pad=3) == (4, 3)
    assert distinct_prompt((3, 5), [], pad=3) == (3, 5)
    assert distinct_prompt((2,), [(3, 1)], pad=3) == (2,)
    assert distinct_prompt((2,), [(2, 1)], pad=3) == (4,)  # past the collision, then past the pad


# ---------------------------------------------------------------------------------------
# The diagnosis of an engine's wrong token: the request re-run alone on the same engine


class WrongLastToken(EqSpecEngine):
    """Emits a wrong token in place of each step's last one (its own state stays right)."""

    def step(self) -> dict[int, list[int]]:
        return {r: tokens[:-1] + [(tokens[-1] + 1) % VOCAB_SIZE] for r, tokens in super().step().items()}


class SwapsOutputs(EqSpecEngine):
    """Hands requests 0 and 1 each other's tokens when both advance alike: right alone, wrong in a batch."""

    def step(self) -> dict[int, list[int]]:
        out = super().step()
        if 0 in out and 1 in out and len(out[0]) == len(out[1]):
            out[0], out[1] = out[1], out[0]
        return out


@pytest.mark.parametrize(("name", "signature"), [("WrongLastToken", "bonus"), ("SwapsOutputs", "bookkeeping")])
def test_wrong_token_diagnosis_reruns_the_request_alone(name: str, signature: str) -> None:
    session = engine_session(f"{__name__}:{name}", 2, None, 0)
    try:
        with pytest.raises(EngineFailure) as caught:
            session.add(request(0, (5, 6, 7), 4))
            session.add(request(1, (9, 9), 4))
            session.step()
    finally:
        session.close()
    failure = caught.value
    assert failure.first_check == "equivalence", str(failure)
    assert failure.diagnosis.signature == signature, f"{name}: {failure.diagnosis.render()}"
    assert failure.diagnosis.step == 1, failure.diagnosis
    again = pickle.loads(pickle.dumps(failure))
    assert again.diagnosis == failure.diagnosis, "a pickled failure diagnoses the same"


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
    reproducer = json.loads(json.dumps(run.failure.reproducer.to_json()))
    assert reproducer["model"] == "llama", reproducer
    replayed = replay_rules(reproducer)
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
    assert replay_rules({**base, "engine": CORRECT_ENGINES[0], "ops": ops}) == []
    found = replay_rules({**base, "engine": "specaudit.reference.engine_mutants:AbortLeavesRowAttended", "ops": ops})
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
    assert replay_rules(path)[0].rule == "retired-row"
    assert replay_rules(str(path))[0].check == "I2"
    reproducer["engine"] = "specaudit.reference.engines:EqSpecEngine"
    assert replay_rules(reproducer) == [], "the reference engine passes the same rules"


# ---------------------------------------------------------------------------------------
# Contract breaches, each with the rule it breaks


def request(request_id: int = 0, prompt: tuple[int, ...] = (5, 6, 7), max_new: int = 4) -> AddRequest:
    return AddRequest(request_id, prompt, max_new, pattern_from_rounds(True, (1,), max_new + 4))


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


class LeavesAGlobalHook(EqSpecEngine):
    def step(self) -> dict[int, list[int]]:
        torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
        return super().step()


class CallsForwardDirectly(EqSpecEngine):
    def step(self) -> dict[int, list[int]]:
        self.target.forward(input_ids=torch.tensor([[1]]))
        return super().step()


CONTRACT_CASES = {
    "TrainsTheTarget": "models-unchanged",
    "LeavesAGlobalHook": "models-unchanged",  # a decoder run's guard: torch's global hooks too
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
    session = engine_session(f"{__name__}:{name}", 2, None, 0, timeout_s=1.0)
    try:
        with pytest.raises(EngineFailure) as caught:
            session.add(request())
            session.step()
    finally:
        session.close()
    first = caught.value.violations[0]
    assert (first.check, first.rule) == ("contract", CONTRACT_CASES[name]), str(caught.value)
    assert not torch.nn.modules.module._global_forward_hooks, "the guard removes what the engine left"


def test_tokens_after_abort_break_the_contract() -> None:
    session = engine_session(f"{__name__}:TalksAfterAbort", 2, None, 0)
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
    session = engine_session("specaudit.reference.engines:EqSpecEngine", 2, None, 0)
    try:
        session.add(request(max_new=1))
        session.step()  # request 0 finishes at its first token
        session.abort(0)
        session.abort(42)
        session.add(request(1, (9, 9), 3))
        session.step()
        session.drain()
        assert session.book.requests[1].tokens == list(session.record.entries[1].oracle.tokens)
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
