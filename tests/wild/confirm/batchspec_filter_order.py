"""Confirm, without specaudit, that BatchSpec's sampling path is not lossless when top-k and top-p are both on.

BatchSpec verifies with `get_sampling_probs` (softmax, top-p, *then* top-k) while its drafts and its first token come
from `sample` (FlashInfer's top-k *then* top-p, Hugging Face's order). Then (1) the distribution it verifies against
is not the one it samples its first token from, (2) drafts are drawn from one q and divided by another, and
(3) `fix_invalid_draft_tokens` swaps a draft outside the verifying q's support for argmax q *for the test only*,
while the engine emits the original draft. This script measures the emitted token's distribution:

  A. one verification slot on fixed categorical logits (K = 1, 20000 rows), against HF's exact p;
  B. the whole transcribed decoder on two tiny random Llamas: the second token (the first one verified) at a fixed
     prompt over many seeds, against its exact marginal sum_x1 p(x1) p(x2 | x1).

Run: .venv/bin/python tests/wild/confirm/batchspec_filter_order.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # run as a script: the repository root

from tests.wild.batchspec import (  # noqa: E402  (the transcription: pure torch)
    BatchSpecStandalone,
    chain_speculative_sampling,
    fix_invalid_draft_tokens,
    get_sampling_probs,
    sample,
)
from tests.wild.confirm.common import (  # noqa: E402
    VOCAB,
    assert_standalone,
    chi_square,
    exact_p,
    hf_warp,
    tiny_llama,
    total_variation,
)

T, TOP_K, TOP_P = 1.0, 5, 0.6


def part_a(rows: int = 20000) -> dict:
    """One slot: draft d ~ sample(draft logits); accept/residual by chain sampling over get_sampling_probs."""
    g = torch.Generator().manual_seed(0)
    target_logits = torch.tensor([3.0, 2.6, 2.2, 2.0, 1.9, 1.5, 1.0, 0.5] + [0.0] * 8, dtype=torch.float64)
    draft_logits = torch.tensor([2.0, 2.8, 1.6, 2.4, 2.1, 1.8, 1.2, 0.4] + [0.1] * 8, dtype=torch.float64)
    p_hf = torch.softmax(hf_warp(target_logits[None], T, TOP_K, TOP_P), -1)[0]
    p_verify = get_sampling_probs(target_logits[None], TOP_P, TOP_K, T)[0, 0]
    d = sample(draft_logits.expand(rows, -1), TOP_P, TOP_K, T, g)  # [rows, 1]
    q = get_sampling_probs(draft_logits.expand(rows, 1, -1), TOP_P, TOP_K, T)  # [rows, 1, V]
    p = get_sampling_probs(target_logits.expand(rows, 2, -1), TOP_P, TOP_K, T)  # slot and bonus
    fixed = fix_invalid_draft_tokens(d, q)
    out, _, emitted = chain_speculative_sampling(q, fixed, p, g)
    token = torch.where(emitted == 1, d[:, 0], out[:, 0])  # the engine emits the original draft when accepted
    counts = torch.bincount(token, minlength=p_hf.numel()).double()
    return {
        "hf support": torch.nonzero(p_hf).flatten().tolist(),
        "verify support (top-p then top-k)": torch.nonzero(p_verify).flatten().tolist(),
        "draft support, sample() vs get_sampling_probs()": (
            torch.nonzero(torch.bincount(d[:, 0], minlength=16)).flatten().tolist(),
            torch.nonzero(q[0, 0]).flatten().tolist(),
        ),
        "drafts swapped by fix_invalid_draft_tokens": float((fixed != d).double().mean()),
        "emitted outside HF support": float(counts[p_hf == 0].sum() / rows),
        "TV to HF p": total_variation(counts, p_hf),
        "chi-square vs HF p (stat, df, p-value)": chi_square(counts, p_hf),
        "TV to their own verify p": total_variation(counts, p_verify),
    }


@torch.no_grad()
def part_b(seeds: int = 40, batch: int = 100) -> dict:
    """The transcribed decoder end to end: the second token at one prompt, against its exact marginal."""
    target, draft = tiny_llama(0), tiny_llama(1)
    prompt = [3, 7, 1]
    decoder = BatchSpecStandalone()
    ids = torch.tensor([prompt] * batch)
    seconds = []
    for seed in range(seeds):
        out = decoder.generate(
            target, draft, ids, torch.ones_like(ids), num_draft_tokens=2, max_new_tokens=2, eos_token_id=None,
            pad_token_id=0, temperature=T, top_k=TOP_K, top_p=TOP_P, generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        seconds += [row[:2] for row in out]
    pairs = torch.tensor(seconds)  # [N, 2]
    sampling = (T, TOP_K, TOP_P)
    p1 = exact_p(target, [prompt], sampling)[0]  # [V]
    p2_given = exact_p(target, [prompt + [x] for x in range(VOCAB)], sampling)  # [V, V]
    marginal = p1 @ p2_given  # P(x2)
    impossible = float((p2_given[pairs[:, 0], pairs[:, 1]] == 0).double().mean())
    c1 = torch.bincount(pairs[:, 0], minlength=VOCAB).double()
    c2 = torch.bincount(pairs[:, 1], minlength=VOCAB).double()
    return {
        "samples": len(pairs),
        "first token (plain, from sample()): chi-square vs exact p (stat, df, p-value)": chi_square(c1, p1),
        "second token: outside HF support given its own first token": impossible,
        "second token: TV to exact marginal": total_variation(c2, marginal),
        "second token: chi-square vs exact marginal (stat, df, p-value)": chi_square(c2, marginal),
    }


def main() -> None:
    a, b = part_a(), part_b()
    assert_standalone()
    print(f"BatchSpec sampling path, temperature {T}, top_k {TOP_K}, top_p {TOP_P}")
    print("A. one verification slot, categorical logits, 20000 rows")
    for key, value in a.items():
        print(f"   {key}: {value}")
    print("B. transcribed decoder on tiny random Llamas (K = 2)")
    for key, value in b.items():
        print(f"   {key}: {value}")
    biased = a["emitted outside HF support"] > 0 and b["second token: outside HF support given its own first token"] > 0
    print(
        "VERDICT:",
        "BIASED: tokens the target's top-k/top-p distribution forbids are emitted at a draft's place"
        if biased
        else "no bias detected",
    )


if __name__ == "__main__":
    main()
