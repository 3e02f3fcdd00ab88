"""The instrumentation sees every target forward, whatever the call style, or refuses the run:
positional and keyword calls record the same thing, a StaticCache is read by its filled
length, inputs the checks cannot judge and forwards that bypass the hooks are contract breaks."""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch
from transformers import DynamicCache, StaticCache

from specaudit.checks.diagnosis import all_violations
from specaudit.contracts.case import Case
from specaudit.fixtures.pairs import target_model
from specaudit.models.compat import cache_keyword, call_arguments, forward_signature, layer_lengths
from specaudit.running.instrument import CallRecord, Recording, breach, instrument
from specaudit.running.runner import run_case
from tests.decoders.positional import MaskedSpec, Positional

IDS = torch.tensor([[0, 5, 9, 2], [7, 3, 8, 1]])  # [2, 4]
MASK = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
POS = (MASK.cumsum(-1) - 1).clamp(min=0)


def case(model: str = "transparent", rows: int = 2) -> Case:
    prompts = ((3, 1, 4, 1, 5), (9, 2), (6, 6, 6))[:rows]
    accept = ((True, False, True, True, False, True), (False, True, True, False, True, True), (True,) * 6)[:rows]
    return Case(prompts, accept, 2, 5, None, 0, 1, model, "scripted" if model == "transparent" else "tiny")


def recorded(model: torch.nn.Module, call: Any) -> Recording:
    with torch.no_grad(), instrument(model, None) as recording:
        call()
    return recording


def same_record(a: CallRecord, b: CallRecord) -> bool:
    tensors = ("input_ids", "attention_mask", "position_ids")
    same = all(torch.equal(getattr(a, t), getattr(b, t)) for t in tensors)
    snapshots = all(
        torch.equal(x, y) for (ka, va), (kb, vb) in zip(a.cache_after, b.cache_after) for x, y in ((ka, kb), (va, vb))
    )
    return same and snapshots and a.layer_lengths == b.layer_lengths and len(a.cache_after) == len(b.cache_after)


@pytest.mark.parametrize("model", ["transparent", "llama", "gpt2"])
def test_positional_call_records_what_a_keyword_call_records(model: str) -> None:
    """model(ids, mask, pos, cache) and the keyword call give the same record: mask, positions and cache all seen."""
    target = target_model(model)
    decoder = Positional()
    by_position = recorded(target, lambda: decoder.forward(target, IDS, MASK, POS, DynamicCache()))
    by_keyword = recorded(target, lambda: MaskedSpec().forward(target, IDS, MASK, POS, DynamicCache()))
    (pos_call,), (kw_call,) = by_position.target_calls, by_keyword.target_calls
    assert pos_call.attention_mask is not None and pos_call.position_ids is not None, "positional mask read as absent"
    assert same_record(pos_call, kw_call)


def test_positional_cache_is_read_with_its_length() -> None:
    """A cache passed positionally is recorded with its length, not as an empty cache."""
    target = target_model("transparent")
    cache = DynamicCache()
    with torch.no_grad():
        target(IDS, MASK, POS, cache)
    second = recorded(target, lambda: target(IDS[:, :1], torch.cat([MASK, MASK[:, :1]], 1), POS[:, -1:] + 1, cache))
    assert second.target_calls[0].layer_lengths == (4,), (
        f"got {second.target_calls[0].layer_lengths}, but should be (4,)"
    )
    assert second.target_calls[0].cache_batch == 2


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_both_cache_keywords_are_read(keyword: str) -> None:
    """`cache=` (transformers 5.24) and `past_key_values=` (older; **kwargs on 5.24) both reach the record."""
    target = target_model("llama")
    cache = DynamicCache()
    with torch.no_grad():
        target(input_ids=IDS, attention_mask=MASK, position_ids=POS, use_cache=True, **{keyword: cache})
    step = dict(input_ids=IDS[:, :1], attention_mask=torch.cat([MASK, MASK[:, :1]], 1), position_ids=POS[:, -1:] + 1)
    rec = recorded(target, lambda: target(**step, use_cache=True, **{keyword: cache}))
    assert rec.target_calls[0].layer_lengths == (4, 4), f"got {rec.target_calls[0].layer_lengths}, but should be (4, 4)"


def test_call_arguments_binds_like_python() -> None:
    """Positional, keyword and **kwargs-only arguments land under their parameter names."""
    signature = forward_signature(target_model("llama"))
    bound = call_arguments(signature, (IDS, MASK), {"position_ids": POS, "past_key_values": "c", "use_cache": True})
    assert bound["input_ids"] is IDS and bound["attention_mask"] is MASK and bound["position_ids"] is POS
    assert bound["past_key_values"] == "c" and "kwargs" not in bound


def test_static_cache_is_read_by_filled_length_not_capacity() -> None:
    """A StaticCache of capacity 32 holding 4 slots is recorded with P = 4 and a snapshot of 4 + T slots."""
    target = target_model("llama")
    cache = StaticCache(config=target.config, max_cache_len=32)
    kw = cache_keyword(target)
    with torch.no_grad():
        target(input_ids=IDS, attention_mask=MASK, position_ids=POS, use_cache=True, **{kw: cache})
    assert layer_lengths(cache) == (4, 4)
    step = dict(input_ids=IDS[:, :2], attention_mask=torch.cat([MASK, MASK[:, :2]], 1), position_ids=POS[:, -2:] + 2)
    call = recorded(target, lambda: target(**step, use_cache=True, **{kw: cache})).target_calls[0]
    assert call.layer_lengths == (4, 4), f"got {call.layer_lengths}, but should be (4, 4) (capacity is 32)"
    assert [k.shape[-2] for k, _ in call.cache_after] == [6, 6]


class FourDMask(MaskedSpec):
    """Passes the target an additive 4-D mask [B, 1, T, S] (a tree or custom mask) instead of the 2-D one."""

    def forward(
        self, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        if model is not self.target:
            return super().forward(model, ids, mask, positions, cache)
        width, past = ids.shape[1], mask.shape[1] - ids.shape[1]
        causal = torch.arange(past + width)[None, :] <= (past + torch.arange(width))[:, None]  # [T, S]
        allowed = mask[:, None, None, :].bool() & causal[None, None]  # [B, 1, T, S]
        dtype = next(model.parameters()).dtype
        additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        return super().forward(model, ids, additive, positions, cache)

    def generate(self, target: torch.nn.Module, draft: torch.nn.Module, *args: Any, **kwargs: Any) -> list[list[int]]:
        self.target = target
        return super().generate(target, draft, *args, **kwargs)


class EmbedsInput(MaskedSpec):
    """Embeds the tokens itself and passes `inputs_embeds` to the target."""

    def forward(
        self, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        embed = model.get_input_embeddings()
        if embed is None or model is not self.target:
            return super().forward(model, ids, mask, positions, cache)
        out = model(
            inputs_embeds=embed(ids),
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{cache_keyword(model): cache},
        )
        return out.logits

    def generate(self, target: torch.nn.Module, draft: torch.nn.Module, *args: Any, **kwargs: Any) -> list[list[int]]:
        self.target = target
        return super().generate(target, draft, *args, **kwargs)


@pytest.mark.parametrize(
    ("decoder", "model", "fragment"),
    [
        (FourDMask, "transparent", "4-D attention_mask of shape (2, 1, 6, 6)"),
        (FourDMask, "llama", "4-D attention_mask of shape (2, 1, 6, 6)"),
        (EmbedsInput, "llama", "inputs_embeds instead of input_ids"),
    ],
    ids=["4d-transparent", "4d-llama", "embeds-llama"],
)
def test_unsupported_inputs_are_refused_not_crashed_on(decoder: type, model: str, fragment: str) -> None:
    """A 4-D mask or inputs_embeds ends in one 'unsupported-input' violation, even where the model itself raises."""
    run = run_case("tests:unsupported", case(model), factory=decoder)
    violations = all_violations(run)
    assert [(v.check, v.rule) for v in violations] == [("contract", "unsupported-input")], violations
    assert fragment in violations[0].found and "target call 0" in violations[0].found


def test_unreadable_cache_is_unsupported_not_a_hook_crash() -> None:
    """A cache object the harness cannot read is recorded as unsupported; the model still runs."""
    target = target_model("transparent")

    class Opaque:
        layers = property(lambda self: 1 / 0)

    rec = recorded(target, lambda: pytest.raises(ZeroDivisionError, target, IDS, MASK, POS, Opaque()))
    err = breach(rec)
    assert err is not None and err.rule == "unsupported-input" and "Opaque" in err.found


def test_forward_bypass_is_unobserved() -> None:
    """target.forward(...) runs no hook: counted as an unobserved forward, and the run is refused."""
    target = target_model("transparent")
    rec = recorded(target, lambda: (target(IDS, MASK, POS), target.forward(IDS, MASK, POS), target.forward(IDS)))
    assert (rec.forwards, len(rec.target_calls), len(rec.unobserved)) == (3, 1, 2)
    err = breach(rec)
    assert err is not None and err.rule == "unobserved-forward"
    assert (
        err.found.startswith("2 of 3 target forwards unseen by the hooks")
        and "target.forward() called directly" in err.found
    )


def test_base_model_called_directly_is_observed_and_its_forward_is_not() -> None:
    """target.model(...) is recorded as a target call (entry 'base'); target.model.forward(...) is unobserved."""
    target = target_model("llama")
    kw = cache_keyword(target.model)
    rec = recorded(
        target, lambda: target.model(input_ids=IDS, attention_mask=MASK, position_ids=POS, **{kw: DynamicCache()})
    )
    assert [c.entry for c in rec.target_calls] == ["base"] and breach(rec) is None
    assert rec.target_calls[0].cache_after and rec.target_calls[0].attention_mask is not None
    rec = recorded(target, lambda: target.model.forward(input_ids=IDS, attention_mask=MASK, position_ids=POS))
    err = breach(rec)
    assert not rec.target_calls and err is not None and "target.model.forward() called directly" in err.found


def test_nested_base_call_is_not_recorded_twice() -> None:
    """A plain target(...) call runs the base model inside it: one record, one forward."""
    target = target_model("llama")
    rec = recorded(target, lambda: target(IDS, MASK, POS))
    assert (len(rec.target_calls), rec.forwards, rec.unobserved) == (1, 1, [])


def test_instrumentation_leaves_no_trace() -> None:
    """After the block, no hook or forward probe is left on the target or its base model."""
    target = target_model("llama")
    recorded(target, lambda: target(IDS, MASK, POS))
    for module in (target, target.model):
        assert "forward" not in vars(module) and not module._forward_hooks and not module._forward_pre_hooks


def test_deep_copy_during_a_run_gets_its_own_forward() -> None:
    """A decoder that deep-copies the target gets a model whose forward is its own, not a probe into the run."""
    target = target_model("transparent")
    copies: list[torch.nn.Module] = []
    recorded(target, lambda: copies.append(copy.deepcopy(target)))
    forward = vars(copies[0]).get("forward")
    assert isinstance(forward, types.MethodType) and forward.__self__ is copies[0]
    assert torch.equal(copies[0](IDS, MASK, POS).logits, target(IDS, MASK, POS).logits)


def test_positional_decoder_passes_token_preservation() -> None:
    """The positional decoder is judged like the keyword one: every check passes (it failed token preservation)."""
    run = run_case("tests.decoders.positional:Positional", case(rows=3))
    assert all_violations(run) == []
    assert all(c.attention_mask is not None for c in run.recording.target_calls)


def test_compiled_target_is_observed() -> None:
    """torch.compile(target) (eager backend: no C++ toolchain needed) still runs the hooks: one observed call."""
    target = target_model("llama")
    compiled = torch.compile(target, backend="eager")
    kw = {cache_keyword(target): DynamicCache()}
    rec = recorded(target, lambda: compiled(input_ids=IDS, attention_mask=MASK, position_ids=POS, use_cache=True, **kw))
    assert (len(rec.target_calls), rec.forwards, breach(rec)) == (1, 1, None)
    assert rec.target_calls[0].cache_after and torch.equal(rec.target_calls[0].attention_mask, MASK)
