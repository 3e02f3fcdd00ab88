"""The checks: I1, I2, equivalence with the oracle, token preservation.

Each check reads a Run and returns evidence (Violation records); nothing here prints or
asserts. pytest, the CLI and delta debugging call these same functions.

Rounds are counted in target calls: "target call c" is the decoder's c-th call of the target
(call 0 is usually the prefill, call c >= 1 the verification of round c).

  rows          which request each batch row holds, followed by construction (RowView)
  i1            rectangular alignment of every target call
  i2            each row attends exactly its request's tokens at positions 0, 1, 2, ...
  equivalence   tokens, length and stop reason against the batch-size-1 oracle
  preservation  each round keeps exactly the drafts the scripted draft's schedule allows
"""

from specaudit.checks.contract import check_contract
from specaudit.checks.equivalence import (
    Equivalence,
    RowEquivalence,
    check_equivalence,
    compare_row,
    equivalence,
    locate,
    stop_reason,
)
from specaudit.checks.i1 import check_i1, i1_call_violations, implied_positions
from specaudit.checks.i2 import check_i2, row_views
from specaudit.checks.preservation import check_token_preservation
from specaudit.checks.rows import Fault, RowTrace, RowView, common_prefix, follow_rows

__all__ = [
    "Equivalence",
    "Fault",
    "RowEquivalence",
    "RowTrace",
    "RowView",
    "check_contract",
    "check_equivalence",
    "check_i1",
    "check_i2",
    "check_token_preservation",
    "common_prefix",
    "compare_row",
    "equivalence",
    "follow_rows",
    "i1_call_violations",
    "implied_positions",
    "locate",
    "row_views",
    "stop_reason",
]
