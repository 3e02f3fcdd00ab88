"""The sampling decoders' place in the audit: the plan, the search and its minimal cases, the reproducers."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from specaudit.artifacts.reproducer import load_reproducer
from specaudit.audits.decoders import audit_plan
from specaudit.audits.plan import SUBJECTS
from specaudit.audits.sampling import DESIGNS, KIND, SAMPLING, audit_items, gate_items, planted, run_sampling, samples
from specaudit.audits.subject import Item
from specaudit.commands.replay import replay
from specaudit.config.settings import AuditSettings, GateSettings
from specaudit.contracts.errors import UsageError
from specaudit.contracts.sampling import Sampling
from specaudit.contracts.subjects import SAMPLING_DECODER
from specaudit.search.sampling import candidates, sampling_cases, search_sampling

SPEC = "specaudit.reference.sampling:SpecSampling"
SHARED = "specaudit.reference.sampling_mutants:shared_uniforms"


def test_the_default_audit_plans_every_design_and_every_planted_sampling_bug() -> None:
    items = audit_items(AuditSettings())
    assert [i.spec for i in items if not i.expect_failure] == list(DESIGNS)
    assert [i.spec for i in items if i.expect_failure] == planted() and len(planted()) >= 12
    assert SAMPLING in SUBJECTS and {i.kind for i in items} == {KIND} and KIND == SAMPLING_DECODER.name


def test_a_named_sampling_decoder_is_judged_in_distribution_not_greedily() -> None:
    settings = AuditSettings(decoders=(SPEC, "specaudit.reference.eqspec:EqSpec"))
    assert [i.spec for i in audit_items(settings)] == [SPEC]
    assert {spec for spec, _, _ in audit_plan(settings)} == {"specaudit.reference.eqspec:EqSpec"}
    assert samples(SPEC) and not samples("specaudit.reference.eqspec:EqSpec")


def test_the_gate_refuses_a_sampling_decoder_in_one_line() -> None:
    with pytest.raises(UsageError, match="samples: the gate judges greedy decoders"):
        gate_items(GateSettings(decoders=(SPEC,)))
    assert gate_items(GateSettings()) == []


def test_candidates_are_smaller_cases_of_the_same_seed() -> None:
    from hypothesis import given, settings

    @settings(max_examples=20, database=None)
    @given(sampling_cases())
    def check(scase):  # type: ignore[no-untyped-def]
        for smaller in candidates(scase):
            assert smaller.seed == scase.seed and smaller != scase
            assert smaller.case.batch_size <= scase.case.batch_size and smaller.runs <= scase.runs
            assert smaller.case.max_new_tokens <= scase.case.max_new_tokens

    check()


@pytest.mark.slow
def test_a_planted_bug_is_found_shrunk_and_replayed(tmp_path: Path) -> None:
    """Rows that share their uniforms: caught by row independence, minimized, written, replayed to
    the same verdict; the same reproducer passes against the reference."""
    verdict = run_sampling(Item(SHARED, "transparent", True, 12, 0, kind=KIND), None)
    assert not verdict.passed and verdict.as_expected
    failure = verdict.report_entry()["failures"][0]
    assert (failure["check"], failure["rule"]) == ("row-independence", "rows-correlated")
    assert failure["rows"] <= 6, failure["case"]
    [path] = verdict.write_reproducers(tmp_path, "")
    reproducer = load_reproducer(path)
    assert reproducer.kind == "sampling-case" and reproducer.sampling_case.runs == failure["runs"]
    again = replay(path)
    assert not again.passed and again.evaluation.violations[0].rule == "rows-correlated"
    assert replay(path, decoder=SPEC).passed


def test_a_search_is_deterministic_for_its_seed() -> None:
    strategy = sampling_cases(max_prompts=2, max_copies=3, max_runs=2).map(
        lambda c: replace(c, case=replace(c.case, max_new_tokens=min(c.case.max_new_tokens, 6)), sampling=Sampling())
    )
    drawn: list[list[object]] = [[], []]
    for seen in drawn:
        note = lambda s, seen=seen: seen.append((s.case, [r.outputs for r in s.runs]))  # noqa: E731
        result = search_sampling(SPEC, max_examples=3, seed=5, strategy=strategy, on_run=note)
        assert result.cases_run == 3 and not result.found
    assert drawn[0] == drawn[1]
