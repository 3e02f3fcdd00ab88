"""Known defects of transformers CB itself (5.24): reported with their reproducers, not fatal.

An audit that failed on every run of `generate(cache_implementation="paged")` would hide new
failures behind old ones, so a failure whose every violation one of these explains (same entry
point, check and rule, on a workload it applies to) is counted as known instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specaudit.adapters.transformers_cb.verdict import CbVerdict
from specaudit.adapters.transformers_cb.workload import CbWorkload


@dataclass(frozen=True)
class KnownDefect:
    """A failure transformers' own code causes, matched by entry point, check and rule on the
    workloads it applies to; `reproducer` is a minimal script that shows it."""

    name: str
    entry: str
    check: str
    rule: str
    applies: Callable[[CbWorkload], bool]
    reproducer: str


KNOWN_DEFECTS: tuple[KnownDefect, ...] = (
    KnownDefect(
        "generate-paged-ragged-eos",
        "generate",
        "contract",
        "generate-returns",
        lambda w: w.eos_token_id is not None,
        "model.generate(input_ids=torch.tensor([[1, 2, 3], [17, 18, 19]]), cache_implementation='paged', "
        "max_new_tokens=12, do_sample=False, eos_token_id=38) raises ValueError ('expected sequence of length "
        "7 at dim 1 (got 9)'): when rows stop at EOS at different lengths, generate builds its [1, B, L] "
        "result with torch.tensor over ragged lists (generation/utils.py, the cache_implementation == 'paged' "
        "branch); generate_batch returns the same requests correctly",
    ),
    KnownDefect(
        "generate-paged-ignores-attention-mask",
        "generate",
        "equivalence",
        "first-divergence",
        lambda w: len({len(r.prompt) for r in w.requests}) > 1,
        "model.generate(input_ids=torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]]), attention_mask="
        "torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]), cache_implementation='paged', max_new_tokens=5, "
        "do_sample=False, pad_token_id=0) gives row 0 ... 74, 6 where generate() without "
        "cache_implementation (and greedy on [5, 6, 7] alone) gives ... 74, 26: the paged branch passes "
        "input_ids.tolist() to generate_batch and drops attention_mask, so left pads are prefilled as tokens",
    ),
)


def known_defects(verdict: CbVerdict) -> tuple[str, ...]:
    """The known defects that explain every violation of a failing verdict (() if one is unexplained)."""
    w, names = verdict.run.workload, set()
    for v in verdict.violations:
        hits = [
            d.name for d in KNOWN_DEFECTS if (d.entry, d.check, d.rule) == (w.entry, v.check, v.rule) and d.applies(w)
        ]
        if not hits:
            return ()
        names.update(hits)
    return tuple(sorted(names))
