"""Speculative *sampling* decoders that are lossless in distribution: five designs built differently.

Each emits tokens distributed exactly as autoregressive sampling from p, the target's distribution after
temperature, top-k and top-p (`contracts.sampling.target_distribution`); the draft's q is the same processing
of the draft's logits. All randomness comes from the `generator` handed to `generate`, so a run replays for a
seed; rows of a batch are independent samples.

  SpecSampling       vectorised rejection sampling over the batch (Leviathan et al. 2023, Chen et al. 2023),
                     every draw an inverse CDF of one uniform; one method per step: the planted sampling bugs
                     (reference/planted/sampling.py) each override one of its hooks.
  PerRowSampling     one generator per row, acceptance and draws in a Python loop over rows (`torch.multinomial`).
  GumbelSpec         a coupled Gumbel-max verifier: draft and target argmax over the same noise, accept while
                     they agree, emit the target's at the first disagreement.
  EqualitySpec       accept while the draft equals a target sample, emit that sample at the first mismatch.
  RecomputeSampling  no cache at all: every round re-feeds each row's whole left-padded sequence, as public
                     example code does.

The first four keep EQSPEC's contiguous caches and realignment (`reference.eqspec`), so every target forward
attends exactly each row's prompt and committed tokens at positions 0, 1, 2, ... (I1, I2); the fifth makes
every forward a fresh prefill of the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from specaudit.contracts.sampling import Sampling, target_distribution
from specaudit.models.compat import call_model
from specaudit.reference.eqspec import BatchState, EqSpec, left_pad_positions


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token whose CDF interval holds u: x = #{y : F(y) <= u F(V - 1)}. probs [B, V], u [B] -> [B].

    u is scaled by the total mass so rounding never runs past the last token; a token with p = 0 has an
    empty interval (F does not move over it) and is never drawn."""
    cdf = probs.cumsum(-1)  # [B, V]
    return (cdf <= u[:, None] * cdf[:, -1:]).sum(-1)


def at_count(x: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """x[b, accepted[b]]: each row's distribution at the position after its accepted drafts. [B, P, V] -> [B, V]"""
    index = accepted[:, None, None].expand(-1, 1, x.shape[-1])  # [B, 1, V]
    return x.gather(1, index)[:, 0]


def accepted_prefix(ok: torch.Tensor) -> torch.Tensor:
    """The number of leading True per row. [B, K] -> [B]"""
    return ok.long().cumprod(dim=1).sum(dim=1)


class SampledRounds(EqSpec):
    """EQSPEC's batch, caches and realignment with each round's tokens drawn at random: the skeleton the
    cached designs share. A design says how it draws the first token (`draw_plain`), a draft
    (`propose_token`) and how it settles a round (`settle`); `rng` is its own randomness (the generator,
    or what it derives from it)."""

    name = "SAMPLED_ROUNDS"
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
        sampling = Sampling(temperature, top_k, top_p)
        rng = self.streams(generator, input_ids.shape[0])
        out: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
        state, last = self.prefill_logits(target, draft, input_ids, attention_mask)  # last: [B, V]
        state.pending = self.draw_plain(self.target_probs(last, sampling), state, rng)  # [B]
        finished = self.commit(out, state.rows, [[t] for t in state.pending.tolist()], max_new_tokens, eos_token_id)
        state = self.drop_finished(state, finished)
        while state.rows.numel():
            drafts, q = self.propose_sampled(draft, state, num_draft_tokens, sampling, rng)  # [B, K], [B, K + 1, V]
            p = self.target_probs(self.verify_logits(target, state, drafts), sampling)  # [B, K + 1, V]
            accepted, token = self.settle(drafts, p, q, state, rng)  # [B], [B]
            new_tokens = [d[:a] + [t] for d, a, t in zip(drafts.tolist(), accepted.tolist(), token.tolist())]
            finished = self.commit(out, state.rows, new_tokens, max_new_tokens, eos_token_id)
            state = self.realign(state, accepted, token, num_draft_tokens, finished)
        return out

    # -- the models: EQSPEC's calls, logits kept ------------------------------------------------------

    def propose_sampled(
        self, draft: torch.nn.Module, state: BatchState, k: int, sampling: Sampling, rng: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K drafts drawn one at a time, then one more draft step so the draft cache holds the same K + 1 new
        slots as the target's after verification. Returns drafts [B, K] and q [B, K + 1, V]: q_i is the
        draft's distribution for position i, the last one the draft's after d_K (a bonus-from-draft bug reads it)."""
        batch = state.rows.numel()
        mask, token = state.draft_mask, state.pending[:, None]
        drafts, qs = [], []
        for step in range(k + 1):
            position = self.positions(state, mask, 1, "draft")  # [B, 1]
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)  # [B, S + step + 1]
            logits, state.draft_cache = call_model(
                draft, token, self.call_mask(state, mask, "draft"), position, state.draft_cache
            )
            qs.append(self.draft_probs(logits[:, -1], sampling))  # [B, V]
            if step < k:
                token = self.propose_token(logits[:, -1], qs[-1], state, rng)[:, None]  # [B, 1]
                drafts.append(token)
        drafts_t = torch.cat(drafts, dim=1) if drafts else state.pending.new_zeros(batch, 0)
        return drafts_t, torch.stack(qs, dim=1)

    def target_probs(self, logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        """p: the target's distribution after temperature, top-k, top-p. [..., V] float64"""
        return target_distribution(logits, sampling)

    def draft_probs(self, logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        """q: the draft's distribution under the same processing as p. [..., V] float64"""
        return target_distribution(logits, sampling)

    # -- what each design defines ---------------------------------------------------------------------

    def streams(self, generator: torch.Generator, batch: int) -> Any:
        """The design's randomness for one call, derived from `generator` only."""
        return generator

    def draw_plain(self, p: torch.Tensor, state: BatchState, rng: Any) -> torch.Tensor:
        """The token after the prefill, a plain step: x ~ p. [B, V] -> [B]"""
        raise NotImplementedError

    def propose_token(self, logits: torch.Tensor, q: torch.Tensor, state: BatchState, rng: Any) -> torch.Tensor:
        """One draft per row from the draft's logits [B, V] (q [B, V] their processed distribution). -> [B]"""
        raise NotImplementedError

    def settle(
        self, drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor, state: BatchState, rng: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The round's verdict: accepted drafts per row [B] and the token after them [B]."""
        raise NotImplementedError


class SpecSampling(SampledRounds):
    """Speculative sampling, vectorised over the batch: the reference the planted sampling bugs vary.

    Every random choice is an inverse CDF of one uniform from `uniforms`, so one hook sees all the randomness.
    The hooks, one per algorithm step (a planted bug overrides one):
      target_probs(logits, sampling)         p, the distribution judged
      draft_probs(logits, sampling)          q, the distribution drafts are drawn from and divided by
      propose_token(logits, q, state, rng)   the proposal draw d ~ q
      uniforms(batch, k, generator)          every uniform of the run, [B, k]
      accept_sampled(drafts, p, q, u)        the acceptance count
      next_distributions(p, q, accepted)     which (p, q) the round's last token is drawn with
      residual(p, q)                         norm(max(0, p - q))
      draw_residual(p_at, q_at, generator)   the token after a rejection
      draw_bonus(p_next, q_next, generator)  the token after K accepted drafts
      draw_plain(p, state, generator)        the first token after the prefill
    """

    name = "SPEC_SAMPLING"

    def uniforms(self, batch: int, k: int, generator: torch.Generator) -> torch.Tensor:
        """Independent U[0, 1) per row and slot. [B, k] float64"""
        return torch.rand(batch, k, generator=generator, dtype=torch.float64)

    def sample(self, probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """x ~ probs by inverse CDF. [B, V] -> [B]"""
        u = self.uniforms(probs.shape[0], 1, generator)[:, 0].to(probs.device)
        return inverse_cdf(probs, u)

    def draw_plain(self, p: torch.Tensor, state: BatchState, rng: Any) -> torch.Tensor:
        return self.sample(p, rng)

    def propose_token(self, logits: torch.Tensor, q: torch.Tensor, state: BatchState, rng: Any) -> torch.Tensor:
        """d ~ q: the very distribution the acceptance ratio divides by."""
        return self.sample(q, rng)

    def settle(
        self, drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor, state: BatchState, rng: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Accept a prefix of the drafts, then draw the round's last token: from the residual at the first
        rejection, from p after the K-th draft (the bonus). Only the rows that need a draw consume one."""
        k = drafts.shape[1]
        u = self.uniforms(drafts.shape[0], k, rng).to(p.device)  # [B, K]
        accepted = self.accept_sampled(drafts, p[:, :k], q[:, :k], u)  # [B]
        p_at, q_at = self.next_distributions(p, q, accepted)  # [B, V] each
        token = torch.empty_like(accepted)
        rejected = accepted < k
        if bool(rejected.any()):
            token[rejected] = self.draw_residual(p_at[rejected], q_at[rejected], rng)
        if bool((~rejected).any()):
            token[~rejected] = self.draw_bonus(p_at[~rejected], q_at[~rejected], rng)
        return accepted, token

    # Rejection sampling. A draft d_i ~ q_i is accepted iff u_i < p_i(d_i) / q_i(d_i), u_i ~ U[0, 1):
    # probability min(1, p/q). At the first rejection the token comes from r = norm(max(0, p - q)), so
    #   P(emit x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) r(x)
    #             = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x).
    # After K acceptances the bonus comes from p at position K + 1. Written as u q < p (no division):
    # a drawn draft has q(d) > 0, and a draft with q(d) = 0 (drawn elsewhere) is accepted iff p(d) > 0.
    @staticmethod
    def accept_sampled(drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """a_b = max{a : u_{b,i} q_i(d_i) < p_i(d_i) for all i < a}. drafts, u [B, K]; p, q [B, K, V] -> [B]"""
        p_d = p.gather(-1, drafts[..., None])[..., 0]  # [B, K]
        q_d = q.gather(-1, drafts[..., None])[..., 0]  # [B, K]
        return accepted_prefix(u * q_d < p_d)

    @staticmethod
    def next_distributions(
        p: torch.Tensor, q: torch.Tensor, accepted: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's (p, q) at the position after its accepted drafts. [B, K + 1, V] -> [B, V] each"""
        return at_count(p, accepted), at_count(q, accepted)

    @staticmethod
    def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """r = norm(max(0, p - q)). [B, V]

        Nothing is left where q >= p everywhere (p == q): a rejection then has probability 0 and r is never
        drawn in exact arithmetic; p stands in so the draw stays defined."""
        r = (p - q).clamp(min=0)
        total = r.sum(-1, keepdim=True)
        return torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p)

    def draw_residual(self, p_at: torch.Tensor, q_at: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The token after a rejected draft: x ~ residual(p, q). [B', V] -> [B']"""
        return self.sample(self.residual(p_at, q_at), generator)

    def draw_bonus(self, p_next: torch.Tensor, q_next: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The token after K accepted drafts: x ~ p at position K + 1 (never q). [B', V] -> [B']"""
        return self.sample(p_next, generator)


class PerRowSampling(SampledRounds):
    """One generator per row: a row's draws never depend on its neighbours', whatever the batch does.

    The forwards stay batched; every draw (`torch.multinomial`) and the acceptance scan run per row, on that
    row's own stream, seeded from the call's generator in row order."""

    name = "PERROW_SAMPLING"

    def streams(self, generator: torch.Generator, batch: int) -> list[torch.Generator]:
        seeds = torch.randint(2**62, (batch,), generator=generator)
        return [torch.Generator().manual_seed(int(s)) for s in seeds]

    def draw_plain(self, p: torch.Tensor, state: BatchState, rng: Any) -> torch.Tensor:
        return torch.stack([self.draw(p[b], rng[row]) for b, row in enumerate(state.rows.tolist())])

    def propose_token(self, logits: torch.Tensor, q: torch.Tensor, state: BatchState, rng: Any) -> torch.Tensor:
        return torch.stack([self.draw(q[b], rng[row]) for b, row in enumerate(state.rows.tolist())])

    def settle(
        self, drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor, state: BatchState, rng: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        verdicts = [self.settle_row(drafts[b], p[b], q[b], rng[row]) for b, row in enumerate(state.rows.tolist())]
        accepted, token = zip(*verdicts)
        return torch.tensor(accepted), torch.stack(token)

    @staticmethod
    def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """x ~ probs (unnormalised is fine). [V] -> [] long"""
        return torch.multinomial(probs, 1, generator=generator)[0]

    def settle_row(
        self, drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator
    ) -> tuple[int, torch.Tensor]:
        """One row's scan: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
        draw from max(0, p_i - q_i) (multinomial normalises), after all K from p_{K+1}. drafts [K], p, q [K + 1, V]"""
        for i, d in enumerate(drafts.tolist()):
            if not float(torch.rand((), generator=generator, dtype=torch.float64)) * q[i, d] < p[i, d]:
                left = (p[i] - q[i]).clamp(min=0)  # its mass is the rejection's probability: > 0 here
                return i, self.draw(left if bool(left.sum() > 0) else p[i], generator)
        k = drafts.numel()
        return k, self.draw(p[k], generator)


@dataclass
class NoiseTape:
    """GumbelSpec's randomness: the generator, and the Gumbel noise of the drafts proposed this round."""

    generator: torch.Generator
    round: list[torch.Tensor] = field(default_factory=list)  # [B, V] per draft slot

    def gumbel(self, shape: tuple[int, ...]) -> torch.Tensor:
        """g = -log(-log u), u ~ U(0, 1) (u = 0 nudged up: g stays finite). float64"""
        u = torch.rand(shape, generator=self.generator, dtype=torch.float64)
        return -torch.log(-torch.log(u.clamp(min=torch.finfo(torch.float64).tiny)))


class GumbelSpec(SampledRounds):
    """A coupled Gumbel-max verifier: draft and target share one noise vector per position.

    Gumbel-max: argmax_x (log p(x) + g(x)), g i.i.d. Gumbel, is an exact sample of p (log 0 = -inf: a
    filtered token is never the argmax). At draft slot i one g_i gives d_i = argmax(log q_i + g_i) (a sample
    of q) and y_i = argmax(log p_i + g_i) (a sample of p given the same prefix). Accept while d_i == y_i; at
    the first mismatch emit y_i; after K agreements the bonus is argmax(log p_{K+1} + g') with fresh g'.
    Lossless: every emitted token is some y_i, whose g_i is independent of everything before it; the shared
    noise only makes agreement likely."""

    name = "GUMBEL_SPEC"

    def streams(self, generator: torch.Generator, batch: int) -> NoiseTape:
        return NoiseTape(generator)

    def draw_plain(self, p: torch.Tensor, state: BatchState, rng: Any) -> torch.Tensor:
        return (p.log() + rng.gumbel(tuple(p.shape)).to(p.device)).argmax(-1)

    def propose_token(self, logits: torch.Tensor, q: torch.Tensor, state: BatchState, rng: Any) -> torch.Tensor:
        """d_i = argmax(log q_i + g_i); g_i kept on the tape for verification."""
        rng.round.append(rng.gumbel(tuple(q.shape)).to(q.device))
        return (q.log() + rng.round[-1]).argmax(-1)

    def settle(
        self, drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor, state: BatchState, rng: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = drafts.shape[1]
        noise = torch.stack(rng.round, dim=1) if k else p.new_zeros(p.shape[0], 0, p.shape[-1])  # [B, K, V]
        rng.round.clear()
        y = (p[:, :k].log() + noise).argmax(-1)  # [B, K]: the target's sample at each draft slot
        accepted = accepted_prefix(drafts == y)  # [B]
        bonus = self.draw_plain(p[:, k], state, rng)  # [B], fresh noise
        token = torch.cat([y, bonus[:, None]], dim=1).gather(1, accepted[:, None])[:, 0]
        return accepted, token


class EqualitySpec(SampledRounds):
    """Accept while the draft equals a target sample, and emit that sample at the first mismatch.

    At every slot i of a round y_i ~ p_i is drawn independently of the draft; d_i is accepted iff d_i == y_i,
    so the committed tokens are always y_1 .. y_{a+1} (y_{K+1} the bonus): each a sample of p given its own
    prefix. Lossless whatever the drafts are; it accepts less often than rejection sampling (sum p q <=
    sum min(p, q))."""

    name = "EQUALITY_SPEC"

    def draw_plain(self, p: torch.Tensor, state: BatchState, rng: Any) -> torch.Tensor:
        return torch.multinomial(p, 1, generator=rng)[:, 0]

    def propose_token(self, logits: torch.Tensor, q: torch.Tensor, state: BatchState, rng: Any) -> torch.Tensor:
        return torch.multinomial(q, 1, generator=rng)[:, 0]

    def settle(
        self, drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor, state: BatchState, rng: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, slots, vocab = p.shape
        y = torch.multinomial(p.reshape(-1, vocab), 1, generator=rng).view(batch, slots)  # [B, K + 1]
        accepted = accepted_prefix(drafts == y[:, :-1])  # [B]
        return accepted, y.gather(1, accepted[:, None])[:, 0]


def left_pad(rows: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists left-padded to the longest: input_ids and attention_mask, each [B, T]."""
    width = max(map(len, rows))
    ids = torch.tensor([[pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


class RecomputeSampling:
    """Cache-free speculative sampling, the way public example code writes it.

    Each round re-feeds every active row's whole sequence (prompt and committed tokens, left-padded, position
    ids counting real tokens, a fresh cache per call) to the draft K times, growing it by one sampled draft each
    time, and to the target once with all K drafts appended; then standard rejection sampling. Nothing is
    carried between calls but token lists, so there is nothing to realign."""

    name = "RECOMPUTE_SAMPLING"
    samples = True
    max_wait_calls = 0  # every unfinished row is in every target call

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
        sampling = Sampling(temperature, top_k, top_p)
        sequences = [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask)]  # real tokens only
        out: list[list[int]] = [[] for _ in sequences]
        active = torch.arange(len(sequences))
        p = self.forward_probs(target, sequences, pad_token_id, sampling)[:, -1]  # [B, V]
        first = torch.multinomial(p, 1, generator=generator)
        active = self.extend(out, sequences, active, first.tolist(), max_new_tokens, eos_token_id)
        while active.numel():
            rows = [sequences[r] for r in active.tolist()]
            drafts, q = self.draft_block(draft, rows, num_draft_tokens, pad_token_id, sampling, generator)
            p = self.forward_probs(target, [r + d for r, d in zip(rows, drafts.tolist())], pad_token_id, sampling)
            p = p[:, p.shape[1] - num_draft_tokens - 1 :]  # [B, K + 1, V]: p_1 .. p_{K+1}
            accepted, token = self.reject(drafts, p, q, generator)
            new_tokens = [d[:a] + [t] for d, a, t in zip(drafts.tolist(), accepted.tolist(), token.tolist())]
            active = self.extend(out, sequences, active, new_tokens, max_new_tokens, eos_token_id)
        return out

    @staticmethod
    def forward_probs(
        model: torch.nn.Module, rows: list[list[int]], pad_token_id: int, sampling: Sampling
    ) -> torch.Tensor:
        """The processed next-token distribution at every column of a fresh left-padded forward. [B, T, V]"""
        ids, mask = left_pad(rows, pad_token_id)
        logits, _ = call_model(model, ids, mask, left_pad_positions(mask), DynamicCache())
        return target_distribution(logits, sampling)

    def draft_block(
        self,
        draft: torch.nn.Module,
        rows: list[list[int]],
        k: int,
        pad_token_id: int,
        sampling: Sampling,
        generator: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K drafts d_i ~ q_i, each from a full re-feed of the row and the drafts before it: [B, K], q [B, K, V]."""
        drafts, qs = torch.zeros(len(rows), 0, dtype=torch.long), []
        for _ in range(k):
            q = self.forward_probs(draft, [r + d for r, d in zip(rows, drafts.tolist())], pad_token_id, sampling)
            qs.append(q[:, -1])
            drafts = torch.cat([drafts, torch.multinomial(qs[-1], 1, generator=generator)], dim=1)
        return drafts, torch.stack(qs, dim=1) if qs else torch.zeros(len(rows), 0, 0, dtype=torch.float64)

    @staticmethod
    def reject(
        drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Standard rejection sampling: accept d_i while u_i < p_i(d_i) / q_i(d_i); at the first rejection draw
        from norm(max(0, p - q)); after K acceptances from p_{K+1}. drafts [B, K], p [B, K + 1, V], q [B, K, V]"""
        batch, k = drafts.shape
        q = torch.cat([q, torch.zeros_like(p[:, :1])], dim=1) if k else torch.zeros_like(p)  # [B, K + 1, V]
        ratio = p[:, :k].gather(-1, drafts[..., None])[..., 0] / q[:, :k].gather(-1, drafts[..., None])[..., 0]
        accepted = accepted_prefix(torch.rand(batch, k, generator=generator, dtype=torch.float64) < ratio)  # [B]
        left = (at_count(p, accepted) - at_count(q, accepted)).clamp(min=0)  # [B, V]; q_{K+1} = 0: r = p
        left = torch.where(left.sum(-1, keepdim=True) > 0, left, at_count(p, accepted))
        return accepted, torch.multinomial(left, 1, generator=generator)[:, 0]

    @staticmethod
    def extend(
        out: list[list[int]],
        sequences: list[list[int]],
        active: torch.Tensor,
        new_tokens: list[list[int]],
        max_new_tokens: int,
        eos_token_id: int | None,
    ) -> torch.Tensor:
        """Commit each active row's tokens (cut at EOS or the limit) to its output and its sequence; returns
        the rows still active."""
        before = [len(out[r]) for r in active.tolist()]
        finished = EqSpec.commit(out, active, new_tokens, max_new_tokens, eos_token_id)
        for r, n in zip(active.tolist(), before):
            sequences[r].extend(out[r][n:])
        return active[~finished]
