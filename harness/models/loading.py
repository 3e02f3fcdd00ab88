"""Real-model mode, loading: models, tokenizer and prompts from local files, and the tiny pair on disk.

Everything here turns user input (paths, a device, a dtype, a prompts file) into models and
token ids, or fails with a `RealModelError`: a `UsageError` whose message is one line that
names the path or option.

With no GPU and no weights, `save_tiny_pair(DIR)` writes the tiny Llama target and draft with
`save_pretrained`, plus a 128-token character tokenizer, so real-model mode loads them from
disk exactly as real weights.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import transformers
from packaging.version import Version
from tokenizers import Tokenizer, decoders
from tokenizers import models as tokenizer_models
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from specaudit.config.settings import REAL_DTYPES
from specaudit.contracts.errors import UsageError
from specaudit.fixtures import VOCAB_SIZE
from specaudit.fixtures.tiny import build_tiny
from specaudit.models.pretrained import resolve


class RealModelError(UsageError):
    """Bad input for real-model mode (a path, a prompts file, a device); the message is one line."""


# ---------------------------------------------------------------------------------------
# Models and tokenizer


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def dtype_kwargs(dtype: torch.dtype | str) -> dict[str, Any]:
    """`dtype=` from transformers 4.56 on, `torch_dtype=` before (5.x warns on the old name)."""
    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return {key: dtype}


def worker_device(dev: torch.device) -> torch.device:
    """Plain `cuda` in a pytest-xdist worker: worker gwN takes cuda:(N % device count), so
    `pytest -n N` on a multi-GPU machine puts one worker per GPU (N up to the count) instead of
    every worker on cuda:0. An explicit index, another device type, or no worker: unchanged."""
    worker = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    if dev.type != "cuda" or dev.index is not None or worker is None:
        return dev
    count = torch.cuda.device_count()
    return torch.device("cuda", int(worker.group(1)) % count) if count else dev


def resolve_device(device: str) -> torch.device:
    """The torch device for `--device`, checked to exist; plain `cuda` under xdist is the
    worker's GPU (`worker_device`)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise RealModelError(f"invalid device {device!r}: {_one_line(exc)}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RealModelError(f"device {device!r} is not available (torch.cuda.is_available() is False)")
    dev = worker_device(dev)
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise RealModelError(f"device {device!r} is not available ({torch.cuda.device_count()} CUDA device(s))")
    if dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise RealModelError(f"device {device!r} is not available")
    return dev


@contextmanager
def _quiet_loading() -> Iterator[None]:
    """No weight-loading progress bars on stderr; the previous setting is restored."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _check_model_dir(role: str, path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise RealModelError(f"{role} model path {str(path)!r} does not exist")
    if not p.is_dir() or not (p / "config.json").is_file():
        raise RealModelError(f"{role} model path {str(path)!r} is not a Hugging Face model directory (no config.json)")
    return p


def load_model(role: str, path: str | Path, device: torch.device, dtype: str = "auto") -> torch.nn.Module:
    p = _check_model_dir(role, path)
    if dtype not in REAL_DTYPES:
        raise RealModelError(f"unknown dtype {dtype!r}; choose one of {', '.join(REAL_DTYPES)}")
    torch_dtype: Any = "auto" if dtype == "auto" else getattr(torch, dtype)
    try:
        with _quiet_loading():
            model = AutoModelForCausalLM.from_pretrained(str(p), local_files_only=True, **dtype_kwargs(torch_dtype))
    except Exception as exc:  # any loader failure is bad input, reported in one line
        raise RealModelError(f"cannot load the {role} model from {str(path)!r}: {_one_line(exc)}") from None
    model = model.to(device)
    model.requires_grad_(False)
    return model.eval()


def load_tokenizer(path: str | Path) -> Any:
    p = _check_model_dir("target", path)
    try:
        with _quiet_loading():
            return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as exc:
        raise RealModelError(f"cannot load a tokenizer from the target path {str(path)!r}: {_one_line(exc)}") from None


def load_pair(
    target_path: str | Path, draft_path: str | Path, device: str = "cpu", dtype: str = "auto"
) -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    """(target, draft, tokenizer): both models from local directories, the tokenizer from the target's.

    A built-in name (`smollm2`, `smollm2-draft`) stands for its directory, built on first use
    (`specaudit.models.pretrained`). `dtype` is "auto" (the checkpoint's) or a REAL_DTYPES name. Errors are
    `RealModelError`s with one line that names the path.
    """
    target_path, draft_path = resolve(target_path), resolve(draft_path)
    dev = resolve_device(device)
    target = load_model("target", target_path, dev, dtype)
    draft = load_model("draft", draft_path, dev, dtype)
    tokenizer = load_tokenizer(target_path)
    if target.dtype != draft.dtype:
        raise RealModelError(f"target and draft dtypes differ ({target.dtype} vs {draft.dtype}); pass --dtype")
    return target, draft, tokenizer


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: JSONL (SpecBench `turns`: the first turn; else `prompt` or `text`)
    when the first non-blank line starts with `{`, otherwise one prompt per non-blank line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise RealModelError(f"cannot read prompts file {str(path)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise RealModelError(f"prompts file {str(path)!r} is not UTF-8 text") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        raise RealModelError(f"prompts file {str(path)!r} holds no prompts")
    if not lines[0][1].lstrip().startswith("{"):
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RealModelError(f"{path}, line {n}: not a JSON object ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise RealModelError(f"{path}, line {n}: a JSON {type(obj).__name__}, but should be an object")
        if "turns" in obj:
            turns = obj["turns"]
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
                raise RealModelError(f'{path}, line {n}: "turns" should be a non-empty list of strings')
            prompts.append(turns[0])
        elif isinstance(obj.get("prompt"), str):
            prompts.append(obj["prompt"])
        elif isinstance(obj.get("text"), str):
            prompts.append(obj["text"])
        else:
            raise RealModelError(f'{path}, line {n}: no "turns", "prompt" or "text" string')
    return prompts


def special_ids(tokenizer: Any) -> tuple[int | None, int]:
    """(eos, pad): the tokenizer's; pad falls back to eos, then to 0."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = eos if eos is not None else 0
    return (None if eos is None else int(eos)), int(pad)


def tokenize(tokenizer: Any, prompts: Sequence[str]) -> list[tuple[int, ...]]:
    out = []
    for i, text in enumerate(prompts):
        ids = tuple(int(t) for t in tokenizer(text)["input_ids"])
        if not ids:
            raise RealModelError(f"prompt {i} ({text[:40]!r}) tokenizes to no tokens")
        out.append(ids)
    return out


# ---------------------------------------------------------------------------------------
# Tiny pair on disk (CPU tests and demos)


def tiny_tokenizer() -> Any:
    """A 128-token character tokenizer (0 <pad>, 1 <eos>, 2 <unk>, 3..127 characters 32..156)."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    vocab.update({chr(29 + i): i for i in range(3, VOCAB_SIZE)})
    tok = Tokenizer(tokenizer_models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def save_tiny_pair(directory: str | Path, arch: str = "llama", dtype: torch.dtype | None = None) -> tuple[Path, Path]:
    """Write the tiny `arch` target and draft (specaudit.fixtures.tiny) and a tokenizer under `directory`.

    Returns (target_dir, draft_dir); the tokenizer is saved with the target, as a real
    checkpoint ships it. Loading them gives the same weights as `build_tiny(arch, role, dtype=dtype)`
    (float64 by default).
    """
    dtype = torch.float64 if dtype is None else dtype
    root = Path(directory)
    dirs = root / "target", root / "draft"
    for role, path in zip(("target", "draft"), dirs):
        build_tiny(arch, role, dtype=dtype).save_pretrained(str(path))
    tiny_tokenizer().save_pretrained(str(dirs[0]))
    return dirs
