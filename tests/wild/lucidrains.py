"""lucidrains/speculative-decoding's batched `speculative_decoding`, transcribed as a specaudit sampling decoder.

Source: https://github.com/lucidrains/speculative-decoding, file speculative_decoding/speculative_decoding.py,
commit 72171ac91cd040ad6b67c186ac985e4f50a0c269 (22 Dec 2024): `speculative_decoding` and its helpers `log`,
`gumbel_noise`, `gumbel_sample`, `top_k`, `safe_div`, `find_first_true_index`.
MIT License, Copyright (c) 2023 Phil Wang. Permission is granted, free of charge, to deal in the Software without
restriction, provided this copyright notice and permission notice are included in all copies or substantial
portions of the Software. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND.

Kept as written: the batch layout (all rows right-aligned in one tensor `out` with per-row `seq_lens`; rejected
drafts dropped by the gather `out[batch_range, seq_offset_indices]`, whose negative indices wrap junk into the
masked left region), gumbel-max drafting from the top-k filtered draft logits, the acceptance scan
`find_first_true_index(r > p / q)`, the residual `relu(p - q)` at the first rejection, the bonus `prob[:, -1]`,
`torch.multinomial` for the round's last token, every row advancing until all reach `seq_len`, the final left
alignment and cut to `seq_len`.

Changed to fit the contract:
- the model call: theirs is `net(out, seq_start_pos=..., cache=..., return_cache=True)` with a KV cache they
  gather with the same indices; here each call is a cache-free forward of the whole `out`, the columns before
  `seq_start_pos` masked (their masking rule), positions counting the attended columns (their model's rotary
  positions are column indices, which only relative offsets reach);
- left-padded prompts: theirs are one unpadded length; a row's own pads count in `seq_lens` like their prompt and
  `seq_start_pos` moves past them;
- randomness: `uniform_` and `torch.multinomial` on the global RNG draw from `generator` instead;
- sampling settings: `filter_thres` is chosen so that their `top_k` keeps exactly the contract's k (all tokens when
  none); top-p, which they do not have, is added as an -inf mask next to their top-k on both models (HF's rule);
- EOS: they have none; each row is cut at its first EOS afterwards;
- einops' `rearrange` (not installed here) is written as the equivalent indexing, the pattern left in a comment.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import TopPLogitsWarper

from tests.wild._common import cut, forward_logits

# -- their helpers, verbatim but for the generator --------------------------------------------------------------


def log(t: torch.Tensor, eps: float = 1e-20) -> torch.Tensor:
    return torch.log(t.clamp(min=eps))


def gumbel_noise(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    noise = torch.rand(t.shape, generator=generator, dtype=t.dtype)  # theirs: torch.zeros_like(t).uniform_(0, 1)
    return -log(-log(noise))


def gumbel_sample(t: torch.Tensor, generator: torch.Generator, temperature: float = 1.0, dim: int = -1) -> torch.Tensor:
    return ((t / max(temperature, 1e-10)) + gumbel_noise(t, generator)).argmax(dim=dim)


def top_k(logits: torch.Tensor, thres: float = 0.9) -> torch.Tensor:
    k = math.ceil((1 - thres) * logits.shape[-1])
    val, ind = torch.topk(logits, k)
    probs = torch.full_like(logits, float("-inf"))
    probs.scatter_(-1, ind, val)
    return probs


def safe_div(num: torch.Tensor, den: float, eps: float = 1e-10) -> torch.Tensor:
    return num / max(den, eps)


def find_first_true_index(bool_tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return (bool_tensor.cumsum(dim=dim) == 0).sum(dim=dim)


# -- the adapter's additions -----------------------------------------------------------------------------------


def filter_thres_for(k: int | None, vocab: int) -> float:
    """The `filter_thres` at which their `top_k` keeps exactly k tokens (all when k is off)."""
    k = vocab if not k or k >= vocab else k
    return 1 - (k - 0.5) / vocab


def filtered(logits: torch.Tensor, thres: float, temperature: float, top_p: float | None) -> torch.Tensor:
    """Their `top_k(logits, thres)`, then top-p (added: theirs has none) as -inf, judged on softmax(z / T)."""
    logits = top_k(logits, thres=thres)
    if top_p is not None and top_p < 1:
        shape = logits.shape
        z = TopPLogitsWarper(top_p)(None, safe_div(logits, temperature).reshape(-1, shape[-1]))
        logits = logits.masked_fill(torch.isinf(z).reshape(shape), float("-inf"))
    return logits


class LucidrainsSpeculativeDecoding:
    """`speculative_decoding(net, small_net, prompt, seq_len, gamma, temperature, filter_thres)` per call."""

    name = "lucidrains_speculative_decoding"
    samples = True

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
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        generator: torch.Generator,
    ) -> list[list[int]]:
        gamma = num_draft_tokens
        prompt = input_ids
        seq_len = prompt.shape[-1] + max_new_tokens
        own_pads = (attention_mask == 0).sum(-1)  # [B]: a row's own left pads (adapter)
        thres = filter_thres_for(top_k, target.config.vocab_size)

        def net(model: torch.nn.Module, out: torch.Tensor, seq_start_pos: torch.Tensor) -> torch.Tensor:
            """Their `net(out, seq_start_pos=...)`: columns before seq_start_pos (and a row's own pads) masked."""
            columns = torch.arange(out.shape[-1])
            return forward_logits(model, out, columns[None, :] >= (seq_start_pos + own_pads)[:, None])

        batch, prompt_seq_len, out, device = *prompt.shape, prompt.clone(), prompt.device
        batch_range = torch.arange(batch, device=device, dtype=torch.long)[..., None]
        seq_lens = torch.full((batch,), prompt_seq_len, device=device, dtype=torch.long)

        while (seq_lens < seq_len).any():
            # predict with smaller network
            all_small_logits = []
            q_sampled_out = []
            for _ in range(gamma):
                small_logits = net(draft, out, out.shape[-1] - seq_lens)
                small_logits = small_logits[:, -1]
                small_logits = filtered(small_logits, thres, temperature, top_p)
                all_small_logits.append(small_logits)
                sample = gumbel_sample(small_logits, generator, temperature=temperature, dim=-1)
                out = torch.cat((out, sample[..., None]), dim=-1)
                seq_lens += 1
                q_sampled_out.append(sample[:, None, None])  # rearrange(sample, "b -> b 1 1")
            q_sampled_out = torch.cat(q_sampled_out, dim=-2)
            small_logits = torch.stack(all_small_logits, dim=-2)

            # verify with larger network
            logits = net(target, out, out.shape[-1] - seq_lens)
            logits = logits[..., -(gamma + 1) :, :]
            logits = filtered(logits, thres, temperature, top_p)

            # prob and prob of small model (p(x) and q(x) in algorithm 1)
            prob = safe_div(logits, temperature).softmax(dim=-1)
            small_prob = safe_div(small_logits, temperature).softmax(dim=-1)
            p, prob_next = prob[:, :-1], prob[:, -1]
            p = p.gather(-1, q_sampled_out)
            q = small_prob.gather(-1, q_sampled_out)  # * lenience (1.0)
            p, q = [t[..., 0] for t in (p, q)]  # rearrange(t, "b n 1 -> b n")
            r = torch.rand(q.shape, generator=generator, dtype=q.dtype)  # theirs: zeros_like(q).uniform_(0, 1)
            accepted = find_first_true_index(r > (p / q))

            num_rejected = gamma - accepted
            has_rejected = num_rejected > 0
            accepted = accepted[:, None]  # rearrange(accepted, "b -> b 1")
            accepted.clamp_(max=gamma - 1)
            adjusted_prob = F.relu(prob[batch_range, accepted] - small_prob[batch_range, accepted])
            adjusted_prob = adjusted_prob / adjusted_prob.sum(dim=-1, keepdim=True)
            adjusted_prob = adjusted_prob[:, 0]  # rearrange(adjusted_prob, "b 1 d -> b d")
            prob_next = torch.where(has_rejected[..., None], adjusted_prob, prob_next)

            # do a bunch of slicing and align everything to the right (their caches: not kept, see above)
            seq_lens -= num_rejected
            max_seq_len = seq_lens.amax()
            curr_len = out.shape[-1]
            seq_arange = torch.arange(max_seq_len, device=device, dtype=torch.long) + (curr_len - max_seq_len)
            seq_offset_indices = seq_arange - num_rejected[..., None]
            if batch > 1:
                out = out[batch_range, seq_offset_indices]
            else:
                out = out[..., :max_seq_len]

            # sample the additional token, one of the tricks in the paper to better bound the worst case
            next_token = torch.multinomial(prob_next, 1, generator=generator)
            out = torch.cat((out, next_token), dim=-1)
            seq_lens += 1

        # now left align
        num_pad_left = out.shape[-1] - seq_lens
        max_pad_left = num_pad_left.amax()
        out = F.pad(out, (0, max_pad_left), value=pad_token_id)
        seq_len_range = torch.arange(seq_len, device=device, dtype=torch.long)
        out = out[batch_range, seq_len_range + num_pad_left[..., None]]
        return [cut(row, max_new_tokens, eos_token_id) for row in out[..., prompt_seq_len:].tolist()]
