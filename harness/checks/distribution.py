"""Lossless in distribution: a sampling decoder's tokens are the target's own samples.

Every sampled token is scored against the exact target distribution p given its row's own
prefix (`SampledRun.distribution`), pooled over rows, positions and runs, and broken down by
role (`checks.roles`: plain step, a draft's place, the bonus). One verdict is a family of
FAMILY tests sharing the stated false-alarm probability ALPHA (Bonferroni): the pooled fit,
one fit per role, and row independence (`checks.independence`). Certain evidence needs no
test: a token p gives probability 0 (outside top-k or top-p), a row that stops before its
limit without EOS.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from specaudit.checks.i2 import row_views
from specaudit.checks.roles import ROLES, UNKNOWN_ROLE, Role, decisions, roles_of
from specaudit.contracts.violation import Violation
from specaudit.numerics.fit import ALPHA, POWER, Fit, ks_fit, pit_uniforms, randomized_pit
from specaudit.running.sampling import SampledRun

FAMILY = 5
"""The tests of one sampling verdict: pooled fit, one fit per role (3), row independence."""
TEST_ALPHA = ALPHA / FAMILY
UNSEEN = Role(UNKNOWN_ROLE, 0, 0, None, None)
"""The role of a token whose forwards were not seen (a black box's)."""


@dataclass(frozen=True)
class SampledToken:
    """One sampled token, where it is, what p gave it, its PIT value and its role."""

    run: int
    row: int
    index: int
    token: int
    prob: float  # p(token | the row's prefix)
    u: float  # its randomized PIT value
    role: Role


def sampled_tokens(sampled: SampledRun) -> list[SampledToken]:
    """Every sampled token of every run that kept the contract, made once per sampled run."""
    if "tokens" not in sampled.cached:
        found: list[SampledToken] = []
        for i, run in enumerate(sampled.runs):
            if run.outputs is None:
                continue
            sequences = [p + tuple(out) for p, out in zip(run.case.prompts, run.outputs)]
            deciding = decisions(row_views(run)[0], sequences)
            for b, (prompt, out) in enumerate(zip(run.case.prompts, run.outputs)):
                if not out:
                    continue
                p = sampled.distribution(i, b)  # [n, V]
                tokens = torch.tensor(out)
                u = randomized_pit(p, tokens, sampled.uniforms(i, b, len(out)))
                probs = p.gather(1, tokens[:, None])[:, 0].tolist()
                for n, (token, role) in enumerate(zip(out, roles_of(b, len(prompt), out, deciding))):
                    found.append(SampledToken(i, b, n, token, probs[n], float(u[n]), role))
        sampled.cached["tokens"] = found
    return sampled.cached["tokens"]


def fits(sampled: SampledRun) -> dict[str, Fit]:
    """The pooled fit ("all") and each role's, each at TEST_ALPHA: the verdict's power is theirs."""
    return fits_of(sampled_tokens(sampled))


def fits_of(tokens: list[SampledToken]) -> dict[str, Fit]:
    result = {"all": ks_fit([t.u for t in tokens], TEST_ALPHA)}
    for role in ROLES:
        result[role] = ks_fit([t.u for t in tokens if t.role.role == role], TEST_ALPHA)
    return result


def check_distribution(sampled: SampledRun) -> list[Violation]:
    """Impossible tokens and early stops (certain), then each role's fit, then the pooled fit."""
    return early_stops(sampled) + judge_tokens(sampled_tokens(sampled))


def judge_tokens(tokens: list[SampledToken]) -> list[Violation]:
    """The verdict on sampled tokens whatever produced them (a decoder's runs, an engine's or a
    server's answers, whose tokens have no role): impossible tokens, each role's fit, the pooled fit."""
    found = impossible_tokens(tokens)
    tested = fits_of(tokens)
    for role in ROLES:
        if tested[role].rejects:
            found.append(role_violation(role, tested[role], [t for t in tokens if t.role.role == role]))
    if tested["all"].rejects and not any(tested[role].rejects for role in ROLES):
        facts = fit_facts("sampled tokens", tested["all"], tokens[0] if tokens else None)
        found.append(Violation("distribution", "pooled-fit", *facts[:2], evidence=facts[2]))
    return found


def output_tokens(rows: list[tuple[list[int], torch.Tensor]], seed: int) -> list[SampledToken]:
    """Sampled tokens seen at the output level only (a black box): per request its tokens and
    their exact p [n, V], no role. The PIT's uniforms are seeded by `seed` and the request."""
    found = []
    for r, (out, p) in enumerate(rows):
        if not out:
            continue
        tokens = torch.tensor(out)
        u = randomized_pit(p, tokens, pit_uniforms(len(out), seed, r))
        probs = p.gather(1, tokens[:, None])[:, 0].tolist()
        found += [SampledToken(0, r, n, t, probs[n], float(u[n]), UNSEEN) for n, t in enumerate(out)]
    return found


def impossible_tokens(tokens: list[SampledToken], limit: int = 3) -> list[Violation]:
    """Tokens the target's distribution gives probability 0: never sampled by a lossless sampler."""
    zero = [t for t in tokens if t.prob == 0.0]
    return [
        Violation(
            "distribution",
            "impossible-token",
            f"token {t.token} ({role_words(t.role)}) at index {t.index} of {place(t)}, which p gives probability 0",
            "a token p gives a positive probability (the target's distribution after temperature, top-k and top-p)",
            call=t.role.call,
            row=t.role.row,
            request=t.row,
            evidence={**where(t), "impossible": len(zero)},
        )
        for t in zero[:limit]
    ]


def early_stops(sampled: SampledRun) -> list[Violation]:
    """A row that ends before max_new_tokens without EOS: its next token was never drawn."""
    case = sampled.case.case
    found = []
    for i, run in enumerate(sampled.runs):
        for b, out in enumerate(run.outputs or []):
            if len(out) < case.max_new_tokens and (not out or out[-1] != case.eos_token_id):
                found.append(
                    Violation(
                        "distribution",
                        "stops-early",
                        f"run {i} row {b} ending after {len(out)} tokens without EOS",
                        f"{case.max_new_tokens} tokens (max_new_tokens) or an end at EOS",
                        request=b,
                        evidence={"run": i, "request": b, "tokens": len(out)},
                    )
                )
    return found[:3]


def role_violation(role: str, fit: Fit, tokens: list[SampledToken]) -> Violation:
    """A role's fit rejected: the slot (acceptance count) where it is most off, and its first token there."""
    by_slot: dict[int, list[SampledToken]] = defaultdict(list)
    for t in tokens:
        by_slot[t.role.slot].append(t)
    slots = {slot: ks_fit([t.u for t in group], TEST_ALPHA) for slot, group in sorted(by_slot.items())}
    worst = max(slots, key=lambda s: slots[s].distance / slots[s].bound if slots[s].n else 0.0)
    found, expected, evidence = fit_facts(ROLE_WORDS[role], fit, by_slot[worst][0])
    if role != "plain":
        found += f"; most off after {worst} accepted draft(s): {slots[worst].n} tokens at {slots[worst].distance:.3f}"
    slot_facts = {str(s): {"n": f.n, "distance": round(f.distance, 4)} for s, f in slots.items()}
    evidence.update(role=role, slot=worst, slots=slot_facts)
    return Violation("distribution", "role-fit", found, expected, evidence=evidence)  # pooled: no one call or row


def fit_facts(words: str, fit: Fit, first: SampledToken | None) -> tuple[str, str, dict[str, object]]:
    """(found, expected, evidence) of a rejected fit: the distance against its bound, its power, where it leans."""
    found = (
        f"{fit.n} {words} at KS distance {fit.distance:.3f} from the target's p: {fit.direction} "
        f"({fit.below:.0%} of them within p's likeliest {fit.at:.0%} of mass)"
    )
    expected = (
        f"a distance <= {fit.bound:.3f} (false alarm <= {fit.alpha:.0e}; a shift >= {fit.shift:.3f} is "
        f"detected with probability {POWER:.0%})"
    )
    evidence = {"n": fit.n, "distance": fit.distance, "bound": fit.bound, "shift": fit.shift, "alpha": fit.alpha,
                "p_bound": fit.p_bound, **(where(first) if first else {})}  # fmt: skip
    return found, expected, evidence


ROLE_WORDS = {
    "plain": "plain-step tokens (no draft)",
    "draft": "tokens at a draft's place (accepted drafts and draws after a rejection)",
    "bonus": "bonus tokens",
}


def role_words(role: Role) -> str:
    if role.role == "draft":
        return f"{'an accepted draft' if role.accepted else 'drawn after a rejected draft'}, round {role.round}"
    if role.role == "bonus":
        return f"the bonus after {role.slot} accepted draft(s), round {role.round}"
    if role == UNSEEN:
        return "its role unseen: output level"
    return f"a {role.role} step, round {role.round}"


def place(t: SampledToken) -> str:
    """Where a token lies: its run, or at the output level (no forward seen) its request."""
    return f"request {t.row}" if t.role == UNSEEN else f"run {t.run}"


def where(t: SampledToken) -> dict[str, object]:
    return {"run": t.run, "request": t.row, "index": t.index, "token": t.token, "round": t.role.round,
            "token_role": t.role.role, "accepted_before": t.role.slot}  # fmt: skip
