"""`specaudit suite [pytest arguments]`: the installed conformance suite, from any directory.

The same run as `pytest properties/ ...` in a checkout: the arguments go to pytest unchanged
(`--decoder`, `--engine`, `--models`, `-n`, `-x`, `--hypothesis-profile` ...); `--engine`
without `--decoder` runs the engine state machine's property alone. The current directory is
put on the import path, in this process and in xdist workers, so `--decoder mymod:MyDecoder`
finds a module that sits beside the caller.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

USAGE = (
    "usage: specaudit suite --decoder MODULE:ATTR [--models NAMES] [pytest arguments]\n"
    "       specaudit suite --engine MODULE:ATTR [pytest arguments]"
)
ENGINE_PROPERTIES = "test_engines.py"
"""The engine state machine's property: `--engine` without `--decoder` runs it alone."""


def suite_dir() -> Path:
    import specaudit.properties

    return Path(specaudit.properties.__file__).resolve().parent


def names(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def targets(args: list[str]) -> list[str]:
    """What pytest collects: the whole suite, or with `--engine` and no `--decoder` the engine
    property only (the batch properties would audit the reference decoders again)."""
    if names(args, "--engine") and not names(args, "--decoder"):
        return [str(suite_dir() / ENGINE_PROPERTIES)]
    return [str(suite_dir())]


def run_suite(args: list[str]) -> int:
    """pytest's exit status, with its usage error (4) mapped to specaudit's (2)."""
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE + "\n\nRuns the conformance suite shipped with specaudit; see `pytest --help` for the rest.")
        return 0
    import pytest

    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (cwd, os.environ.get("PYTHONPATH")) if p)
    # specaudit is imported already (this CLI): pytest cannot assertion-rewrite its plugin, and need not say so.
    quiet = ["-W", "ignore::pytest.PytestAssertRewriteWarning"]
    code = int(pytest.main([*targets(args), "-p", "no:cacheprovider", *quiet, *args]))
    return 2 if code == int(pytest.ExitCode.USAGE_ERROR) else code
