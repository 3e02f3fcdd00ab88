"""Confirm, without specaudit, what specaudit found in Pleto/speculative-sampling-pytorch's batched sampler.

Its acceptance is random (`torch.rand` against min(1, p/q)) but every token it draws is an argmax: the drafts, the
token after a rejection (argmax of max(0, p - q), with q from the wrong slot) and the bonus (read at the batch's last
column). On two tiny random Llamas this script measures:

  A. the first token at a fixed prompt over many seeds (temperature 1, no filtering) against the target's exact p,
     and how often two rows of one prompt emit the same first token against sum_x p(x)^2 for independent rows;
  B. ragged batches (80 random pairs of a 1- and a 2-token prompt, top-p 0.5, K = 3, 2 new tokens): tokens top-p
     forbids given the row's own prefix (a rejected row's position is read through an index among the *active* rows
     applied to the whole batch; the bonus at the batch's last column), and rows returned short (a residual that is
     all zeros, from q of the wrong slot, has argmax 0, and token id 0 is dropped while still counted as generated);
  C. a batch of one row with a draft that disagrees: generate() raises (a 0-d tensor added to a 1-element one).

Run: .venv/bin/python tests/wild/confirm/pleto_argmax.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # run as a script: the repository root

from tests.wild.confirm.common import (  # noqa: E402
    VOCAB,
    assert_standalone,
    chi_square,
    exact_p,
    exact_p_along,
    perturbed,
    tiny_llama,
)
from tests.wild.pleto import PletoBatchedSpeculativeSampling  # noqa: E402  (the re-implementation: pure torch)


def run(target, draft, prompts, seed, *, temperature=1.0, top_k=None, top_p=None, k=2, new=2):
    """One call of the re-implemented decoder on left-padded prompts."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return PletoBatchedSpeculativeSampling().generate(
        target, draft, ids, mask, num_draft_tokens=k, max_new_tokens=new, eos_token_id=None, pad_token_id=0,
        temperature=temperature, top_k=top_k, top_p=top_p, generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip


@torch.no_grad()
def part_a(target, draft, seeds: int = 60, batch: int = 8) -> dict:
    prompt = [3, 7, 1]
    outs = [run(target, draft, [prompt] * batch, seed) for seed in range(seeds)]
    first = torch.tensor([[row[0] for row in out] for out in outs])  # [seeds, batch]
    p = exact_p(target, [prompt], (1.0, None, None))[0]
    counts = torch.bincount(first.flatten(), minlength=VOCAB).double()
    same = (first[:, :, None] == first[:, None, :]).double()
    pairs = same.sum() - same.diagonal(dim1=1, dim2=2).sum()
    return {
        "samples": int(counts.sum()),
        "distinct first tokens": int((counts > 0).sum()),
        "p of the likeliest token": float(p.max()),
        "chi-square vs exact p (stat, df, p-value)": chi_square(counts, p),
        "two rows agree: observed vs independent (sum p^2)": (
            float(pairs / (seeds * batch * (batch - 1))),
            float((p**2).sum()),
        ),
    }


@torch.no_grad()
def part_b(target, draft, pairs: int = 80) -> dict:
    """Random prompt pairs of 1 and 2 tokens, one seed each."""
    sampling = (1.0, None, 0.5)
    g = torch.Generator().manual_seed(0)
    emitted = forbidden = short = 0
    for i in range(pairs):
        prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (1, 2)]
        out = run(target, draft, prompts, i, top_p=0.5, k=3, new=2)
        for prompt, row in zip(prompts, out):
            short += len(row) < 2  # no EOS in this run: every row is owed 2 tokens
            if row:
                p = exact_p_along(target, prompt, row, sampling)
                forbidden += int((p[torch.arange(len(row)), torch.tensor(row)] == 0).sum())
                emitted += len(row)
    return {
        "rows": 2 * pairs,
        "tokens": emitted,
        "outside top-p given their own prefix": forbidden,
        "rows returned short of max_new_tokens (no EOS)": short,
    }


@torch.no_grad()
def part_c(target, draft) -> str:
    for seed in range(20):
        try:
            run(target, draft, [[3, 7, 1]], seed, k=3, new=8)
        except RuntimeError as exc:
            return f"raises on seed {seed}: RuntimeError: {exc}"
    return "no error in 20 seeds"


def main() -> None:
    target = tiny_llama(0)
    draft = perturbed(target, 1, 0.5)  # a draft that agrees with the target often, not always
    a, b, c = part_a(target, draft), part_b(target, draft), part_c(target, draft)
    assert_standalone()
    print("Pleto batched speculative sampling, re-implemented; tiny random Llamas, K = 2 (B: K = 3)")
    print("A. first token at one prompt, temperature 1")
    for key, value in a.items():
        print(f"   {key}: {value}")
    print("B. ragged batches (1- and 2-token prompts), top-p 0.5, K = 3")
    for key, value in b.items():
        print(f"   {key}: {value}")
    print(f"C. one row, K = 3: {c}")
    biased = a["chi-square vs exact p (stat, df, p-value)"][2] < 1e-6
    print("VERDICT:", "BIASED: argmax draws, not samples of p" if biased else "no bias detected",
          "| forbidden tokens emitted" if b["outside top-p given their own prefix"] > 0 else "",
          "| rows stop short" if b["rows returned short of max_new_tokens (no EOS)"] > 0 else "",
          "| crashes at batch size 1" if c.startswith("raises") else "")  # fmt: skip


if __name__ == "__main__":
    main()
