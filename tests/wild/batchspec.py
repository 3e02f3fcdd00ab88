"""BatchSpec's standalone-drafter engine (`StandaloneEngine.generate_batch`), its sampling path transcribed as a
specaudit sampling decoder.

Source: https://github.com/siihwanpark/BatchSpec (Apache License 2.0, Copyright 2025 BatchSpec Contributors),
as stored in the search index: batchspec/backends/standalone_engine.py at commit
0b3013d5bec1f657a0fce4b1cfc3f9d6410f4747 (`prefill`, `draft`, `generate_batch`), batchspec/backends/base/engine.py
at commit 0486c74c28affa23f5f4c0b6bf728d0ec897b9d8 (`evaluate_posterior`), and batchspec/backends/utils/sampling.py
in the version that defines `fix_invalid_draft_tokens` (`get_sampling_probs`, `sample`, `fix_invalid_draft_tokens`).
The newest snapshot (commit 927c35f48747c367a4a95ad3d485545e914e15e1, 15 Jan 2026) has no standalone engine, but the
same `get_sampling_probs` / `sample` pair, used the same way by its MTP engine. This file is a modified derivative:
the changes are listed below.

Kept as written: the first token `sample(prefill logits[:, -1])`; K drafts, each `sample(drafter logits)` with its
logits kept; one target forward over [previous token, drafts]; `evaluate_posterior`'s sampling branch (target and
draft probabilities from `get_sampling_probs`, `fix_invalid_draft_tokens` on the drafts, `chain_speculative_sampling`,
`accept_nums = emitted + 1`, the bonus as the last valid output token); the emitted tokens `tokens_buffer[:, :accept]`
(the previous round's token and the accepted drafts, as drafted); the bonus carried into the next round's buffer.
`get_sampling_probs` applies top-p *then* top-k; `sample` applies top-k then top-p (FlashInfer's
`top_k_top_p_sampling_from_logits`, whose default `filter_apply_order` is "top_k_first"); both kept.

Changed to fit the contract:
- FlashInfer (CUDA only) is not installed here: its `softmax`, `top_p_renorm_probs`, `top_k_renorm_probs`, the
  `*_sampling_from_*` samplers and `chain_speculative_sampling` are re-implemented below in torch from their documented
  semantics (top-p: keep the smallest set of most probable tokens whose mass reaches top_p; top-k: keep the k most
  probable; chain sampling: Chen et al.'s rejection scheme), in float64 and drawing from `generator`;
- the paged KV caches, the drafter's one-token-delay "double buffer" and chunked prefill are replaced by cache-free
  forwards of each row's whole sequence (left-padded, positions counting real tokens); their engine assumes prompts of
  one length (`prefix_len`), the contract's prompts are ragged;
- termination: theirs stops the whole batch at the first EOS of any row, or once the *mean* generated length reaches
  the budget (a benchmark's choices); here every row runs until it has `max_new_tokens`, then is cut at its first EOS;
- the contract's `top_k` None becomes their "off" (-1) and `top_p` None their default 1.0.
"""

from __future__ import annotations

import torch

from tests.wild._common import cut, forward_logits, left_pad, unpad

# -- FlashInfer's sampling ops, re-implemented in torch (documented semantics) ---------------------------------


def fi_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.double() / temperature, dim=-1)


def top_p_renorm_probs(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most probable tokens whose mass reaches top_p (the mass above a kept token < top_p)."""
    values, order = probs.sort(dim=-1, descending=True)
    keep_sorted = (values.cumsum(-1) - values) < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(-1, keepdim=True)


def top_k_renorm_probs(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the top_k most probable tokens."""
    if top_k >= probs.shape[-1]:
        return probs
    kth = probs.topk(top_k, dim=-1).values[..., -1:]
    kept = probs * (probs >= kth)
    return kept / kept.sum(-1, keepdim=True)


def sampling_from_probs(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def top_k_top_p_sampling_from_logits(
    logits: torch.Tensor, top_k: int, top_p: float, generator: torch.Generator
) -> torch.Tensor:
    """FlashInfer's default filter_apply_order="top_k_first": top-k, renormalise, then top-p."""
    probs = top_p_renorm_probs(top_k_renorm_probs(torch.softmax(logits.double(), dim=-1), top_k), top_p)
    return sampling_from_probs(probs, generator)


def chain_speculative_sampling(
    draft_probs: torch.Tensor, draft_token_ids: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chain rejection sampling: accept d_i while u_i * q_i(d_i) < p_i(d_i); at the first rejection draw from
    norm(max(0, p_i - q_i)), after all K from target_probs[K]. Returns (output_token_ids [B, K + 1] with -1 after the
    last emitted token, accepted_num [B], emitted_num [B] = accepted drafts)."""
    batch, k = draft_token_ids.shape
    u = torch.rand(batch, k, generator=generator, dtype=torch.float64)
    p_d = target_probs[:, :k].gather(-1, draft_token_ids[..., None])[..., 0]
    q_d = draft_probs.gather(-1, draft_token_ids[..., None])[..., 0]
    ok = u * q_d < p_d
    emitted = ok.long().cumprod(dim=1).sum(dim=1)  # [B]
    output = torch.full((batch, k + 1), -1, dtype=torch.long)
    for b in range(batch):
        n = int(emitted[b])
        output[b, :n] = draft_token_ids[b, :n]
        if n < k:
            residual = (target_probs[b, n] - draft_probs[b, n]).clamp(min=0)
            dist = residual if bool(residual.sum() > 0) else target_probs[b, n]
        else:
            dist = target_probs[b, k]
        output[b, n] = torch.multinomial(dist, 1, generator=generator)[0]
    return output, ok.long().sum(dim=1), emitted


# -- BatchSpec's utils/sampling.py (FlashInfer calls routed to the above) --------------------------------------


def get_sampling_probs(logits: torch.Tensor, top_p: float, top_k: int, temperature: float) -> torch.Tensor:
    if len(logits.shape) == 2:
        bsz, voc_size = logits.shape
        seqlen = 1
    else:
        bsz, seqlen, voc_size = logits.shape
        logits = logits.reshape(-1, voc_size)
    probs = fi_softmax(logits, temperature=temperature)
    if top_p > 0:  # Apply top-p filtering
        probs = top_p_renorm_probs(probs, top_p)
    if top_k > 0:  # Apply top-k filtering
        probs = top_k_renorm_probs(probs, top_k)
    return probs.reshape(bsz, seqlen, voc_size)


def sample(
    logits: torch.Tensor, top_p: float, top_k: int, temperature: float, generator: torch.Generator
) -> torch.Tensor:
    if len(logits.shape) == 2:
        bsz, voc_size = logits.shape
        seqlen = 1
    else:
        bsz, seqlen, voc_size = logits.shape
        logits = logits.reshape(-1, voc_size)
    if temperature == 0:
        return torch.argmax(logits, dim=-1).reshape(bsz, seqlen).long()
    if top_k > 0:
        if top_p > 0:  # Simultaneously apply top-k and top-p
            samples = top_k_top_p_sampling_from_logits(logits / temperature, top_k, top_p, generator)
        else:  # top_k_sampling_from_probs
            samples = sampling_from_probs(top_k_renorm_probs(fi_softmax(logits, temperature), top_k), generator)
    elif top_p > 0:  # top_p_sampling_from_probs
        samples = sampling_from_probs(top_p_renorm_probs(fi_softmax(logits, temperature), top_p), generator)
    else:  # sampling_from_logits
        samples = sampling_from_probs(fi_softmax(logits, temperature), generator)
    return samples.reshape(bsz, seqlen).long()


def fix_invalid_draft_tokens(draft_tokens: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """A draft with q(x) == 0 under `get_sampling_probs` is replaced by argmax q (theirs: "a lightweight safety guard
    that only triggers on rare sampler failures")."""
    sampled_prob = torch.gather(draft_probs, dim=-1, index=draft_tokens[..., None])[..., 0]
    zero_mask = sampled_prob == 0
    if not zero_mask.any():
        return draft_tokens
    argmax_tokens = draft_probs.argmax(dim=-1)
    return torch.where(zero_mask, argmax_tokens, draft_tokens)


class BatchSpecStandalone:
    """`StandaloneEngine.generate_batch` with `evaluate_posterior`'s sampling branch, cache-free."""

    name = "batchspec_standalone"
    samples = True

    def evaluate_posterior(
        self, draft_tokens: torch.Tensor, target_logits: torch.Tensor, draft_logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampling branch of `BaseEngine.evaluate_posterior`: (bonus_tokens [B, 1], accept_nums [B])."""
        target_probs = get_sampling_probs(
            target_logits, top_p=self.top_p, top_k=self.top_k, temperature=self.temperature
        )
        draft_probs = get_sampling_probs(draft_logits, top_p=self.top_p, top_k=self.top_k, temperature=self.temperature)
        draft_tokens = fix_invalid_draft_tokens(draft_tokens, draft_probs)
        output_tokens, _, emitted_nums = chain_speculative_sampling(
            draft_probs, draft_tokens, target_probs, self.generator
        )
        accept_nums = emitted_nums + 1
        positions = torch.arange(output_tokens.size(1))
        last_valid_idx = ((output_tokens != -1).to(torch.long) * positions).argmax(dim=1, keepdim=True)
        bonus_tokens = output_tokens.gather(1, last_valid_idx)
        return bonus_tokens, accept_nums

    def logits(self, model: torch.nn.Module, rows: list[list[int]], last: int) -> torch.Tensor:
        """The adapter's model call: each row's whole sequence, left-padded, cache-free; the last `last` logits."""
        ids, mask = left_pad(rows, self.pad_token_id)
        return forward_logits(model, ids, mask)[:, -last:]

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
        self.temperature, self.top_k, self.top_p = temperature, top_k or -1, 1.0 if top_p is None else top_p
        self.generator, self.pad_token_id = generator, pad_token_id
        k = num_draft_tokens
        prompts = unpad(input_ids, attention_mask)
        output: list[list[int]] = [[] for _ in prompts]

        # Prefill: the first token from the target's last logits
        next_tokens = sample(self.logits(target, prompts, 1)[:, -1], self.top_p, self.top_k, temperature, generator)
        tokens_buffer = next_tokens  # [B, 1]: the previous step's token; drafts are appended

        while min(map(len, output)) < max_new_tokens:  # adapter: every row to its budget (see the header)
            context = [p + o for p, o in zip(prompts, output)]
            logits_buffer = []
            for _ in range(k):  # Standalone Draft
                rows = [c + t for c, t in zip(context, tokens_buffer.tolist())]
                draft_logits = self.logits(draft, rows, 1)  # [B, 1, V]
                draft_tokens = sample(draft_logits, self.top_p, self.top_k, temperature, generator)  # [B, 1]
                tokens_buffer = torch.cat([tokens_buffer, draft_tokens], dim=1)
                logits_buffer.append(draft_logits)
            # Target verification over [previous token, drafts]
            target_logits = self.logits(target, [c + t for c, t in zip(context, tokens_buffer.tolist())], k + 1)
            if k:
                bonus_tokens, accept_nums = self.evaluate_posterior(
                    tokens_buffer[:, 1:], target_logits, torch.cat(logits_buffer, dim=1)
                )
            else:  # no drafts: a plain step (chain sampling needs at least one)
                bonus_tokens = sample(target_logits[:, -1], self.top_p, self.top_k, temperature, generator)
                accept_nums = torch.ones(len(prompts), dtype=torch.long)
            # Update output: the previous token and the accepted drafts, as drafted
            for b, n in enumerate(accept_nums.tolist()):
                output[b].extend(tokens_buffer[b, :n].tolist())
            tokens_buffer = bonus_tokens.long()
        return [cut(row, max_new_tokens, eos_token_id) for row in output]
