"""Judging a low-precision run (the CPU defaults, bf16 compute and a u8 KV cache) so that numerics
are told apart from synchronization.

At bf16/u8 even OpenVINO's non-speculative pipeline differs from the float64 oracle, so a
speculative output that differs from the oracle is not yet a failure. Each such request is judged
against the control: the same workload through OpenVINO's own batched non-speculative pipeline at
the same precision, same budget and prefix caching.

- equal to the control (as far as both go): numerics, the precision's own drift, not a failure;
- different from the control too, but departing from the oracle no earlier than the control
  does: numerics (past the control's own departure the precision has already left the oracle's
  trajectory, and the output level judges no further, as at f32);
- departing earlier than the control (or where the control keeps the oracle's tokens): the
  departing token must be a near-tie, its float64 gap (the target's top logit minus the token's,
  on the oracle's prefix) at most the noise floor: numerics (the verify forward rounded the other
  way). Beyond it: a failure, `equivalence: beyond-precision-noise`, naming the request, the index,
  the gap, the floor and what the control did.

The control is held to the same floor: where it departs from the oracle on a token beyond the
floor, its departure is no numerics either, and the request fails (a defect common to both
pipelines is not hidden by the comparison). `FLOOR` is calibrated: about twice the largest gap
of the non-speculative control's tokens measured at bf16/u8.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from specaudit.adapters.openvino.engine import F32_HINTS
from specaudit.checks.registry import FAIL, PASS, CheckOutcome
from specaudit.contracts.violation import Violation

CPU_DEFAULTS = (("INFERENCE_PRECISION_HINT", "bf16"), ("KV_CACHE_PRECISION", "u8"))
"""OpenVINO's defaults on this CPU, set explicitly so a run does not depend on the machine."""
FLOOR = 1.0
"""Logit units: about twice the largest gap of the non-speculative control's tokens at
bf16/u8 measured over 20 runs (0.56; bench/results/openvino_audit.md). A wrong token drawn at
random is 14.5 below the top on the tiny Llama (median; 10th percentile 8.4), so it is caught;
a flip to the second-best token (median gap 0.94) may not be: weaker evidence than f32's."""
RULE = "beyond-precision-noise"
EXPECTED = "the oracle's tokens as far as the control keeps them, or a near-tie within the noise floor where it leaves"


def token_gaps(target: torch.nn.Module, prompt: Sequence[int], tokens: Sequence[int]) -> list[float]:
    """Per emitted token, the float64 target's top logit minus the token's logit on its own prefix
    (one teacher-forced forward): 0 for a greedy choice, small for a near-tie."""
    if not tokens:
        return []
    ids = torch.tensor([list(prompt) + list(tokens)], dtype=torch.long)
    with torch.no_grad():
        logits = target(ids).logits[0, len(prompt) - 1 : -1].to(torch.float64)
    chosen = logits.gather(1, torch.tensor(list(tokens)).unsqueeze(1)).squeeze(1)
    return (logits.max(dim=1).values - chosen).tolist()


@dataclass(frozen=True)
class PrecisionVerdict:
    """Per diverging request: 'equals the control', 'within the noise floor' or a violation."""

    floor: float
    numerics: dict[int, str]
    violations: list[Violation]

    @property
    def explained(self) -> bool:
        return not self.violations


def judge_at_precision(
    target: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    diverged: dict[int, tuple[list[int], int]],
    control: dict[int, tuple[list[int], int | None]],
    label: str,
) -> PrecisionVerdict:
    """`diverged`: per request that differs from the oracle, its speculative tokens and the index
    where they depart from it; `control`: per request, the control's tokens and where they depart
    from the oracle (None: they do not)."""
    floor = FLOOR
    numerics: dict[int, str] = {}
    violations: list[Violation] = []
    for i, (tokens, at) in sorted(diverged.items()):
        theirs, departs = control.get(i, ([], None))
        wrong = None if departs is None else token_gaps(target, prompts[i], theirs[: departs + 1])[departs]
        if wrong is not None and wrong > floor:  # the control's own departure is no near-tie: not numerics
            found = (f"{label}: request {i}'s non-speculative control at the same precision departs from the "
                     f"oracle at index {departs} with token {theirs[departs]}, {wrong:.3g} below the float64 "
                     f"target's top logit, over the noise floor {floor:.3g}")  # fmt: skip
            violations.append(Violation("equivalence", "beyond-precision-noise", found, EXPECTED, request=i))
            continue
        common = min(len(tokens), len(theirs))
        if common and tokens[:common] == theirs[:common]:
            numerics[i] = "equals the control"
            continue
        if departs is not None and at >= departs:
            numerics[i] = f"departs at {at}, the control at {departs}"
            continue
        gap = token_gaps(target, prompts[i], tokens[: at + 1])[at]  # on the oracle's prefix
        if gap <= floor:
            numerics[i] = f"a near-tie at {at} ({gap:.3g} <= floor {floor:.3g})"
            continue
        control_says = "keeps the oracle's" if departs is None else f"departs only at {departs}"
        found = (f"{label}: request {i} departs from the oracle at index {at} with token {tokens[at]}, "
                 f"{gap:.3g} below the float64 target's top logit, over the noise floor {floor:.3g}; the "
                 f"non-speculative control at the same precision {control_says} ({theirs[: at + 1]})")  # fmt: skip
        violations.append(Violation("equivalence", "beyond-precision-noise", found, EXPECTED, request=i))
    return PrecisionVerdict(floor, numerics, violations)


def low_precision(options: Any) -> bool:
    """Whether a configuration runs at other than the f32 hints (so the control judges it)."""
    return dict(options.hints) != F32_HINTS


def at_precision(target: torch.nn.Module, prompts: Sequence[Sequence[int]], result: Any, control: Any,
                 label: str) -> PrecisionVerdict | None:  # fmt: skip
    """A failing low-precision result (`EngineAuditResult`) judged against its control's; None when
    it broke the output contract (no precision explains a contract break)."""
    if result.engine_error is not None or result.errors:
        return None
    diverged = {o.request.id: (list(o.tokens), o.first_divergence) for o in result.outcomes
                if o.violation is not None and o.first_divergence is not None}  # fmt: skip
    if len(diverged) != len(result.diverged):
        return None
    theirs = {o.request.id: (list(o.tokens or ()), o.first_divergence) for o in control.outcomes}
    return judge_at_precision(target, prompts, diverged, theirs, label)


def rejudged(result: Any, verdict: PrecisionVerdict) -> Any:
    """The result with each diverging request's violation replaced by the precision verdict's:
    none where numerics explain it, the precision violation where they do not; the registry's
    equivalence check the same (it decides `passed` too: left as it was, a run numerics explain
    failed with no violation, and the search took its first violation from an empty list)."""
    by_request = {v.request: v for v in verdict.violations}
    outcomes = tuple(replace(o, violation=by_request.get(o.request.id)) if o.violation is not None else o
                     for o in result.outcomes)  # fmt: skip
    evaluation = result.evaluation
    if evaluation is not None:
        equivalence = CheckOutcome("equivalence", FAIL if verdict.violations else PASS, tuple(verdict.violations))
        checks = tuple(equivalence if c.check == "equivalence" else c for c in evaluation.outcomes)
        evaluation = replace(evaluation, outcomes=checks)
    return replace(result, outcomes=outcomes, evaluation=evaluation)
