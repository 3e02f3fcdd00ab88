"""Confirm, without specaudit, that lucidrains' batched `speculative_decoding` (transcribed) samples the target's
distribution and that its rows attend only their own tokens: specaudit's I2 failure on it is a false alarm.

  A. ragged batches (a 3-token and a 1-token prompt, left-padded), temperature 0.8, top-k 6, top-p 0.8, K = 3: the
     first token of each prompt against the exact p, the second against its exact marginal sum_x1 p(x1) p(x2 | x1)
     (the first is a draft-place token, the second a draft-place or bonus token);
  B. twins (rows of one prompt) with an EOS the target emits often, so that some rows finish while their twins go
     on (their rows keep computing past the EOS, as lucidrains' loop runs every row to `seq_len`): every target call
     recorded by a forward hook, each row's attended tokens, bar the round's K drafts, checked to be its own prompt
     and its own tokens (those of the same seed without EOS, which only the final cut differs from).

Run: .venv/bin/python tests/wild/confirm/lucidrains_lossless.py
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
    perturbed,
    tiny_llama,
)
from tests.wild.lucidrains import LucidrainsSpeculativeDecoding  # noqa: E402  (the transcription: pure torch)

SAMPLING = (0.8, 6, 0.8)
K = 3


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def generate(target, draft, prompts, seed, *, new, eos=None):
    ids, mask = left_padded(prompts)
    temperature, top_k, top_p = SAMPLING
    return LucidrainsSpeculativeDecoding().generate(
        target, draft, ids, mask, num_draft_tokens=K, max_new_tokens=new, eos_token_id=eos, pad_token_id=0,
        temperature=temperature, top_k=top_k, top_p=top_p, generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip


@torch.no_grad()
def part_a(target, draft, seeds: int = 30, per_prompt: int = 12) -> dict:
    prompts = [[3, 7, 1]] * per_prompt + [[5]] * per_prompt
    outs = [generate(target, draft, prompts, seed, new=2) for seed in range(seeds)]
    result = {}
    for name, prompt, rows in (
        ("3-token prompt", [3, 7, 1], slice(0, per_prompt)),
        ("1-token prompt", [5], slice(per_prompt, None)),
    ):
        pairs = torch.tensor([row for out in outs for row in out[rows]])  # [N, 2]
        p1 = exact_p(target, [prompt], SAMPLING)[0]
        marginal = p1 @ exact_p(target, [prompt + [x] for x in range(VOCAB)], SAMPLING)
        c1, c2 = (torch.bincount(pairs[:, i], minlength=VOCAB).double() for i in (0, 1))
        result[name] = {
            "samples": len(pairs),
            "first token chi-square (stat, df, p-value)": chi_square(c1, p1),
            "second token chi-square vs marginal (stat, df, p-value)": chi_square(c2, marginal),
            "tokens p forbids": int(c1[p1 == 0].sum() + c2[marginal == 0].sum()),
        }
    return result


@torch.no_grad()
def part_b(target, draft, seeds: int = 12) -> dict:
    prompts = [[3, 7, 1]] * 3 + [[5]] * 3
    eos = int(exact_p(target, [[5]], SAMPLING)[0].argmax())  # the 1-token prompt's likeliest next token
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    hook = target.register_forward_hook(
        lambda _m, _a, kwargs, _o: calls.append((kwargs["input_ids"], kwargs["attention_mask"])), with_kwargs=True
    )
    checked = foreign = past_eos = finished_early = 0
    try:
        for seed in range(seeds):
            full = generate(target, draft, prompts, seed, new=6)  # the same draws, no EOS cut
            calls.clear()
            cut = generate(target, draft, prompts, seed, new=6, eos=eos)
            finished_early += sum(len(c) < 6 for c in cut)
            for ids, mask in calls:
                for b, prompt in enumerate(prompts):
                    attended = ids[b][mask[b].bool()].tolist()
                    own = prompt + full[b]
                    committed = attended[: len(attended) - K]  # the round's last K are its drafts
                    n = min(len(committed), len(own))  # a row may run past seq_len: `full` holds 6 tokens
                    checked += 1
                    foreign += committed[:n] != own[:n]
                    past_eos += len(committed) > len(prompt) + len(cut[b])
    finally:
        hook.remove()
    return {
        "eos token": eos,
        "rows finished at EOS while a twin went on": finished_early,
        "row views checked": checked,
        "row views computing past their own EOS": past_eos,
        "row views attending a token not their own": foreign,
    }


def main() -> None:
    target = tiny_llama(0)
    draft = perturbed(target, 1, 0.5)
    a, b = part_a(target, draft), part_b(target, draft)
    assert_standalone()
    print(f"lucidrains speculative_decoding, transcribed; tiny random Llamas; (T, top-k, top-p) = {SAMPLING}, K = {K}")
    for name, facts in a.items():
        print(f"A. {name}")
        for key, value in facts.items():
            print(f"   {key}: {value}")
    print("B. twins with EOS, every target call hooked")
    for key, value in b.items():
        print(f"   {key}: {value}")
    p_values = [facts[key][2] for facts in a.values() for key in facts if "chi-square" in key]
    lossless = min(p_values) > 0.001 and all(facts["tokens p forbids"] == 0 for facts in a.values())
    print(
        "VERDICT:",
        "CONSISTENT with lossless sampling" if lossless else "BIASED",
        f"(smallest p-value {min(p_values):.3g});",
        "rows attend only their own tokens"
        if b["row views attending a token not their own"] == 0
        else "FOREIGN TOKENS",
    )


if __name__ == "__main__":
    main()
