"""The pipeline's models: the built-in tiny Llama and its layer-0 draft (the ones `audit-vllm`
serves, `adapters.vllm.models`), exported offline to OpenVINO IR by optimum-intel in float32,
with their tokenizer converted by openvino-tokenizers. Built once under the specaudit cache."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from specaudit.adapters.vllm.models import model_directories
from specaudit.contracts.errors import UsageError
from specaudit.models.pretrained import built, cache_dir

EXPORT_TIMEOUT_S = 600


def export_ir(source: Path, out: Path) -> None:
    """`optimum-cli export openvino` of a Hugging Face directory, f32 weights, with its tokenizer."""
    cli = Path(sys.executable).with_name("optimum-cli")
    command = [str(cli), "export", "openvino", "--model", str(source), "--task", "text-generation-with-past",
               "--weight-format", "fp32", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=EXPORT_TIMEOUT_S)
    if done.returncode != 0 or not (out / "openvino_model.xml").is_file():
        tail = (done.stderr or done.stdout)[-800:]
        raise UsageError(f"exporting {source} to OpenVINO IR failed (exit {done.returncode}): {tail}")


def ir_directories(root: Path | None = None, say: Callable[[str], None] = print) -> tuple[Path, Path, Path]:
    """(target IR, draft IR, target Hugging Face directory): the HF one is the oracle's weights."""
    root = root or cache_dir()
    hf_target, hf_draft = model_directories("tiny", root / "vllm", say)

    def ir(name: str, source: Path) -> Path:
        path = root / "openvino" / name
        if (path / "openvino_model.xml").is_file():
            return path
        say(f"exporting {source.name} to OpenVINO IR under {path.parent} (first use only)")
        return built_ir(path, source)

    return ir("tiny-llama", hf_target), ir("tiny-llama-draft", hf_draft), hf_target


def built_ir(path: Path, source: Path) -> Path:
    """`models.pretrained.built` keyed on config.json, which the export writes too."""
    return built(path, lambda out: export_ir(source, out), lambda _: None)
