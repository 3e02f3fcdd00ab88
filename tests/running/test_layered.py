"""A forward assembled from the model's parts is recorded as one target call (issue 38 item 4)."""

from __future__ import annotations

import pytest
import torch

from specaudit.running.layered import key_mask, model_parts


def additive(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def causal_allowed(keys: torch.Tensor, queries: int, past: int) -> torch.Tensor:
    """[B, 1, T, S] keys[s] and s <= past + t."""
    width = keys.shape[1]
    causal = torch.arange(width)[None] <= past + torch.arange(queries)[:, None]
    return keys.bool()[:, None, None, :] & causal[None, None]


KEYS = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])  # [B, S]: row 0 left-padded by one


@pytest.mark.parametrize("form", ["bool", "additive"])
def test_a_causal_4d_mask_reads_as_its_key_mask(form: str) -> None:
    allowed = causal_allowed(KEYS, queries=2, past=3)
    mask = allowed if form == "bool" else additive(allowed)
    assert torch.equal(key_mask(mask, past=3, batch=2), KEYS)


def test_a_broadcast_mask_is_expanded_to_the_batch() -> None:
    allowed = causal_allowed(KEYS[1:], queries=2, past=3)
    assert key_mask(allowed, past=3, batch=2).shape == (2, 5)


def test_a_pad_query_unmasked_by_the_kernel_is_not_judged() -> None:
    """sdpa may let a query with nothing to attend see every key: its output is never read."""
    keys = torch.tensor([[0, 0, 1, 1]])
    allowed = causal_allowed(keys, queries=4, past=0)
    allowed[0, 0, 0] = True  # query 0 (a pad) attends nothing under the rule
    assert torch.equal(key_mask(allowed, past=0, batch=1), keys)


@pytest.mark.parametrize("change", ["not causal", "a key hidden from one query", "per head"])
def test_a_mask_of_another_form_is_not_read(change: str) -> None:
    allowed = causal_allowed(KEYS, queries=2, past=3)
    if change == "not causal":
        allowed = allowed | True
    elif change == "a key hidden from one query":
        allowed[1, 0, 0, 2] = False
    else:
        allowed = allowed.expand(2, 4, 2, 5)
    assert key_mask(allowed, past=3, batch=2) is None


def test_parts_of_the_tiny_models_and_none_for_the_transparent_one() -> None:
    from specaudit.fixtures.tiny import build_tiny
    from specaudit.fixtures.transparent import transparent_target

    target = transparent_target()
    assert model_parts(target, target.base_model) is None
    for arch, positions in (("llama", "rotary"), ("gpt2", "wpe")):
        model = build_tiny(arch, dtype=torch.float32)
        parts = model_parts(model, model.base_model)
        assert parts is not None and parts.first is not parts.last, arch
        assert positions in type(parts.positions).__name__.lower() or positions == "wpe", arch
        assert parts.head is model.get_output_embeddings(), arch


def recorded(forward: str) -> list:
    """The target calls recorded while a runner calls the tiny Llama's parts its own way: "plain";
    "rotary precomputed" (the rotary embedding called once, its output reused by a second forward);
    "no cache"."""
    from transformers import DynamicCache

    from specaudit.fixtures.tiny import build_tiny
    from specaudit.running.instrument import instrument
    from tests.designs.layerwise import causal_mask

    model = build_tiny("llama", dtype=torch.float32)
    base = model.base_model
    ids, mask = torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), instrument(model, None) as recording:
        rotary = base.rotary_emb(model.get_input_embeddings()(ids), positions)
        for _ in range(2 if forward == "rotary precomputed" else 1):
            hidden = model.get_input_embeddings()(ids)
            cache = None if forward == "no cache" else DynamicCache()
            for layer in base.layers:
                hidden = layer(hidden, attention_mask=causal_mask(mask, 3, hidden.dtype), position_embeddings=rotary,
                               cache=cache)  # fmt: skip
            model.lm_head(base.norm(hidden))
    return recording.target_calls


def test_a_layer_by_layer_forward_is_one_target_call() -> None:
    (call,) = recorded("plain")
    assert call.entry == "layers" and not call.unsupported, call.unsupported
    assert call.input_ids.tolist() == [[0, 5, 6], [7, 8, 9]]
    assert call.position_ids.tolist() == [[0, 0, 1], [0, 1, 2]]
    assert call.attention_mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert call.past_length == 0 and len(call.cache_after) == 2 and call.cache_after[0][0].shape[2] == 3
    assert call.choices is not None and call.choices.shape == (2, 3)


@pytest.mark.parametrize(
    ("forward", "reason"),
    [("rotary precomputed", "positions were not read"), ("no cache", "without a cache")],
)
def test_what_a_layer_by_layer_forward_hides_is_a_refusal(forward: str, reason: str) -> None:
    """Positions the rotary module was not asked for, or K/V no cache holds, cannot be judged: the
    call is refused as unsupported, never judged as the default positions or an empty cache."""
    call = recorded(forward)[-1]
    assert any(reason in u for u in call.unsupported), call.unsupported
