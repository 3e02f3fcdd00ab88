"""The GPU path on the CPU: the config-built pair of bench/gpu_model.py through the real-model
audit and through transformers' continuous batching (bench/gpu_cb.py), the summary of
bench/gpu_summary.py, the syntax of bench/gpu_check.sh, and the GPU each pytest-xdist worker
takes for plain `cuda` (specaudit.models.loading.worker_device)."""

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


def passing_audit(results: Path, *steps: str) -> None:
    """One EqSpec audit that passed (a report.json as written before the envelope) and steps.tsv
    with it and `steps`: the audits' part of a summary as expected."""
    run = results / "audit" / "float32" / "EqSpec"
    run.mkdir(parents=True, exist_ok=True)
    diagnosis = {"passed": True, "verdict": "exact", "exact_match": 1.0, "case": {"requests": [{"prompt": [5]}]}}
    (run / "report.json").write_text(json.dumps([{"batch": 0, "outputs": [[1, 2]], "diagnosis": diagnosis}]))
    lines = ["step\texit\tseconds\ttimeout", "audit/float32/EqSpec\t0\t3\t60", *steps]
    (results / "steps.tsv").write_text("\n".join(lines) + "\n")


HALF_ONLY_MISSING = {"planted:logits-one-early", "planted:one-token-too-many", "planted:token-after-eos"}
"""The planted bugs only an inexact check catches (greedy-commit, the output contract): float32 only."""


@pytest.fixture(scope="module")
def cb_results(pair: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bench/gpu_cb.py on the config-built target, float32 and bfloat16 on the CPU, one torch thread."""
    pytest.importorskip("transformers.generation.continuous_batching.cache_allocators")
    results = tmp_path_factory.mktemp("cb-results")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        argv = ["--model", str(pair / "target"), "--device", "cpu", "--dtype", "float32", "--dtype", "bfloat16"]
        assert bench_module("gpu_cb").main([*argv, "--out", str(results / "cb")]) == 0
    finally:
        torch.set_num_threads(threads)
    return results


def test_gpu_cb_judges_the_config_target_in_each_dtype(cb_results: Path) -> None:
    """Every entry point passes and every planted bug is caught at its catalog rule, in float32 by
    every check and in bfloat16 by the exact layout alone (the output checks not applicable)."""
    full = json.loads((cb_results / "cb" / "float32" / "report.json").read_text())
    half = json.loads((cb_results / "cb" / "bfloat16" / "report.json").read_text())
    assert full["finished"] and half["finished"], "a dtype's report is not marked finished"
    assert (full["judging"], half["judging"]) == ("full", "exact")
    planned = {p["item"] for p in full["planned"]}
    assert len(planned) == 14 and planned - {p["item"] for p in half["planned"]} == HALF_ONLY_MISSING
    for report in (full, half):
        entries = {e["subject"]["item"]: e for e in report["entries"]}
        for plan in report["planned"]:
            got = entries[plan["item"]]
            if plan["expect"] == "PASS":
                assert got["passed"], f"{report['dtype']} {plan['item']}: {got['first']}"
            else:
                assert (got["first"]["check"], got["first"]["rule"]) == (plan["check"], plan["rule"]), got["first"]
    statuses = {e["subject"]["item"]: e["statuses"] for e in half["entries"]}
    assert statuses["smoke:manager"]["equivalence"] == "not applicable", statuses["smoke:manager"]
    assert {e["statuses"]["equivalence"] for e in full["entries"] if e["passed"]} == {"pass"}


def test_summary_reports_the_cb_runs(cb_results: Path, tmp_path: Path) -> None:
    """The summary's transformers-cb section: one row per planned item and dtype, all as expected."""
    passing_audit(cb_results, "cb\t0\t20\t60")
    assert bench_module("gpu_summary").main([str(cb_results)]) == 0, (cb_results / "summary.md").read_text()
    text = (cb_results / "summary.md").read_text()
    assert "25 of 25 runs as expected" in text and "25 of 25 transformers-cb runs" in text, text
    row = next(line for line in text.splitlines() if line.startswith("| planted:read-page-twice | bfloat16"))
    assert "| exact | FAIL | paged/kv-provenance |" in row and "| yes |" in row, row


def test_exact_judging_ignores_half_precision_argmax_but_not_the_layout(pair: Path) -> None:
    """A bfloat16 run whose recorded argmax disagrees with what was committed fails greedy-commit
    under every check, and passes the exact judging; a wrong position still fails it."""
    pytest.importorskip("transformers.generation.continuous_batching.cache_allocators")
    from dataclasses import replace

    from specaudit.adapters.transformers_cb import SMOKE, run_workload, verdict_of

    gpu_cb = bench_module("gpu_cb")
    model = gpu_cb.load(pair / "target", "bfloat16", "cpu")
    run = run_workload(SMOKE["generate_batch"], model)
    assert gpu_cb.exact_verdict(run, "bfloat16").passed
    flipped = [replace(c, greedy=(c.greedy + 1) % 64) for c in run.trace.calls]  # [N] another token everywhere
    wrong = replace(run, trace=replace(run.trace, calls=tuple(flipped)))
    assert verdict_of(wrong, gpu_cb.load(pair / "target", "float32", "cpu")).first.rule == "greedy-commit"
    assert gpu_cb.exact_verdict(wrong, "bfloat16").passed, "exact judging compared a half-precision argmax"
    last = run.trace.calls[-1]
    shifted = replace(last, positions=last.positions + 1)  # [N]
    moved = replace(run, trace=replace(run.trace, calls=(*run.trace.calls[:-1], shifted)))
    assert gpu_cb.exact_verdict(moved, "bfloat16").first.rule == "query-positions"


def test_summary_flags_unfinished_and_uncaught_cb_runs(tmp_path: Path) -> None:
    """A planted bug that passes, one caught under another rule, a planned item without an entry
    and a dtype transformers could not run: only the second is as expected (exit 1)."""
    planned = [
        {"item": "planted:read-page-twice", "expect": "FAIL", "check": "paged", "rule": "kv-provenance"},
        {"item": "planted:context-one-long", "expect": "FAIL", "check": "paged", "rule": "context-length"},
        {"item": "smoke:manager", "expect": "PASS"},
    ]
    first = {"check": "paged", "rule": "kv-overwritten"}
    entries = [
        {"subject": {"item": "planted:read-page-twice"}, "passed": True, "first": None},
        {"subject": {"item": "planted:context-one-long"}, "passed": False, "first": first, "signature": "kv-drift"},
    ]
    for dtype, report in (
        ("float32", {"judging": "full", "planned": planned, "entries": entries}),
        ("float16", {"unavailable": "transformers 5.17.0 has no cache_allocators", "entries": []}),
    ):
        (tmp_path / "cb" / dtype).mkdir(parents=True)
        (tmp_path / "cb" / dtype / "report.json").write_text(json.dumps(report))
    passing_audit(tmp_path, "cb\t124\t60\t60")
    summary = bench_module("gpu_summary")
    got = {(o.item, o.dtype): o for o in summary.cb_collect(tmp_path, summary.read_steps(tmp_path))}
    assert got["planted:read-page-twice", "float32"].met == "**no**"
    assert got["planted:context-one-long", "float32"].met == "yes, other rule"
    assert (got["smoke:manager", "float32"].verdict, got["smoke:manager", "float32"].met) == ("timed out", "no")
    unavailable = got["all", "float16"]
    assert unavailable.verdict.startswith("not run: transformers 5.17.0") and unavailable.met == "no"
    assert summary.main([str(tmp_path)]) == 1, "the audits were as expected: the cb runs must fail the summary"
    assert "1 of 4 runs as expected" in (tmp_path / "summary.md").read_text()


def test_gpu_cb_records_an_item_that_raises_and_goes_on(
    pair: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An item whose engine raises (say, on a device the observer cannot read) is reported with
    what it raised, the next item still runs, and the exit status is 1."""
    pytest.importorskip("transformers.generation.continuous_batching.cache_allocators")
    gpu_cb = bench_module("gpu_cb")
    real_plan, real_run = gpu_cb.plan, gpu_cb.run_item
    monkeypatch.setattr(gpu_cb, "plan", lambda how, oracle: real_plan(how, oracle)[:2])

    def run_item(item: object, *args: object) -> object:
        if item.name == "smoke:generate_batch":  # type: ignore[attr-defined]
            raise RuntimeError("the observer failed on a forward")
        return real_run(item, *args)

    monkeypatch.setattr(gpu_cb, "run_item", run_item)
    argv = ["--model", str(pair / "target"), "--device", "cpu", "--dtype", "bfloat16", "--out", str(tmp_path / "cb")]
    assert gpu_cb.main(argv) == 1
    report = json.loads((tmp_path / "cb" / "bfloat16" / "report.json").read_text())
    assert report["errors"] == {"smoke:generate_batch": "RuntimeError: the observer failed on a forward"}, report
    assert [e["subject"]["item"] for e in report["entries"]] == ["smoke:manager"] and not report["finished"]
    (tmp_path / "steps.tsv").write_text("step\texit\tseconds\ttimeout\ncb\t1\t5\t60\n")
    summary = bench_module("gpu_summary")
    got = {o.item: o for o in summary.cb_collect(tmp_path, summary.read_steps(tmp_path))}
    assert got["smoke:generate_batch"].verdict.startswith("raised RuntimeError") and got["smoke:manager"].met == "yes"


def test_gpu_cb_without_cache_allocators_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A transformers without the cache allocators the adapter reads (5.17): exit 3, and a report saying so."""
    gpu_cb = bench_module("gpu_cb")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if "allocators" in name else real(name))
    assert gpu_cb.main(["--model", str(tmp_path / "none"), "--device", "cpu", "--out", str(tmp_path / "cb")]) == 3
    report = json.loads((tmp_path / "cb" / "float32" / "report.json").read_text())
    assert "cache_allocators" in report["unavailable"] and not report["entries"], report


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
