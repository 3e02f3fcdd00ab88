"""A case: everything one decoder run depends on, as plain data, and its JSON form."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specaudit.contracts.errors import UsageError

CASE_FORMAT, CASE_VERSION = "specaudit-case", 1
ENVELOPE_FORMAT = "specaudit-reproducer"
"""A reproducer file (`specaudit.artifacts.reproducer`); one of a decoder case holds its case under payload.case."""


class CaseFormatError(UsageError, ValueError):
    """A case file that cannot be read as a case; the message says what is wrong where."""


def pattern_text(pattern: tuple[bool, ...]) -> str:
    """An accept pattern as "1101": one character per generated index."""
    return "".join("1" if a else "0" for a in pattern)


def parse_pattern(pattern: str | tuple[bool, ...] | list[bool]) -> tuple[bool, ...]:
    """An accept pattern from its "1101" text or any sequence of flags."""
    if isinstance(pattern, str):
        if set(pattern) - {"0", "1"}:
            raise ValueError(f'an accept pattern is written with 0 and 1, got "{pattern}"')
        return tuple(c == "1" for c in pattern)
    return tuple(bool(a) for a in pattern)


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
        # Lists and "1101" strings are accepted so that `eval(repr(case)) == case`; stored as tuples.
        object.__setattr__(self, "prompts", tuple(tuple(int(t) for t in p) for p in self.prompts))
        object.__setattr__(self, "accept", tuple(parse_pattern(a) for a in self.accept))
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
        """Evaluable with `Case` in scope, so a found case can be pinned with `@example(case=...)`;
        accept patterns are written as "1101" strings, which the constructor reads back."""
        return (
            f"Case(model={self.model!r}, draft={self.draft!r}, dtype={self.dtype!r}, "
            f"num_draft_tokens={self.num_draft_tokens}, max_new_tokens={self.max_new_tokens}, "
            f"eos_token_id={self.eos_token_id}, pad_token_id={self.pad_token_id}, "
            f"extra_pad_columns={self.extra_pad_columns}, prompts={self.prompts!r}, "
            f"accept={tuple(pattern_text(a) for a in self.accept)!r})"
        )

    def to_json(self) -> dict[str, Any]:
        """The versioned reproducer form: one entry per row under `requests`."""
        return {
            "format": CASE_FORMAT,
            "version": CASE_VERSION,
            "requests": [
                {"prompt": list(p), "accept": pattern_text(pattern)} for p, pattern in zip(self.prompts, self.accept)
            ],
            "padding": {"pad_token_id": self.pad_token_id, "extra_pad_columns": self.extra_pad_columns},
            "num_draft_tokens": self.num_draft_tokens,
            "limits": {"max_new_tokens": self.max_new_tokens, "eos_token_id": self.eos_token_id},
            "model": {"target": self.model, "draft": self.draft, "dtype": self.dtype},
        }

    @classmethod
    def from_json(cls, data: Any) -> Case:
        """A case from its JSON form, or from a reproducer that holds one (a decoder or real-model case)."""
        if isinstance(data, dict) and data.get("format") == ENVELOPE_FORMAT:
            data = (data.get("payload") or {}).get("case") if isinstance(data.get("payload"), dict) else None
            if data is None:
                raise CaseFormatError('a reproducer without a case (its payload holds no "case")')
        try:
            if not isinstance(data, dict) or data.get("format") != CASE_FORMAT:
                raise CaseFormatError(f'not a specaudit case (expected "format": "{CASE_FORMAT}")')
            if data.get("version") != CASE_VERSION:
                raise CaseFormatError(f"unsupported case version {data.get('version')!r} (this is {CASE_VERSION})")
            requests = data["requests"]
            prompts = tuple(tuple(int(t) for t in r["prompt"]) for r in requests)
            accept = tuple(tuple(c == "1" for c in str(r["accept"])) for r in requests)
            model = data.get("model", {})
            return cls(
                prompts,
                accept,
                int(data["num_draft_tokens"]),
                int(data["limits"]["max_new_tokens"]),
                None if data["limits"].get("eos_token_id") is None else int(data["limits"]["eos_token_id"]),
                int(data["padding"]["pad_token_id"]),
                int(data["padding"].get("extra_pad_columns", 0)),
                str(model.get("target", "transparent")),
                str(model.get("draft", "scripted")),
                str(model.get("dtype", "float64")),
            )
        except CaseFormatError:
            raise
        except KeyError as exc:
            raise CaseFormatError(f"case is missing the field {exc}") from None
        except (TypeError, ValueError) as exc:
            raise CaseFormatError(f"case has a malformed field: {exc}") from None

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: Path) -> Case:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except OSError as exc:
            raise CaseFormatError(f"cannot read case file {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise CaseFormatError(f"{path} is not JSON: {exc.msg} at line {exc.lineno}") from None
