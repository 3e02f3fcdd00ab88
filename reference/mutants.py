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
(`info` holds `BugInfo`, `shared` the pieces several families build on.) Old reproducers name
them here, so this module re-exports every class and every lowercase name.

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
from specaudit.reference.planted.acceptance import (
    AcceptanceOneShort,
    BonusFromDraft,
    CropToShortest,
    FirstMismatchAccepted,
    LogitsShiftedByOne,
    NoBonusToken,
)
from specaudit.reference.planted.bookkeeping import EosScansPaddedRow, MaxNewTokensOverrun
from specaudit.reference.planted.info import BugInfo as BugInfo
from specaudit.reference.planted.kv_cache import (
    CacheRowsPermuted,
    DraftCacheNotRolledBack,
    KvCroppedToMinAcceptance,
    RealignOffByOne,
    RejectedKvAttended,
    RejectedKvMaskedNoPositionIds,
    UninitialisedPadSlots,
)
from specaudit.reference.planted.masks import (
    DraftWithoutMask,
    MaskNotUpdatedAfterRepad,
    PadsAccumulate,
    PadsAttended,
    RightPadding,
)
from specaudit.reference.planted.positions import BatchUniformCacheOffset, PositionsFromArange, VerifyPositionOffByOne
from specaudit.reference.planted.scale import (
    BonusWindowOfThree,
    MatchesAfterRejectionAccepted,
    PositionsInModelDtype,
    PositionsWrapAt256,
    RowBufferOf16,
)
from specaudit.reference.planted.shared import mask_in_place as mask_in_place
from specaudit.reference.planted.side_effects import ForwardBypass, MutatesInputs, MutatesModel
from specaudit.reference.planted.side_effects import forward_directly as forward_directly

CATALOG: dict[str, type[EqSpec]] = {
    cls.name: cls
    for cls in (
        BonusFromDraft,
        FirstMismatchAccepted,
        RejectedKvAttended,
        RejectedKvMaskedNoPositionIds,
        PositionsFromArange,
        VerifyPositionOffByOne,
        MaskNotUpdatedAfterRepad,
        PadsAttended,
        PadsAccumulate,
        KvCroppedToMinAcceptance,
        RealignOffByOne,
        NoBonusToken,
        LogitsShiftedByOne,
        RightPadding,
        DraftCacheNotRolledBack,
        AcceptanceOneShort,
        CacheRowsPermuted,
        UninitialisedPadSlots,
        BatchUniformCacheOffset,
        EosScansPaddedRow,
        MaxNewTokensOverrun,
        DraftWithoutMask,
        CropToShortest,
        RowBufferOf16,
        PositionsWrapAt256,
        PositionsInModelDtype,
        MatchesAfterRejectionAccepted,
        BonusWindowOfThree,
    )
}
CATALOG.update({cls.name: cls for cls in (ForwardBypass, MutatesInputs, MutatesModel)})
globals().update(CATALOG)  # the lowercase names too: `specaudit.reference.mutants:rejected_kv_attended`
