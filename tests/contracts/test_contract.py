"""The decoder contract: every breach is a ContractError naming its rule, every bad spec a DecoderLoadError."""

from __future__ import annotations

import itertools
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from specaudit.checks import check_equivalence, check_i2, check_token_preservation
from specaudit.contracts.case import Case
from specaudit.contracts.decoder import (
    ContractError,
    DecoderLoadError,
    instantiate,
    load_decoder,
    validate_output,
)
from specaudit.reference.eqspec import EqSpec
from specaudit.running import watchdog
from specaudit.running.runner import run_case
from specaudit.running.watchdog import call_decoder
from tests.decoders.hangs import HangsOnTwoRows

IDS = torch.tensor([[0, 3, 1, 4], [9, 2, 6, 5]])  # [2, 4]
MASK = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
EOS = 7


class Returns:
    """A decoder whose generate() returns a fixed value (or calls a function of its arguments)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def generate(
        self, target: Any, draft: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kw: Any
    ) -> Any:
        return self.value(input_ids, **kw) if callable(self.value) else self.value


def call(decoder: Any, *, max_new_tokens: int = 4, eos: int | None = EOS, timeout_s: float = 120.0) -> list[list[int]]:
    return call_decoder(
        decoder,
        None,
        None,
        IDS,
        MASK,
        num_draft_tokens=2,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=0,
        timeout_s=timeout_s,
    )


def breach(decoder: Any, rule: str, **kwargs: Any) -> ContractError:
    """The ContractError `decoder` causes, checked to name `rule` in its attribute and its message."""
    with pytest.raises(ContractError) as info:
        call(decoder, **kwargs)
    assert info.value.rule == rule
    assert f"'{rule}'" in str(info.value) and info.value.detail in str(info.value)
    return info.value


def test_valid_output_passes() -> None:
    """Lists of ints, one per row, within the limit and ending at EOS, come back unchanged as lists."""
    assert call(Returns(([1, 2, 3, 4], (EOS,)))) == [[1, 2, 3, 4], [EOS]]
    assert call(Returns([[], [5]])) == [[], [5]]  # rows may be short: equivalence judges that, not the contract
    assert call(Returns([[EOS, EOS], [1]]), eos=None) == [[EOS, EOS], [1]]  # no EOS id: EOS is an ordinary token


@pytest.mark.parametrize("rows", [[[1]], [[1], [2], [3]], []])
def test_wrong_number_of_rows(rows: list[list[int]]) -> None:
    """A result with a row count other than the batch's breaks 'one-list-per-row'."""
    err = breach(Returns(rows), "one-list-per-row")
    assert err.detail.startswith(f"got {len(rows)} row") and "should be 2 rows" in err.detail


def test_generate_raises() -> None:
    """An exception inside generate() breaks 'generate-returns' and keeps its type and message."""

    def boom(input_ids: torch.Tensor, **kw: Any) -> Any:
        raise IndexError("row 7 out of range")

    err = breach(Returns(boom), "generate-returns")
    assert "IndexError: row 7 out of range" in err.detail
    assert isinstance(err.__cause__, IndexError)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (torch.tensor([[1, 2], [3, 4]]), "got a Tensor"),
        ([torch.tensor([1, 2]), torch.tensor([3])], "got row 0 as a Tensor"),
        ([[1, torch.tensor(2)], [3]], "got row 0 holding Tensor"),
        ([[1, 2.0], [3]], "got row 0 holding float"),
        ([[1, True], [3]], "got row 0 holding bool"),
        ({0: [1], 1: [2]}, "got a dict"),
        (None, "got a NoneType"),
        ([[1], "ab"], "got row 1 as a str"),
    ],
    ids=["tensor", "tensor-rows", "tensor-token", "float-token", "bool-token", "dict", "none", "str-row"],
)
def test_not_lists_of_int(value: Any, fragment: str) -> None:
    """Tensors, floats, bools or other containers instead of lists of int break 'returns-lists'."""
    assert fragment in breach(Returns(value), "returns-lists").detail


def test_row_longer_than_max_new_tokens() -> None:
    """A row with more than max_new_tokens tokens breaks 'max-new-tokens', naming the row and both counts."""
    err = breach(Returns([[1, 2], [1, 2, 3, 4, 5]]), "max-new-tokens", max_new_tokens=4)
    assert err.detail == "got row 1 with 5 new tokens, but should be at most 4 (max_new_tokens)"


def test_continuing_after_eos() -> None:
    """A row that goes on after EOS breaks 'ends-at-eos', naming the row and the EOS index."""
    err = breach(Returns([[1], [2, EOS, 3]]), "ends-at-eos")
    assert (
        err.detail == "got row 1 going on after EOS at index 1, but should be the row ending at index 1 (EOS included)"
    )


def test_hang_times_out() -> None:
    """A generate() that does not return within timeout_s breaks 'generate-returns' instead of hanging."""

    def hang(input_ids: torch.Tensor, **kw: Any) -> Any:
        deadline = time.monotonic() + 10.0  # bounded, so a broken time limit fails the test instead of hanging it
        while time.monotonic() < deadline:
            time.sleep(0.01)
        return [[1], [2]]

    start = time.monotonic()
    err = breach(Returns(hang), "generate-returns", timeout_s=0.5)
    assert time.monotonic() - start < 5.0
    assert "not returning within 0.5 s" in err.detail and "stopped" in err.detail


def test_validate_output_is_the_same_rules() -> None:
    """validate_output applies the same rules to a result obtained elsewhere (the black-box adapter path)."""
    assert validate_output([(1, 2)], 1, 2, None) == [[1, 2]]
    with pytest.raises(ContractError) as info:
        validate_output([[1, 2, 3]], 1, 2, None)
    assert info.value.rule == "max-new-tokens"


def test_contract_breach_is_reported_by_every_check() -> None:
    """When the decoder breaks the contract, run_case records it and every check reports it as 'contract'."""
    run = run_case("tests:Returns", Case(((3, 1, 4),), ((True,),), 2, 3, None, 0), factory=lambda: Returns([[1], [2]]))
    assert run.outputs is None and run.error is not None and run.error.rule == "one-list-per-row"
    for check in (check_i2, check_equivalence, check_token_preservation):
        assert [(v.check, v.rule) for v in check(run)] == [("contract", "one-list-per-row")]


# ---------------------------------------------------------------------------------------
# load_decoder

_counter = itertools.count()


@pytest.fixture
def make_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], str]]:
    """Write a uniquely named module under tmp_path (on sys.path) and return its name; forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names: list[str] = []

    def make(source: str) -> str:
        name = f"specaudit_tmp_decoder_{next(_counter)}_{id(tmp_path):x}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        return name

    yield make
    for name in names:
        sys.modules.pop(name, None)


def load_error(spec: str) -> str:
    with pytest.raises(DecoderLoadError) as info:
        load_decoder(spec)
    return str(info.value)


def test_load_reference_decoders() -> None:
    """The shipped specs load to factories whose instances have generate()."""
    assert load_decoder("specaudit.reference.eqspec:EqSpec") is EqSpec
    mutant = load_decoder("specaudit.reference.mutants:rejected_kv_attended")
    assert callable(instantiate(mutant, "specaudit.reference.mutants:rejected_kv_attended").generate)


def test_load_zero_argument_factory(make_module: Callable[[str], str]) -> None:
    """A zero-argument function returning a decoder is a valid target of a spec, nested attributes too."""
    name = make_module(
        """
        class Ns:
            class Dec:
                def generate(self, *a, **k):
                    return []
        def make():
            return Ns.Dec()
        """
    )
    assert callable(instantiate(load_decoder(f"{name}:make"), name).generate)
    assert load_decoder(f"{name}:Ns.Dec").__name__ == "Dec"


@pytest.mark.parametrize("spec", ["specaudit.reference.eqspec", "specaudit.reference.eqspec:", ":EqSpec", "", ":"])
def test_load_malformed_spec(spec: str) -> None:
    """A spec not of the form module:attr is rejected with the expected form in the message."""
    assert "module:attr" in load_error(spec)


def test_load_missing_module() -> None:
    """A module that does not exist is named as not found."""
    message = load_error("specaudit_no_such_module_xyz:Dec")
    assert "'specaudit_no_such_module_xyz'" in message and "not found" in message


def test_load_missing_submodule() -> None:
    """A missing submodule of an existing package is named as not found."""
    message = load_error("specaudit.reference.no_such_submodule:Dec")
    assert "'specaudit.reference.no_such_submodule'" in message and "not found" in message


def test_load_missing_attribute(make_module: Callable[[str], str]) -> None:
    """An attribute the module lacks is named together with the module."""
    name = make_module("class Other:\n    def generate(self): ...\n")
    message = load_error(f"{name}:Missing")
    assert f"'{name}'" in message and "'Missing'" in message and "no attribute" in message


def test_load_class_without_generate(make_module: Callable[[str], str]) -> None:
    """A class without a generate() method is rejected at load time."""
    name = make_module("class NoGenerate:\n    def run(self): ...\n")
    assert "no generate() method" in load_error(f"{name}:NoGenerate")


def test_load_not_callable(make_module: Callable[[str], str]) -> None:
    """A spec naming a plain value (not a class or factory) is rejected."""
    name = make_module("DECODER = 3\n")
    assert "neither a class nor a zero-argument callable" in load_error(f"{name}:DECODER")


def test_factory_returning_object_without_generate(make_module: Callable[[str], str]) -> None:
    """A factory whose product has no generate() is rejected when instantiated."""
    name = make_module("def make():\n    return object()\n")
    factory = load_decoder(f"{name}:make")
    with pytest.raises(DecoderLoadError, match="without a generate"):
        instantiate(factory, f"{name}:make")


def test_load_module_raising_on_import(make_module: Callable[[str], str]) -> None:
    """A module that raises on import is reported in one line with the exception type and message."""
    name = make_module("raise RuntimeError('decoder needs a GPU')\n")
    message = load_error(f"{name}:Dec")
    assert f"'{name}' failed to import" in message and "RuntimeError: decoder needs a GPU" in message


def test_load_module_with_syntax_error(make_module: Callable[[str], str]) -> None:
    """A module with a syntax error is reported as failing to import, not as missing."""
    name = make_module("def broken(:\n")
    message = load_error(f"{name}:Dec")
    assert "failed to import" in message and "SyntaxError" in message


def test_load_module_missing_a_dependency(make_module: Callable[[str], str]) -> None:
    """A module whose own import of a missing package fails is reported as failing to import, naming the package."""
    name = make_module("import specaudit_absent_dependency_q\n")
    message = load_error(f"{name}:Dec")
    assert "failed to import" in message and "specaudit_absent_dependency_q" in message


def test_load_module_missing_a_prefix_named_dependency(make_module: Callable[[str], str]) -> None:
    """A missing dependency whose name is a prefix of the module's name is still reported as a failed import."""
    name = make_module("import specaudit_tmp\n")  # a string prefix of the module's own name
    message = load_error(f"{name}:Dec")
    assert "failed to import" in message and "specaudit_tmp" in message


# ---------------------------------------------------------------------------------------
# Messages, side effects, hangs, replays

SMALL = Case(((3, 1, 4), (9, 2)), ((True, False, True), (False, True, True)), 2, 3, None, 0)


def test_contract_message_says_once_what_was_found_and_what_the_rule_wants() -> None:
    """The rendered violation reads 'got X, but should be Y' once, with the rule's own expectation."""
    run = run_case("tests:Returns", SMALL, factory=lambda: Returns([[1]]))
    (violation,) = check_i2(run)
    text = violation.render()
    assert text == "[contract: one-list-per-row] run: got 1 row, but should be 2 rows (one per input row, in order)"
    assert text.count("got") == 1 and text.count("but should be") == 1


class WritesInputs:
    """Writes the first generated token into the caller's input_ids (as scratch space), then answers right."""

    def generate(
        self, target: Any, draft: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kw: Any
    ) -> Any:
        out = EqSpec().generate(target, draft, input_ids.clone(), attention_mask.clone(), **kw)
        input_ids[:, -1] = torch.tensor([row[0] for row in out])
        return out


@pytest.mark.parametrize(
    ("spec", "factory", "fragment"),
    [
        ("specaudit.reference.mutants:mutates_inputs", None, "attention_mask[0, 0] = 0 after generate() (was 1"),
        ("tests:writes-inputs", WritesInputs, "input_ids[0, 2] = "),
    ],
    ids=["mask", "ids"],
)
def test_writing_into_the_callers_inputs_breaks_inputs_unchanged(spec: str, factory: Any, fragment: str) -> None:
    """A decoder that writes into the input_ids/attention_mask it was handed breaks 'inputs-unchanged'."""
    run = run_case(spec, SMALL, factory=factory)
    assert run.error is not None and run.error.rule == "inputs-unchanged", run.error
    assert fragment in run.error.found
    assert run.outputs is None


def test_clean_run_keeps_inputs_and_models() -> None:
    """EQSPEC hands back untouched inputs and models: no side-effect rule fires (the negative control)."""
    assert run_case("specaudit.reference.eqspec:EqSpec", SMALL).error is None


class Meddles:
    """EQSPEC, after changing its target in one of several ways."""

    def __init__(self, how: str) -> None:
        self.how = how

    def generate(self, target: Any, draft: Any, *args: Any, **kw: Any) -> Any:
        out = EqSpec().generate(target, draft, *args, **kw)
        if self.how == "config":
            target.config.salt = 5
        elif self.how == "weight":
            next(target.parameters()).data.add_(0.5)
        elif self.how == "train":
            target.train()
        elif self.how == "hook":
            target.register_forward_pre_hook(lambda module, args: None)
        elif self.how == "global-hook":
            torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
        return out


@pytest.mark.parametrize(
    ("how", "model", "fragment"),
    [
        ("config", "transparent", "target.config.salt = 5 (was 0)"),
        ("weight", "transparent", "parameter target.anchor written in place"),
        ("weight", "llama", "parameter target.model.embed_tokens.weight written in place"),
        ("train", "transparent", "target modules in training mode: ['<model>']"),
        ("hook", "transparent", "1 forward pre hook left on target"),
        ("global-hook", "transparent", "1 global forward hook left registered"),
    ],
)
def test_changing_the_shared_models_breaks_models_unchanged_and_is_repaired(
    how: str, model: str, fragment: str
) -> None:
    """A changed weight, config, mode or a hook left behind breaks 'models-unchanged', naming what changed;
    the next run gets the model as built, so EQSPEC passes again."""
    from specaudit.checks.diagnosis import all_violations
    from specaudit.fixtures.pairs import target_model

    case = Case(
        ((3, 1, 4),), ((True, False, True),), 2, 3, None, 0, 0, model, "scripted" if model == "transparent" else "tiny"
    )
    before = target_model(model)
    run = run_case(f"tests:meddles-{how}", case, factory=lambda: Meddles(how))
    assert run.error is not None and run.error.rule == "models-unchanged", run.error
    assert fragment in run.error.found, run.error.found
    after = target_model(model)
    assert not after._forward_pre_hooks and not after.training and getattr(after.config, "salt", 0) == 0
    assert not torch.nn.modules.module._global_forward_hooks
    if how in ("config", "weight", "train"):
        assert after is not before, "a changed model must be rebuilt, not reused"
    assert all_violations(run_case("specaudit.reference.eqspec:EqSpec", case)) == []


def test_a_timeout_condemns_only_its_own_case() -> None:
    """A timeout fails the case that timed out; the next case of the same decoder is run, and passes."""
    start = time.monotonic()
    first = run_case("tests:hangs", SMALL, factory=HangsOnTwoRows, timeout_s=0.5)
    waited = time.monotonic() - start
    assert first.error is not None and first.error.rule == "generate-returns", first.error
    assert 0.5 <= waited < 5.0 and "stopped" in first.error.found, (waited, first.error.found)
    alone = Case(((5,),), ((True,),), 1, 1, None, 0)
    second = run_case("tests:hangs", alone, factory=HangsOnTwoRows, timeout_s=0.5)
    assert second.error is None and second.outputs is not None, f"a later case was condemned: {second.error}"


@pytest.mark.slow
def test_a_hangs_reproducer_is_the_case_that_hung(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Searching a decoder that hangs on two rows shrinks to a two-row case (every attempt runs
    a fresh decoder that can time out again, nothing is condemned in advance), and replaying the
    reproducer written for it reports 'generate-returns' again."""
    from specaudit.artifacts.reproducer import failure_record, write_reproducer
    from specaudit.commands.replay import replay
    from specaudit.running import runner
    from specaudit.search.driver import search

    monkeypatch.setattr(runner, "IDLE_FLOOR_S", 0.3)
    spec = "tests.decoders.hangs:HangsOnTwoRows"
    result = search(spec, "transparent", max_examples=10, seed=1, shrink_budget=8, minimize_budget=8)
    assert result.minimal is not None, "the hang was not found"
    assert result.minimal.batch_size == 2, f"shrunk to {result.minimal!r}: should be the two rows that hang"
    path = write_reproducer(tmp_path, "hang", failure_record(result.minimal, spec, []))
    diagnosis = replay(path, spec)
    assert diagnosis.first is not None and diagnosis.first.rule == "generate-returns", diagnosis.render()


class Unstoppable:
    """Swallows the watchdog's stop for `seconds` (as native code would), then returns."""

    seconds = 2.0

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + self.seconds
        while time.monotonic() < deadline:
            try:
                time.sleep(0.01)
            except BaseException:  # noqa: B036 -- the point: it will not stop
                pass
        return [[1], [2]]


def test_a_decoder_still_running_is_reported_until_it_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder that cannot be stopped is still running: the next run of it says so at once
    instead of running beside it; once its thread returns, it is run again."""
    monkeypatch.setattr(watchdog, "STOP_GRACE_S", 0.2)
    first = run_case("tests:unstoppable", SMALL, factory=Unstoppable, timeout_s=0.3)
    assert first.error is not None and "still running" in first.error.found, first.error
    start = time.monotonic()
    second = run_case("tests:unstoppable", SMALL, factory=Unstoppable, timeout_s=0.3)
    assert time.monotonic() - start < 0.25, "a still-running decoder must not be waited for again"
    assert second.error is not None and second.error.rule == "generate-returns"
    assert "still running since it timed out on" in second.error.found and repr(SMALL) in second.error.found
    time.sleep(Unstoppable.seconds)
    third = run_case("tests:unstoppable", SMALL, factory=lambda: Returns([[1], [2]]), timeout_s=0.3)
    assert third.error is None or "still running" not in third.error.found, third.error


class SlowEqSpec(EqSpec):
    """EQSPEC that pauses `pause` seconds before every forward of the target: slow, not hung."""

    pause = 0.3

    def generate(self, target: Any, draft: Any, *args: Any, **kwargs: Any) -> Any:
        pause = self.pause

        def slow(module: Any, args: Any, kwargs: Any) -> None:
            time.sleep(pause)

        hook = target.register_forward_pre_hook(slow, with_kwargs=True)
        try:
            return super().generate(target, draft, *args, **kwargs)
        finally:
            hook.remove()


def test_a_slow_decoder_making_progress_is_not_a_hang() -> None:
    """The limit is on idleness: a run longer than the idle limit passes while forwards keep
    completing; the same decoder pausing longer than the limit between forwards is a hang."""
    slow = run_case("tests:slow", SMALL, factory=SlowEqSpec, timeout_s=0.8)
    assert slow.error is None and slow.seconds > 0.8, (slow.seconds, slow.error)
    stalled = type("StalledEqSpec", (SlowEqSpec,), {"pause": 1.5})
    hung = run_case("tests:stalled", SMALL, factory=stalled, timeout_s=0.8)
    assert hung.error is not None and "no forward of the models for 0.8 s" in hung.error.found, hung.error


class Runaway:
    """Calls the target over and over without returning (rows that never finish), bounded."""

    def generate(
        self, target: Any, draft: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kw: Any
    ) -> Any:
        for _ in range(2000):
            target(input_ids=input_ids, attention_mask=attention_mask)
        return [[1]] * input_ids.shape[0]


def test_a_decoder_whose_rows_never_finish_is_stopped() -> None:
    """More target forwards than the case can need is 'generate-returns', long before the idle limit."""
    from specaudit.running.runner import max_forwards

    case = Case(((5,),), ((True,),), 1, 1, None, 0)
    run = run_case("tests:runaway", case, factory=Runaway)
    assert run.error is not None and run.error.rule == "generate-returns", run.error
    assert f"more than the {max_forwards(case)}" in run.error.found, run.error.found


def test_idle_limit_follows_the_measured_reference_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The idle limit is IDLE_MULTIPLE x the oracle's measured time on the case, with a floor:
    a machine twice as slow gets a limit twice as long once the floor is passed."""
    from specaudit.running import runner

    case = Case(((1,),), ((True,),), 1, 1, None, 0)
    assert runner.idle_limit(case) == runner.IDLE_FLOOR_S  # a tiny case: the floor
    monkeypatch.setattr(runner, "reference_seconds", lambda c: 5.0)
    assert runner.idle_limit(case) == 5.0 * runner.IDLE_MULTIPLE
    monkeypatch.setattr(runner, "reference_seconds", lambda c: 10.0)
    assert runner.idle_limit(case) == 10.0 * runner.IDLE_MULTIPLE


class Flaky:
    """One row short on every second run of the first batch it sees (other batches, such as a
    check's permuted re-run, are answered right): a nondeterministic decoder."""

    first: tuple[int, ...] | None = None
    runs = 0

    def generate(self, target: Any, draft: Any, input_ids: torch.Tensor, *args: Any, **kw: Any) -> Any:
        key = tuple(input_ids.flatten().tolist())
        cls = type(self)
        cls.first = cls.first or key
        cls.runs += key == cls.first
        out = EqSpec().generate(target, draft, input_ids, *args, **kw)
        return out[:-1] if key == cls.first and cls.runs % 2 == 0 else out


def test_replay_failures_measures_nondeterminism() -> None:
    """replay_failures counts failing replays: 0 for EQSPEC, all for a broken decoder, some for a flaky one."""
    from specaudit.commands.replay import replay_failures

    assert replay_failures("specaudit.reference.eqspec:EqSpec", SMALL, None, 2) == 0
    assert replay_failures("tests:short", SMALL, lambda: Returns([[1]]), 3) == 3
    assert replay_failures("tests:flaky", SMALL, Flaky, 4) == 2


def test_run_keeps_the_factory_the_user_gave() -> None:
    """Run.factory is the loaded factory (a configured callable stays itself), so a re-run is the same decoder."""
    from specaudit.reference.exspec import ExSpec

    def configured() -> ExSpec:
        return ExSpec(batch_size=1, window=2)

    run = run_case("tests:configured", SMALL, factory=configured)
    assert run.factory is configured and type(run.instance) is ExSpec
    again = run_case("tests:configured", SMALL, factory=run.factory)
    assert again.instance.batch_size == 1 and again.outputs == run.outputs
    assert run_case("specaudit.reference.eqspec:EqSpec", SMALL).factory is EqSpec


def test_models_are_repaired_even_when_the_decoder_also_raises() -> None:
    """A decoder that leaves a hook and then raises is reported for the raise, and its hook is still removed."""
    from specaudit.fixtures.pairs import target_model

    class HookThenRaise:
        def generate(self, target: Any, *args: Any, **kwargs: Any) -> Any:
            target.register_forward_hook(lambda module, args, output: None)
            raise RuntimeError("out of memory")

    run = run_case("tests:hook-then-raise", SMALL, factory=HookThenRaise)
    assert run.error is not None and run.error.rule == "generate-returns" and "out of memory" in run.error.found
    assert not target_model("transparent")._forward_hooks
