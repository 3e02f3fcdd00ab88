"""Hypothesis profiles: dev (fast), ci (derandomized, Hypothesis's own ci settings kept), thorough."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
PROFILE_EXAMPLES = {"dev": 15, "ci": 30, "thorough": 300}


def register_profiles() -> None:
    """Idempotent; `ci` inherits Hypothesis's built-in ci profile where it has one."""
    try:
        ci_parent = settings.get_profile("ci")
    except Exception:  # older Hypothesis without a built-in ci profile
        ci_parent = settings.get_profile("default")
    settings.register_profile("dev", max_examples=PROFILE_EXAMPLES["dev"], **_COMMON)
    settings.register_profile(
        "ci", parent=ci_parent, max_examples=PROFILE_EXAMPLES["ci"], derandomize=True, database=None, **_COMMON
    )
    settings.register_profile("thorough", max_examples=PROFILE_EXAMPLES["thorough"], **_COMMON)


def default_profile() -> str:
    return "ci" if os.environ.get("CI") else "dev"
