"""What a failing property leaves on its pytest item for the plugin (torch-free: the plugin imports it at start-up)."""

from __future__ import annotations

import pytest

FAILURE = pytest.StashKey[dict]()
"""The key of a failing property's record on its item: a decoder's `failure_record` or an engine's
`engine_failure_record`; the last one noted is the shrunk one (Hypothesis replays it last)."""
