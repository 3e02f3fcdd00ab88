"""The GPU path on the CPU: the config-built pair of bench/gpu_model.py through the real-model
audit, the summary of bench/gpu_summary.py, the syntax of bench/gpu_check.sh, and the GPU each
pytest-xdist worker takes for plain `cuda` (specaudit.models.loading.worker_device)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from specaudit.commands.cli import main
from specaudit.models.loading import resolve_device, worker_device

BENCH = Path(__file__).resolve().parents[2] / "bench"
TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--draft-layers", "1"]
TINY += ["--init-std", "0.2", "--head-std", "0.6"]  # the smoke config of bench/gpu_check.sh
PROMPTS = ("What is 17 times 23?", "Write a Python function that returns the n-th Fibonacci number.")  # short first
EQSPEC = "specaudit.reference.eqspec:EqSpec"
PLANTED = "specaudit.reference.mutants:realign_off_by_one"  # kv-drift, visible at any batch size


def bench_module(name: str) -> ModuleType:
    """A bench/ script as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None, f"cannot load bench/{name}.py"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpu-model")
    assert bench_module("gpu_model").main([str(out), *TINY]) == 0
    return out


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def audit(pair: Path, prompts: Path, decoder: str, out: Path) -> int:
    argv = ["audit", "--target", str(pair / "target"), "--draft", str(pair / "draft"), "--prompts", str(prompts)]
    argv += [
        "--decoder",
        decoder,
        "--dtype",
        "float32",
        "--max-new-tokens",
        "8",
        "--check-rate",
        "1",
        "--out",
        str(out),
    ]
    return main(argv)


def test_builder_writes_a_loadable_pair_with_its_tokenizer(pair: Path) -> None:
    """The target and its layer-skip draft load from disk, share the tokenizer, which covers the prompts."""
    from transformers import AutoConfig, AutoTokenizer

    target, draft = AutoConfig.from_pretrained(pair / "target"), AutoConfig.from_pretrained(pair / "draft")
    assert (target.num_hidden_layers, draft.num_hidden_layers) == (2, 1), (
        f"got {target.num_hidden_layers} target and {draft.num_hidden_layers} draft layers, should be 2 and 1"
    )
    tokenizer = AutoTokenizer.from_pretrained(pair / "draft")
    assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id is not None, "eos and pad must be set"
    for text in PROMPTS:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == text, f"{text!r} does not round-trip"
    assert len(tokenizer) == target.vocab_size, f"tokenizer {len(tokenizer)} tokens, model vocab {target.vocab_size}"


def test_builder_is_seeded(tmp_path: Path, pair: Path) -> None:
    """The same arguments build the same weights (one explicit generator, no global RNG)."""
    from safetensors.torch import load_file

    assert bench_module("gpu_model").main([str(tmp_path), *TINY]) == 0
    first, again = (
        load_file(pair / "target" / "model.safetensors"),
        load_file(tmp_path / "target" / "model.safetensors"),
    )
    differ = [name for name in first if not torch.equal(first[name], again[name])]
    assert not differ, f"rebuilt weights differ in {differ[:3]}"


def test_real_audit_of_the_config_pair(pair: Path, prompts_file: Path, tmp_path: Path) -> None:
    """Through the CLI on the config-built pair, EqSpec passes (exit 0) and a planted bug is caught
    (exit 1); the summary reports both from their report.json, each as expected."""
    results = tmp_path / "results"
    assert audit(pair, prompts_file, EQSPEC, results / "audit" / "float32" / "EqSpec") == 0
    bug = PLANTED.rsplit(":", 1)[1]
    assert audit(pair, prompts_file, PLANTED, results / "audit" / "float32" / bug) == 1
    steps = ["step\texit\tseconds\ttimeout", "audit/float32/EqSpec\t0\t1\t60", f"audit/float32/{bug}\t1\t1\t60"]
    (results / "steps.tsv").write_text("\n".join(steps) + "\n")
    assert bench_module("gpu_summary").main([str(results)]) == 0, (results / "summary.md").read_text()
    rows = {line.split(" | ")[0].strip("| "): line for line in (results / "summary.md").read_text().splitlines()}
    assert "PASS" in rows["EqSpec"] and "| yes |" in rows["EqSpec"], rows["EqSpec"]
    assert "FAIL" in rows[bug] and "kv-drift" in rows[bug] and "| yes |" in rows[bug], rows[bug]
    report = json.loads((results / "audit" / "float32" / bug / "report.json").read_text())
    assert report["entries"], "the planted bug's report.json holds no batch"


def test_summary_flags_a_planted_bug_that_passes(tmp_path: Path) -> None:
    """A planted bug whose run passes, or a run without a report, is not as expected (exit 1)."""
    run = tmp_path / "audit" / "bfloat16" / "cache_rows_permuted"
    run.mkdir(parents=True)
    case = {"requests": [{"prompt": [5, 6, 7]}]}
    batch = {"batch": 0, "outputs": [[1, 2]], "diagnosis": {"passed": True, "verdict": "exact", "exact_match": 1.0}}
    batch["diagnosis"]["case"] = case
    (run / "report.json").write_text(json.dumps([batch]))  # a bare list, as written before the envelope
    steps = [
        "step\texit\tseconds\ttimeout",
        "audit/bfloat16/cache_rows_permuted\t0\t3\t60",
        "audit/float16/EqSpec\t124\t60\t60",
    ]
    (tmp_path / "steps.tsv").write_text("\n".join(steps) + "\n")
    assert bench_module("gpu_summary").main([str(tmp_path)]) == 1
    text = (tmp_path / "summary.md").read_text()
    assert "0 of 2 audit runs as expected" in text and "timed out" in text, text


@pytest.mark.parametrize(
    "dtype, reach, expected",
    [("bfloat16", 300, "FAIL"), ("bfloat16", 200, "PASS"), ("float16", 300, "PASS"), ("float16", 3000, "FAIL")],
)
def test_dtype_bug_expected_only_past_exact_positions(dtype: str, reach: int, expected: str) -> None:
    """positions_in_model_dtype is expected to fail only where a position passes the dtype's exact integers."""
    batch = {"outputs": [[0] * 10], "diagnosis": {"case": {"requests": [{"prompt": [0] * (reach - 9)}]}}}
    got = bench_module("gpu_summary").expectation("positions_in_model_dtype", dtype, [batch])
    assert got.split()[0] == expected, f"{dtype} reaching position {reach}: got {got!r}, should be {expected}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_gpu_check_script_parses() -> None:
    """bench/gpu_check.sh is valid bash."""
    done = subprocess.run(["bash", "-n", str(BENCH / "gpu_check.sh")], capture_output=True, text=True)
    assert done.returncode == 0, f"bash -n bench/gpu_check.sh: {done.stderr}"


@pytest.mark.parametrize(
    "worker, count, device, expected",
    [
        ("gw0", 4, "cuda", "cuda:0"),
        ("gw5", 4, "cuda", "cuda:1"),
        ("gw3", 8, "cuda", "cuda:3"),
        ("gw5", 4, "cuda:2", "cuda:2"),  # an explicit index is kept
        ("", 4, "cuda", "cuda"),  # not under xdist: the current device
        ("master", 4, "cuda", "cuda"),
        ("gw2", 4, "cpu", "cpu"),
    ],
)
def test_xdist_worker_takes_its_own_gpu(
    monkeypatch: pytest.MonkeyPatch, worker: str, count: int, device: str, expected: str
) -> None:
    """Plain `cuda` under `pytest -n N` is cuda:(worker index mod GPU count); anything else is unchanged."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    got = resolve_device(device)
    assert got == torch.device(expected), f"worker {worker!r}, {count} GPUs, --device {device}: got {got}"
    assert worker_device(torch.device(device)) == got
