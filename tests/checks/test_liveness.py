"""The one liveness rule set over a ledger, shared by decoders (target calls) and engines (steps)."""

from __future__ import annotations

from specaudit.checks.liveness import WaitLedger, overdue, unfinished, waits


def ledger(bound: int | None, unit: str = "steps") -> WaitLedger:
    return WaitLedger(unit, bound, "max_wait_steps")


def test_a_queue_wait_past_the_bound_is_bounded_queue() -> None:
    book = ledger(2)
    tenure = book.tenure(7, max_new_tokens=4)
    tenure.waiting, tenure.served = {0, 1, 2}, [3]
    [v] = overdue(book)
    assert (v.rule, v.request, v.evidence["wait"], v.evidence["until"], v.call) == ("bounded-queue", 7, 3, 3, None), v
    assert "3 steps with room without request 7 before it first took part (until step 3)" == v.found, v.found


def test_ticks_without_room_do_not_count() -> None:
    """The negative control of the one above: the same stretch, one tick crowded (not waiting)."""
    book = ledger(2)
    tenure = book.tenure(7, max_new_tokens=4)
    tenure.waiting, tenure.served = {0, 2}, [3]
    assert overdue(book) == []


def test_a_gap_between_services_is_bounded_wait_and_names_the_call() -> None:
    book = ledger(1, unit="target calls")
    tenure = book.tenure(0, max_new_tokens=4, row=0)
    tenure.served, tenure.waiting = [0, 1, 4], {2, 3}
    [v] = overdue(book)
    assert (v.rule, v.call, v.evidence["since"], v.evidence["wait"]) == ("bounded-wait", 4, 1, 2), v


def test_an_open_wait_counts_so_far() -> None:
    book = ledger(0)
    tenure = book.tenure(1, max_new_tokens=4)
    tenure.served, tenure.waiting = [0], {1}
    assert [(w.since, w.until, w.counted) for w in waits(tenure)] == [(None, 0, 0), (0, None, 1)]
    [v] = overdue(book)
    assert v.rule == "bounded-wait" and v.found.endswith("(so far)"), v


def test_no_bound_judges_finishing_only() -> None:
    book = ledger(None)
    done, stuck = book.tenure(0, max_new_tokens=3), book.tenure(1, max_new_tokens=5)
    stuck.waiting = set(range(100))
    done.finished, stuck.tokens = True, 2
    assert overdue(book) == []
    [v] = unfinished(book)
    assert (v.rule, v.request, v.evidence) == ("request-finishes", 1, {"tokens": 2, "max_new_tokens": 5}), v
