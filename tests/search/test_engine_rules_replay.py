"""Typed engine rule sequences through the search: the machine's failure carries `EngineRules`,
ddmin shrinks them as typed ops, and the shrunk rules replay the same failure, as they are, from
their JSON text, from the line a failure prints, and from an older file's dict form. Each
replay in this layer has a name of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specaudit.contracts.engine_rules import AddRequest, Drain, EngineRules, Step
from specaudit.search.ddmin import minimize_ops
from specaudit.search.engine_machine import run_machine
from specaudit.search.engine_replay import replay_rules

FREE_LIST = "specaudit.reference.engine_mutants:FreeListOffByOne"
LEGACY = Path(__file__).parents[1] / "data" / "legacy_reproducers"


@pytest.fixture(scope="module")
def shrunk() -> tuple[EngineRules, tuple[str, str], EngineRules, str]:
    """A planted engine bug through the machine (Hypothesis shrinks it), then ddmin: the failure's
    rules, its first (check, rule), the minimized rules and the failure's message."""
    run = run_machine(FREE_LIST, 30, 12, seed=0)
    assert run.failure is not None, f"{FREE_LIST} not caught in {run.runs} runs"
    first = run.failure.violations[0]
    minimized = minimize_ops(run.failure.reproducer)
    return run.failure.reproducer, (first.check, first.rule), minimized.reproducer, str(run.failure)


def test_a_machine_failure_carries_typed_rules(shrunk: tuple[EngineRules, tuple[str, str], EngineRules, str]) -> None:
    rules, _, minimized, _ = shrunk
    for found in (rules, minimized):
        assert isinstance(found, EngineRules) and found.engine == FREE_LIST, repr(found)
        assert found.ops and all(isinstance(op, (AddRequest, Step, Drain)) for op in found.ops), repr(found)
    assert len(minimized.ops) <= len(rules.ops), f"ddmin grew the rules:\n{rules!r}\n->\n{minimized!r}"


def test_the_shrunk_rules_replay_the_same_failure(
    shrunk: tuple[EngineRules, tuple[str, str], EngineRules, str],
) -> None:
    """As they are and through their JSON text: the same first check and rule."""
    rules, first, minimized, _ = shrunk
    for replayed in (rules, minimized, json.loads(json.dumps(minimized.to_json()))):
        found = replay_rules(replayed)
        assert found and (found[0].check, found[0].rule) == first, f"replay gave {found[:1]}, want {first}"


def test_the_rules_a_failure_prints_replay_it(shrunk: tuple[EngineRules, tuple[str, str], EngineRules, str]) -> None:
    """The last line of an EngineFailure's message is its rules' JSON, the text `replay_rules` reads."""
    rules, first, _, message = shrunk
    printed = message.rstrip().splitlines()[-1]
    assert EngineRules.from_json(json.loads(printed)) == rules, printed
    found = replay_rules(printed)
    assert found and (found[0].check, found[0].rule) == first, found[:1]


def test_an_older_engine_file_replays() -> None:
    """The pre-envelope engine file, a dict, replays as the rules it holds (and by its path)."""
    path = LEGACY / "engine_ops.json"
    for given in (json.loads(path.read_text()), path):
        found = replay_rules(given)
        assert found and (found[0].check, found[0].rule) == ("contract", "has-unfinished"), found[:1]


def test_minimize_ops_takes_the_dict_form_too() -> None:
    """Callers not yet moved over hand ddmin a dict; it reads it and returns typed rules."""
    data = json.loads((LEGACY / "engine_ops.json").read_text())
    padded = dict(data, ops=[{"op": "add", "id": 7, "prompt": [40, 41], "max_new_tokens": 3, "accept": "11"}]
                  + data["ops"])  # fmt: skip
    result = minimize_ops(padded)
    assert isinstance(result.reproducer, EngineRules) and len(result.reproducer.ops) < len(padded["ops"])
    assert result.original == EngineRules.from_json(padded)


def test_each_replay_has_a_name_of_its_own() -> None:
    """The engine rules' replay is `replay_rules` (`replay` stays, the public name regression tests
    import); the plugin's re-run of a failure is `rerun_failure`; `commands.replay.replay` runs any
    reproducer. An engine session's request is the `AddRequest` rule, not a second `Request`."""
    from specaudit.commands import pytest_plugin
    from specaudit.running import engine_session
    from specaudit.search import engine_replay

    assert engine_replay.replay is engine_replay.replay_rules
    assert callable(pytest_plugin.rerun_failure) and not hasattr(pytest_plugin, "replay")
    assert not hasattr(engine_session, "Request")


def test_a_failure_reads_a_dict_as_rules_and_pickles_with_them() -> None:
    """An EngineFailure given an older dict holds its `EngineRules`; it crosses processes whole
    (`specaudit audit` sends verdicts back from workers)."""
    import pickle

    from specaudit.checks.engine import EngineFailure
    from specaudit.search.engine_replay import diagnose_engine

    data = json.loads((LEGACY / "engine_ops.json").read_text())
    failure = EngineFailure([], data, diagnose_engine)
    assert failure.reproducer == EngineRules.from_json(data)
    assert pickle.loads(pickle.dumps(failure)).reproducer == failure.reproducer
