"""`EngineRules`: an engine rule sequence as typed data. Its JSON form round-trips (and is the one
engine reproducers have always held), every older dict form reads, bad input is named, and its
repr is evaluable."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specaudit.contracts.case import ENVELOPE_FORMAT
from specaudit.contracts.engine_rules import (
    Abort,
    AddRequest,
    Drain,
    EngineRules,
    Op,
    RulesFormatError,
    Step,
    as_rules,
)

LEGACY = Path(__file__).parents[1] / "data" / "legacy_reproducers"
FREE_LIST = "specaudit.reference.engine_mutants:FreeListOffByOne"


@st.composite
def ops(draw: st.DrawFn) -> Op:
    """One rule of any kind, an add with a non-empty prompt and its accept pattern."""
    kind = draw(st.sampled_from(["add", "step", "abort", "drain"]))
    if kind == "add":
        return AddRequest(
            draw(st.integers(0, 20), label="id"),
            tuple(draw(st.lists(st.integers(0, 255), min_size=1, max_size=6), label="prompt")),
            draw(st.integers(1, 12), label="max_new_tokens"),
            tuple(draw(st.lists(st.booleans(), max_size=16), label="accept")),
        )
    if kind == "abort":
        return Abort(draw(st.integers(0, 30), label="id"))
    return Step() if kind == "step" else Drain()


@st.composite
def engine_rules(draw: st.DrawFn) -> EngineRules:
    """A rule sequence on any engine spec and built-in model, with or without EOS."""
    return EngineRules(
        draw(st.sampled_from(["specaudit.reference.engines:EqSpecEngine", FREE_LIST, "my_pkg.engine:Mine"])),
        draw(st.integers(1, 7), label="K"),
        draw(st.one_of(st.none(), st.integers(0, 255)), label="eos"),
        draw(st.integers(0, 255), label="pad"),
        tuple(draw(st.lists(ops(), max_size=12))),
        draw(st.sampled_from(["transparent", "llama", "gpt2"])),
    )


@given(engine_rules())
def test_json_round_trip(rules: EngineRules) -> None:
    """to_json -> JSON text -> from_json gives the same rules; the repr evaluates to them too."""
    text = json.dumps(rules.to_json())
    assert EngineRules.from_json(json.loads(text)) == rules, text
    scope = {"EngineRules": EngineRules, "AddRequest": AddRequest, "Step": Step, "Abort": Abort, "Drain": Drain}
    assert eval(repr(rules), scope) == rules, repr(rules)  # noqa: S307 (the repr is the pinning form)


@given(engine_rules())
def test_the_envelope_form_reads_as_the_flat_one(rules: EngineRules) -> None:
    """A reproducer envelope of kind engine-ops (engine and model in the subject, the rest in the
    payload) reads as the rules it holds."""
    flat = rules.to_json()
    envelope = {
        "format": ENVELOPE_FORMAT,
        "version": 2,
        "kind": "engine-ops",
        "subject": {"engine": flat.pop("engine"), "model": flat.pop("model")},
        "payload": flat,
        "evidence": {"first_check": None, "rule": None, "violations": []},
    }
    assert EngineRules.from_json(envelope) == rules


def test_the_json_form_is_the_one_reproducers_held() -> None:
    """The field names and op spellings engine reproducer files have always used."""
    rules = EngineRules(FREE_LIST, 2, 7, 0, (AddRequest(0, (5, 6), 3, "0100"), Step(), Abort(0), Drain()))
    assert rules.to_json() == {
        "engine": FREE_LIST,
        "num_draft_tokens": 2,
        "eos_token_id": 7,
        "pad_token_id": 0,
        "model": "transparent",
        "ops": [
            {"op": "add", "id": 0, "prompt": [5, 6], "max_new_tokens": 3, "accept": "0100"},
            {"op": "step"},
            {"op": "abort", "id": 0},
            {"op": "drain"},
        ],
    }


def test_a_legacy_engine_file_reads_with_its_evidence_ignored() -> None:
    """The pre-envelope engine file (an `engine_failure_record`: rules plus first_check, rule and
    evidence) reads as its rules."""
    data = json.loads((LEGACY / "engine_ops.json").read_text())
    rules = EngineRules.from_json(data)
    assert rules == EngineRules(FREE_LIST, 1, None, 0, (AddRequest(0, (0,), 2, "00000"), Drain()), "transparent")
    assert {**rules.to_json(), "first_check": data["first_check"], "rule": data["rule"],
            "evidence": data["evidence"]} == data  # fmt: skip


@pytest.mark.parametrize("model", [None, "missing"])
def test_rules_without_a_model_are_on_the_transparent_one(model: str | None) -> None:
    """Written before engines ran on tiny real models: no "model" key (or a null one)."""
    data: dict[str, Any] = json.loads((LEGACY / "engine_ops.json").read_text())
    if model is None:
        data["model"] = None
    else:
        del data["model"]
    assert EngineRules.from_json(data).model == "transparent"


def test_rules_as_they_are_and_an_engine_put_in_place() -> None:
    rules = EngineRules(FREE_LIST, 1, None, 0, (Step(),))
    assert as_rules(rules) is rules
    assert EngineRules.from_json(rules, engine="x:Y") == EngineRules("x:Y", 1, None, 0, (Step(),))
    assert EngineRules.from_json({**rules.to_json(), "engine": None}, engine="x:Y").engine == "x:Y"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ops": [{"op": "add", "id": 0}]}, r"rule 0 \(add\) lacks prompt, max_new_tokens, accept"),
        ({"ops": [{"op": "step"}, {"op": "jump"}]}, "rule 1 is .*jump.*; rules are add, step, abort, drain"),
        ({"ops": [{"op": "add", "id": 0, "prompt": [], "max_new_tokens": 1, "accept": ""}]}, "at least one token"),
        (
            {"ops": [{"op": "add", "id": 0, "prompt": [1], "max_new_tokens": 1, "accept": "01x"}]},
            "written with 0 and 1",
        ),
        ({"ops": {"op": "step"}}, "'ops' must be a list"),
        ({"engine": None}, "lack engine"),
        ({"num_draft_tokens": "two"}, "malformed field"),
    ],
)
def test_malformed_rules_are_named(change: dict[str, Any], message: str) -> None:
    data = {**EngineRules(FREE_LIST, 1, None, 0).to_json(), **change}
    with pytest.raises(RulesFormatError, match=message):
        EngineRules.from_json(data)


def test_another_reproducer_kind_is_refused() -> None:
    with pytest.raises(RulesFormatError, match="'decoder-case', not 'engine-ops'"):
        EngineRules.from_json({"format": ENVELOPE_FORMAT, "kind": "decoder-case", "subject": {}, "payload": {}})


def test_ops_read_as_the_session_applies_them() -> None:
    """Each op is its own type with the fields its rule needs; its repr reads as the rule."""
    add = AddRequest(3, [5, 6], 4, [True, False])
    assert (add.request_id, add.prompt, add.max_new_tokens, add.accept) == (3, (5, 6), 4, (True, False))
    assert repr(add) == "AddRequest(3, prompt=(5, 6), max_new_tokens=4, accept='10')"
    assert (repr(Abort(3)), repr(Step()), repr(Drain())) == ("Abort(3)", "Step()", "Drain()")
    with pytest.raises(TypeError, match="not dict"):
        EngineRules(FREE_LIST, 1, None, 0, ({"op": "step"},))  # type: ignore[arg-type]
