"""specaudit's own Hypothesis profiles, prefixed so no user profile is overridden.

`specaudit-dev` (fast), `specaudit-ci` (derandomized, Hypothesis's own ci settings kept) and
`specaudit-thorough`. Registered and loaded by the conformance suite's conftest only, which also
gives each decoder x model parametrization its own seed under `specaudit-ci` (derandomize alone
would draw the same cases for all of them) and its conformance properties `suite_examples()`.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
PROFILE_EXAMPLES = {"specaudit-dev": 15, "specaudit-ci": 30, "specaudit-thorough": 300}
"""Each profile's max_examples: what a property that draws alone (the engine state machine) runs."""
SUITE_EXAMPLES = {"specaudit-dev": 15, "specaudit-ci": 240, "specaudit-thorough": 2400}
"""Distinct cases per decoder on the transparent model for the eight conformance properties, which
share them (one run judged by eight checks): before they shared, each drew the profile's examples
on its own, 8 x 30 = 240 runs under specaudit-ci; the runs saved went to distinct cases (issue 27,
point 7). The transparent model's space is the widest (up to 64 rows, positions past 500, 64 new
tokens) and a case there is cheap."""
REAL_MODEL_SHARE = 4
"""The tiny real models draw SUITE_EXAMPLES // REAL_MODEL_SHARE distinct cases (60 under
specaudit-ci, twice and more what their properties shared before), never fewer than the profile's
max_examples: their space is smaller (REAL_BOUNDS: at most 20 rows, 24 new tokens) and every case
costs K/V comparisons with batch-size-1 runs; bench/results/suite_coverage.md shows the coverage."""


def register_profiles() -> None:
    """Idempotent; `specaudit-ci` inherits Hypothesis's built-in ci profile where it has one."""
    try:
        ci_parent = settings.get_profile("ci")
    except Exception:  # older Hypothesis without a built-in ci profile
        ci_parent = settings.get_profile("default")
    settings.register_profile("specaudit-dev", max_examples=PROFILE_EXAMPLES["specaudit-dev"], **_COMMON)
    settings.register_profile(
        "specaudit-ci",
        parent=ci_parent,
        max_examples=PROFILE_EXAMPLES["specaudit-ci"],
        derandomize=True,
        database=None,
        **_COMMON,
    )
    settings.register_profile("specaudit-thorough", max_examples=PROFILE_EXAMPLES["specaudit-thorough"], **_COMMON)


def suite_examples(exact: bool = True) -> int:
    """The conformance properties' distinct cases per decoder x model under the loaded profile:
    SUITE_EXAMPLES for specaudit's own profiles (a share of them on a tiny real model, `exact`
    False), the profile's max_examples for any other (a user's, or a test's few)."""
    name = settings.get_current_profile_name()
    if name not in SUITE_EXAMPLES:
        return settings.default.max_examples
    if exact:
        return SUITE_EXAMPLES[name]
    return max(PROFILE_EXAMPLES[name], SUITE_EXAMPLES[name] // REAL_MODEL_SHARE)


def default_profile() -> str:
    return "specaudit-ci" if os.environ.get("CI") else "specaudit-dev"
