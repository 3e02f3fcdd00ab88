"""The tiny real-architecture fixtures: deterministic, draft smaller than target, and batch == single."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from specaudit.checks import check_equivalence, check_i1, check_i2
from specaudit.checks.diagnosis import diagnose
from specaudit.contracts.case import Case
from specaudit.fixtures import VOCAB_SIZE, tiny
from specaudit.fixtures.tiny import ARCHS, build_tiny
from specaudit.fixtures.transparent import RequestScript, TransparentLM, scripted_draft, transparent_target
from specaudit.models.compat import cache_length, call_model
from specaudit.running.runner import run_case

ATOL = 1e-9
PROMPT_LENGTHS = (5, 2, 7)  # left padding: rows 0 and 1 are padded, row 2 is not
PAD_ID = 0
REPO = Path(__file__).resolve().parents[2]
CHECKS = {"I1": check_i1, "I2": check_i2, "equivalence": check_equivalence}


def _uncached(arch: str, role: str, seed: int, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """A freshly built model, bypassing the lru_cache (which would make determinism trivial)."""
    return tiny._build.__wrapped__(arch, role, seed, dtype)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


def _prompts(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB_SIZE, (n,), generator=g) for n in PROMPT_LENGTHS]


def _left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    return ids, mask  # [B, T], [B, T]


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _single(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Last-position logits [V] of one unpadded sequence, batch size 1, fresh cache."""
    ids = tokens[None]
    logits, _ = call_model(
        model, ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None], transformers.DynamicCache()
    )
    return logits[0, -1]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("arch", ARCHS)
def test_build_is_deterministic(arch: str) -> None:
    """Two builds with the same arguments have identical weights."""
    for role in tiny.ROLES:
        assert _same_weights(_uncached(arch, role, 3), _uncached(arch, role, 3)), (arch, role)


@pytest.mark.parametrize("arch", ARCHS)
def test_seed_changes_weights(arch: str) -> None:
    """Different seeds give different weights."""
    for role in tiny.ROLES:
        assert not _same_weights(_uncached(arch, role, 0), _uncached(arch, role, 1)), (arch, role)


def test_build_leaves_global_rng_alone() -> None:
    """Building a model does not change the global CPU RNG state."""
    before = torch.random.get_rng_state()
    for arch in ARCHS:
        for role in tiny.ROLES:
            _uncached(arch, role, 11)
    after = torch.random.get_rng_state()
    assert torch.equal(before, after), "building a tiny model advanced the global RNG"


def test_weights_do_not_depend_on_hash_seed() -> None:
    """The seed derivation is stable across processes (it must not use the salted builtin hash())."""
    code = (
        "import torch\n"
        "from specaudit.fixtures.tiny import build_tiny\n"
        "print(repr(sum(p.sum().item() for p in build_tiny('llama', seed=5).parameters())))\n"
    )
    hash_seed = "54321" if os.environ.get("PYTHONHASHSEED") == "12345" else "12345"
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    here = sum(p.sum().item() for p in build_tiny("llama", seed=5).parameters())
    assert float(out.stdout.strip().splitlines()[-1]) == here


def test_build_is_cached() -> None:
    """The same arguments return the same (shared) model object."""
    assert build_tiny("llama") is build_tiny("llama", "target", seed=0, dtype=torch.float64)


def test_unknown_arch_or_role_is_rejected() -> None:
    """Unknown architectures, roles and non-float dtypes raise ValueError naming the choices."""
    with pytest.raises(ValueError, match="unknown tiny architecture 'mamba'"):
        build_tiny("mamba")
    with pytest.raises(ValueError, match="unknown role 'verifier'"):
        build_tiny("llama", "verifier")
    with pytest.raises(ValueError, match="floating point"):
        build_tiny("llama", dtype=torch.int64)


@pytest.mark.parametrize("arch", ARCHS)
def test_draft_is_smaller_than_target(arch: str) -> None:
    """The draft has fewer parameters and fewer layers than the target."""
    target, draft = build_tiny(arch, "target"), build_tiny(arch, "draft")
    assert _param_count(draft) < _param_count(target)
    assert draft.config.num_hidden_layers < target.config.num_hidden_layers


@pytest.mark.parametrize("arch", ARCHS)
def test_draft_is_the_targets_first_layer(arch: str) -> None:
    """Every draft tensor equals the target tensor of the same name."""
    target_state = build_tiny(arch, "target").state_dict()
    for name, tensor in build_tiny(arch, "draft").state_dict().items():
        assert torch.equal(tensor, target_state[name]), name


@pytest.mark.parametrize("arch", ARCHS)
def test_draft_agrees_with_target_sometimes(arch: str) -> None:
    """The draft's greedy token matches the target's often but not always (so acceptance is ragged)."""
    target, draft = build_tiny(arch, "target"), build_tiny(arch, "draft")
    ids = torch.randint(0, VOCAB_SIZE, (16, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        agree = target(input_ids=ids).logits.argmax(-1) == draft(input_ids=ids).logits.argmax(-1)
    assert 0.2 <= agree.double().mean().item() <= 0.8


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_config_shape(arch: str, dtype: torch.dtype) -> None:
    """Shared vocabulary, no special token ids, eager attention, eval mode, frozen, the requested dtype."""
    for role in tiny.ROLES:
        model = build_tiny(arch, role, dtype=dtype)
        cfg = model.config
        assert cfg.vocab_size == VOCAB_SIZE
        assert model.get_output_embeddings().weight.shape[0] == VOCAB_SIZE
        assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (None, None, None)
        gen = model.generation_config
        assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (None, None, None)
        assert cfg._attn_implementation == "eager"  # the name real classes accept, float64 too (issue 38)
        assert not model.training
        assert not any(p.requires_grad for p in model.parameters())
        assert {p.dtype for p in model.parameters()} == {dtype}
        assert cfg.max_position_embeddings >= 512
        if arch in ("llama", "qwen3"):
            assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
        if arch == "qwen3":
            assert cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_exact_eager_is_hf_eager(arch: str) -> None:
    """HF's "eager" on the tiny models is HF's eager attention: bit for bit in float32; in float64 it is
    the float64-softmax variant (`EXACT_EAGER`), within 1e-4 of HF's own, under the name "eager"."""
    import importlib

    hf_eager = importlib.import_module(
        f"transformers.models.{arch}.modeling_{arch}"
    ).eager_attention_forward.__wrapped__
    ids = torch.randint(0, VOCAB_SIZE, (2, 9), generator=torch.Generator().manual_seed(4))
    for dtype, atol in ((torch.float32, 0.0), (torch.float64, 1e-4)):
        ours, exact = _uncached(arch, "target", 0, dtype), _uncached(arch, "target", 0, dtype)
        ours.config._attn_implementation = "eager"
        exact.config._attn_implementation = tiny.EXACT_EAGER
        with torch.no_grad():
            a, b = ours(input_ids=ids).logits, exact(input_ids=ids).logits
            layer = ours.model.layers[0].self_attn
            q = torch.randn(2, layer.config.num_attention_heads, 9, layer.head_dim, dtype=dtype)
            kv = torch.randn(2, layer.config.num_key_value_heads, 9, layer.head_dim, dtype=dtype)
            mine, theirs = (
                hf_eager(layer, q, kv, kv, None, 0.5)[0],
                tiny._exact_eager_attention(layer, q, kv, kv, None, 0.5)[0],
            )
        assert torch.equal(a, b), f"{dtype}: 'eager' and EXACT_EAGER differ by {_diff(a, b):.3g}"
        assert torch.allclose(mine, theirs, rtol=0, atol=atol), f"{dtype}: got max |diff| {_diff(mine, theirs):.3g}"


@pytest.mark.parametrize("arch", ARCHS)
def test_padded_batch_matches_single_sequences(arch: str) -> None:
    """Left-padded prefill plus one cached decode step gives each row its batch-size-1 logits (float64)."""
    model = build_tiny(arch)
    prompts = _prompts(seed=1)
    ids, mask = _left_pad(prompts)  # [B, T]
    positions = _positions(mask)
    with torch.no_grad():
        logits, cache = call_model(model, ids, mask, positions, transformers.DynamicCache())  # [B, T, V]
        assert cache_length(cache) == ids.shape[1]
        nxt = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        mask2 = torch.cat([mask, torch.ones_like(nxt)], dim=1)  # [B, T + 1]
        logits2, cache = call_model(model, nxt, mask2, positions[:, -1:] + 1, cache)  # [B, 1, V]
        assert cache_length(cache) == ids.shape[1] + 1
        for row, prompt in enumerate(prompts):
            alone = _single(model, prompt)
            alone2 = _single(model, torch.cat([prompt, nxt[row]]))
            for step, got, want in (("prefill", logits, alone), ("decode", logits2, alone2)):
                diff = _diff(got[row, -1], want)
                assert torch.allclose(got[row, -1], want, rtol=0, atol=ATOL), (
                    f"row {row} {step}: got max |diff| {diff:.3g}, but should be <= {ATOL}"
                )


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_is_a_dynamic_cache_updated_in_place(arch: str) -> None:
    """The cache passed in comes back as the same DynamicCache, grown by the call's tokens."""
    for role in tiny.ROLES:
        model = build_tiny(arch, role)
        ids = torch.arange(5)[None]
        cache = transformers.DynamicCache()
        with torch.no_grad():
            _, out = call_model(model, ids, torch.ones_like(ids), torch.arange(5)[None], cache)
            assert out is cache and cache_length(cache) == 5
            _, out = call_model(model, ids[:, :2], torch.ones(1, 7, dtype=torch.long), torch.arange(5, 7)[None], cache)
        assert out is cache and cache_length(cache) == 7


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_batch_is_finite_in_low_precision(arch: str, dtype: torch.dtype) -> None:
    """Left-padded float32/bfloat16 batches stay finite, and float32 matches batch size 1 to 1e-4."""
    model = build_tiny(arch, dtype=dtype)
    prompts = _prompts(seed=1)
    ids, mask = _left_pad(prompts)
    with torch.no_grad():
        logits, _ = call_model(model, ids, mask, _positions(mask), transformers.DynamicCache())
        assert torch.isfinite(logits[:, -1]).all()
        if dtype == torch.float32:
            for row, prompt in enumerate(prompts):
                diff = _diff(logits[row, -1], _single(model, prompt))
                assert diff < 1e-4, f"row {row}: got max |diff| {diff:.3g}, but should be < 1e-4"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_missing_position_ids_change_padded_rows(arch: str) -> None:
    """Negative control: without position_ids a left-padded row's logits differ from its batch-size-1 ones."""
    model = build_tiny(arch)
    prompts = _prompts(seed=1)
    ids, mask = _left_pad(prompts)
    with torch.no_grad():
        logits, _ = call_model(model, ids, mask, None, transformers.DynamicCache())
        diff = _diff(logits[1, -1], _single(model, prompts[1]))  # row 1 carries 5 pads
    if arch == "gpt2":  # learned absolute positions: a shifted row is a different input
        assert diff > 1e-3, f"got max |diff| {diff:.3g}, but should be > 1e-3"
    else:
        # RoPE scores depend on position differences only, so shifting a whole row moves the
        # logits by the float32 rounding of the rotary angles alone: visible at float64, but
        # a RoPE model exposes missing position ids only once a row's shift varies (a gap).
        assert ATOL < diff < 1e-4, f"got max |diff| {diff:.3g}, but should be in ({ATOL}, 1e-4)"


@pytest.mark.parametrize("arch", ARCHS)
def test_position_gap_needs_position_ids(arch: str) -> None:
    """A masked slot inside a row (a kept, rejected draft) is harmless with position_ids and not without."""
    model = build_tiny(arch)
    prompt = _prompts(seed=2)[2]  # 7 tokens
    junk = torch.tensor([VOCAB_SIZE - 1])
    ids = torch.cat([prompt[:4], junk, prompt[4:]])[None]  # [1, 8]
    mask = torch.ones_like(ids)
    mask[0, 4] = 0
    with torch.no_grad():
        alone = _single(model, prompt)
        fixed, _ = call_model(model, ids, mask, _positions(mask), transformers.DynamicCache())
        broken, _ = call_model(model, ids, mask, None, transformers.DynamicCache())
    assert _diff(fixed[0, -1], alone) <= ATOL
    assert _diff(broken[0, -1], alone) > 1e-3


def _layer_kv(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> list:
    """Per layer (K, V) [B, H, T, D] after a prefill of `ids` at `positions`."""
    from specaudit.models.compat import cache_layers

    with torch.no_grad():
        _, cache = call_model(model, ids, mask, positions, transformers.DynamicCache())
    return [(k.double(), v.double()) for k, v in cache_layers(cache)]


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_kv_past_position_256_is_within_tolerance_and_rounded_positions_are_not(arch: str) -> None:
    """What I2 relies on for long bfloat16 rows: a padded batch's K/V match batch size 1 within
    KV_TOLERANCE past position 256, and positions rounded to bfloat16 (the planted bug
    positions_in_model_dtype) break that tolerance there, but not below 256."""
    from specaudit.numerics.tolerance import KV_TOLERANCE

    rtol, atol = KV_TOLERANCE[torch.bfloat16]
    model = build_tiny(arch, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB_SIZE, (n,), generator=g) for n in (300, 262)]
    ids, mask = _left_pad(prompts)  # [2, 300]
    batch = _layer_kv(model, ids, mask, _positions(mask))
    for row, prompt in enumerate(prompts):
        alone = _layer_kv(model, prompt[None], torch.ones_like(prompt[None]), torch.arange(len(prompt))[None])
        real = slice(ids.shape[1] - len(prompt), None)
        for layer, ((k, v), (rk, rv)) in enumerate(zip(batch, alone)):
            for got, want in ((k[row, :, real], rk[0]), (v[row, :, real], rv[0])):  # [H, T, D]
                close = torch.isclose(got, want, rtol=rtol, atol=atol)
                assert close.all(), f"row {row} layer {layer}: got max |diff| {_diff(got, want):.3g} past tolerance"
    prompt = prompts[0][None]  # [1, 300]
    right = torch.arange(prompt.shape[1])[None]
    rounded = right.to(torch.bfloat16).long()  # 257 -> 256, 259 -> 260, ...
    assert torch.equal(rounded[:, :257], right[:, :257]) and not torch.equal(rounded, right)
    ones = torch.ones_like(prompt)
    k, rk = _layer_kv(model, prompt, ones, rounded)[0][0], _layer_kv(model, prompt, ones, right)[0][0]  # layer 0 K
    below = torch.isclose(k[0, :, :256], rk[0, :, :256], rtol=rtol, atol=atol)
    above = torch.isclose(k[0, :, 256:], rk[0, :, 256:], rtol=rtol, atol=atol)
    assert below.all(), f"below 256: got max |diff| {_diff(k[0, :, :256], rk[0, :, :256]):.3g}, but should be 0"
    assert not above.all(), "positions rounded to bfloat16 past 256 should change the K/V beyond KV_TOLERANCE"


# ---------------------------------------------------------------------------------------
# Every built-in model takes what its real class takes, under Hugging Face `generate` too.
# CI's oldest smoke runs this file on transformers 4.51.


def _real_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A plain instance of the Hugging Face class a built-in stands for, with its config and weights.

    The transparent models stand for a Llama-style causal LM (their forward copies its arguments).
    """
    if isinstance(model, TransparentLM):
        return build_tiny("llama")
    plain = type(model).__mro__[1] if type(model).__name__.startswith("_") else type(model)
    twin = plain(model.config).to(next(model.parameters()).dtype)
    twin.load_state_dict(model.state_dict())
    twin.generation_config = model.generation_config
    return twin.eval()


def _builtins() -> dict[str, torch.nn.Module]:
    script = RequestScript((3, 1, 4), (1, 5, 9), (True, False, True))
    models: dict[str, torch.nn.Module] = {"transparent": transparent_target(), "scripted": scripted_draft([script])}
    for arch in ARCHS:
        for role in tiny.ROLES:
            models[f"{arch}-{role}"] = build_tiny(arch, role)
    return models


BUILTINS = ("transparent", "scripted", *(f"{a}-{r}" for a in ARCHS for r in tiny.ROLES))


def _generate_takes(model: torch.nn.Module, name: str) -> bool:
    """Whether `generate(..., name=...)` passes Hugging Face's own keyword check for `model`."""
    try:
        model._validate_model_kwargs({name: 1})
    except ValueError:
        return False
    return True


def _named_parameters(model: torch.nn.Module) -> set[str]:
    params = inspect.signature(model.forward).parameters.values()
    return {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_takes_every_keyword_its_real_class_takes(name: str) -> None:
    """Every named argument of the real class's forward is a named argument of the built-in's, and
    `generate` lets through (and refuses: a typo) the same model keywords for both."""
    model = _builtins()[name]
    twin = _real_twin(model)
    missing = _named_parameters(twin) - _named_parameters(model) - {"cache", "past_key_values"}
    assert not missing, f"{name}: forward lacks {sorted(missing)}, which {type(twin).__name__} takes"
    for keyword in sorted(_named_parameters(twin) - {"input_ids"}) + ["position_id_typo"]:
        assert _generate_takes(model, keyword) == _generate_takes(twin, keyword), (
            f"{name}: generate(..., {keyword}=...) is {'' if _generate_takes(model, keyword) else 'not '}taken, "
            f"but should be as on {type(twin).__name__}"
        )


@pytest.mark.parametrize("role", tiny.ROLES)
@pytest.mark.parametrize("given", [True, False], ids=["position_ids", "no-position_ids"])
def test_gpt2_generate_behaves_as_gpt2lmheadmodel(role: str, given: bool) -> None:
    """`generate(input_ids, attention_mask, position_ids=..., ...)` on the built-in GPT-2 gives the tokens
    a plain `GPT2LMHeadModel` with the same config and weights gives, with and without position ids."""
    model = build_tiny("gpt2", role)
    twin = _real_twin(model)
    ids, mask = _left_pad(_prompts(seed=3))  # [B, T]
    extra = {"position_ids": _positions(mask)} if given else {}
    kwargs = {"attention_mask": mask, "max_new_tokens": 3, "do_sample": False, "pad_token_id": PAD_ID, **extra}
    with torch.no_grad():
        got, want = model.generate(ids, **kwargs)[:, ids.shape[1] :], twin.generate(ids, **kwargs)[:, ids.shape[1] :]
    assert torch.equal(got, want), f"got new tokens {got.tolist()}, but should be {want.tolist()} as on GPT2LMHeadModel"


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_forward_calls_behave_as_hugging_face(name: str) -> None:
    """Positional calls, `logits_to_keep` and `return_dict=False` work on every built-in as on a real causal LM."""
    model = _builtins()[name]
    ids, mask = _left_pad(_prompts(seed=4))
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits  # [B, T, V]
        if "logits_to_keep" in _named_parameters(model):
            last = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits  # [B, 1, V]
            assert torch.allclose(last, full[:, -1:], rtol=0, atol=ATOL), f"got max |diff| {_diff(last, full[:, -1:])}"
        as_tuple = model(input_ids=ids, attention_mask=mask, return_dict=False)
        assert isinstance(as_tuple, tuple) and torch.allclose(as_tuple[0], full, rtol=0, atol=ATOL)
        positional = model(ids, *([None] if "gpt2" in name else []), mask)  # GPT-2 takes the cache second
        assert torch.allclose(positional.logits, full, rtol=0, atol=ATOL)


# ---------------------------------------------------------------------------------------
# Stuck decode positions under `generate`: a bug on transformers 4.51, none on 5.x

STUCK = "tests.decoders.stuck_positions:StuckPositions"
ADVANCING = "tests.decoders.stuck_positions:AdvancingPositions"


def generate_advances_given_positions() -> bool:
    """Whether this transformers' `generate` moves given position ids on at each decode step (5.x
    extends them by one a token) or keeps slicing the given ones (4.51: every step at the last)."""
    model, seen = build_tiny("llama"), []
    ids = torch.arange(1, 5)[None]  # [1, 4]
    hook = model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["position_ids"]), with_kwargs=True)
    try:
        with torch.no_grad():
            positions = torch.arange(4)[None]  # [1, 4]
            model.generate(ids, attention_mask=torch.ones_like(ids), position_ids=positions, max_new_tokens=3)
    finally:
        hook.remove()
    return [int(p[0, -1]) for p in seen[1:]] == [4, 5]  # the two decode steps


def _stuck_case(model: str) -> Case:
    draft = "scripted" if model == "transparent" else "tiny"
    return Case(((3, 1, 4, 1, 5), (9, 2), (6, 6, 6)), ("101101", "111111", "1"), 2, 6, None, 0, 0, model, draft)


def test_transformers_451_generate_keeps_given_positions() -> None:
    """The premise: transformers 4.51's `generate` does not advance given position ids; 5.24's does."""
    version = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    if version == (4, 51):
        assert not generate_advances_given_positions()
    elif version >= (5, 24):
        assert generate_advances_given_positions()


@pytest.mark.parametrize("model", ["transparent", "llama"])
def test_stuck_generate_positions_fail_where_generate_keeps_them(model: str) -> None:
    """A decoder handing the target's `generate` position ids for the context only fails I2 (position-ids)
    and equivalence where `generate` keeps them (4.51), on the transparent model as on Llama; where
    `generate` advances them (5.x) the same code is right and passes I1, I2 and equivalence."""
    run = run_case(STUCK, _stuck_case(model))
    assert run.error is None, run.error
    found = {name: [v.rule for v in check(run)] for name, check in CHECKS.items()}
    if generate_advances_given_positions():
        assert found == {name: [] for name in CHECKS}, f"got {found}, but should pass where generate advances"
    else:
        assert "position-ids" in found["I2"], f"got I2 rules {found['I2']}, but should report position-ids"
        assert found["equivalence"], "got equal outputs, but stuck positions should change the tokens"
        assert diagnose(run).first_check == "I2"


def test_advancing_generate_positions_pass_everywhere() -> None:
    """Control: the same decoder leaving position ids to `generate` passes I1, I2 and equivalence."""
    run = run_case(ADVANCING, _stuck_case("transparent"))
    assert run.error is None, run.error
    assert {name: [v.render() for v in check(run)] for name, check in CHECKS.items()} == {n: [] for n in CHECKS}
