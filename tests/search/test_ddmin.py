"""Delta debugging: ddmin on plain lists, `minimize_case` on hand-built cases around planted
bugs, and `specaudit minimize` end to end, down to running the regression test it writes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from specaudit.checks.diagnosis import all_violations, diagnose
from specaudit.commands.cli import main
from specaudit.contracts.case import Case
from specaudit.running.runner import run_case
from specaudit.search.ddmin import CasePasses, ddmin, failure_class, minimize_case

EQSPEC = "specaudit.reference.eqspec:EqSpec"
REJECTED_KV = "specaudit.reference.mutants:rejected_kv_attended"
BONUS = "specaudit.reference.mutants:bonus_from_draft"


# ---------------------------------------------------------------------------------------
# ddmin on lists


def recording(cause: set[int]) -> tuple[list[tuple[int, ...]], object]:
    calls: list[tuple[int, ...]] = []

    def fails(subset: list[int]) -> bool:
        calls.append(tuple(subset))
        return cause <= set(subset)

    return calls, fails


def test_ddmin_finds_a_one_minimal_subset() -> None:
    """ddmin returns a failing subset from which removing any one element passes."""
    calls, fails = recording({3, 11, 17})
    result = ddmin(list(range(20)), fails)
    assert result == [3, 11, 17]
    for i in range(len(result)):
        assert not fails(result[:i] + result[i + 1 :])


def test_ddmin_tests_each_subset_once() -> None:
    """Predicate results are cached: no subset is handed to the predicate twice."""
    calls, fails = recording({0, 5, 6, 13})
    ddmin(list(range(16)), fails)
    assert len(calls) == len(set(calls))


def test_ddmin_single_cause_is_logarithmic() -> None:
    """With one failure-inducing element among 64, ddmin needs O(log n) predicate calls."""
    calls, fails = recording({37})
    assert ddmin(list(range(64)), fails) == [37]
    assert len(calls) <= 2 * math.log2(64) + 2


def test_ddmin_keeps_order_and_unhashable_items() -> None:
    """Items need not be hashable; equal items at different places stay distinct; order is kept."""
    items = [[1], [2], [1], [3]]
    result = ddmin(items, lambda sub: sum(x[0] for x in sub) >= 5)  # needs [2] and [3]
    assert result == [[2], [3]]


def test_ddmin_needs_a_failing_input() -> None:
    """A passing input is an error, not a silent empty result."""
    with pytest.raises(ValueError, match="failing input"):
        ddmin([1, 2, 3], lambda sub: False)


# ---------------------------------------------------------------------------------------
# minimize_case


def eight_rows() -> Case:
    """A failing batch built by hand: 8 rows, duplicates, ragged prompts and schedules, padding."""
    k, max_new = 4, 12
    horizon = max_new + k + 2
    patterns = {
        (5, 17, 33, 2): "110111011110111",
        (9, 1): "0111100111",
        (40, 41, 42, 43, 44, 45, 46): "1111101111011",
        (77,): "10101010101",
        (12, 13, 14): "0",
        (100, 3, 60, 61, 62): "1101101101101",
    }
    prompts = [(5, 17, 33, 2), (9, 1), (40, 41, 42, 43, 44, 45, 46), (5, 17, 33, 2), (77,), (12, 13, 14)]
    prompts += [(100, 3, 60, 61, 62), (9, 1)]
    accept = [tuple(c == "1" for c in patterns[p].ljust(horizon, "0")) for p in prompts]
    return Case(tuple(prompts), tuple(accept), k, max_new, None, 0, 1)


def test_rejected_kv_case_shrinks_to_at_most_two_rows() -> None:
    """An 8-row case failing rejected_kv_attended shrinks to <= 2 rows, same failure class."""
    case = eight_rows()
    result = minimize_case(REJECTED_KV, case)
    assert result.original_diagnosis.first_check == "I2"
    assert result.case.batch_size <= 2
    # one class: kv-drift in the batch, signed bonus once one row is left (wrong at batch size 1)
    assert failure_class(result.diagnosis) == failure_class(result.original_diagnosis) == ("I2", "kv-drift")
    assert result.diagnosis.signature == ("bonus" if result.case.batch_size == 1 else "kv-drift")
    assert result.case.max_new_tokens < case.max_new_tokens and result.runs < 100
    assert all_violations(run_case(REJECTED_KV, result.case))
    assert not all_violations(run_case(EQSPEC, result.case))


def test_bonus_case_shrinks_to_one_row() -> None:
    """A bug visible at batch size 1 (bonus token from the draft) shrinks to a single row."""
    result = minimize_case(BONUS, eight_rows())
    assert result.case.batch_size == 1
    assert (result.diagnosis.first_check, result.diagnosis.signature) == ("equivalence", "bonus")


class Chameleon:
    """Fails I2 (rejected KV attended) on batches of 3+ rows, equivalence (bonus) on smaller ones."""

    name = "chameleon"

    def generate(self, target, draft, input_ids, attention_mask, **kwargs):  # type: ignore[no-untyped-def]
        from specaudit.reference.planted.acceptance import BonusFromDraft
        from specaudit.reference.planted.kv_cache import RejectedKvAttended

        decoder = RejectedKvAttended() if input_ids.shape[0] >= 3 else BonusFromDraft()
        return decoder.generate(target, draft, input_ids, attention_mask, **kwargs)


def test_a_different_failure_does_not_reproduce() -> None:
    """Minimizing keeps the original failure class: candidates that fail differently are rejected."""
    result = minimize_case("tests:Chameleon", eight_rows(), factory=Chameleon)
    assert result.original_diagnosis.first_check == "I2"
    assert result.case.batch_size == 3
    assert (result.diagnosis.first_check, result.diagnosis.signature) == ("I2", "kv-drift")


def test_duplicate_prompts_stay_consistent() -> None:
    """Rows sharing a prompt keep one accept pattern through every stage (Case would refuse otherwise)."""
    case = eight_rows()
    dup = Case(case.prompts[:2] * 3, case.accept[:2] * 3, 4, 12, None, 0, 0)
    result = minimize_case(REJECTED_KV, dup)
    patterns: dict[tuple[int, ...], tuple[bool, ...]] = {}
    for prompt, pattern in zip(result.case.prompts, result.case.accept):
        assert patterns.setdefault(prompt, pattern) == pattern


def test_shrinking_keeps_a_violation_that_counts() -> None:
    """With `counts`, a candidate must keep a violation that counts (not a known failure): told
    to ignore I2, the minimized case still shows the equivalence failure the bug causes."""
    ignore_i2 = lambda v: v.check != "I2"  # noqa: E731
    result = minimize_case(REJECTED_KV, eight_rows(), counts=ignore_i2)
    assert failure_class(result.diagnosis) == ("I2", "kv-drift")
    assert any(ignore_i2(v) for v in result.diagnosis.violations)
    with pytest.raises(CasePasses):  # nothing counts: nothing to minimize
        minimize_case(REJECTED_KV, eight_rows(), counts=lambda v: False)


def test_budget_is_respected() -> None:
    """With a budget of N runs, minimize_case stops after N and still returns a failing case."""
    result = minimize_case(REJECTED_KV, eight_rows(), budget=4)
    assert result.runs <= 4 and result.exhausted
    assert not diagnose(run_case(REJECTED_KV, result.case)).passed


# ---------------------------------------------------------------------------------------
# `specaudit minimize`


def minimize(*argv: str) -> int:
    return main(["minimize", *argv])


@pytest.mark.slow
def test_minimize_command_writes_reproducer_and_regression_test(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pytester: pytest.Pytester
) -> None:
    """`specaudit minimize` exits 1 and writes a reproducer and a regression test that fails on
    the planted bug and passes on EqSpec."""
    source = eight_rows().save(tmp_path / "batch8.json")
    out = tmp_path / "out"
    assert minimize(str(source), "--decoder", REJECTED_KV, "--out", str(out)) == 1
    stdout = capsys.readouterr().out
    assert "8 rows before, 1 after" in stdout and "decoder runs" in stdout
    reproducer, test = out / "batch8.json", out / "test_regression_batch8.py"
    document = json.loads(reproducer.read_text())
    assert document["kind"] == "decoder-case" and document["subject"]["decoder"] == REJECTED_KV
    assert document["evidence"]["first_check"] == "I2" and document["evidence"]["violations"][0]["check"] == "I2"
    assert Case.from_json(document).batch_size == 1

    result = pytester.runpytest_subprocess(
        str(test), "--specaudit-decoder", REJECTED_KV, "--specaudit-decoder", EQSPEC, "-p", "no:cacheprovider", "-v"
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            f"*test_regression_batch8?{REJECTED_KV}? FAILED*",
            f"*test_regression_batch8?{EQSPEC}? PASSED*",
            "*[[]I2: attends-wrong-slot[]]*",
        ]
    )


def test_minimize_of_a_passing_case_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A case the decoder passes: said so, exit 0, nothing written."""
    source = eight_rows().save(tmp_path / "batch8.json")
    assert minimize(str(source), "--decoder", EQSPEC, "--out", str(tmp_path / "out")) == 0
    assert "nothing to minimize" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("content", "decoder", "message"),
    [
        (None, EQSPEC, "cannot read reproducer"),
        ("{not json", EQSPEC, "not JSON"),
        ('{"format": "other"}', EQSPEC, "is not a specaudit reproducer"),
        ("CASE", "specaudit.reference.nosuchmodule:X", "not found"),
        ("CASE", "specaudit.reference.eqspec", "not of the form module:attr"),
        ("UNKNOWN_MODEL", EQSPEC, "unknown model"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, decoder: str, message: str
) -> None:
    """Unreadable case files, bad decoder specs and unknown models: exit 2 with one line on stderr."""
    path = tmp_path / "case.json"
    if content == "CASE":
        eight_rows().save(path)
    elif content == "UNKNOWN_MODEL":
        document = eight_rows().to_json()
        document["model"]["target"] = "gpt7"
        path.write_text(json.dumps(document))
    elif content is not None:
        path.write_text(content)
    assert minimize(str(path), "--decoder", decoder, "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specaudit: error: ") and message in err
    assert "Traceback" not in err
