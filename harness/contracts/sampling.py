"""The sampling mode of the decoder contract: what a sampling decoder is handed, and the one
definition of the target distribution it must reproduce.

A decoder that samples says so (`samples = True`) and its `generate` then also takes
`temperature`, `top_k`, `top_p` and `generator` (a seeded `torch.Generator` on the CPU: draw from
it, or seed your own from `generator.initial_seed()`). Greedy stays the default: a decoder
without the attribute is called exactly as before.

The target distribution (Hugging Face's logits processors, in their order):

    z = logits / temperature                                   (float64; temperature > 0)
    top-k:  keep every token whose z >= the k-th largest z     (ties at the k-th kept, as HF's
                                                               TopKLogitsWarper; None, 0 or k >= V: off)
    top-p:  on softmax(z) over the kept tokens, keep token x iff the mass of the kept tokens
            strictly more probable than x is < top_p           (the smallest set of most likely
                                                               tokens reaching top_p, every token
                                                               tied with its last one kept, at
                                                               least one token; None or 1: off)
    p = softmax(z) over the tokens kept by both                (renormalised)

This is Hugging Face's result wherever no two tokens tie at a top-k or top-p boundary; at such a
tie every tied token is kept (HF's top-p keeps whichever its sort puts first). The built-in
models' logits never tie, so the tie rule decides no verdict on them.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specaudit.contracts.case import Case, CaseFormatError

SAMPLING_FORMAT, SAMPLING_VERSION = "specaudit-sampling-case", 1


@dataclass(frozen=True)
class Sampling:
    """The sampling settings of one run: temperature, then top-k, then top-p."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 in sampling mode (greedy is the greedy mode), got {self.temperature}"
            )
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 or None: off), got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (None or 1: off), got {self.top_p}")

    def keywords(self) -> dict[str, Any]:
        """What `generate` receives besides the generator."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}

    def __repr__(self) -> str:
        parts = [f"temperature={self.temperature:g}"]
        if self.top_k:
            parts.append(f"top_k={self.top_k}")
        if self.top_p is not None and self.top_p < 1:
            parts.append(f"top_p={self.top_p:g}")
        return f"Sampling({', '.join(parts)})"


def target_distribution(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution a lossless sampler draws from, in float64 (see the module's definition). [..., V]"""
    z = logits.double() / sampling.temperature  # [..., V]
    keep = top_k_kept(z, sampling.top_k)
    z = z.masked_fill(~keep, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1:
        keep = keep & top_p_kept(torch.softmax(z, dim=-1), sampling.top_p)
        z = z.masked_fill(~keep, float("-inf"))
    return torch.softmax(z, dim=-1)


def top_k_kept(z: torch.Tensor, k: int | None) -> torch.Tensor:
    """[..., V] True where a token survives top-k: its score at least the k-th largest (ties kept)."""
    if not k or k >= z.shape[-1]:
        return torch.ones_like(z, dtype=torch.bool)
    kth = z.topk(k, dim=-1).values[..., -1:]  # [..., 1]
    return z >= kth


def top_p_kept(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] True where a token survives top-p: the mass strictly more probable than it is < top_p.

    mass_above(x) = sum_y p(y) [p(y) > p(x)]: computed by sorting, with tied tokens given the
    mass above the first of them, so a tie is kept or dropped whole."""
    values, order = probs.sort(dim=-1, descending=True)  # [..., V]
    before = values.cumsum(-1) - values  # mass of the tokens sorted before each
    first_of_tie = torch.cat(
        [torch.ones_like(values[..., :1], dtype=torch.bool), values[..., 1:] < values[..., :-1]], -1
    )
    index = torch.cummax(torch.where(first_of_tie, torch.arange(values.shape[-1]).expand_as(values), 0), dim=-1)
    above = before.gather(-1, index.values)  # mass strictly above each sorted token
    return torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, above < top_p)


def declares_sampling(decoder: Any) -> bool:
    """A decoder (class or object) that declares `samples = True`."""
    return getattr(decoder, "samples", False) is True


# ---------------------------------------------------------------------------------------
# A sampling case: a batch, its settings and how many runs are pooled


@dataclass(frozen=True)
class SamplingCase:
    """One batch run `runs` times with seeds derived from `seed`, pooled into one verdict.

    `case` holds the batch (prompts, pads, K, limits, model); its accept patterns are unused (no
    scripted draft). The draft proposes from q = (1 - disagree) p_target + disagree p_other at
    temperature 1 (`fixtures.sampling`), so rejections, residuals and bonuses happen at a rate
    the search chooses.
    """

    case: Case
    sampling: Sampling = field(default_factory=Sampling)
    disagree: float = 0.5
    runs: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.disagree <= 1:
            raise ValueError(f"disagree must be in [0, 1], got {self.disagree}")
        if self.runs < 1:
            raise ValueError(f"runs must be >= 1, got {self.runs}")

    def run_seed(self, index: int) -> int:
        """The generator seed of run `index` (runs of one case never share a stream)."""
        return zlib.crc32(f"{self.seed}:{index}".encode()) & 0x7FFFFFFF

    def __repr__(self) -> str:
        c = self.case
        return (
            f"SamplingCase({self.sampling!r}, disagree={self.disagree:g}, runs={self.runs}, seed={self.seed}, "
            f"K={c.num_draft_tokens}, max_new_tokens={c.max_new_tokens}, eos_token_id={c.eos_token_id}, "
            f"pad_token_id={c.pad_token_id}, extra_pad_columns={c.extra_pad_columns}, model={c.model!r}, "
            f"prompts={c.prompts!r})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": SAMPLING_FORMAT,
            "version": SAMPLING_VERSION,
            "case": self.case.to_json(),
            "sampling": {
                "temperature": self.sampling.temperature,
                "top_k": self.sampling.top_k,
                "top_p": self.sampling.top_p,
            },  # fmt: skip
            "disagree": self.disagree,
            "runs": self.runs,
            "seed": self.seed,
        }

    @classmethod
    def from_json(cls, data: Any) -> SamplingCase:
        """A sampling case from its JSON form (a reproducer's payload holds it under "case")."""
        if isinstance(data, dict) and isinstance(data.get("payload"), dict):
            data = data["payload"].get("case")
        if not isinstance(data, dict) or data.get("format") != SAMPLING_FORMAT:
            raise CaseFormatError(f'not a specaudit sampling case (expected "format": "{SAMPLING_FORMAT}")')
        if data.get("version") != SAMPLING_VERSION:
            raise CaseFormatError(
                f"unsupported sampling case version {data.get('version')!r} (this is {SAMPLING_VERSION})"
            )
        try:
            settings = data["sampling"]
            sampling = Sampling(float(settings["temperature"]), settings.get("top_k"), settings.get("top_p"))
            return cls(Case.from_json(data["case"]), sampling, float(data["disagree"]), int(data["runs"]),
                       int(data["seed"]))  # fmt: skip
        except CaseFormatError:
            raise
        except KeyError as exc:
            raise CaseFormatError(f"sampling case is missing the field {exc}") from None
        except (TypeError, ValueError) as exc:
            raise CaseFormatError(f"sampling case has a malformed field: {exc}") from None

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path
