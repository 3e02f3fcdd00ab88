"""The exit statuses of the `specaudit` command (and of `specaudit.main`): what a CI job gates on.

Every command returns one of these; `specaudit suite` returns pytest's own status, except that
pytest's usage error (4) is reported as EXIT_USAGE, so a gate tells a broken invocation from a
failing decoder with one test in every command.
"""

from __future__ import annotations

from typing import Final

EXIT_PASS: Final = 0
"""Every check passed, or failed only as a listed known failure (`--xfails`)."""

EXIT_FAIL: Final = 1
"""A check failed: a decoder, engine or server is wrong (or a planted bug was missed)."""

EXIT_USAGE: Final = 2
"""The invocation is wrong (a bad option, an unloadable `--decoder`, a malformed file): one line on stderr."""
