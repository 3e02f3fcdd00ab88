"""Real-model mode on the CPU: the tiny Llama pair saved to disk and loaded as real weights are.

Covers loading, prompt files, the audit end to end (exit 0 / 1 / 2), the deterministic I2
sampling, instrumentation overhead, and transplanting a run onto the exact CPU models.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.overhead import measure_overhead
from specaudit.adapters.realmodel import OnDevice, RealRun, audit_batch, make_sampler, real_case, run_real
from specaudit.audits.transplant import map_prompts, observed_rounds, round_shape, transplant
from specaudit.checks.diagnosis import diagnose
from specaudit.commands.cli import main
from specaudit.contracts.errors import UsageError
from specaudit.fixtures.tiny import build_tiny
from specaudit.models.compat import call_model
from specaudit.models.loading import RealModelError, load_pair, read_prompts, save_tiny_pair, special_ids, tokenize
from specaudit.running.runner import run_case

EQSPEC = "specaudit.reference.eqspec:EqSpec"
PLANTED = "specaudit.reference.mutants:rejected_kv_attended"
PROMPTS = ["Hello world", "The quick brown fox", "abc", "Hello world", "zz top x"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads on shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_tiny_pair(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def pair(pair_dirs: tuple[Path, Path]):
    return load_pair(*pair_dirs)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "question.jsonl"
    rows = [{"question_id": i, "category": "demo", "turns": [p, "a second turn"]} for i, p in enumerate(PROMPTS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def audit_argv(pair_dirs: tuple[Path, Path], prompts: Path, *extra: str) -> list[str]:
    target, draft = pair_dirs
    return [
        "audit", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
        "--batch-size", "3", "--max-new-tokens", "10", "--num-draft-tokens", "3", *extra,
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------
# Loading


def test_saved_pair_loads_as_the_fixture(pair) -> None:
    """The tiny pair loaded from disk computes what build_tiny's models compute."""
    target, draft, tokenizer = pair
    ids = torch.tensor([[5, 17, 3, 99, 42]])
    positions = torch.arange(5)[None]
    for loaded, role in ((target, "target"), (draft, "draft")):
        built = build_tiny("llama", role)
        with torch.no_grad():
            a, _ = call_model(loaded, ids, torch.ones_like(ids), positions, None)
            b, _ = call_model(built, ids, torch.ones_like(ids), positions, None)
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    assert special_ids(tokenizer) == (1, 0)
    assert tokenizer.decode(tokenize(tokenizer, ["Hi there"])[0]) == "Hi there"


def test_read_prompts_formats(tmp_path: Path) -> None:
    """JSONL `turns` (first turn), `prompt` and `text` objects, and plain lines are read."""
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"turns": ["first", "second"]}\n\n{"prompt": "p"}\n{"text": "t"}\n')
    assert read_prompts(jsonl) == ["first", "p", "t"]
    plain = tmp_path / "b.txt"
    plain.write_text("one prompt\n\n  another one\n")
    assert read_prompts(plain) == ["one prompt", "  another one"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "holds no prompts"),
        ("\n  \n", "holds no prompts"),
        ('{"turns": ["a"]}\n{"turns": ["b"\n', "line 2: not a JSON object"),
        ('{"turns": []}\n', 'line 1: "turns" should be a non-empty list'),
        ('{"turns": ["a"]}\n[1, 2]\n', "line 2: a JSON list"),
        ('{"question": "a"}\n', 'line 1: no "turns", "prompt" or "text"'),
    ],
)
def test_read_prompts_rejects_bad_files(tmp_path: Path, content: str, message: str) -> None:
    """An empty or malformed prompts file is a RealModelError (a UsageError) naming the line."""
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(RealModelError, match=message.replace("[", r"\[")) as caught:
        read_prompts(path)
    assert isinstance(caught.value, UsageError)


# ---------------------------------------------------------------------------------------
# The audit end to end


def test_audit_passes_reference_decoder(pair_dirs, prompts_file, capsys) -> None:
    """EQSPEC on the tiny pair from disk passes with exit 0, reporting rate, throughput and overhead."""
    assert main(audit_argv(pair_dirs, prompts_file, "--decoder", EQSPEC, "--check-rate", "0.5")) == 0
    out = capsys.readouterr().out
    assert "overall: PASS (exact)" in out
    assert "check rate 0.5" in out and "tok/s" in out and "instrumentation overhead" in out
    assert "checks: contract pass, I1 pass, I2 pass, equivalence pass, token-preservation n/a" in out
    assert out.count("  batch ") == 2  # 5 prompts in batches of 3


def test_audit_fails_planted_bug_and_writes_reproducers(pair_dirs, prompts_file, tmp_path, capsys) -> None:
    """A planted bug exits 1 and leaves a real-model reproducer and a failing CPU transplant."""
    argv = audit_argv(pair_dirs, prompts_file, "--decoder", PLANTED, "--check-rate", "0.25", "--out", str(tmp_path))
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "overall: FAIL" in out and "first violated check" in out
    assert "transplant on the CPU (transparent target, scripted draft): FAIL" in out
    names = sorted(p.name for p in (tmp_path / "repro").iterdir())
    assert any(n.startswith("real_") for n in names) and any(n.startswith("transplant_") for n in names)
    assert any(n.startswith("test_regression_transplant_") for n in names)  # the CPU transplant is a test too
    report = json.loads((tmp_path / "report.json").read_text())["entries"]
    assert len(report) == 2 and not report[0]["diagnosis"]["passed"] and report[0]["reproducers"]
    assert report[0]["kind"] == "real-model batch" and not report[0]["passed"], report[0]
    assert report[0]["first"]["check"] == report[0]["diagnosis"]["first_check"], report[0]
    checks = report[0]["checks"]
    assert checks["token-preservation"] == "not applicable" and checks[report[0]["diagnosis"]["first_check"]] == "fail"
    from specaudit.contracts.case import Case

    moved = Case.load(next((tmp_path / "repro").glob("transplant_*batch0.json")))
    assert moved.model == "transparent" and not diagnose(run_case(PLANTED, moved)).passed


@pytest.mark.parametrize(
    "bad",
    ["target-missing", "draft-not-a-model", "prompts-missing", "prompts-empty", "prompts-malformed", "device", "rate"],
)
def test_bad_input_exits_2_with_one_line(pair_dirs, prompts_file, tmp_path, capsys, bad: str) -> None:
    """Bad paths, prompts files and options exit 2 with one line on stderr, never a traceback."""
    target, draft = pair_dirs
    argv = audit_argv(pair_dirs, prompts_file)
    if bad == "target-missing":
        argv[2] = str(tmp_path / "nowhere")
    elif bad == "draft-not-a-model":
        argv[4] = str(tmp_path)
    elif bad == "prompts-missing":
        argv[6] = str(tmp_path / "missing.jsonl")
    elif bad == "prompts-empty":
        (tmp_path / "empty.txt").write_text("\n")
        argv[6] = str(tmp_path / "empty.txt")
    elif bad == "prompts-malformed":
        (tmp_path / "bad.jsonl").write_text('{"turns": ["a"]}\n{oops\n')
        argv[6] = str(tmp_path / "bad.jsonl")
    elif bad == "device":
        argv += ["--device", "cuda:7" if not torch.cuda.is_available() else "not-a-device"]
    else:
        argv += ["--check-rate", "1.5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("specaudit: error: ") and err.count("\n") == 1 and "Traceback" not in err


# ---------------------------------------------------------------------------------------
# Sampling and overhead


def test_sampling_rate_decides_snapshots(pair) -> None:
    """I2 snapshots are kept exactly for the calls the seeded sampler draws; I1 sees every call."""
    target, draft, tokenizer = pair
    counts = {}
    for rate in (0.0, 0.5, 1.0):
        (run,) = run_real(
            EQSPEC, target, draft, tokenizer, PROMPTS[:3], batch_size=3, num_draft_tokens=3, max_new_tokens=8,
            sample_rate=rate, seed=7, baseline=False,
        )  # fmt: skip
        assert isinstance(run, RealRun)
        calls = run.recording.target_calls
        sampler = make_sampler(7, 0, rate)
        assert [c.sampled for c in calls] == [sampler(i) for i in range(len(calls))]
        assert [bool(c.cache_after) for c in calls] == [c.sampled for c in calls]
        assert diagnose(run).passed
        counts[rate] = (run.sampled_calls, len(calls))
    assert counts[0.0][0] == 0 and counts[1.0][0] == counts[1.0][1]
    assert 0 < counts[0.5][0] < counts[0.5][1]


def test_measure_overhead_reports_each_rate(pair) -> None:
    """The overhead measurement runs the decoder at each sampling rate and checks the right calls, with
    I2's reference K/V from the oracle's kept cache and from a batch-size-1 re-run side by side."""
    target, draft, tokenizer = pair
    eos, pad = special_ids(tokenizer)
    case = real_case(
        tokenize(tokenizer, PROMPTS[:3]), num_draft_tokens=3, max_new_tokens=8, eos_token_id=eos,
        pad_token_id=pad, model="tiny", dtype="float64",
    )  # fmt: skip
    rows = measure_overhead(EQSPEC, target, draft, case, rates=(1.0, 0.0), repeats=1, references=("oracle", "rerun"))
    assert [(r.rate, r.reference) for r in rows] == [(1.0, "oracle"), (1.0, "rerun"), (0.0, "oracle"), (0.0, "rerun")]
    assert rows[0].sampled_calls == rows[0].target_calls > 0 and rows[2].sampled_calls == 0
    assert all(r.baseline_seconds > 0 and r.instrumented_seconds > 0 for r in rows)
    assert "rate 1.00" in rows[0].render() and "(oracle reference)" in rows[0].render()
    with pytest.raises(ValueError, match="unknown I2 reference"):
        measure_overhead(EQSPEC, target, draft, case, references=("cached",))


# ---------------------------------------------------------------------------------------
# Transplant


def test_transplant_replays_the_acceptance_on_the_cpu(pair) -> None:
    """A passing real-model batch transplants to a transparent case with the same shape and rounds."""
    target, draft, tokenizer = pair
    for run in run_real(
        EQSPEC, target, draft, tokenizer, PROMPTS, batch_size=5, num_draft_tokens=3, max_new_tokens=12,
        sample_rate=0.25, baseline=False,
    ):  # fmt: skip
        assert audit_batch(run).passed
        moved = transplant(run)
        case = moved.case
        assert (case.model, case.draft) == ("transparent", "scripted")
        assert [len(p) for p in case.prompts] == [len(p) for p in run.case.prompts]
        assert case.prompts[0] == case.prompts[3] and len(set(case.prompts)) == len(set(run.case.prompts))
        assert (case.num_draft_tokens, case.max_new_tokens) == (3, 12)
        assert moved.stops_reproduced == len(case.prompts)
        replay = run_case(EQSPEC, case)
        assert diagnose(replay).passed
        assert round_shape(observed_rounds(replay)) == round_shape(moved.rounds)
        assert any(r.accepted for rounds in moved.rounds for r in rounds)  # some drafts kept,
        assert any(r.accepted < r.offered for rounds in moved.rounds for r in rounds)  # some rejected: ragged


def test_transplant_of_a_planted_bug_fails_on_the_cpu(pair) -> None:
    """With a planted bug the real-model run fails, and so does its transplant."""
    target, draft, tokenizer = pair
    (run,) = run_real(
        PLANTED, target, draft, tokenizer, PROMPTS[:3], batch_size=3, num_draft_tokens=3, max_new_tokens=10,
        sample_rate=1.0, baseline=False,
    )  # fmt: skip
    real = audit_batch(run)
    assert not real.passed and real.first_check == "I2" and real.signature == "kv-drift"
    replay = diagnose(run_case(PLANTED, transplant(run).case))
    assert not replay.passed and replay.first_check == "I2"


def test_prompt_mapping_keeps_prompts_apart() -> None:
    """Distinct real prompts stay distinct in the transparent vocabulary, duplicates stay duplicates."""
    prompts = ((5,), (133,), (261,), (5,), (7, 300), (7, 44))
    images = map_prompts(prompts, horizon=8)
    assert [len(p) for p in images] == [len(p) for p in prompts]
    assert images[0] == images[3] and len(set(images)) == 5
    assert all(0 <= t < 128 for p in images for t in p)


def test_checks_target_wrapper_computes_the_same(pair) -> None:
    """The device wrapper the checks use off the CPU gives the oracle and reference K/V unchanged."""
    from specaudit.reference.oracle import greedy_oracle, reference_kv

    target = pair[0]
    wrapped = OnDevice(target)
    prompt = (5, 17, 3, 99)
    assert greedy_oracle(wrapped, prompt, max_new_tokens=6, eos_token_id=None) == greedy_oracle(
        target, prompt, max_new_tokens=6, eos_token_id=None
    )
    for (k, v), (k2, v2) in zip(reference_kv(wrapped, prompt + (8,)), reference_kv(target, prompt + (8,))):
        assert torch.equal(k, k2) and torch.equal(v, v2)


def hook_count(model: torch.nn.Module) -> int:
    """Every module hook on `model`: what a run may not leave behind."""
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
    return sum(len(getattr(m, kind)) for m in model.modules() for kind in kinds)


@pytest.mark.parametrize(
    "mutant, rule",
    [
        ("mutates_model", "models-unchanged"),
        ("forward_bypass", "unobserved-forward"),
        ("mutates_inputs", "inputs-unchanged"),
    ],
)
def test_real_model_runs_keep_the_whole_contract(pair, mutant: str, rule: str) -> None:
    """Real-model mode applies the batch mode's contract guard: each planted contract bug breaks
    its own rule (not an accidental I1), and no hook is left on the caller's models."""
    target, draft, tokenizer = pair
    before = hook_count(target), hook_count(draft)
    runs = run_real(
        f"specaudit.reference.mutants:{mutant}", target, draft, tokenizer, PROMPTS[:2], batch_size=2, max_new_tokens=4
    )
    errors = [run.error.rule if run.error else None for run in runs]
    assert errors == [rule], f"got {errors}, but should be [{rule!r}]"
    assert (hook_count(target), hook_count(draft)) == before, "a run left hooks on the caller's models"
    clean = run_real(EQSPEC, target, draft, tokenizer, PROMPTS[:2], batch_size=2, max_new_tokens=4)
    assert diagnose(clean[0]).passed, diagnose(clean[0]).render()


def test_a_failing_verdict_is_on_disk_before_its_reproducers(pair_dirs, prompts_file, tmp_path, monkeypatch) -> None:
    """An audit cut off after a failing batch's diagnosis (its step's time running out while the
    reproducers are written) has already written that batch's verdict, flagged incomplete."""
    from specaudit.audits import realaudit

    def cut_off(*args, **kwargs):
        raise KeyboardInterrupt  # what `timeout` leaves of the rest of the step

    monkeypatch.setattr(realaudit, "write_reproducers", cut_off)
    argv = audit_argv(pair_dirs, prompts_file, "--decoder", PLANTED, "--check-rate", "0.25", "--out", str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["complete"] is False and len(report["entries"]) == 1, report
    assert not report["entries"][0]["passed"] and report["entries"][0]["first"]["check"], report["entries"][0]
