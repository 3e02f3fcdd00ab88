"""The checks: every check of the registry, the row binding they share, the diagnosis.

Each check reads evidence (a Run, an engine session, a black box's answers, a paged trace) and
returns Violation records; nothing here prints or asserts. pytest, the CLI and delta debugging
call these same functions.

Rounds are counted in target calls: "target call c" is the decoder's c-th call of the target
(call 0 is usually the prefill, call c >= 1 the verification of round c).

  registry      the one list of checks: order, subjects, rules, signatures, when not applicable
  contract      the decoder contract as a check (a broken contract leaves the rest not applicable)
  i1            rectangular alignment of every target call
  i2            each row attends exactly its request's tokens at positions 0, 1, 2, ...
  observe       reading one target call: each row's attended stream, round boundaries
  kv            a real model's attended K/V against a batch-size-1 run
  rows          which request each batch row holds, followed by construction (RowView)
  equivalence   tokens, length and stop reason against the batch-size-1 oracle
  preservation  each round keeps exactly the drafts the scripted draft proposed and the schedule allows
  liveness      every request finishes and waits no longer than declared (decoders and engines)
  scheduling    grouped batches need no realignment; order independence
  paged         the variable-length paged layout of an in-process engine (vLLM)
  engine        the engine checks after every step of an engine session
  coverage      what a verdict exercised (not a check: it never fails)
  diagnosis     a failing run's first violation, its place and its signature
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
