"""specaudit's own Hypothesis profiles, prefixed so no user profile is overridden.

`specaudit-dev` (fast), `specaudit-ci` (derandomized, Hypothesis's own ci settings kept) and
`specaudit-thorough`. Registered and loaded by the conformance suite's conftest only, which also
gives each decoder x model parametrization its own seed under `specaudit-ci` (derandomize alone
would draw the same cases for all of them).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
PROFILE_EXAMPLES = {"specaudit-dev": 15, "specaudit-ci": 30, "specaudit-thorough": 300}


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


def default_profile() -> str:
    return "specaudit-ci" if os.environ.get("CI") else "specaudit-dev"
