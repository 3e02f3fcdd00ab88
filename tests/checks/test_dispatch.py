"""One registry that dispatches: `evaluate(subject, evidence)` judges any subject's evidence by
each check's implementation for that subject, in the registry's order, and a registry that
could not dispatch (a subject without an implementation) fails at import, not mid-run.

Paged evidence comes from the simulated paged engine of tests/adapters/test_vllm_observer.py
(torch only): its trace, and a record of each request's outputs against the simulated target's
greedy oracle."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from specaudit.checks import registry
from specaudit.checks.outputs import OutputEvidence
from specaudit.checks.registry import (
    BLACK_BOX,
    CHECKS,
    DECODER,
    ENGINE,
    FAIL,
    NOT_APPLICABLE,
    PAGED,
    PASS,
    SUBJECTS,
    Check,
    RegistryError,
    Requirement,
    check_named,
    evaluate,
    order_for,
    validate,
)
from specaudit.contracts.case import Case
from specaudit.contracts.violation import Violation
from specaudit.reference.oracle import OracleResult
from specaudit.running.paged import PagedRun, PagedTrace
from specaudit.running.record import Entry, Record
from specaudit.running.runner import run_case
from tests.adapters.test_vllm_observer import fake_trace, reference, target_next, with_call

# ---------------------------------------------------------------------------------------
# Evidence


def oracle(prompt: tuple[int, ...], n: int) -> OracleResult:
    """The simulated target's greedy continuation, far from any tie."""
    tokens = [target_next(prompt[-1])]
    while len(tokens) < n:
        tokens.append(target_next(tokens[-1]))
    return OracleResult(tuple(tokens[:n]), "length", (10.0,) * n)


def paged_record(trace: PagedTrace, **tokens: list[int]) -> Record:
    """Each request of the trace with what it committed (or `tokens[request]`), asked for as many."""
    record = Record("simulated", "paged engine", "steps", None)
    for r, (rid, prompt) in enumerate(trace.prompts.items()):
        found = list(trace.commits[-1][rid])
        record.admit(Entry(r, prompt, len(found), oracle(prompt, len(found)), tokens.get(rid, found)))
    return record


def statuses(subject: str, evidence: Any) -> dict[str, str]:
    return dict(evaluate(subject, evidence).statuses)


# ---------------------------------------------------------------------------------------
# A paged engine: the layout alone without a record, its outputs too with one


def test_a_paged_trace_without_a_record_is_judged_by_its_layout_only() -> None:
    """Today's observer (no outputs recorded): `paged` judges, the output checks say why they cannot."""
    evaluation = evaluate(PAGED, PagedRun(fake_trace(), None, reference))
    assert evaluation.statuses == (
        ("contract", NOT_APPLICABLE),
        ("paged", PASS),
        ("equivalence", NOT_APPLICABLE),
        ("liveness", NOT_APPLICABLE),
    )
    assert all("not recorded" in o.why for o in evaluation.outcomes if o.status == NOT_APPLICABLE)
    broken = with_call(fake_trace(), 4, positions=fake_trace().calls[4].positions + 1)
    assert statuses(PAGED, PagedRun(broken))["paged"] == FAIL  # negative control: the layout is still judged


def test_a_paged_trace_with_a_record_is_judged_by_its_outputs_too() -> None:
    """With a record, contract, equivalence and liveness judge each request's outputs; each fails
    on the field its negative control breaks."""
    trace = fake_trace()
    assert set(statuses(PAGED, PagedRun(trace, paged_record(trace), reference)).values()) == {PASS}
    a = list(trace.commits[-1]["a"])
    wrong = statuses(PAGED, PagedRun(trace, paged_record(trace, a=[a[0], (a[1] + 1) % 97, *a[2:]])))
    assert (wrong["contract"], wrong["equivalence"]) == (PASS, FAIL), wrong
    long = evaluate(PAGED, PagedRun(trace, paged_record(trace, a=[*a, target_next(a[-1])])))
    assert long.statuses[0] == ("contract", FAIL) and long.violations[0].rule == "max-new-tokens"
    assert all(status == NOT_APPLICABLE for _, status in long.statuses[1:]), long.statuses  # short-circuit
    short = statuses(PAGED, PagedRun(trace, paged_record(trace, a=a[:-1])))
    assert (short["contract"], short["liveness"]) == (PASS, FAIL), short


def test_an_aborted_paged_request_is_held_to_a_prefix_of_its_oracle() -> None:
    trace = fake_trace()
    record = paged_record(trace)
    record.entries[0].tokens, record.entries[0].aborted = record.entries[0].tokens[:2], True
    assert set(statuses(PAGED, PagedRun(trace, record)).values()) == {PASS}
    record.entries[0].tokens = [record.entries[0].tokens[0], 0]
    assert statuses(PAGED, PagedRun(trace, record))["equivalence"] == FAIL


def test_a_black_box_is_judged_by_its_checks() -> None:
    trace = fake_trace()
    evidence = OutputEvidence(paged_record(trace), "float32")
    assert evaluate(BLACK_BOX, evidence).statuses == (("contract", PASS), ("equivalence", PASS), ("liveness", PASS))
    broken = Violation("contract", "http-status", "HTTP 500", "HTTP 200", request=1)
    failed = evaluate(BLACK_BOX, OutputEvidence(paged_record(trace), "float32", errors={1: broken}))
    assert failed.violations == [broken] and failed.statuses[1] == ("equivalence", NOT_APPLICABLE)


# ---------------------------------------------------------------------------------------
# Dispatch: each subject's evidence reaches that subject's implementations, in order


def recording_registry(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, Any]]:
    """Every check's implementations replaced by ones that note (check, subject, evidence)."""
    seen: list[tuple[str, str, Any]] = []

    def noting(name: str, subject: str) -> Any:
        return lambda evidence: seen.append((name, subject, evidence)) or []

    checks = tuple(
        replace(c, implementations={s: noting(c.name, s) for s in c.implementations}, needs=()) for c in CHECKS
    )
    monkeypatch.setattr(registry, "CHECKS", checks)
    monkeypatch.setattr(registry, "_BY_NAME", {c.name: c for c in checks})
    return seen


@pytest.mark.parametrize("subject", [ENGINE, BLACK_BOX, PAGED])
def test_evaluate_dispatches_to_the_subjects_implementations(monkeypatch: pytest.MonkeyPatch, subject: str) -> None:
    seen = recording_registry(monkeypatch)
    evidence = object()
    evaluation = evaluate(subject, evidence)
    assert seen == [(name, subject, evidence) for name in order_for(subject)]
    assert evaluation.statuses == tuple((name, PASS) for name in order_for(subject))


def test_a_decoder_run_alone_is_still_evaluated(monkeypatch: pytest.MonkeyPatch) -> None:
    """`evaluate(run)` is `evaluate(DECODER, run)`: the decoder's implementations, once per run."""
    run = run_case("specaudit.reference.eqspec:EqSpec", Case(((1, 2, 3),), ((True,) * 8,), 2, 4, None, 0))
    seen = recording_registry(monkeypatch)
    assert evaluate(run).statuses == evaluate(DECODER, run).statuses
    assert seen == [(name, DECODER, run) for name in order_for(DECODER)]


def test_every_subject_is_judged_and_orders_follow_the_registry() -> None:
    assert order_for(PAGED) == ("contract", "paged", "equivalence", "liveness")
    assert order_for(BLACK_BOX) == ("contract", "equivalence", "liveness")
    assert order_for(ENGINE) == ("contract", "I1", "I2", "equivalence", "liveness")
    assert all(order_for(s) for s in SUBJECTS)
    with pytest.raises(ValueError, match="unknown subject 'vllm'"):
        evaluate("vllm", object())


# ---------------------------------------------------------------------------------------
# A registry that could not dispatch fails when it is built


def no_violations(evidence: object) -> list[Violation]:
    return []


def test_a_subject_without_an_implementation_fails_at_validation() -> None:
    base = check_named("liveness")
    with pytest.raises(RegistryError, match="judges \\['paged engine'\\] without an implementation"):
        replace(base, implementations={**base.implementations, PAGED: None})
    with pytest.raises(RegistryError, match="subjects \\['vllm'\\]"):
        replace(base, implementations={"vllm": no_violations})
    with pytest.raises(RegistryError, match="requirements for subjects it does not judge"):
        replace(base, implementations={DECODER: no_violations})  # its PAGED requirement, for no PAGED implementation
    with pytest.raises(RegistryError, match="no rules"):
        Check("I3", "-", "-", {DECODER: no_violations}, lambda first, run: ("contract", ""))


def test_a_registry_missing_a_subject_or_out_of_step_with_its_rules_fails_validation() -> None:
    validate(CHECKS)
    only_decoders = tuple(
        replace(
            c,
            implementations={DECODER: c.implementations[DECODER]},
            needs=tuple(n for n in c.needs if n.subject == DECODER),
        )
        for c in CHECKS
        if DECODER in c.implementations
    )
    with pytest.raises(RegistryError, match="are judged by no check"):
        validate(only_decoders)
    with pytest.raises(RegistryError, match="rules.CHECK_RULES names"):
        validate(tuple(c for c in CHECKS if c.name != "token-preservation"))
    paged_first = (check_named("paged"), *(c for c in CHECKS if c.name != "paged"))
    with pytest.raises(RegistryError, match="the contract first"):
        validate(paged_first)
    requirement = Requirement("x", lambda evidence: True, subject=PAGED)
    assert requirement.subject == PAGED and check_named("equivalence").unmet(object(), ENGINE) is None


# ---------------------------------------------------------------------------------------
# Cache slots: declared by the check that fills them


def test_every_slot_a_run_fills_is_declared_by_its_check() -> None:
    run = run_case(
        "specaudit.reference.mutants:rejected_kv_attended",
        Case(((1, 2, 3), (4, 5)), ((True,) * 40, (False,) * 40), 2, 5, None, 0),
    )
    evaluate(run)
    assert run.derived.cached, "no check cached anything"
    for name, slots in run.derived.cached.items():
        assert set(slots) <= set(check_named(name).caches), (name, sorted(slots), check_named(name).caches)
    assert {"I2", "equivalence"} <= set(run.derived.cached)


# ---------------------------------------------------------------------------------------
# Every subject's judge reads the registry


def test_the_engine_judge_steps_through_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """`EngineJudge.step` hands the step to `evaluate(ENGINE, ...)`: the registry's ENGINE
    implementations run, in order, and the first failing one's violations are the step's."""
    from specaudit.checks.engine import EngineJudge
    from specaudit.checks.engine_step import EngineStep

    seen = recording_registry(monkeypatch)
    judge = object.__new__(EngineJudge)
    assert EngineJudge.step(judge, [], {1}, {1: 3}, False, {1: [7]}) == []
    assert [(name, subject) for name, subject, _ in seen] == [(name, ENGINE) for name in order_for(ENGINE)]
    step = seen[0][2]
    assert isinstance(step, EngineStep) and step.reader is judge and step.emitted == {1: [7]}
    planted = Violation("I2", "row-identity", "planted", "-")
    i2 = check_named("I2")
    monkeypatch.setitem(registry._BY_NAME, "I2", replace(i2, implementations={ENGINE: lambda step: [planted]}))
    monkeypatch.setattr(registry, "CHECKS", tuple(registry._BY_NAME.values()))
    seen.clear()
    assert EngineJudge.step(judge, [], set(), {}, False, {}) == [planted]
    assert [name for name, _, _ in seen] == ["contract", "I1"]  # nothing after the step's first failure


def test_a_black_box_verdict_is_the_registrys(monkeypatch: pytest.MonkeyPatch) -> None:
    """`judge_answers` (every transport) evaluates BLACK_BOX: right answers pass the registry's
    checks, and a violation the registry's contract implementation finds fails the run."""
    import torch

    from specaudit.adapters.engine_blackbox import Answer, judge_answers, make_requests
    from specaudit.fixtures.pairs import target_model
    from specaudit.reference.oracle import greedy_oracle

    target = target_model("transparent", "float64")
    requests = make_requests([[5, 6, 7], [9, 8]], [0.0, 1.0], 4)
    with torch.no_grad():
        right = {
            r.id: Answer(greedy_oracle(target, r.prompt, max_new_tokens=4, eos_token_id=None).tokens, start=0, end=1)
            for r in requests
        }
    result = judge_answers("x", "callable", target, requests, right, None, "float64", 0.0)
    assert result.passed and result.evaluation is not None
    assert result.evaluation.statuses == (("contract", PASS), ("equivalence", PASS), ("liveness", PASS))
    planted = Violation("contract", "token-ids", "planted", "-", request=0)
    contract = check_named("contract")
    replaced = {**contract.implementations, BLACK_BOX: lambda evidence: [planted]}
    monkeypatch.setitem(registry._BY_NAME, "contract", replace(contract, implementations=replaced))
    monkeypatch.setattr(registry, "CHECKS", tuple(registry._BY_NAME.values()))
    failed = judge_answers("x", "callable", target, requests, right, None, "float64", 0.0)
    assert not failed.passed and failed.evaluation.violations == [planted]
