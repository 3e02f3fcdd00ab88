"""Goodness of fit for sampled tokens against exact distributions, with stated error rates.

Every sampled token x_t comes with the exact target distribution p_t it should have been drawn
from (given its row's own prefix). Its randomized probability integral transform

    u_t = F_t(x_t-) + U_t p_t(x_t),   F_t(x-) = sum of p_t(y) over the tokens y ordered before x

(tokens ordered by descending p_t, ties by id; U_t uniform from a seeded stream) is exactly
Uniform(0, 1) and independent of everything before it when x_t ~ p_t, whatever p_t is. So the
tokens of a lossless sampler, pooled over rows, positions and runs, give i.i.d. uniforms, and
their empirical CDF is held to the diagonal by the Dvoretzky-Kiefer-Wolfowitz inequality
(Massart's constant), valid for every n, no asymptotics:

    P( sup_s |F_n(s) - s| > eps ) <= 2 exp(-2 n eps^2),   eps(n, a) = sqrt(ln(2 / a) / (2 n)).

A verdict rejects when the KS distance D_n exceeds eps(n, a): its false-alarm probability is at
most a. Its power, by the same bound: a sampler whose PIT law is at KS distance delta from the
uniform is rejected with probability >= 1 - b once delta >= eps(n, a) + eps(n, b). Moving mass
delta between the likelier and the less likely tokens of p (a bias toward the modes, a lost or
added tail: what sampler bugs do) puts the PIT law at KS distance delta, so that sum is the
smallest total-variation shift of that kind the run detects (`detectable_shift`).

Correlated rows are tested by collisions (`collision_evalue`): two rows with identical histories
emit the same token with probability c = sum_x p(x)^2 when independent; a test martingale
prod (1 + l (X_i - c_i)), averaged over a few bets l, exceeds 1/a with probability <= a (Ville).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

ALPHA = 1e-6
"""The family-wise false-alarm probability of one sampling verdict (every test of it together)."""
POWER = 0.95
"""The detection probability at which `detectable_shift` is stated."""


def randomized_pit(probs: torch.Tensor, tokens: torch.Tensor, uniforms: torch.Tensor) -> np.ndarray:
    """u [n] of tokens [n] under probs [n, V] (float64), tokens ordered by descending probability."""
    order = torch.sort(probs, dim=-1, descending=True, stable=True)  # ties keep id order
    rank = torch.argsort(order.indices, dim=-1, stable=True)  # [n, V] rank of each token id
    cdf = order.values.cumsum(-1) - order.values  # [n, V] mass strictly before each rank
    r = rank.gather(1, tokens[:, None])[:, 0]  # [n]
    below = cdf.gather(1, r[:, None])[:, 0]
    mass = probs.gather(1, tokens[:, None])[:, 0]
    return (below + uniforms.double() * mass).clamp(0, 1).numpy()


def pit_uniforms(n: int, *key: object) -> torch.Tensor:
    """[n] float64 the randomized PIT's uniforms, seeded by `key` alone, so a verdict replays."""
    seed = zlib.crc32(":".join(["pit", *map(str, key)]).encode())
    return torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def threshold(n: int, alpha: float) -> float:
    """eps(n, alpha): the KS distance a sample of n uniforms exceeds with probability <= alpha."""
    return math.sqrt(math.log(2 / alpha) / (2 * n)) if n else math.inf


def detectable_shift(n: int, alpha: float, power: float = POWER) -> float:
    """The smallest KS (rank-ordered total-variation) shift detected with probability >= power."""
    return threshold(n, alpha) + threshold(n, 1 - power) if n else math.inf


@dataclass(frozen=True)
class Fit:
    """One KS test of pooled PIT values against the uniform."""

    n: int
    distance: float  # D_n = sup |F_n(s) - s|
    at: float  # the s where it is reached
    below: float  # F_n(s) there: the share of tokens at or above p's top mass s
    alpha: float  # the false-alarm probability this test was given
    bound: float  # eps(n, alpha)
    shift: float  # detectable_shift(n, alpha)

    @property
    def rejects(self) -> bool:
        return self.n > 0 and self.distance > self.bound

    @property
    def p_bound(self) -> float:
        """An upper bound on the p-value: 2 exp(-2 n D^2) (1 when nothing was sampled)."""
        return min(1.0, 2 * math.exp(-2 * self.n * self.distance**2)) if self.n else 1.0

    @property
    def direction(self) -> str:
        """Which way the mass moved: toward p's likeliest tokens, or away from them."""
        return "too many of p's likelier tokens" if self.below > self.at else "too few of p's likelier tokens"


def ks_fit(u: Sequence[float] | np.ndarray, alpha: float) -> Fit:
    """The KS distance of `u` from Uniform(0, 1), tested at false-alarm probability `alpha`."""
    values = np.sort(np.asarray(u, dtype=np.float64))
    n = len(values)
    if not n:
        return Fit(0, 0.0, 0.0, 0.0, alpha, math.inf, math.inf)
    upper = np.arange(1, n + 1) / n - values  # F_n(s) - s just after each point
    lower = values - np.arange(n) / n  # s - F_n(s-) just before
    i, j = int(upper.argmax()), int(lower.argmax())
    if upper[i] >= lower[j]:
        distance, at, below = float(upper[i]), float(values[i]), (i + 1) / n
    else:
        distance, at, below = float(lower[j]), float(values[j]), j / n
    return Fit(n, distance, at, below, alpha, threshold(n, alpha), detectable_shift(n, alpha))


BETS = (0.25, 0.5, 1.0)
"""The bets averaged in the collision martingale: a small one for mild correlation, 1 for rows that copy."""


def collision_evalue(collided: Sequence[bool], chances: Sequence[float]) -> float:
    """The test martingale's value after each (indicator, chance) pair, averaged over BETS.

    Each factor 1 + l (X - c) has mean 1 when P(X = 1) = c given the past, and stays > 0 for
    l <= 1, so the average is a nonnegative martingale with mean 1 under independence."""
    logs = np.zeros(len(BETS))
    for x, c in zip(collided, chances):
        logs += np.log1p(np.array(BETS) * (float(x) - c))
    top = logs.max()
    return float(math.exp(top) * np.exp(logs - top).mean()) if len(collided) else 1.0
