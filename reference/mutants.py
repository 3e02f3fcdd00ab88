"""Planted bugs: small named variations of EqSpec that the suite must catch. This module is their catalog.

Each is a negative control for a check. `CATALOG` maps name to class, and every entry can be
run with `--decoder specaudit.reference.mutants:NAME` (the class name or its lowercase `name`).
Every class documents the bug class and where it was seen ("—": nowhere in particular), and
carries a `bug: BugInfo` whose `first_check` and `visible_at_batch_1` were measured with the
harness on generated cases (tests/reference/test_mutants.py keeps them honest).

The classes live in `specaudit.reference.planted`, one module per family:
  acceptance    bonus token and acceptance scan
  kv_cache      rejected, cropped, stale or garbage KV entries
  masks         attention masks and padding
  positions     position ids
  bookkeeping   EOS and length
  scale         bugs only the larger generated space reaches (rows, length, dtype, draft, K)
  side_effects  the decoder contract: side effects and unobserved calls
(`info` holds `BugInfo`, `shared` the pieces several families build on.) A class is catalogued by
being written there with its `bug: BugInfo` (`reference.planted.planted`); nothing is listed here.
Reproducers name them here, so this module exports every class and every lowercase name.

Checks run in the registry's order for a decoder (`specaudit.checks.registry.order_for(DECODER)`:
contract, I1, I2, equivalence, token-preservation, liveness, grouped-no-realignment,
order-independence; `paged` judges only a paged engine's trace); `first_check` is the first of
those that reports a violation on the shrunk failing case.

Signatures (decided on the shrunk case, `specaudit.checks.registry.decided`):
  position-id        wrong position ids, slots written at wrong positions (I2 position rule), or
                     a row's logits read at a pad column (a misaligned batch)
  kv-drift           a stale, pad, garbage or rejected entry attended, in a batch of >= 2 rows
  bonus              wrong even at batch size 1: a wrong token choice, or (a shrunk case of one
                     row) an entry attended wrongly with no batch to drift across
  output-equivalent  output unchanged; only token preservation or an invariant catches it
  bookkeeping        EOS, length or row-order errors in the output
"""

from __future__ import annotations

from specaudit.reference.eqspec import EqSpec
from specaudit.reference.planted import planted
from specaudit.reference.planted.info import BugInfo as BugInfo
from specaudit.reference.planted.shared import mask_in_place as mask_in_place
from specaudit.reference.planted.side_effects import forward_directly as forward_directly

CATALOG: dict[str, type[EqSpec]] = planted(BugInfo)
globals().update(CATALOG)  # the lowercase names: `specaudit.reference.mutants:rejected_kv_attended`
globals().update({cls.__name__: cls for cls in CATALOG.values()})  # and the class names
