"""Warnings of a decoder's run (issue 38, point 7): transformers' deprecation warnings, raised with a
stack level that lands on the harness's hook wrapper, were printed on every run of an audit and
blamed on specaudit. Each is now shown once per process, at the decoder's line that called the model."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest
import torch

from specaudit.contracts.case import Case
from specaudit.fixtures.pairs import target_model
from specaudit.models.compat import cache_keyword
from specaudit.running import guard
from specaudit.running.guard import decoder_warnings
from specaudit.running.runner import run_case

pytestmark = pytest.mark.usefixtures("one_thread")

LIBRARY = "/nowhere/library/"
"""A stand-in library: a forward that warns with stacklevel=2, called through a wrapper, as
transformers' `deprecate_kwarg` is called through the hooks."""
library: dict[str, Any] = {}
exec(  # noqa: S102 -- code whose frames are in LIBRARY, as an installed library's are in site-packages
    compile(
        "import warnings\n"
        "def forward(n):\n"
        "    warnings.warn(f'argument {n} is deprecated', FutureWarning, stacklevel=2)\n"
        "def wrapper(n):\n"
        "    return forward(n)\n",
        LIBRARY + "lib.py",
        "exec",
    ),
    library,
)


@pytest.fixture(autouse=True)
def nothing_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a fresh process would: no warning shown yet."""
    monkeypatch.setattr(guard, "SHOWN", set())


def test_each_warning_once_at_the_callers_line() -> None:
    """Three calls, two messages: two warnings, each at the caller's line, not the wrapper's."""
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with decoder_warnings((LIBRARY,)) as held:
            for n in (1, 1, 2):
                line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
                library["wrapper"](n)
        assert len(held) == 3
    assert [str(w.message) for w in shown] == ["argument 1 is deprecated", "argument 2 is deprecated"]
    assert {(w.filename, w.lineno) for w in shown} == {(__file__, line)}


def test_a_warning_shown_before_is_not_shown_again() -> None:
    """Once per process: a second run's same warning is held, not shown."""
    for _ in range(2):
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            with decoder_warnings((LIBRARY,)):
                library["wrapper"](3)
    assert shown == [] and len(guard.SHOWN) == 1


def test_the_filters_still_hold() -> None:
    """Nothing is swallowed or forced: an 'error' filter raises in the caller, 'ignore' shows nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(FutureWarning), decoder_warnings((LIBRARY,)):
            library["wrapper"](4)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("ignore")
        with decoder_warnings((LIBRARY,)) as held:
            library["wrapper"](5)
    assert shown == [] and held == []


class LegacyCacheName:
    """Cache-free greedy decoding that names the cache `past_key_values=`, deprecated for `cache=`
    from transformers 5.24 on (a FutureWarning at every forward)."""

    name = "legacy-cache-name"

    @torch.no_grad()
    def generate(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        num_draft_tokens: int,
        max_new_tokens: int,
        eos_token_id: int | None,
        pad_token_id: int,
    ) -> list[list[int]]:
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]
        new: list[list[int]] = [[] for _ in rows]
        for _ in range(max_new_tokens):
            lengths = torch.tensor([len(r) + len(n) for r, n in zip(rows, new)])  # [B]
            width = int(lengths.max())
            ids = torch.tensor([[pad_token_id] * (width - len(r) - len(n)) + r + n for r, n in zip(rows, new)])
            mask = (torch.arange(width) >= width - lengths[:, None]).long()  # [B, W], left-padded
            positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, W]
            kwargs = {"attention_mask": mask, "position_ids": positions, "use_cache": False}
            logits = target(input_ids=ids, past_key_values=None, **kwargs).logits  # [B, W, V]
            for n, token in zip(new, logits[:, -1].argmax(-1).tolist()):
                n.append(token)
        return new


def test_transformers_deprecation_once_per_audit_at_the_decoders_line() -> None:
    """The tiny Llama through the hooks, two runs of a decoder that passes `past_key_values=`: one
    FutureWarning shown, placed in this file (the decoder's call), never in the harness's hooks."""
    case = Case(((3, 4), (5,)), ("01", "1"), 1, 3, None, 0, model="llama")
    if cache_keyword(target_model(case.model, case.dtype)) != "cache":
        pytest.skip("transformers before 5.24 does not deprecate `past_key_values`")
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        runs = [run_case(LegacyCacheName.name, case, factory=LegacyCacheName) for _ in range(2)]
    assert all(run.error is None for run in runs), [run.error for run in runs]
    deprecations = [w for w in shown if "past_key_values" in str(w.message)]
    assert len(deprecations) == 1, [(str(w.message), w.filename, w.lineno) for w in shown]
    assert deprecations[0].filename == __file__, (deprecations[0].filename, deprecations[0].lineno)
