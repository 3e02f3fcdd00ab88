"""The decoder contract: every breach is a ContractError naming its rule, every bad spec a DecoderLoadError."""

from __future__ import annotations

import itertools
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from specaudit.case import Case
from specaudit.checks import check_equivalence, check_i2, check_token_preservation
from specaudit.contract import ContractError, DecoderLoadError, call_decoder, instantiate, load_decoder, validate_output
from specaudit.reference.eqspec import EqSpec
from specaudit.runner import run_case

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
    assert f"got {len(rows)} rows" in err.detail and "should be 2" in err.detail


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
        (torch.tensor([[1, 2], [3, 4]]), "got Tensor"),
        ([torch.tensor([1, 2]), torch.tensor([3])], "row 0 is a Tensor"),
        ([[1, torch.tensor(2)], [3]], "row 0 holds Tensor"),
        ([[1, 2.0], [3]], "row 0 holds float"),
        ([[1, True], [3]], "row 0 holds bool"),
        ({0: [1], 1: [2]}, "got dict"),
        (None, "got NoneType"),
        ([[1], "ab"], "row 1 is a str"),
    ],
    ids=["tensor", "tensor-rows", "tensor-token", "float-token", "bool-token", "dict", "none", "str-row"],
)
def test_not_lists_of_int(value: Any, fragment: str) -> None:
    """Tensors, floats, bools or other containers instead of lists of int break 'returns-lists'."""
    assert fragment in breach(Returns(value), "returns-lists").detail


def test_row_longer_than_max_new_tokens() -> None:
    """A row with more than max_new_tokens tokens breaks 'max-new-tokens', naming the row and both counts."""
    err = breach(Returns([[1, 2], [1, 2, 3, 4, 5]]), "max-new-tokens", max_new_tokens=4)
    assert "row 1 has 5 new tokens" in err.detail and "at most 4" in err.detail


def test_continuing_after_eos() -> None:
    """A row that goes on after EOS breaks 'ends-at-eos', naming the row and the EOS index."""
    err = breach(Returns([[1], [2, EOS, 3]]), "ends-at-eos")
    assert "row 1" in err.detail and "index 1" in err.detail


def test_hang_times_out() -> None:
    """A generate() that does not return within timeout_s breaks 'generate-returns' instead of hanging."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("the time limit uses SIGALRM, which only the main thread receives")

    def hang(input_ids: torch.Tensor, **kw: Any) -> Any:
        deadline = time.monotonic() + 10.0  # bounded, so a broken time limit fails the test instead of hanging it
        while time.monotonic() < deadline:
            time.sleep(0.01)
        return [[1], [2]]

    start = time.monotonic()
    err = breach(Returns(hang), "generate-returns", timeout_s=0.5)
    assert time.monotonic() - start < 5.0
    assert "did not return within 0.5 s" in err.detail


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
