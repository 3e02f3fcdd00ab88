"""The one registry of built-in model, draft and dtype names, and the default decoders.

Torch-free on purpose: the CLI parser and the pytest plugin read it without importing torch.
"""

from __future__ import annotations

from specaudit.contracts.errors import UsageError

MODELS = ("transparent", "llama", "qwen3", "gpt2")
DRAFTS = ("scripted", "tiny")
DTYPE_NAMES = ("float64", "float32", "bfloat16", "float16")
DEFAULT_DECODERS = (
    "specaudit.reference.eqspec:EqSpec",
    "specaudit.reference.exspec:ExSpec",
    "specaudit.reference.lazy:LazySpec",
)


def parse_models(text: str | None) -> list[str]:
    """`transparent,llama` as a list of known model names (None: all of them)."""
    if text is None:
        return list(MODELS)
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise UsageError("--models names no model")
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        raise UsageError(f"unknown model(s) {', '.join(unknown)}; built-in models are {', '.join(MODELS)}")
    return names


def check_model(model: str, draft: str = "scripted", dtype: str = "float64") -> None:
    """A case's model, draft and dtype names, checked against the registry (ValueError)."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; built-in models are {', '.join(MODELS)}")
    if draft not in DRAFTS or (draft == "tiny" and model == "transparent"):
        raise ValueError(f"unknown draft {draft!r} for model {model!r}; drafts are {', '.join(DRAFTS)}")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_NAMES)}")
