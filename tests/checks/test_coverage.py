"""Coverage: what a verdict exercised, counted exactly on hand-made cases and sessions, flagged
when a pass exercised no ragged round, and present on every report.json entry and in the gate's
JUnit properties."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from specaudit.adapters.transports import audit_callable
from specaudit.adapters.vllm.report import ConfigurationOutcome as Outcome
from specaudit.adapters.vllm.report import from_report
from specaudit.artifacts.report import entry
from specaudit.audits.decoders import DecoderVerdict as Verdict
from specaudit.audits.decoders import format_table
from specaudit.checks.coverage import (
    NO_RAGGED_ROUND,
    NO_ROUND,
    NOT_MEASURED,
    NOTHING_IN_FLIGHT,
    Coverage,
    coverage_of_run,
    coverage_of_session,
    merged,
)
from specaudit.commands.cli import main
from specaudit.contracts.case import Case
from specaudit.contracts.engine_rules import AddRequest
from specaudit.fixtures.pairs import draft_model, target_model
from specaudit.models.loading import save_tiny_pair
from specaudit.reference.engines import EqSpecEngine
from specaudit.reference.eqspec import EqSpec
from specaudit.running.runner import Run, oracle_continuation, run_case
from specaudit.search.engine_replay import engine_session

EQSPEC = "specaudit.reference.eqspec:EqSpec"
MUTANT = "specaudit.reference.mutants:rejected_kv_attended"
ENGINE = "specaudit.reference.engines:EqSpecEngine"
ALL, NONE = "1" * 12, "0" * 12

pytestmark = pytest.mark.usefixtures("one_thread")


def two_rows(eos: int | None = None, second: str = NONE, prompts: tuple = ((3, 4, 5, 6), (5, 0, 7))) -> Case:
    """Row 0 (4 prompt tokens) accepts every draft, row 1 (3 prompt tokens, one of them the pad
    id 0) the ones `second` says; K = 2, 5 new tokens each."""
    return Case(prompts, (ALL, second), 2, 5, eos, 0)


def run(case: Case, spec: str = EQSPEC) -> Run:
    done = run_case(spec, case)
    assert done.error is None, done.error
    return done


# ---------------------------------------------------------------------------------------
# Decoder runs: the counts on hand-made cases


def test_counts_on_a_hand_made_case() -> None:
    """EQSPEC, K = 2, 5 tokens per row, row 0 accepting every draft and row 1 none:

        call 0  prefill, both rows                            committed: row 0 4+1, row 1 3+1
        call 1  row 0 accepts 2, row 1 accepts 0  (ragged)    row 0 4+4, row 1 3+2
        call 2  row 0 accepts 1 (its 5th token), row 1 0      row 0 done; row 1 3+3
        call 3  row 1 alone, accepts 0                        3+4
        call 4  row 1 alone, accepts 0                        done

    so 4 rounds, 2 ragged, batch sizes {1, 2}, row 0 finished while row 1 ran; row 0's last
    call writes positions 7, 8, 9 (pending + 2 drafts after 8 committed): the highest, 9."""
    got = coverage_of_run(run(two_rows()))
    want = Coverage(
        runs=1, requests=2, batch_sizes=(1, 2), k_values=(2,), target_calls=5, rounds=4, ragged_rounds=2,
        finished_early=1, longest_sequence=9, longest_output=5, highest_position=9, pad_prompts=1, eos_stops=0,
        in_flight=2,
    )  # fmt: skip
    assert got == want, f"got {got}, should be {want}"
    assert got.flags == [] and got.summary() == "ragged 2/4 rounds, B<=2, K 2, pos<=9, early 1, pad-prompts 1, eos 0"


def test_a_target_verifying_with_generate_counts_drafts_not_its_own_tokens() -> None:
    """A decoder whose target decodes K + 1 tokens itself each round (`generate`) has rounds of
    several target calls and target tokens past the drafts: only what the draft proposed counts,
    so the same acceptance pattern is as ragged as under EQSPEC."""
    case = two_rows()
    eqspec = coverage_of_run(run(case))
    ours = coverage_of_run(run(case, "tests.decoders.generate_verify:GenerateVerify"))
    assert ours.target_calls > eqspec.target_calls, (ours, eqspec)
    assert ours.ragged_rounds == eqspec.ragged_rounds == 2 and not ours.flags, (ours, eqspec)


def test_an_eos_stop_is_counted() -> None:
    """With EOS set to row 1's third oracle token, row 1 stops there (call 2, as row 0 does): one
    EOS stop, no row finished before another, two rounds, both ragged (2 and 0, then 1 and 0)."""
    case = two_rows()
    eos = oracle_continuation("transparent", "float64", case.prompts[1], 8).tokens[2]
    assert eos not in oracle_continuation("transparent", "float64", case.prompts[0], 8).tokens[:5]
    done = run(two_rows(eos))
    got = coverage_of_run(done)
    assert done.outputs is not None and done.outputs[1][-1] == eos and len(done.outputs[1]) == 3, done.outputs
    assert (got.eos_stops, got.finished_early, got.rounds, got.ragged_rounds) == (1, 0, 2, 2), got


@pytest.mark.parametrize(
    "case",
    [
        two_rows(second=ALL, prompts=((3, 4, 5), (5, 9, 7))),  # uniform acceptance, equal lengths
        Case(((3, 4, 5, 6),), ("1001" * 3,), 2, 5, None, 0),  # a single row
    ],
    ids=["uniform", "single-row"],
)
def test_a_pass_without_a_ragged_round_is_flagged(case: Case) -> None:
    """Rounds in which every row accepted as many drafts (or a single row) exercise no
    realignment: the coverage says so, and the audit table writes the pass as "PASS (no ragged round)"."""
    done = run(case)
    got = coverage_of_run(done)
    assert got.rounds >= 2 and got.ragged_rounds == 0 and got.flags == [NO_RAGGED_ROUND], got
    assert got.to_json()["flags"] == [NO_RAGGED_ROUND]
    verdict = Verdict(EQSPEC, "transparent")
    verdict.record(done, {"I2": "pass"}, [])
    assert verdict.coverage == got
    row, covered = verdict_and_coverage_rows(format_table([verdict]))
    assert f"PASS ({NO_RAGGED_ROUND})" in row and "ragged 0/" in covered, (row, covered)


def test_a_ragged_pass_is_not_flagged() -> None:
    """A pass with a ragged round reads plain PASS, its coverage shown beside it."""
    verdict = Verdict(EQSPEC, "transparent")
    verdict.record(run(two_rows()), {"I2": "pass"}, [])
    row, covered = verdict_and_coverage_rows(format_table([verdict]))
    assert " PASS " in row and "(no ragged" not in row and "ragged 2/4 rounds" in covered, (row, covered)


def verdict_and_coverage_rows(table: str) -> tuple[str, str]:
    """The one verdict's row of the decoder table and its row of the coverage table under it."""
    lines = table.splitlines()
    return lines[2], lines[lines.index(next(x for x in lines if x.startswith("coverage "))) + 2]


def test_an_engine_without_speculation_is_not_flagged_for_no_ragged_round() -> None:
    """K 0 (transformers' continuous batching): nothing is drafted, so no round can be ragged;
    its hard path is requests in flight together, which the flag and the summary name instead."""
    alone = Coverage(runs=1, requests=2, batch_sizes=(1,), k_values=(0,), target_calls=6, rounds=5, in_flight=1)
    assert alone.flags == [NOTHING_IN_FLIGHT] and "ragged" not in alone.summary(), alone.summary()
    together = replace(alone, batch_sizes=(1, 2), in_flight=2)
    assert together.flags == [] and together.summary().startswith("5 rounds, in flight<=2"), together.summary()
    speculative = replace(together, k_values=(3,))
    assert speculative.flags == [NO_RAGGED_ROUND]


def test_a_case_with_no_round_is_flagged_as_such() -> None:
    """One new token per row: only the prefill runs, so there is no round at all to be ragged."""
    got = coverage_of_run(run(Case(((3, 4), (5, 6, 7)), (ALL, NONE), 2, 1, None, 0)))
    assert (got.rounds, got.target_calls, got.flags) == (0, 1, [NO_ROUND, NO_RAGGED_ROUND]), got


def test_merge_adds_counts_unites_sets_and_keeps_extremes() -> None:
    """A verdict's coverage (and helper F's over a list of runs) is the runs' coverages merged."""
    a = coverage_of_run(run(two_rows()))
    b = coverage_of_run(run(Case(((3, 4, 5, 6),), ("1001" * 3,), 3, 7, None, 0)))
    both = a.merge(b)
    assert (both.runs, both.requests, both.rounds) == (2, 3, a.rounds + b.rounds), both
    assert both.ragged_rounds == a.ragged_rounds and both.k_values == (2, 3) and both.batch_sizes == (1, 2)
    assert both.highest_position == max(a.highest_position, b.highest_position)
    assert both.longest_sequence == max(a.longest_sequence, b.longest_sequence)
    assert merged([a, b]) == both == b.merge(a) and merged([]) == Coverage() and Coverage().merge(a) == a
    assert Coverage.from_json(both.to_json()) == both


class DropsLastRow:
    """EQSPEC, its last row's output left out: a broken contract (one list per row)."""

    def generate(self, *args: Any, **kwargs: Any) -> list[list[int]]:
        return EqSpec().generate(*args, **kwargs)[:-1]


def test_a_broken_contract_still_counts_its_calls_and_case() -> None:
    """A run that broke the contract has no rows to follow: its requests, calls, K and pad
    prompts are counted, its rounds are not."""
    done = run_case("test_coverage:DropsLastRow", two_rows(), factory=DropsLastRow)
    assert done.outputs is None and done.error is not None
    got = coverage_of_run(done)
    assert (got.requests, got.target_calls, got.k_values, got.pad_prompts) == (2, 5, (2,), 1), got
    assert (got.rounds, got.ragged_rounds, got.highest_position) == (0, 0, 9), got


# ---------------------------------------------------------------------------------------
# Engine sessions and black boxes


def test_engine_session_counts_arrivals_aborts_duplicates_and_reused_rows() -> None:
    """EQSPEC's engine, K = 2:

        add 0 (3,4,5) max 6 accepting all, add 1 (9,8) max 6 accepting none, step
        add 2 (9,8) max 3: arrives while 0 and 1 run, the prompt of running request 1
        step, step: request 0 done at call 3 (while 1 and 2 go on), 2 at call 4 (while 3 goes on later)
        abort 1; add 3 (11,12,13) max 4: takes row 0, which aborted request 1 left; drain

    Target calls: 0 prefill (0, 1), 1 round (0 accepts 2, 1 accepts 0: ragged), 2 prefill (2),
    3 round (2, 0, 0: ragged), 4 round (0, 0), 5 prefill (3), 6 round (3 alone)."""
    session = engine_session(ENGINE, 2, None, 0)
    try:
        session.add(AddRequest(0, (3, 4, 5), 6, (True,) * 12))
        session.add(AddRequest(1, (9, 8), 6, (False,) * 12))
        session.step()
        session.add(AddRequest(2, (9, 8), 3, (False,) * 12))
        session.step()
        session.step()
        session.abort(1)
        session.add(AddRequest(3, (11, 12, 13), 4, (True,) * 12))
        session.drain()
        got = coverage_of_session(session)
    finally:
        session.close()
    want = Coverage(
        runs=1, requests=4, batch_sizes=(1, 2, 3), k_values=(2,), target_calls=7, rounds=4, ragged_rounds=2,
        finished_early=2, longest_sequence=9, longest_output=6, highest_position=8, arrivals=1, in_flight=3, aborts=1,
        duplicate_prompts=1, reused_rows=1,
    )  # fmt: skip
    assert got == want, f"got {got}, should be {want}"
    assert "arrivals 1, aborts 1, dup 1, reused 1" in got.summary(), got.summary()


def test_black_box_coverage_is_output_level() -> None:
    """A step-wise engine as a black box: requests in flight together, arrivals while others ran,
    the longest output and EOS stops; nothing about rounds, which it cannot see."""
    target, draft = target_model("transparent"), draft_model("transparent", "scripted", [])
    prompts = [[5, 6, 7, 8], [9, 10, 11], [1, 2, 3], [12, 13]]
    eos = oracle_continuation("transparent", "float64", (9, 10, 11), 8).tokens[3]
    engine = EqSpecEngine(target, draft, num_draft_tokens=2, eos_token_id=eos, pad_token_id=0)
    result = audit_callable(engine, target, prompts, max_new_tokens=6, arrivals=[0, 0, 2, 9], eos_token_id=eos)
    assert result.passed, result.render()
    got = result.report_entry("transparent")["coverage"]
    # steps: 0 and 1 from step 0 (1 stops at EOS at step 2), 2 arrives at step 2 while 0 runs, 3 alone at step 9
    assert (got["arrivals"], got["in_flight"], got["eos_stops"], got["longest_output"]) == (1, 3, 1, 6), got
    assert "ragged_rounds" not in got and "highest_position" not in got and got["flags"] == [], got
    assert "coverage: in flight<=3, out<=6, arrivals 1, eos 1" in result.table()
    alone = audit_callable(EqSpecEngine(target, draft, num_draft_tokens=2, eos_token_id=None, pad_token_id=0),
                           target, prompts[:2], max_new_tokens=3, arrivals=[0, 20])  # fmt: skip
    assert alone.coverage.flags == [NOTHING_IN_FLIGHT], alone.coverage


def test_a_vllm_configuration_keeps_its_black_box_coverage() -> None:
    """audit-vllm reads each configuration's black-box report: its coverage goes into the
    configuration's entry; a configuration that never ran says it was not measured."""
    coverage = Coverage(level="outputs", runs=1, requests=4, in_flight=3, arrivals=2).to_json()
    report = {"passed": True, "verdict": "exact", "requests": [], "exact_match": 1.0, "partial_match": 1.0,
              "seconds": 1.0, "oracle_seconds": 1.0, "coverage": coverage}  # fmt: skip
    ran = Outcome("tiny", "ngram", {}, **from_report(report))
    failed = Outcome("tiny", "ngram", {}, False, "server or audit error", error="no server")
    entries = [entry("vllm configuration", {}, o.passed, None, None, o.to_json()) for o in (ran, failed)]
    assert entries[0]["coverage"] == coverage and entries[1]["coverage"]["flags"] == [NOT_MEASURED], entries


def test_an_entry_without_coverage_says_it_was_not_measured() -> None:
    e = entry("blackbox", {"engine": "x"}, True, None, None, {})
    assert e["coverage"]["flags"] == [NOT_MEASURED] and e["coverage"]["level"] == "none", e


# ---------------------------------------------------------------------------------------
# The audit's report.json and the gate's JUnit


@pytest.fixture(scope="module")
def audit_report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """One audit: a passing decoder, a failing one and an engine (25 s on one core)."""
    out = tmp_path_factory.mktemp("audit")
    argv = ["audit", "--decoder", EQSPEC, "--decoder", MUTANT, "--engine", ENGINE, "--models", "transparent",
            "--examples", "3", "--quiet", "--jobs", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 1  # the mutant fails, not as expected
    yield json.loads((out / "report.json").read_text())


def test_every_report_entry_has_coverage(audit_report: dict) -> None:
    """Passing or failing, decoder or engine: a coverage object with its figures and flags."""
    entries = audit_report["entries"]
    assert [(e["kind"], e["passed"]) for e in entries] == [("decoder", True), ("decoder", False), ("engine", True)]
    for e in entries:
        c = e["coverage"]
        assert c["level"] == "calls" and c["runs"] >= 1 and isinstance(c["flags"], list), e
        assert {"batch_sizes", "k_values", "rounds", "ragged_rounds", "finished_early", "longest_sequence",
                "highest_position", "pad_prompts", "eos_stops"} <= set(c), c  # fmt: skip
    decoder, _, engine = entries
    assert decoder["coverage"]["runs"] == decoder["cases"] and decoder["coverage"]["rounds"] > 0
    assert {"arrivals", "aborts", "duplicate_prompts", "reused_rows"} <= set(engine["coverage"])
    assert engine["coverage"]["runs"] == engine["runs"], engine  # a pass: every run of the machine


@pytest.fixture(scope="module")
def junit(tmp_path_factory: pytest.TempPathFactory) -> ET.Element:
    out = tmp_path_factory.mktemp("gate")
    argv = ["gate", "--junit", str(out / "junit.xml"), "--out", str(out / "repro"), "--quiet", "--models",
            "transparent", "--decoder", EQSPEC, "--examples", "2", "--jobs", "1"]  # fmt: skip
    assert main(argv) == 0
    return ET.parse(out / "junit.xml").getroot()


def test_junit_has_the_coverage_properties(junit: ET.Element) -> None:
    (case,) = junit.findall("./testsuite/testcase")
    props = {p.get("name", ""): p.get("value", "") for p in case.findall("./properties/property")}
    assert int(props["coverage.runs"]) == 2 and int(props["coverage.rounds"]) >= int(props["coverage.ragged_rounds"])
    assert {"coverage.ragged_rounds", "coverage.batch_sizes", "coverage.k_values", "coverage.highest_position",
            "coverage.eos_stops", "coverage.flags"} <= set(props), props  # fmt: skip


def test_real_model_batches_have_coverage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Real-model mode: each batch's entry and printed line carry its coverage, and the overall
    line the batches' merged."""
    target, draft = save_tiny_pair(tmp_path / "tiny-llama")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello world\nThe quick brown fox\nabc\nzz top x\n")
    argv = ["audit", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts), "--batch-size", "2",
            "--max-new-tokens", "8", "--num-draft-tokens", "3", "--decoder", EQSPEC,
            "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("    coverage: ragged ") == 2 and out.count("  coverage: ragged ") == 3, out
    entries = json.loads((tmp_path / "out" / "report.json").read_text())["entries"]
    assert [e["kind"] for e in entries] == ["real-model batch"] * 2
    for e in entries:
        c = e["coverage"]
        assert (c["level"], c["runs"], c["requests"], c["k_values"]) == ("calls", 1, 2, [3]), c
        assert c["rounds"] >= 1 and c["batch_sizes"] and c["highest_position"] is not None, c
