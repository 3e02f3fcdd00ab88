"""The checks: every check of the registry, the row binding they share, the diagnosis.

Each check reads evidence (a Run, an engine step, a black box's answers, a paged engine's run)
and returns Violation records; nothing here prints or asserts. Every subject's judge calls
`registry.evaluate(subject, evidence)`, which runs each check's implementation for that subject;
pytest, the CLI and delta debugging call these same functions.

Rounds are counted in target calls: "target call c" is the decoder's c-th call of the target
(call 0 is usually the prefill, call c >= 1 the verification of round c).

  registry      the one list of checks: order, implementation per subject, rules, signatures, caches,
                when not applicable; `evaluate(subject, evidence)`
  cache         what a check computes once per decoder run, in the slots its entry declares
  contract      the decoder contract as a check (a broken contract leaves the rest not applicable)
  i1            rectangular alignment of every target call
  i2            each row attends exactly its request's tokens at positions 0, 1, 2, ...
  observe       reading one target call: each row's attended stream, round boundaries
  kv            a real model's attended K/V against a batch-size-1 run
  rows          which request each batch row holds, followed by construction (RowView)
  agreement     the tie-aware comparison of a request with its oracle (every subject's)
  equivalence   tokens, length and stop reason against the batch-size-1 oracle
  outputs       contract, equivalence and liveness over a record (black boxes, paged engines)
  preservation  each round keeps exactly the drafts the scripted draft proposed and the schedule allows
  liveness      every request finishes and waits no longer than declared (decoders and engines)
  scheduling    grouped batches need no realignment; order independence
  paged         the variable-length paged layout of a paged engine (vLLM, transformers' continuous batching)
  engine_step   an engine step as evidence, and the checks' implementations for it
  engine        the engine judge: a session's evidence judged after every step
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
