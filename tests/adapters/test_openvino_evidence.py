"""The OpenVINO audit's per-step evidence and workloads, without OpenVINO: acceptance and the
ragged share from tokens emitted per request per step, the drawn workloads' bounds and their
reproducer form. Runs in the main venv (nothing here imports openvino_genai)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings

from specaudit.adapters.openvino.engine import StepLog
from specaudit.adapters.openvino.workloads import MAX_K, MAX_LONG, MAX_PROMPT, Workload, workloads


def test_acceptance_counts_verify_steps_not_the_prefill_token() -> None:
    # request 0 (K=3): prefill token at step 0, then 1 + 2 accepted, then 1 + 0; request 1 (K=1): 1 + 1
    log = StepLog([{0: 1}, {0: 3, 1: 1}, {0: 1, 1: 2}])
    assert log.acceptance({0: 3, 1: 1}, {0: 0, 1: 1}) == (2 + 0 + 1) / (3 + 3 + 1)


def test_acceptance_with_the_prefill_token_and_a_verify_in_one_step() -> None:
    log = StepLog([{0: 3}])  # the prefill's token, then a verify of K=2 emitting 1 accepted + 1, in one step
    assert log.acceptance({0: 2}, {0: 0}) == 0.5


def test_ragged_share_counts_steps_whose_requests_emit_different_counts() -> None:
    log = StepLog([{0: 1}, {0: 2, 1: 2}, {0: 3, 1: 1}, {0: 1, 1: 1, 2: 4}])
    assert log.ragged_share() == 2 / 3  # the single-request step is not a batch
    assert StepLog([{0: 1}, {0: 1, 1: 1}]).ragged_share() == 0.0  # a control: lockstep is not ragged


@settings(max_examples=30, deadline=None, database=None)
@given(workloads(512))
def test_drawn_workloads_stay_in_bounds_and_round_trip(workload: Workload) -> None:
    n = len(workload.prompts)
    assert n == len(workload.limits) == len(workload.ks) == len(workload.arrivals) == len(workload.cancels)
    assert all(1 <= len(p) <= MAX_PROMPT and min(p) >= 4 for p in workload.prompts)
    assert all(1 <= k <= MAX_K for k in workload.ks)
    assert Workload.from_json(workload.to_json()) == workload


def test_openvino_reproducer_round_trips_and_asks_for_its_venv(tmp_path: Path) -> None:
    """An `openvino` reproducer is one envelope kind: its options and workload read back; a file
    without a workload is refused naming it; replaying outside the OpenVINO venv says which venv."""
    import importlib.util
    import json

    from specaudit.adapters.openvino.engine import EngineOptions
    from specaudit.adapters.openvino.reproducer import reproducer_of
    from specaudit.artifacts.reproducer import load_reproducer, save
    from specaudit.commands.replay import replay
    from specaudit.contracts.engine import ENGINE_RULES
    from specaudit.contracts.errors import UsageError
    from specaudit.contracts.violation import Violation

    workload = Workload(((437,), (6,)), (4, 4), (1, 1), (0, 0), (None, None), None)
    options = EngineOptions("draft", max_num_batched_tokens=2)
    violation = Violation("contract", "aborted-silent", "found", ENGINE_RULES["aborted-silent"], request=1)
    run = SimpleNamespace(workload=workload, result=SimpleNamespace(violations=[violation]))
    path = save(tmp_path, "ov", reproducer_of("draft", options, run, None))
    read = load_reproducer(path)
    assert EngineOptions.from_json(read.subject["options"]) == options
    assert Workload.from_json(read.payload["workload"]) == workload
    assert read.evidence["rule"] == "aborted-silent"
    broken = json.loads(path.read_text())
    broken["payload"] = {}
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    with pytest.raises(UsageError, match="broken.json: OpenVINO reproducer has no workload"):
        load_reproducer(tmp_path / "broken.json")
    if importlib.util.find_spec("openvino_genai") is None:
        with pytest.raises(UsageError, match="OpenVINO venv"):
            replay(path)


class Successor(torch.nn.Module):
    """A fake target: after token t the top logit (5.0) is t+1 and the runner-up (4.8) t+2, so the
    greedy oracle counts up, t+2 is a near-tie (gap 0.2) and anything else is 5.0 below the top."""

    def forward(self, ids: torch.Tensor) -> SimpleNamespace:
        logits = torch.zeros(*ids.shape, 64, dtype=torch.float64)
        logits.scatter_(2, ((ids + 1) % 64).unsqueeze(2), 5.0)
        logits.scatter_(2, ((ids + 2) % 64).unsqueeze(2), 4.8)
        return SimpleNamespace(logits=logits)


def test_low_precision_rule_tells_numerics_from_a_wrong_token() -> None:
    """`precision.judge_at_precision`: a speculative request off the oracle is numerics when it
    equals the control, departs no earlier than the control, or departs on a near-tie; a token far
    below the top where the control keeps the oracle's tokens is `beyond-precision-noise`."""
    from specaudit.adapters.openvino.precision import FLOOR, RULE, judge_at_precision

    prompts = [(1,), (1,), (1,), (1,)]
    oracle = [2, 3, 4, 5]
    control = {0: ([2, 4, 5, 6], 1), 1: ([2, 3, 5, 6], 2), 2: (oracle, None), 3: (oracle, None)}
    diverged = {
        0: ([2, 4, 5, 6], 1),  # equals the control
        1: ([2, 3, 4, 6], 3),  # departs after the control does
        2: ([2, 4, 5, 6], 1),  # departs where the control keeps the oracle's, on a near-tie (0.2)
        3: ([2, 3, 40, 41], 2),  # departs where the control keeps the oracle's, 5.0 below the top
    }
    verdict = judge_at_precision(Successor(), prompts, diverged, control, "test")
    assert verdict.floor == FLOOR
    assert set(verdict.numerics) == {0, 1, 2}, verdict.numerics
    assert verdict.numerics[0] == "equals the control" and verdict.numerics[2].startswith("a near-tie at 1")
    [violation] = verdict.violations
    assert (violation.check, violation.rule, violation.request) == ("equivalence", RULE, 3)
    assert "index 2 with token 40" in violation.found and "keeps the oracle's" in violation.found
    # a control that departs on a token far from the top is no numerics: equal outputs do not excuse it
    broken = judge_at_precision(Successor(), prompts, {0: ([30, 31], 0)}, {0: ([30, 31], 0)}, "test")
    assert [(v.rule, v.request) for v in broken.violations] == [(RULE, 0)] and not broken.numerics
    assert "control at the same precision departs" in broken.violations[0].found


def test_a_run_numerics_explain_passes_with_its_checks() -> None:
    """`precision.rejudged` clears the registry's equivalence check with the requests' violations:
    left failing, a bf16 run the control explained read "failed" with no violation, and the search
    took its first violation from an empty list (an IndexError, seen on an AMX CPU). A precision
    violation still fails, in both."""
    from specaudit.adapters.engine_blackbox import Answer, Request, judge_answers
    from specaudit.adapters.openvino.precision import FLOOR, RULE, PrecisionVerdict, rejudged
    from specaudit.contracts.violation import Violation
    from specaudit.fixtures.pairs import target_model
    from specaudit.reference.oracle import greedy_oracle

    target = target_model("llama")
    request = Request(0, (5, 6, 7), 4, 0.0)
    oracle = list(greedy_oracle(target, request.prompt, max_new_tokens=4, eos_token_id=None).tokens)
    off = [*oracle[:3], (oracle[3] + 1) % 64]
    result = judge_answers("t", "steps", target, [request], {0: Answer(tuple(off), None, 0, 3)}, None, None, 0.0)
    assert not result.passed and result.diverged == [0] and not result.evaluation.passed
    explained = rejudged(result, PrecisionVerdict(FLOOR, {0: "equals the control"}, []))
    assert explained.passed and explained.evaluation.passed and explained.violations == []
    wrong = Violation("equivalence", RULE, "beyond the floor", "numerics", request=0)
    failing = rejudged(result, PrecisionVerdict(FLOOR, {}, [wrong]))
    assert not failing.passed and failing.violations == [wrong]
    assert list(failing.evaluation.outcome("equivalence").violations) == [wrong]


def test_expected_output_with_a_stop_string_cuts_the_oracle_where_its_text_shows_it() -> None:
    from specaudit.checks.stops import RULE, check_stop, expected_with_stop

    def decode(ids: list[int]) -> str:
        return " ".join(f"w{t}" for t in ids)

    oracle = [216, 479, 161, 421, 316]
    assert expected_with_stop(decode, oracle, "w479 w161", False) == [216]
    assert expected_with_stop(decode, oracle, "w479 w161", True) == [216, 479, 161]
    assert expected_with_stop(decode, oracle, "w31", False) == [216, 479, 161, 421]  # inside a token: cut before it
    assert expected_with_stop(decode, oracle, "w31", True) == oracle
    assert expected_with_stop(decode, oracle, "w999", False) is None  # never appears: runs to the limit
    assert check_stop(decode, oracle, [216], "w479 w161", False, 0) is None
    kept = check_stop(decode, oracle, [216, 479], "w479 w161", False, 3)  # part of the stop string left in
    assert kept is not None and (kept.rule, kept.request) == (RULE, 3) and "[216]" in kept.expected


def spaced(ids: list[int]) -> str:
    """The tiny tokenizer's text: token t is "w<t>", separated by spaces, token 0 is ""."""
    return " ".join(f"w{t}" for t in ids if t)


def test_drawn_stop_strings_are_judgeable_pieces_of_the_oracles_text() -> None:
    """`stop_from`: one to three tokens' text, a head cut only for one token (and only when included),
    never across a token that decodes to ""; `judgeable` refuses a stop starting inside a token and
    ending in a later one."""
    from specaudit.checks.stops import completing, judgeable, stop_from

    oracle = [216, 479, 161, 421, 316, 18, 0, 221]
    assert stop_from(spaced, oracle, 1, 3, 0, 0, False) == "w479 w161 w421"
    assert stop_from(spaced, oracle, 4, 1, 0, 1, False) == "w31"  # the start of a token
    assert stop_from(spaced, oracle, 4, 1, 1, 0, True) == "316"  # inside one token, included: judgeable
    assert stop_from(spaced, oracle, 4, 1, 1, 0, False) is None  # not included: no token-level answer
    assert stop_from(spaced, oracle, 5, 3, 0, 0, True) is None  # spans token 0 ("")
    assert stop_from(spaced, oracle, 7, 2, 0, 0, True) is None  # past the tokens
    assert not judgeable(spaced, oracle, "316 w1")  # starts inside a token, ends in a later one
    assert judgeable(spaced, oracle, "w999") and completing(spaced, oracle, "w421") == 3


def test_usage_count_is_the_outputs_plus_a_trimmed_stop_string() -> None:
    from specaudit.checks.stops import check_stop_output, check_usage, expected_usage

    oracle = [216, 479, 161, 421, 316]
    assert expected_usage(spaced, oracle, [216], "w479 w161 w421", False) == 4  # the trimmed tokens were generated
    assert expected_usage(spaced, oracle, [216, 479, 161, 421], "w479 w161 w421", True) == 4
    assert expected_usage(spaced, oracle, oracle, None, False) == 5
    assert check_usage(4, 4, 0) is None
    over = check_usage(7, 4, 2)
    assert over is not None and (over.rule, over.request, over.evidence["reported"]) == ("usage-count", 2, 7)
    text = check_stop_output(spaced, oracle, [216, 479], "w216", "w479", True, 1)  # ids kept, text trimmed
    assert text is not None and text.rule == "stop-string" and "text 'w216'" in text.found
    finish = check_stop_output(spaced, oracle, [216, 479], "w216 w479", "w479", True, 1, "length")
    assert finish is not None and "finish reason 'length'" in finish.found
    assert check_stop_output(spaced, oracle, [216, 479], "w216 w479", "w479", True, 1, "stop") is None


@settings(max_examples=40, deadline=None, database=None)
@given(workloads(512))
def test_drawn_stops_start_within_the_limit_or_set_it(workload: Workload) -> None:
    """Stop specs stay in range, a limit set from a stop lies one or two tokens past its last token,
    and the stops survive the reproducer's JSON."""
    assert len(workload.stops) == len(workload.prompts)
    for spec, limit in zip(workload.stops, workload.limits):
        if spec is not None:
            start, n, head, tail, _ = spec
            assert 1 <= n <= 3 and 0 <= head <= 2 and 0 <= tail <= 2 and (head == 0 or n == 1)
            assert start < limit or start + n - 1 + 2 >= limit
    assert Workload.from_json(workload.to_json()) == workload


@settings(max_examples=20, deadline=None, database=None)
@given(workloads(512, stops=False))
def test_no_stop_strings_unless_asked(workload: Workload) -> None:
    """`audit-openvino --no-stop-strings` draws none."""
    assert all(spec is None for spec in workload.stops)


def test_a_flaky_search_is_reported_as_not_reproducible() -> None:
    """Hypothesis's Flaky (a workload failing once, not when run again) reads cause first."""
    from hypothesis.errors import FlakyFailure

    from specaudit.adapters.openvino.audit import unreliable

    text = unreliable(FlakyFailure("Hypothesis probe(workload=...) produces unreliable results", [ValueError("x")]))
    assert text.startswith("not reproducible: a workload failed once") and "probe(workload=...)" in text
    assert "(first: ValueError: x)" in text
    assert unreliable(ValueError("y")) == "ValueError: y"


def test_usage_is_unreported_where_the_pipeline_has_no_perf_metrics() -> None:
    """A request whose generation never completed (the pipeline raised part-way) reports no count;
    the handle's RuntimeError must not end the audit (it made a drawn search 'not reproducible')."""
    from specaudit.adapters.openvino.engine import EngineOptions, OpenVinoEngine

    class Handle:
        def __init__(self, metrics: bool) -> None:
            self.metrics = metrics

        def get_perf_metrics(self) -> Any:
            if not self.metrics:
                raise RuntimeError("Perf metrics are not available until generation has completed.")
            return type("Metrics", (), {"get_num_generated_tokens": lambda _: 3})()

    engine = OpenVinoEngine(None, EngineOptions(), None)
    engine.handles = {0: Handle(False), 1: Handle(True)}
    assert (engine.usage(0), engine.usage(1), engine.usage(2)) == (None, 3, None)


def test_every_known_defect_names_a_standalone_reproducer() -> None:
    """A known defect is shipped with a script that confirms it without specaudit (issue 39)."""
    import re

    from specaudit.adapters.openvino.defects import KNOWN_DEFECTS

    root = Path(__file__).resolve().parents[2]
    for name, text in KNOWN_DEFECTS.items():
        found = re.findall(r"Reproducer: (tests/wild/openvino/\w+\.py)", text)
        assert len(found) == 1, f"{name} names no reproducer script"
        script = (root / found[0]).read_text()
        assert "import specaudit" not in script and "from specaudit" not in script, found[0]
        assert "def main(" in script and "CONFIRMED" in script, found[0]


def test_the_sampling_workload_is_the_seeds() -> None:
    """Same seed, same requests, K, arrivals and rng seeds (no global randomness); K mixed in 1..7."""
    from specaudit.adapters.openvino.sampling import PER_PROMPT, PROMPTS, sampling_workload

    (one, seeds), (again, seeds_again) = sampling_workload(3), sampling_workload(3)
    assert one == again and seeds == seeds_again and sampling_workload(4) != (one, seeds)
    assert len(one.prompts) == len(PROMPTS) * PER_PROMPT == len(set(seeds.values()))
    assert set(one.ks) <= set(range(1, MAX_K + 1)) and len(set(one.ks)) > 1


@settings(max_examples=30, deadline=None, database=None)
@given(workloads(512, budget=32))
def test_a_budget_draws_at_most_one_prompt_past_it(workload: Workload) -> None:
    """Steered toward chunked prefill: one prompt may pass the budget (up to `MAX_LONG`), so a step's
    tokens stay within `defects.WHOLE_BUDGET`; the others keep to `MAX_PROMPT`."""
    from specaudit.adapters.openvino.defects import WHOLE_BUDGET

    lengths = sorted(len(p) for p in workload.prompts)
    assert lengths[-1] <= MAX_LONG and all(n <= MAX_PROMPT for n in lengths[:-1])
    assert sum(lengths) <= WHOLE_BUDGET


def test_a_budget_of_32_is_passed_by_most_drawn_workloads() -> None:
    """The draws reach chunked prefill at the speculative budget (`SPEC_CHUNK`): over 200 draws, 107
    workloads hold a prompt past 32 tokens (140 prompts), where without steering 44 did (69 prompts),
    and an audit's 20 draws reached 2 (bench/results/openvino_audit.md)."""
    from hypothesis import HealthCheck, find

    quick = settings(database=None, max_examples=20, suppress_health_check=list(HealthCheck))
    steered = find(workloads(512, budget=32), lambda w: max(map(len, w.prompts)) > 32, settings=quick)
    assert 32 < max(map(len, steered.prompts)) <= MAX_LONG
    counted = []

    @settings(max_examples=40, deadline=None, database=None)
    @given(workloads(512, budget=32))
    def count(workload: Workload) -> None:
        counted.append(max(map(len, workload.prompts)) > 32)

    count()
    assert sum(counted) >= len(counted) // 4, f"{sum(counted)} of {len(counted)} drawn workloads pass the budget"


def test_exercised_features_are_counted_and_unreached_ones_flagged() -> None:
    """A prompt over the budget is chunked, one sharing an earlier prompt's start can hit the prefix
    cache; a configuration whose draws reached none of an enabled feature is flagged."""
    from specaudit.adapters.openvino.workloads import exercised, unexercised

    w = Workload(((5,) * 12, (5, 6), (7,)), (4, 4, 4), (1, 3, 3), (0, 1, 0), (None, 2, None), None,
                 (None, None, (0, 1, 0, 0, False)))  # fmt: skip
    counts = exercised(w, budget=8)
    assert counts == {"chunked prefill": 1, "shared prefix": 1, "cancel": 1, "stop string": 1, "mixed K": 1}
    assert unexercised(counts, 8, True, True) == []
    none = {name: 0 for name in counts}
    assert unexercised(none, 8, True, True) == ["cancel", "stop string", "chunked prefill", "shared prefix", "mixed K"]
    assert unexercised(none, 256, False, False) == ["cancel", "stop string"]
