"""A decoder with three independent planted defects (issue 27, point 3): one audit must report
all three, each with its own minimal case, instead of the simplest one alone.

`RowwiseSpec` is a correct batch speculative decoder written for this test, not derived from
the references: no KV cache, a small record per row, and every forward a left-padded batch of
the running rows' whole sequences. Per round, for the rows still running,

    draft:   d_1..d_K greedily: one draft forward over h, then one per token on the cache it
             returned (the draft's cache lives for one round; the target never keeps one)
    verify:  one target forward over [h, d_1..d_K]; y_i = argmax at the column of h's last token + i
    accept:  the longest prefix with d_i = y_{i-1} (y_0 predicts d_1), then y_a: after a rejection
             the target's correction, after K accepts the bonus

where h is the row's history (prompt, then committed tokens). The prefill is a target forward
over the prompts alone, whose last column gives the first token.

`ThreeDefects` breaks it in three places, each firing on cases of its own:

  1. a row's start is found as its first column not holding the pad id, not from the mask: a
     prompt that opens with the pad id as a real token loses it (and a prompt of nothing but
     pad-valued tokens gains the left padding): I2 ('history-token');
  2. after a rejection the correction token is committed without the EOS test: a row whose
     correction is EOS runs on past it (the contract's 'ends-at-eos');
  3. the prefill reads the first token one column early for a prompt of odd length >= 3 (the
     token predicted after the prompt's second-to-last token): equivalence, at index 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specaudit.models.compat import cache_keyword


@dataclass
class RowState:
    """One request: its prompt, the tokens committed so far, and whether it has stopped."""

    prompt: list[int]
    new: list[int] = field(default_factory=list)
    done: bool = False

    @property
    def history(self) -> list[int]:
        return self.prompt + self.new


def padded_batch(sequences: list[list[int]], pad: int) -> dict[str, torch.Tensor]:
    """A cache-free forward's keyword arguments for `sequences`, left-padded: each [B, W]."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for r, s in enumerate(sequences):
        ids[r, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[r, width - len(s) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}


def greedy_columns(model: torch.nn.Module, sequences: list[list[int]], pad: int) -> torch.Tensor:
    """[B, W] argmax of one cache-free forward over `sequences`, left-padded to width W."""
    batch = padded_batch(sequences, pad)
    logits = model(**batch, use_cache=True, **{cache_keyword(model): None}).logits  # [B, W, V]
    return logits.argmax(-1)


class RowwiseSpec:
    """Greedy batch speculative decoding without a cache: rows are records, forwards are batches."""

    name = "rowwise"
    max_wait_calls = 0

    @torch.no_grad()
    def generate(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        num_draft_tokens: int,
        max_new_tokens: int,
        eos_token_id: int | None,
        pad_token_id: int,
    ) -> list[list[int]]:
        rows = [RowState(self.real_tokens(ids, mask, pad_token_id)) for ids, mask in zip(input_ids, attention_mask)]
        first = self.first_tokens(greedy_columns(target, [r.prompt for r in rows], pad_token_id), rows)
        for row, token in zip(rows, first):
            self.commit(row, [token], max_new_tokens, eos_token_id)
        while running := [r for r in rows if not r.done]:
            drafts = self.propose(draft, running, num_draft_tokens, pad_token_id)  # [B][K]
            predicted = greedy_columns(target, [r.history + d for r, d in zip(running, drafts)], pad_token_id)
            for row, d, y in zip(running, drafts, predicted[:, -(num_draft_tokens + 1) :].tolist()):
                self.accept(row, d, y, max_new_tokens, eos_token_id)
        return [r.new for r in rows]

    def real_tokens(self, ids: torch.Tensor, mask: torch.Tensor, pad: int) -> list[int]:
        """A row's prompt: the tokens its attention mask marks real."""
        return ids[mask.bool()].tolist()

    def first_tokens(self, columns: torch.Tensor, rows: list[RowState]) -> list[int]:
        """The prefill's token per row: the argmax at the last column ([B, W] -> [B])."""
        return columns[:, -1].tolist()

    @staticmethod
    def propose(draft: torch.nn.Module, rows: list[RowState], k: int, pad: int) -> list[list[int]]:
        """K greedy drafts per row ([B][K]): the histories once, then one token at a time on the cache."""
        batch = padded_batch([r.history for r in rows], pad)
        mask, position = batch["attention_mask"], batch["position_ids"][:, -1:]  # [B, W], [B, 1]
        out = draft(**batch, use_cache=True, **{cache_keyword(draft): None})
        token = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        drafts = [token]
        for _ in range(k - 1):
            mask, position = torch.cat([mask, torch.ones_like(token)], 1), position + 1
            step = {"input_ids": token, "attention_mask": mask, "position_ids": position}
            out = draft(**step, use_cache=True, **{cache_keyword(draft): out.past_key_values})
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            drafts.append(token)
        return torch.cat(drafts, 1).tolist()

    def accept(self, row: RowState, drafts: list[int], y: list[int], limit: int, eos: int | None) -> None:
        """Commit the drafts the target agrees with, then its own next token."""
        a = 0
        while a < len(drafts) and drafts[a] == y[a]:
            a += 1
        self.commit(row, drafts[:a], limit, eos)
        if not row.done:
            self.commit_next(row, y[a], rejected=a < len(drafts), limit=limit, eos=eos)

    def commit_next(self, row: RowState, token: int, *, rejected: bool, limit: int, eos: int | None) -> None:
        """The target's token after the accepted drafts (a correction when `rejected`)."""
        self.commit(row, [token], limit, eos)

    @staticmethod
    def commit(row: RowState, tokens: list[int], limit: int, eos: int | None) -> None:
        for token in tokens:
            row.new.append(token)
            if token == eos or len(row.new) >= limit:
                row.done = True
                return


class ThreeDefects(RowwiseSpec):
    """RowwiseSpec with the three planted defects of the module docstring."""

    name = "three-defects"

    def real_tokens(self, ids: torch.Tensor, mask: torch.Tensor, pad: int) -> list[int]:
        """Defect 1: the row starts at its first column not holding the pad id (column 0 if none)."""
        start = int((ids != pad).int().argmax())
        return ids[start:].tolist()

    def first_tokens(self, columns: torch.Tensor, rows: list[RowState]) -> list[int]:
        """Defect 3: a prompt of odd length >= 3 has its first token read one column early."""
        return [
            int(columns[r, -2 if len(row.prompt) % 2 and len(row.prompt) >= 3 else -1]) for r, row in enumerate(rows)
        ]

    def commit_next(self, row: RowState, token: int, *, rejected: bool, limit: int, eos: int | None) -> None:
        """Defect 2: a correction after a rejection is committed without the EOS test."""
        if not rejected:
            return self.commit(row, [token], limit, eos)
        row.new.append(token)
        row.done = len(row.new) >= limit
        return None
