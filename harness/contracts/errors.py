"""The one error type a user's bad input becomes: caught once by the CLI, one line on stderr, exit 2."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input from the user (an unknown model, a malformed file, a decoder that cannot load)."""
