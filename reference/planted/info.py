"""`BugInfo`: what every planted bug records about itself, measured with the harness.

A module of its own, importing nothing of the project, so every family module (and the catalog) can import it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BugInfo:
    bug_class: str  # short description
    seen_in: str  # "DSD", "BSP", "HF defaults", "several" or "—"
    signature: str  # one of SIGNATURES: what specaudit.checks.diagnosis names it
    first_check: str  # first failing check, in the registry's order
    visible_at_batch_1: bool  # True if it fails even with a single row
    needs_padding: bool = False  # at batch size 1 only with extra pad columns: its smallest case may use a 2nd row
    models: tuple[str, ...] = ("transparent",)  # where tests/test_mutants.py searches for it (the first one)
    min_rows: int = 0  # rows its smallest failing case needs; 0: 1 or 2, as visible_at_batch_1 and needs_padding say
    batch_signature: str = ""  # the signature in a batch of >= 2 rows, where it differs: a wrong entry attended
    # is signed bonus on a one-row minimal case (no batch to drift across) and kv-drift in a batch
