"""The scheduler checks (liveness, grouped batches need no realignment, order independence):
negative controls that must fail them, the reference decoders that must pass them, and the
audit's path (search + diagnosis) reaching them through the registry."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from specaudit.checks.diagnosis import diagnose
from specaudit.checks.registry import DECODER, FAIL, NOT_APPLICABLE, PASS, check_named, evaluate, outcome_of
from specaudit.checks.scheduling import calls_by_request, check_liveness, check_order_independence, permuted, rotation
from specaudit.contracts.case import Case
from specaudit.reference.eqspec import EqSpec
from specaudit.reference.exspec import ExSpec, Sequence
from specaudit.running.runner import Run, run_case
from specaudit.search.driver import search

ALL_ACCEPT = tuple([True] * 40)
ALL_REJECT = tuple([False] * 40)
HERE = "tests.checks.test_scheduling"


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------
# Decoders that break one scheduler rule each (and nothing else)


class OneAtATime(EqSpec):
    """Serves one request at a time, all its rounds, while declaring that no request ever waits."""

    name = "one-at-a-time"
    max_wait_calls = 0

    def generate(self, target: Any, draft: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kw: Any):  # type: ignore[no-untyped-def]
        out: list[list[int]] = []
        for r in range(input_ids.shape[0]):
            real = attention_mask[r].bool()
            out += super().generate(target, draft, input_ids[r : r + 1, real], attention_mask[r : r + 1, real], **kw)
        return out


class StarvingExSpec(ExSpec):
    """Always serves the largest group, never forces a waiting sequence in (no aging)."""

    def schedule(self, active: list[Sequence]) -> list[Sequence]:
        for s in active:
            s.waited = 0
        return super().schedule(active)


class ShiftingGroups(ExSpec):
    """After a grouped round, shifts every row's target cache by one slot (a needless "realignment"
    with an off-by-one roll), although a grouped batch needs no realignment at all."""

    def round(self, target: Any, draft: Any, batch: list[Sequence], k: int, out: list[list[int]], *args: Any):  # type: ignore[no-untyped-def]
        grouped = len({s.length for s in batch}) == 1
        finished = super().round(target, draft, batch, k, out, *args)
        if grouped:
            for s in batch:
                s.target_kv = [(key.roll(1, dims=2), value.roll(1, dims=2)) for key, value in s.target_kv]
        return finished


class SortsByLength(EqSpec):
    """Sorts the pool by prompt length (shortest first) and forgets to restore the caller's
    order: right whenever the caller's rows already come sorted, wrong otherwise."""

    name = "sorts-by-length"

    def generate(self, target: Any, draft: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kw: Any):  # type: ignore[no-untyped-def]
        order = sorted(range(input_ids.shape[0]), key=lambda r: int(attention_mask[r].sum()))
        return super().generate(target, draft, input_ids[order], attention_mask[order], **kw)


def serial_case() -> Case:
    return Case(((1, 2, 3), (4, 5)), (ALL_ACCEPT, ALL_REJECT), 2, 5, None, 0)


def starvation_case() -> Case:
    """Three equal prompts that all reject every draft advance in lock step; one odd prompt waits."""
    prompts = ((1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 11, 12, 13, 14))
    return Case(prompts, (ALL_REJECT,) * 4, 2, 16, None, 0)


def grouped_case() -> Case:
    """Eight prompts of one length, every draft rejected: EXSPEC groups every round."""
    return Case(tuple(tuple(range(i, i + 6)) for i in range(8)), (ALL_REJECT,) * 8, 3, 6, None, 0)


def sorted_case() -> Case:
    """Prompts already in ascending length: the order a length-sorting decoder gets right."""
    return Case(((1,), (2, 3), (4, 5, 6)), (ALL_ACCEPT, ALL_REJECT, ALL_ACCEPT), 2, 4, None, 0)


def failing_checks(run: Run) -> list[str]:
    return [name for name, status in evaluate(run).statuses if status == FAIL]


# ---------------------------------------------------------------------------------------
# Liveness


def test_liveness_counts_queue_time() -> None:
    """Negative control: serving one request to the end before the next while declaring
    max_wait_calls = 0 fails liveness (the second request queues), and only liveness."""
    run = run_case(f"{HERE}:OneAtATime", serial_case(), factory=OneAtATime)
    assert failing_checks(run) == ["liveness"], failing_checks(run)
    first = outcome_of("liveness", run).violations[0]
    assert (first.rule, first.request, first.evidence["since"]) == ("bounded-queue", 1, None), first
    assert first.evidence["wait"] == first.call > 0, first
    fair = run_case("specaudit.reference.eqspec:EqSpec", serial_case())
    assert outcome_of("liveness", fair).status == PASS


def test_queue_time_counts_only_while_there_is_room() -> None:
    """Declaring max_batch_size 1, serving one request at a time is full, not starving: the queue is
    not a wait. Declaring 2, the same schedule leaves room idle while a request queues: a failure."""

    class CapacityOne(OneAtATime):
        max_batch_size = 1

    class CapacityTwo(OneAtATime):
        max_batch_size = 2

    full = run_case(f"{HERE}:CapacityOne", serial_case(), factory=CapacityOne)
    assert outcome_of("liveness", full).status == PASS, outcome_of("liveness", full)
    idle = run_case(f"{HERE}:CapacityTwo", serial_case(), factory=CapacityTwo)
    assert [v.rule for v in outcome_of("liveness", idle).violations] == ["bounded-queue"]


def test_liveness_catches_a_starving_scheduler() -> None:
    """Negative control: without aging one request waits past the stated bound between two of
    its calls; with aging, it does not."""
    starving = run_case("starving", starvation_case(), factory=lambda: StarvingExSpec(3, 4, 2))
    violations = check_liveness(starving, starving.instance.max_wait_calls)
    assert {v.rule for v in violations} == {"bounded-wait"}, violations
    assert {v.request for v in violations} == {3}, violations
    fair = run_case("fair", starvation_case(), factory=lambda: ExSpec(3, 4, 2))
    assert check_liveness(fair, fair.instance.max_wait_calls) == []


def test_liveness_credits_the_longest_waiting_of_duplicate_requests() -> None:
    """Six requests with one prompt through a one-row EXSPEC: after the first prefill, request 1
    and each later arrival are the same history at the same progress, so no call tells them apart.
    The binder credits the one waiting longest (EXSPEC forces it in, oldest first); crediting the
    newest kept request 1 unserved for 9 calls and failed a correct scheduler (bound 7)."""
    script = tuple(c == "1" for c in "11010")
    case = Case(((0,),) * 6, (script,) * 6, 1, 2, None, 0)
    run = run_case("exspec", case, factory=lambda: ExSpec(1, 2, 1))
    assert check_liveness(run, run.instance.max_wait_calls) == []
    served = calls_by_request(run)
    assert served == {0: [0, 1], 1: [0, 3], 2: [2, 5], 3: [4, 7], 4: [6, 9], 5: [8, 10]}, served
    # negative control: the same queue with distinct prompts is judged by content, as before
    distinct = replace(case, prompts=tuple((p,) for p in range(1, 7)))
    assert calls_by_request(run_case("exspec", distinct, factory=lambda: ExSpec(1, 2, 1))) == served


def test_liveness_is_not_applicable_without_a_declared_bound() -> None:
    """A decoder that declares no max_wait_calls is not judged on waits: 'not applicable', never a pass."""

    class Undeclared(OneAtATime):
        max_wait_calls = None  # type: ignore[assignment]

    run = run_case("undeclared", serial_case(), factory=Undeclared)
    outcome = outcome_of("liveness", run)
    assert (outcome.status, outcome.why) == (NOT_APPLICABLE, "the decoder declares no max_wait_calls"), outcome
    assert diagnose(run).passed and ("liveness", NOT_APPLICABLE) in diagnose(run).checks


def test_the_audit_search_catches_a_serial_decoder() -> None:
    """The audit's path: the search finds a failing case for the serial decoder and the
    diagnosis names liveness with the scheduling signature (it is not only a pytest property).
    Seed 3 draws a two-row case at once: the shrinker starts small (seed 0 took minutes)."""
    result = search(f"{HERE}:OneAtATime", "transparent", max_examples=3, seed=3, factory=OneAtATime)
    assert result.minimal is not None, f"no failure in {result.examples} examples"
    assert result.minimal.batch_size == 2, repr(result.minimal)
    diagnosis = diagnose(run_case(f"{HERE}:OneAtATime", result.minimal, factory=OneAtATime))
    assert (diagnosis.first_check, diagnosis.signature) == ("liveness", "scheduling"), diagnosis.render()
    assert diagnosis.to_json()["checks"]["liveness"] == FAIL


@pytest.mark.slow  # the property's search
def test_the_liveness_property_catches_a_serial_decoder(request: pytest.FixtureRequest) -> None:
    """The conformance suite's liveness property fails for the serial decoder (noting its
    reproducer on this test's item, which is not marked specaudit: nothing is written). Its
    search runs unshrunk: shrinking is Hypothesis's, and the property's own (the first failure
    is the one raised), so the property is wrapped, not changed."""
    from hypothesis import Phase, given, settings
    from hypothesis import strategies as st

    from specaudit.properties.test_conformance import test_liveness

    unshrunk = settings(settings.default, phases=(Phase.explicit, Phase.generate), database=None)
    liveness = unshrunk(given(data=st.data())(test_liveness.hypothesis.inner_test))
    with pytest.raises(AssertionError, match="bounded-queue"):
        liveness(specaudit_decoder=f"{HERE}:OneAtATime", specaudit_model="transparent", request=request)


# ---------------------------------------------------------------------------------------
# Grouped batches need no realignment


def test_grouped_check_catches_shifted_slots() -> None:
    """Negative control: a grouped batch whose slots are shifted between two grouped calls fails
    grouped-no-realignment at the first moved slot; EXSPEC on the same pool passes it."""
    bad = run_case("shifting", grouped_case(), factory=lambda: ShiftingGroups(8, 8, 2))
    violations = check_named("grouped-no-realignment").implementations[DECODER](bad)
    assert violations and {v.rule for v in violations} == {"slots-stay"}, violations
    assert violations[0].evidence["since"] < violations[0].call, violations[0]
    good = run_case("exspec", grouped_case(), factory=lambda: ExSpec(8, 8, 2))
    assert outcome_of("grouped-no-realignment", good).status == PASS
    assert all(bool((c.attention_mask == 1).all()) for c in good.recording.target_calls)


def test_grouped_check_is_not_applicable_without_grouped_calls() -> None:
    """A ragged pool that never forms a pad-free batch twice is 'not applicable', not a pass."""
    case = Case(((1, 2), (3, 4, 5, 6, 7)), (ALL_ACCEPT, ALL_REJECT), 2, 3, None, 0)
    outcome = outcome_of("grouped-no-realignment", run_case("specaudit.reference.eqspec:EqSpec", case))
    assert outcome.status == NOT_APPLICABLE and "grouped" in outcome.why, outcome


# ---------------------------------------------------------------------------------------
# Order independence


def test_order_independence_catches_a_row_order_bug() -> None:
    """Negative control: a decoder right on a pool that comes sorted, wrong once the pool is
    rotated, passes every other check on the sorted pool and fails order independence."""
    run = run_case(f"{HERE}:SortsByLength", sorted_case(), factory=SortsByLength)
    assert failing_checks(run) == ["order-independence"], failing_checks(run)
    diagnosis = diagnose(run)
    assert (diagnosis.first_check, diagnosis.signature) == ("order-independence", "scheduling"), diagnosis.render()
    good = run_case("specaudit.reference.eqspec:EqSpec", sorted_case())
    assert outcome_of("order-independence", good).status == PASS


def test_order_independence_compares_permuted_rows() -> None:
    """The comparison itself: row i of the permuted run against row order[i] of the original."""
    case = sorted_case()
    order = rotation(case.batch_size)
    assert order == [1, 2, 0] and permuted(case, order).prompts == ((2, 3), (4, 5, 6), (1,))
    run = run_case("sorts", case, factory=SortsByLength)
    other = run_case("sorts", permuted(case, order), factory=SortsByLength)
    assert [v.row for v in check_order_independence(run, other, order)] == [0, 1, 2]
    assert check_order_independence(run, run, list(range(case.batch_size))) == []


def test_order_independence_reruns_the_factory_once() -> None:
    """The second run uses the decoder the run was made with (its factory, not a class looked up
    again) and is kept in the run's memo."""
    made: list[int] = []

    def factory() -> EqSpec:
        made.append(1)
        return EqSpec()

    run = run_case("not-importable", sorted_case(), factory=factory)
    assert outcome_of("order-independence", run).status == PASS
    evaluate(run)
    assert len(made) == 2, made


def test_order_independence_is_not_applicable_to_one_row() -> None:
    run = run_case("specaudit.reference.eqspec:EqSpec", Case(((1, 2),), (ALL_ACCEPT,), 2, 3, None, 0))
    outcome = outcome_of("order-independence", run)
    assert outcome.status == NOT_APPLICABLE and ">= 2 rows" in outcome.why, outcome
