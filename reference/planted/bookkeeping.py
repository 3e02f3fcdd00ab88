"""Planted bugs in output bookkeeping: EOS and the length limit.

The models and caches can be exactly right while the tokens handed back are not: an EOS test that scans the
padded input finishes a row too early, and a length limit checked once per round overruns max_new_tokens. The
harness must catch the first by equivalence and the second by the decoder contract, which rejects an output
longer than asked for.
"""

from __future__ import annotations

import torch

from specaudit.reference.eqspec import BatchState, EqSpec
from specaudit.reference.planted.info import BugInfo


class EosScansPaddedRow(EqSpec):
    """The EOS test scans the whole padded row, input included: `(ids == eos).any(-1)` (—).

    A row whose padded input holds the EOS id anywhere (a pad id equal to EOS, or EOS as a
    real prompt token) is finished after its first token.
    """

    name = "eos_scans_padded_row"
    bug = BugInfo("EOS check scans the padded row", "—", "bookkeeping", "equivalence", True, True)

    def prefill(
        self, target: torch.nn.Module, draft: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[BatchState, torch.Tensor]:
        self.padded_input = input_ids  # [B, T], pads included
        return super().prefill(target, draft, input_ids, attention_mask)

    def commit(
        self,
        out: list[list[int]],
        rows: torch.Tensor,
        new_tokens: list[list[int]],
        max_new_tokens: int,
        eos_token_id: int | None,
    ) -> torch.Tensor:
        finished = EqSpec.commit(out, rows, new_tokens, max_new_tokens, eos_token_id)
        if eos_token_id is None:
            return finished
        return finished | (self.padded_input[rows] == eos_token_id).any(1)


class MaxNewTokensOverrun(EqSpec):
    """The length limit is checked once per round, before the round's tokens go in (—).

    The last round appends all its accepted drafts and the bonus, overrunning
    max_new_tokens (the contract rejects the output).
    """

    name = "max_new_tokens_overrun"
    bug = BugInfo("max_new_tokens not respected in the last round", "—", "contract", "contract", True)

    def commit(
        self,
        out: list[list[int]],
        rows: torch.Tensor,
        new_tokens: list[list[int]],
        max_new_tokens: int,
        eos_token_id: int | None,
    ) -> torch.Tensor:
        for row, tokens in zip(rows.tolist(), new_tokens):  # below the limit: the whole round goes in
            EqSpec.commit(out, torch.tensor([row]), [tokens], len(out[row]) + len(tokens), eos_token_id)
        return torch.tensor(
            [len(out[r]) >= max_new_tokens or out[r][-1] == eos_token_id for r in rows.tolist()], dtype=torch.bool
        )
