"""Pleto/speculative-sampling-pytorch's `batched_speculative_sampling`, re-implemented as a specaudit sampling decoder.

Source: https://github.com/Pleto/speculative-sampling-pytorch, file batched_speculative_sampling.py, commit
fed3ca4d37b374b87729e82dc4f0a39bb81f10ce (26 Mar 2025; the batched function was added in 762df33). The repository
has no license, so nothing is copied: this is a minimal re-implementation, in its own code, of the algorithm that
function runs, keeping each of its choices (described here, with the line of theirs each stands for):

- rows stay right-padded in one tensor with a mask; every model call is a cache-free forward of the active rows with
  that mask and no position ids (the model counts 0, 1, 2, ... from the left, right for right padding);
- the active rows all draft `min(max_new_tokens - fewest generated so far, gamma)` tokens, each the *argmax* of the
  draft's logits at the row's last real token (`torch.argmax(last)`), its q = softmax of those logits;
- draft i of a row is accepted while `torch.rand(active) < min(1, p(d_i) / q(d_i))`, p read at the row's position;
- accepted tokens sit in a zero-initialised buffer and are counted with `count_nonzero` (a token id 0 counts as not
  accepted, and `accept` drops zeros from the buffer before appending);
- after a rejection the token is the *argmax* of norm(max(0, p - q)), p at the rejected slot but q from
  `draft_probs_history[accepted_len - 1]` (the slot before; the last slot when none was accepted), and the row's
  position read as `mask.sum(1)[resampling_active_indices]`: indices among the *active* rows used on the whole batch;
- after all drafts are accepted the bonus is the *argmax* of p at the batch's *last column* (`verify_probs[..., -1,
  :]`), which is a right-pad column for every row shorter than the longest;
- a row finishes once it has generated at least max_new_tokens tokens; there is no EOS handling.

Their README says "Using greedy decoding to keep the code simple": every draw is an argmax, but acceptance is
random (`torch.rand`), so the output is neither the target's greedy output nor a sample of its distribution.

Changed to fit the contract: the contract's left-padded prompts are moved to the right first; their softmax (at
temperature 1, no filtering) is taken of the logits after Hugging Face's temperature, top-k and top-p warpers (the
argmax draws do not change); `torch.rand` draws from `generator`; their hard-coded pad id 1 is kept for the columns
they pad (always masked); outputs are cut to max_new_tokens and at the first EOS afterwards.
"""

from __future__ import annotations

import torch

from tests.wild._common import cut, hf_warp, unpad

PAD = 1  # theirs: pad_token_id = 1 (OPT's), used for the columns they add


def right_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows right-padded to the longest: (ids, mask) [B, W]."""
    width = max(map(len, rows))
    ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask


class PletoBatchedSpeculativeSampling:
    """One call of their `batched_speculative_sampling(prefix, attention_mask, verifier, drafter, max_new_tokens,
    gamma)`, right-padded rows and all."""

    name = "pleto_batched_speculative_sampling"
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
        def logits_of(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            """Their `model_fn`: model(input_ids, attention_mask, use_cache=False).logits; then the adapter's
            warpers, so that their softmax is the contract's distribution."""
            raw = model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # [B, W, V]
            return hf_warp(raw.reshape(-1, raw.shape[-1]), temperature, top_k, top_p).reshape(raw.shape)

        prompts = unpad(input_ids, attention_mask)
        gamma = num_draft_tokens
        rows = [list(p) for p in prompts]  # every row's real tokens; `accept` rebuilds the tensors from them
        batch = len(rows)
        active = torch.ones(batch, dtype=torch.bool)
        generated = torch.zeros(batch, dtype=torch.long)

        while bool(active.any()):
            steps = min(max_new_tokens - int(generated.min()), gamma)
            if steps <= 0:
                break
            seq, mask = right_pad(rows)  # the whole batch: as wide as its longest row, finished rows included
            spec, spec_mask = seq[active], mask[active]
            n = spec.shape[0]
            lengths = mask.sum(1)  # [B]: real tokens per row, whole batch
            base = lengths[active]  # [n]: each active row's length before its drafts

            # drafts: argmax at each row's last real token, q = softmax of those logits; each inserted at the row's
            # first free column, a pad column added when a row has none
            qs = []
            for i in range(steps):
                last = logits_of(draft, spec, spec_mask)[torch.arange(n), base + i - 1]  # [n, V]
                qs.append(torch.softmax(last, dim=-1))
                spec, spec_mask = insert(spec, spec_mask, last.argmax(-1))
            q_hist = torch.stack(qs)  # [steps, n, V]
            p_all = torch.softmax(logits_of(target, spec, spec_mask), dim=-1)  # [n, W, V]

            # acceptance scan: one uniform per active row and slot, while every earlier slot was accepted
            buffer = torch.zeros(n, gamma + 1, dtype=torch.long)
            still = torch.ones(n, dtype=torch.bool)
            for i in range(steps):
                if not bool(still.any()):
                    break
                d = spec[torch.arange(n), base + i]
                p_d = p_all[torch.arange(n), base + i - 1].gather(-1, d[:, None])[:, 0]
                q_d = q_hist[i].gather(-1, d[:, None])[:, 0]
                u = torch.rand(n, generator=generator)
                still = still & (u < torch.clamp(p_d / q_d, max=1.0))
                buffer[still, i] = d[still]
            kept = buffer.count_nonzero(dim=1)  # [n]: token id 0 is not counted

            rejected = (~still).nonzero()[:, 0]  # indices among the active rows
            if rejected.numel():
                pos = lengths.squeeze()  # the whole batch's lengths, indexed by active-row indices
                if pos.numel() > 1:
                    pos = pos[rejected]
                pos += kept[rejected]  # (a batch of one: a 0-d tensor, and this raises)
                p_r = p_all[rejected, pos - 1]
                q_r = q_hist[kept[rejected] - 1, rejected]  # the slot before the rejected one (-1: the last)
                residual = torch.clamp(p_r - q_r, min=0)
                residual = residual / torch.clamp(residual.sum(-1, keepdim=True), min=1e-12)
                buffer[rejected, kept[rejected]] = residual.argmax(-1)
            full = still.nonzero()[:, 0]
            if full.numel():
                buffer[full, kept[full]] = p_all[full, -1].argmax(-1)  # the spec batch's last column

            generated[active] += kept + 1
            for j, r in enumerate(active.nonzero()[:, 0].tolist()):  # `accept`: nonzero buffer tokens appended
                rows[r].extend(t for t in buffer[j].tolist() if t != 0)
            active[generated >= max_new_tokens] = False

        return [cut(row[len(p) :], max_new_tokens, eos_token_id) for row, p in zip(rows, prompts)]


def insert(ids: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token written at its first masked column (a pad column appended first if a row is full)."""
    at = mask.sum(1)
    if bool((at >= ids.shape[1]).any()):
        ids = torch.cat([ids, torch.full((ids.shape[0], 1), PAD)], dim=1)
        mask = torch.cat([mask, torch.zeros(mask.shape[0], 1, dtype=mask.dtype)], dim=1)
    ids, mask = ids.clone(), mask.clone()
    ids[torch.arange(ids.shape[0]), at] = tokens
    mask[torch.arange(ids.shape[0]), at] = 1
    return ids, mask
