"""Every subject's evidence is one `Record`: a decoder run's rows, an engine session's requests
(admitted and retired at the target call count) and a black box's answers alike."""

from __future__ import annotations

from specaudit.adapters.transports import audit_callable
from specaudit.contracts.case import Case
from specaudit.fixtures import VOCAB_SIZE
from specaudit.fixtures.pairs import target_model
from specaudit.reference.oracle import greedy_oracle
from specaudit.running.runner import run_case
from specaudit.search.engine_replay import engine_session
from tests.search.test_engines import request


def test_a_decoder_run_records_its_rows_as_requests() -> None:
    """Each case row is a request handed over at call 0 and returned at the last call."""
    case = Case(((3, 1, 4), (9, 2)), ((True, False, True),) * 2, 2, 3, None, 0)
    run = run_case("specaudit.reference.eqspec:EqSpec", case)
    record, calls = run.record, len(run.recording.target_calls)
    assert (record.kind, record.unit, record.calls) == ("decoder", "target calls", run.recording.target_calls)
    assert [(e.request, e.prompt, e.tokens, e.admitted, e.retired) for e in record.entries.values()] == [
        (r, case.prompts[r], run.outputs[r], 0, calls) for r in range(2)
    ]
    assert [e.oracle for e in record.entries.values()] == run.oracle


def test_an_engine_session_admits_and_retires_requests_at_call_counts() -> None:
    """A request added after others ran is admitted at the calls made so far; an aborted one is
    retired when aborted, a finished one at the step it finished in; tokens follow the engine's."""
    session = engine_session("specaudit.reference.engines:EqSpecEngine", 2, None, 0)
    try:
        session.add(request(0, max_new=2))
        session.step()
        session.add(request(1, (4, 4), 6))
        admitted = len(session.record.calls)
        session.step()
        session.abort(1)
        aborted = len(session.record.calls)
        session.drain()
    finally:
        session.close()
    first, second = session.record.entries[0], session.record.entries[1]
    assert (first.admitted, second.admitted) == (0, admitted) and admitted > 0
    assert first.finished(None) and first.tokens == list(first.oracle.tokens) and first.retired is not None
    assert second.aborted and second.retired == aborted and not second.finished(None)
    assert second.tokens == session.book.requests[1].tokens


def test_a_black_box_divergence_is_phrased_as_a_decoders() -> None:
    """A black box's answers are judged from a record by the comparison every subject gets: a
    wrong token is the decoder's `first-divergence`, in the decoder's words, naming the request."""
    target = target_model("transparent")
    right = [list(greedy_oracle(target, (5, 6), max_new_tokens=4, eos_token_id=None).tokens)]

    def wrong_last(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return [right[0][:-1] + [(right[0][-1] + 1) % VOCAB_SIZE] for _ in prompts]

    result = audit_callable(wrong_last, target, [(5, 6)], max_new_tokens=4)
    (v,) = result.violations
    assert (v.check, v.rule, v.request) == ("equivalence", "first-divergence", 0), v
    assert v.found.startswith(f"token {(right[0][-1] + 1) % VOCAB_SIZE} at index 3") and "partial match 0.75" in v.found
    assert v.expected == f"token {right[0][-1]} at index 3 like the batch-size-1 oracle", v.expected


def test_a_record_is_of_one_evidence_kind() -> None:
    """A record's kind is a registry evidence name (`contracts.subjects.EVIDENCE`), not a fifth vocabulary."""
    import pytest

    from specaudit.running.record import Record

    assert Record("x", "paged engine", "steps", None).kind == "paged engine"
    with pytest.raises(ValueError, match="a record of 'blackbox': the evidence kinds are decoder, engine"):
        Record("x", "blackbox", "calls", None)
