"""Planted bugs in speculative *sampling*: a wrong distribution somewhere in the rejection step.

Greedy output cannot see any of these: each is a small subclass of `SpecSampling` overriding one of its hooks
(its docstring names the hook), and each emits tokens that are not distributed as p, the target's distribution
after temperature, top-k and top-p (or, for `SharedUniforms`, rows that are not independent samples). Roles are
the token roles a sampled run's tokens are grouped by (`checks.roles`): "plain" (the first token after the
prefill, no draft), "draft" (a token where a draft was verified: the accepted draft or the token drawn after
rejecting it) and "bonus" (the token after K accepted drafts). `SamplingBug.role` names the role a bug corrupts
(most, where it shifts several).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from specaudit.contracts.sampling import Sampling, target_distribution
from specaudit.reference.eqspec import BatchState
from specaudit.reference.sampling import SpecSampling, inverse_cdf


@dataclass(frozen=True)
class SamplingBug:
    description: str  # the bug class, in a few words
    seen_in: str  # "public trackers" or "—"
    role: str  # the token role it corrupts: "plain", "draft" or "bonus"
    check: str  # what catches it: "distribution" or "row-independence"
    needs_batch: bool  # True if it shows only with >= 2 rows


class BonusFromDraft(SpecSampling):
    """Bonus token drawn from the draft's q instead of the target's p (—; the sampling form of DSD's greedy bug).

    Hook: `draw_bonus`. The draft's q after d_K is at hand from its extra step, and looks like the right thing.
    """

    name = "sampled_bonus_from_draft"
    bug = SamplingBug("bonus token drawn from the draft's distribution", "—", "bonus", "distribution", False)

    def draw_bonus(self, p_next: torch.Tensor, q_next: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.sample(q_next, generator)


class ResidualNoClamp(SpecSampling):
    """Residual |p - q| normalised, abs where max(0, .) was meant (—).

    Hook: `residual`. Tokens the draft over-proposed (q > p) get residual mass again.
    """

    name = "residual_no_clamp"
    bug = SamplingBug("residual |p - q| instead of max(0, p - q)", "—", "draft", "distribution", False)

    @staticmethod
    def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        r = (p - q).abs()
        return r / r.sum(-1, keepdim=True)


class ResidualNotRenormalised(SpecSampling):
    """Residual max(0, p - q) sampled without renormalising (—).

    Hook: `draw_residual`. Inverse CDF `(u < cumsum(r)).int().argmax()` with u ~ U(0, 1): when u exceeds
    sum(r) (the total variation, < 1) no entry is True and argmax falls back to token 0, whatever its p
    (often 0 under top-k or top-p).
    """

    name = "residual_not_renormalised"
    bug = SamplingBug("residual max(0, p - q) not renormalised", "—", "draft", "distribution", False)

    def draw_residual(self, p_at: torch.Tensor, q_at: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        r = (p_at - q_at).clamp(min=0)  # [B', V], sums to the total variation
        u = self.uniforms(r.shape[0], 1, generator).to(r.device)  # [B', 1]
        return (u < r.cumsum(-1)).int().argmax(-1)


class AcceptanceInverted(SpecSampling):
    """Acceptance probability min(1, q/p) instead of min(1, p/q) (—).

    Hook: `accept_sampled`. Drafts the draft over-proposes are accepted more, the target's favourites less.
    """

    name = "acceptance_inverted"
    bug = SamplingBug("acceptance ratio inverted: min(1, q/p)", "—", "draft", "distribution", False)

    @staticmethod
    def accept_sampled(drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        p_d = p.gather(-1, drafts[..., None])[..., 0]  # [B, K]
        q_d = q.gather(-1, drafts[..., None])[..., 0]  # [B, K]
        return (u * p_d < q_d).long().cumprod(dim=1).sum(dim=1)


class TemperatureDraftOnly(SpecSampling):
    """Temperature applied to the draft only: the target's p taken at temperature 1 (public trackers).

    Hook: `target_probs`. Rejection sampling then reproduces the wrong p exactly: every role shifts, the plain
    step too; most tokens are draft-role ones.
    """

    name = "temperature_draft_only"
    bug = SamplingBug("temperature applied to the draft only", "public trackers", "draft", "distribution", False)

    def target_probs(self, logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        return target_distribution(logits, replace(sampling, temperature=1.0))


class TopKDraftOnly(SpecSampling):
    """Top-k and top-p applied to the draft only: the target's p untruncated (public trackers).

    Hook: `target_probs`. Tokens outside the target's top-k or top-p come out (p = 0 under the settings).
    """

    name = "top_k_draft_only"
    bug = SamplingBug("top-k and top-p applied to the draft only", "public trackers", "draft", "distribution", False)

    def target_probs(self, logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        return target_distribution(logits, Sampling(sampling.temperature))


class EqualityFreshSample(SpecSampling):
    """Accept while the draft equals a target sample y_i, then emit a *fresh* sample of p at the mismatch (—).

    Hooks: `accept_sampled` (y_i drawn by inverse CDF of the slot's uniform) and `residual` (returns p: the
    fresh draw). EqualitySpec emits y_i itself; a fresh draw makes P(x) = q(x) p(x) + (1 - sum q p) p(x),
    biased toward the tokens the draft favours.
    """

    name = "equality_fresh_sample"
    bug = SamplingBug("equality acceptance, fresh target sample at the mismatch", "—", "draft", "distribution", False)

    @staticmethod
    def accept_sampled(drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        batch, k, vocab = p.shape
        y = inverse_cdf(p.reshape(-1, vocab), u.reshape(-1)).view(batch, k)  # [B, K]: y_i ~ p_i
        return (drafts == y).long().cumprod(dim=1).sum(dim=1)

    @staticmethod
    def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return p


class ProposalMismatch(SpecSampling):
    """Drafts drawn from the draft's raw distribution (temperature 1, no top-k or top-p) while the acceptance
    ratio and the residual use the processed q (public trackers: a q returned that the drafts were not drawn from).

    Hook: `propose_token`.
    """

    name = "proposal_mismatch"
    bug = SamplingBug(
        "drafts drawn from a distribution other than the q in the ratio", "public trackers", "draft", "distribution",
        False,
    )  # fmt: skip

    def propose_token(self, logits: torch.Tensor, q: torch.Tensor, state: BatchState, rng: Any) -> torch.Tensor:
        return self.sample(torch.softmax(logits.double(), dim=-1), rng)


class ResampleFromP(SpecSampling):
    """At a rejection the token is drawn from p instead of the residual norm(max(0, p - q)) (—).

    Hook: `residual`. Tokens both models like are emitted too often (accepted, and drawn again after a rejection).
    """

    name = "resample_from_p"
    bug = SamplingBug("token after a rejection drawn from p, not the residual", "—", "draft", "distribution", False)

    @staticmethod
    def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return p


class SharedUniforms(SpecSampling):
    """One uniform per draw shared by every row of the batch (public trackers: requests sharing one RNG stream).

    Hook: `uniforms`. Every draw (first token, proposal, acceptance, residual, bonus) is an inverse CDF of it,
    so rows with identical histories emit identical tokens; each row alone is still distributed as p.
    """

    name = "shared_uniforms"
    bug = SamplingBug("one random stream shared by every row", "public trackers", "plain", "row-independence", True)

    def uniforms(self, batch: int, k: int, generator: torch.Generator) -> torch.Tensor:
        return torch.rand(1, k, generator=generator, dtype=torch.float64).expand(batch, k)


class NeighbourResidualAfterRagged(SpecSampling):
    """After a ragged round (rows accepted different counts), row b draws its residual or bonus from row
    (b + 1) % B's distributions: an index computed for the rectangular batch, off by one row (—).

    Hook: `next_distributions`. Invisible at batch size 1 and in rounds where every row accepted alike.
    """

    name = "neighbour_residual_after_ragged"
    bug = SamplingBug("residual or bonus drawn from the next row's distribution after a ragged round", "—", "draft",
                      "distribution", True)  # fmt: skip

    @staticmethod
    def next_distributions(
        p: torch.Tensor, q: torch.Tensor, accepted: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        p_at, q_at = SpecSampling.next_distributions(p, q, accepted)  # [B, V] each
        if bool((accepted != accepted[0]).any()):
            return p_at.roll(-1, dims=0), q_at.roll(-1, dims=0)
        return p_at, q_at


class BonusMixture(SpecSampling):
    """Bonus drawn from (1 - e) p + e q: the dial, a bonus bug of any size e in [0, 1] (—).

    Hook: `draw_bonus`. e = 0 is correct and e = 1 is `BonusFromDraft`; `sampling_mutants.bonus_mixture(e)`
    makes the class for one e, so the oracle's power can be measured against the size of the shift.
    """

    e = 0.5
    name = "bonus_mixture_0.5"
    bug = SamplingBug("bonus drawn from a mixture (1 - e) p + e q", "—", "bonus", "distribution", False)

    def draw_bonus(self, p_next: torch.Tensor, q_next: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.sample((1 - self.e) * p_next + self.e * q_next, generator)
