"""A case: everything one decoder run depends on, as plain data."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    """One batch for the decoder under test, plus the scripted draft's acceptance pattern.

    `accept[r][n]` says whether the scripted draft proposes the oracle's token at generated
    index n of row r; rows with the same prompt share a pattern (the draft cannot tell them
    apart, and neither should it).
    """

    prompts: tuple[tuple[int, ...], ...]
    accept: tuple[tuple[bool, ...], ...]
    num_draft_tokens: int
    max_new_tokens: int
    eos_token_id: int | None
    pad_token_id: int
    extra_pad_columns: int = 0
    model: str = "transparent"
    draft: str = "scripted"
    dtype: str = "float64"

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.accept) or not self.prompts:
            raise ValueError("a case needs one accept pattern per prompt and at least one row")
        if any(len(p) == 0 for p in self.prompts):
            raise ValueError("every prompt needs at least one real token")
        shared: dict[tuple[int, ...], tuple[bool, ...]] = {}
        for prompt, pattern in zip(self.prompts, self.accept):
            if shared.setdefault(prompt, pattern) != pattern:
                raise ValueError(f"rows with prompt {list(prompt)} must share one accept pattern")

    @property
    def batch_size(self) -> int:
        return len(self.prompts)

    @property
    def horizon(self) -> int:
        """How far past max_new_tokens the oracle continuation must reach for the draft."""
        return self.max_new_tokens + self.num_draft_tokens + 2

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded (input_ids, attention_mask), each int64 [B, T]."""
        width = max(map(len, self.prompts)) + self.extra_pad_columns
        ids = [[self.pad_token_id] * (width - len(p)) + list(p) for p in self.prompts]
        mask = [[0] * (width - len(p)) + [1] * len(p) for p in self.prompts]
        return torch.tensor(ids), torch.tensor(mask)

    def __repr__(self) -> str:
        patterns = ["".join("1" if a else "0" for a in pattern) for pattern in self.accept]
        return (
            f"Case(model={self.model!r}, draft={self.draft!r}, dtype={self.dtype!r}, K={self.num_draft_tokens}, "
            f"max_new_tokens={self.max_new_tokens}, eos={self.eos_token_id}, pad={self.pad_token_id}, "
            f"extra_pad_columns={self.extra_pad_columns}, prompts={[list(p) for p in self.prompts]}, "
            f"accept={patterns})"
        )
