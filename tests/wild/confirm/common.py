"""Tiny random models, exact target distributions and a chi-square test: what the confirmations share.

Nothing here imports specaudit: each script checks `specaudit` stayed out of `sys.modules` before it prints a verdict.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:  # run as a script: the transcriptions live in tests.wild
    sys.path.insert(0, str(ROOT))

from tests.wild._common import hf_warp  # noqa: E402  (pure transformers: HF's own warpers)

VOCAB = 32


def tiny_llama(seed: int, vocab: int = VOCAB, scale: float = 0.4) -> LlamaForCausalLM:
    """A 2-layer Llama with random weights in float64; `scale` (the init std) makes its next-token distributions
    peaked enough that top-k and top-p cut something."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=scale, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config).double().eval()


@torch.no_grad()
def perturbed(model: LlamaForCausalLM, seed: int, eps: float) -> LlamaForCausalLM:
    """A draft close to `model`: its copy with Gaussian noise of std `eps` added to the output head, so it agrees
    with the target often and not always."""
    draft = LlamaForCausalLM(model.config).double().eval()
    draft.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    head = draft.lm_head.weight
    head.add_(eps * torch.randn(head.shape, generator=g, dtype=head.dtype))
    return draft


@torch.no_grad()
def exact_p(model: torch.nn.Module, prefixes: Sequence[Sequence[int]], sampling: tuple) -> torch.Tensor:
    """[N, V] the target's exact next-token distribution after each prefix (same length), HF's warpers in order."""
    ids = torch.tensor([list(p) for p in prefixes])
    logits = model(input_ids=ids, use_cache=False).logits[:, -1].double()
    return torch.softmax(hf_warp(logits, *sampling), dim=-1)


@torch.no_grad()
def exact_p_along(
    model: torch.nn.Module, prompt: Sequence[int], tokens: Sequence[int], sampling: tuple
) -> torch.Tensor:
    """[n, V] the target's exact distribution at each of the n tokens of a row, given the row's own prefix."""
    ids = torch.tensor([list(prompt) + list(tokens)[:-1]])
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 :].double()
    return torch.softmax(hf_warp(logits, *sampling), dim=-1)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """Pearson's chi-square of observed `counts` against `probs` ([V] each) over the tokens p allows, bins with
    expected count < 5 pooled; returns (statistic, degrees of freedom, p-value). Tokens p forbids are not binned:
    count them separately (any is certain evidence)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big & (probs > 0)].sum()[None]])
    exp = torch.cat([expected[big], expected[~big & (probs > 0)].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = int(keep.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))
    return stat, df, p_value


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return float(0.5 * (counts / counts.sum() - probs).abs().sum())


def assert_standalone() -> None:
    """The confirmation ran without specaudit."""
    assert "specaudit" not in sys.modules and "harness" not in sys.modules, "specaudit was imported"
