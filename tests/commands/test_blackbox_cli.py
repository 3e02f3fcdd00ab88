"""`specaudit blackbox` from the command line: exit 0 for an engine whose outputs are the oracle's,
1 for one that diverges (with the reproducer and report written, and replayable), 2 with one line
for bad input (a server not listening, a malformed URL, an engine spec that does not load, a
target that is not there).

Servers are real HTTP servers on 127.0.0.1 in a thread (`serve` from tests/adapters/test_engine_blackbox.py);
engines named with --engine are the factories below, reached as `tests.commands.test_blackbox_cli:NAME`.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from specaudit.commands.cli import main
from specaudit.fixtures.pairs import draft_model, target_model
from specaudit.reference.engine_mutants import AdmitPositionsFromWidth
from specaudit.reference.engines import EqSpecEngine
from specaudit.reference.oracle import greedy_oracle
from tests.adapters.test_engine_blackbox import EngineApp, serve  # noqa: F401 (serve: the server fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

HERE = "tests.commands.test_blackbox_cli"
FAST = ["--target", "llama", "--requests", "5", "--max-new-tokens", "8", "--seed", "3"]


def engine(cls: type, k: int = 2) -> Any:
    """A continuous-batching engine on the tiny llama pair: it owns its models, as a black box does."""
    target, draft = target_model("llama"), draft_model("llama", "tiny", [])
    return cls(target, draft, num_draft_tokens=k, eos_token_id=None, pad_token_id=0)


def good_engine() -> Any:
    return engine(EqSpecEngine)


def bad_engine() -> Any:
    return engine(AdmitPositionsFromWidth)


def good_generate(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """`generate(prompts, max_new_tokens)`: all prompts added at once to a fresh EQSPEC engine and stepped."""
    e = good_engine()
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        e.add_request(i, p, max_new_tokens)
    while e.has_unfinished():
        for rid, tokens in e.step().items():
            out[rid] += tokens
    return [out[i] for i in range(len(prompts))]


class StopApp:
    """A server that honours the request's stop token as vLLM does (`stop_token_ids` with
    `ignore_eos`), serving the oracle's tokens; `runs_past` ignores the stop token (a planted fault)."""

    def __init__(self, runs_past: bool = False) -> None:
        self.target, self.runs_past = target_model("llama"), runs_past

    def __call__(self, body: dict[str, Any]) -> tuple[int, bytes]:
        stops = [] if self.runs_past else body.get("stop_token_ids") or []
        eos = stops[0] if stops else None
        tokens = greedy_oracle(
            self.target, tuple(body["prompt"]), max_new_tokens=int(body["max_tokens"]), eos_token_id=eos
        )
        choice = {
            "index": 0,
            "token_ids": list(tokens.tokens),
            "finish_reason": "stop" if tokens.stop == "eos" else "length",
        }
        return 200, json.dumps({"choices": [choice]}).encode()


def plan_of(path: Path) -> dict[str, Any]:
    """A black-box reproducer's plan and outcome, the file checked to be the envelope of its kind."""
    data = json.loads(path.read_text())
    assert (data["format"], data["version"], data["kind"]) == ("specaudit-reproducer", 2, "blackbox"), data
    return {**data["subject"], **data["payload"], **data["evidence"]}


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specaudit: error: ") and "Traceback" not in err, err
    return err


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------
# A server


def test_correct_server_passes_and_its_reproducer_replays(serve, tmp_path: Path, capsys) -> None:  # noqa: F811
    """EQSPEC behind HTTP: exit 0, every request exact in the table, the level of evidence stated; the
    reproducer written with --out sends the same requests again."""
    url, seen = serve(EngineApp(good_engine(), step_s=0.02))
    out = tmp_path / "run"
    assert main(["blackbox", "--server", url, *FAST, "--spread", "0.2", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    table = captured.out
    assert "PASS" in table and "output level only" in table and "no I1, no I2" in table, table
    rows = [line.split() for line in table.splitlines() if line.split()[:1] in [[str(i)] for i in range(5)]]
    assert len(rows) == 5 and all(row[5] == "exact" for row in rows), table
    assert "specaudit: sending 5 requests" in captured.err and "request 4: sent at" in captured.err
    repro = plan_of(out / "repro.json")
    assert repro["server"] == url and repro["seed"] == 3 and repro["outcome"]["passed"] is True
    sent = sorted((tuple(b["prompt"]), b["max_tokens"]) for b in seen)
    assert sorted((tuple(r["prompt"]), r["max_new_tokens"]) for r in repro["requests"]) == sent
    assert main(["blackbox", "--replay", str(out / "repro.json"), "--quiet"]) == 0
    again = sorted((tuple(b["prompt"]), b["max_tokens"]) for b in seen[len(sent) :])
    assert again == sent, f"replay sent {again}, first run sent {sent}"
    assert capsys.readouterr().err == "", "--quiet: nothing on stderr"


def test_buggy_server_fails_with_reproducer_and_report(serve, tmp_path: Path, capsys) -> None:  # noqa: F811
    """Positions counted from the batch width for late arrivals: exit 1, the late requests DIVERGED with
    index, found and expected tokens; repro.json and report.json name them."""
    url, _ = serve(EngineApp(bad_engine(), step_s=0.03))
    out = tmp_path / "run"
    argv = ["blackbox", "--server", url, *FAST, "--max-new-tokens", "12", "--spread", "0.25", "--out", str(out)]
    assert main([*argv, "--quiet"]) == 1
    table = capsys.readouterr().out
    assert "FAIL" in table and "DIVERGED" in table and "output level only" in table, table
    (report,) = json.loads((out / "report.json").read_text())["entries"]
    assert report["kind"] == "blackbox" and not report["passed"] and report["signature"] is None, report["first"]
    assert report["first"]["request"] in report["diverged"], report["first"]
    repro = plan_of(out / "repro.json")
    diverged = report["diverged"]
    assert diverged and repro["outcome"]["passed"] is False, report["verdict"]
    assert sorted(int(i) for i in repro["outcome"]["diverged"]) == diverged
    for rid in diverged:
        request = report["requests"][rid]
        i = request["first_divergence"]
        assert request["tokens"][i] != request["expected"][i], request
        row = next(line.split() for line in table.splitlines() if line.split()[:1] == [str(rid)])
        assert row[5:9] == ["DIVERGED", str(i), str(request["tokens"][i]), str(request["expected"][i])], row
    assert [r["prompt"] for r in repro["requests"]] == [r["prompt"] for r in report["requests"]]
    assert [r["arrival"] for r in repro["requests"]] == [r["arrival"] for r in report["requests"]]


def test_json_output_is_the_report(serve, capsys) -> None:  # noqa: F811
    """--json prints the report (every request with its tokens and the oracle's) instead of the table."""
    url, _ = serve(EngineApp(good_engine(), step_s=0.01))
    assert main(["blackbox", "--server", url, *FAST, "--requests", "2", "--json", "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is True and len(report["requests"]) == 2 and "output level only" in report["evidence"]
    assert all(r["tokens"] == r["expected"] and len(r["tokens"]) == 8 for r in report["requests"])


# ---------------------------------------------------------------------------------------
# An in-process engine


@pytest.mark.parametrize(("attr", "status"), [("good_engine", 0), ("bad_engine", 1), ("good_generate", 0)])
def test_engine_spec(attr: str, status: int, capsys) -> None:
    """--engine MODULE:ATTR: a factory of a step-wise engine (correct, planted bug) or a generate() callable."""
    argv = ["blackbox", "--engine", f"{HERE}:{attr}", *FAST, "--spread", "4", "--quiet"]
    assert main(argv) == status
    table = capsys.readouterr().out
    assert ("PASS" if status == 0 else "DIVERGED") in table and "output level only" in table, table
    assert ("[callable]" if attr == "good_generate" else "[steps]") in table


# ---------------------------------------------------------------------------------------
# Bad input: one line, exit 2


def test_unreachable_server_is_a_usage_error(capsys) -> None:
    """Nothing listening on the port: exit 2 before the target is loaded, one line naming host and port."""
    port = free_port()
    assert main(["blackbox", "--server", f"http://127.0.0.1:{port}", "--target", "llama"]) == 2
    assert f"cannot reach the server at 127.0.0.1:{port}" in one_error_line(capsys)


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("127.0.0.1:8000", "not an http(s) URL"),
        ("ftp://127.0.0.1:21", "not an http(s) URL"),
        ("http://", "not an http(s) URL"),
        ("http://127.0.0.1:port", "not a valid URL"),
        ("http://127.0.0.1:99999", "not a valid URL"),
    ],
)
def test_malformed_url_is_a_usage_error(capsys, url: str, words: str) -> None:
    assert main(["blackbox", "--server", url, "--target", "llama"]) == 2
    assert words in one_error_line(capsys)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("nonexistent_module_xyz:make", "engine module 'nonexistent_module_xyz' not found"),
        (f"{HERE}:no_such_factory", "has no attribute 'no_such_factory'"),
        (f"{HERE}", "not of the form module:attr"),
        ("specaudit.reference.engines:EqSpecEngine", "failed to build with no arguments"),
        (f"{HERE}:HERE", "is a str: neither an engine"),
    ],
)
def test_engine_spec_that_does_not_load_is_a_usage_error(capsys, spec: str, words: str) -> None:
    assert main(["blackbox", "--engine", spec, "--target", "llama"]) == 2
    assert words in one_error_line(capsys)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--server", "http://127.0.0.1:1", "--target", "/no/such/model"], "no such directory"),
        (["--server", "http://127.0.0.1:1", "--target", "."], "not a Hugging Face model directory"),
        (["--server", "http://127.0.0.1:1"], "--target is required"),
        (["--target", "llama"], "give --server URL"),
        (["--server", "http://127.0.0.1:1", "--target", "llama", "--requests", "0"], "--requests must be at least 1"),
        (["--replay", "missing.json"], "cannot read reproducer"),
        (["--replay", "pyproject.toml"], "cannot read reproducer"),
        (["--replay", "x.json", "--seed", "2"], "--seed: the reproducer given with --replay fixes"),
        (["--engine", f"{HERE}:good_engine", "--target", "llama", "--out", "pyproject.toml"], "is not a directory"),
    ],
)
def test_other_bad_input_is_a_usage_error(capsys, argv: list[str], words: str) -> None:
    """A target that is not there, missing flags, out-of-range numbers, an unreadable reproducer."""
    assert main(["blackbox", *argv]) == 2
    assert words in one_error_line(capsys)


def test_likely_eos_and_mixed_limits_stop_requests_early_and_replay(serve, tmp_path: Path, capsys) -> None:  # noqa: F811
    """--likely-eos --mixed-max-tokens: the EOS is a token the target emits part-way, sent as the only
    stop token; limits differ; some requests stop at EOS before their limit; the reproducer keeps both
    and its replay sends the same bodies."""
    url, seen = serve(StopApp())
    out = tmp_path / "run"
    argv = ["--target", "llama", "--requests", "8", "--max-new-tokens", "12", "--seed", "1", "--spread", "0.1"]
    assert main(["blackbox", "--server", url, *argv, "--likely-eos", "--mixed-max-tokens", "--out", str(out)]) == 0
    assert "PASS" in capsys.readouterr().out
    repro = plan_of(out / "repro.json")
    eos, limits = repro["eos_token_id"], [r["max_new_tokens"] for r in repro["requests"]]
    assert eos is not None and len(set(limits)) > 1 and limits[0] == 12, (eos, limits)
    assert all(b["stop_token_ids"] == [eos] and b["ignore_eos"] for b in seen)
    (report,) = json.loads((out / "report.json").read_text())["entries"]
    early = [r for r in report["requests"] if r["tokens"] and r["tokens"][-1] == eos and len(r["tokens"]) < 12]
    assert early, f"no request stopped at EOS {eos}: {[r['tokens'] for r in report['requests']]}"
    first = sorted((tuple(b["prompt"]), b["max_tokens"]) for b in seen)
    assert main(["blackbox", "--replay", str(out / "repro.json"), "--quiet"]) == 0
    assert sorted((tuple(b["prompt"]), b["max_tokens"]) for b in seen[len(first) :]) == first


def test_a_server_running_past_the_likely_eos_fails(serve, capsys) -> None:  # noqa: F811
    """The negative control: a server that ignores the stop token runs past EOS and fails."""
    url, _ = serve(StopApp(runs_past=True))
    argv = ["--target", "llama", "--requests", "8", "--max-new-tokens", "12", "--seed", "1", "--likely-eos"]
    assert main(["blackbox", "--server", url, *argv, "--quiet", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["passed"], report["verdict"]
    assert "contract broken" in report["verdict"] and any(r["status"] == "error" for r in report["requests"])
    rules = {v["rule"] for r in report["requests"] if r["status"] == "error" for v in r["violations"]}
    assert rules == {"ends-at-eos"}, rules


def test_likely_eos_with_an_eos_id_is_a_usage_error(capsys) -> None:
    argv = ["blackbox", "--server", "http://127.0.0.1:1", "--target", "llama", "--likely-eos", "--eos-token-id", "2"]
    assert main(argv) == 2
    assert "not both" in one_error_line(capsys)


def test_text_prompts_need_a_tokenizer(tmp_path: Path, capsys) -> None:
    """--prompts with text and a built-in target (no tokenizer): one line saying what to give instead."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\n")
    assert main(["blackbox", "--engine", f"{HERE}:good_engine", "--target", "llama", "--prompts", str(prompts)]) == 2
    assert "holds text" in one_error_line(capsys)


def test_token_id_prompts_are_sent_as_given(serve, tmp_path: Path, capsys) -> None:  # noqa: F811
    """--prompts with token ids (one JSON list per line): exactly those prompts are sent."""
    url, seen = serve(EngineApp(good_engine(), step_s=0.01))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("[5, 6, 7]\n[9, 10]\n")
    assert main(["blackbox", "--server", url, "--target", "llama", "--prompts", str(prompts), "--quiet"]) == 0
    assert sorted(b["prompt"] for b in seen) == [[5, 6, 7], [9, 10]]
    assert "PASS" in capsys.readouterr().out


def test_text_prompts_and_a_model_directory(tmp_path: Path, capsys) -> None:
    """--target as a Hugging Face directory (the tiny llama saved) with text --prompts, tokenized with
    its tokenizer: the engine on the same weights passes, and the reproducer names the directory whole."""
    from specaudit.models.loading import save_tiny_pair, tiny_tokenizer

    target_dir, _ = save_tiny_pair(tmp_path / "models")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\nspeculative decoding\n")
    out = tmp_path / "run"
    argv = ["blackbox", "--engine", f"{HERE}:good_engine", "--target", str(target_dir), "--prompts", str(prompts)]
    assert main([*argv, "--max-new-tokens", "6", "--out", str(out), "--quiet"]) == 0, capsys.readouterr().out
    repro = plan_of(out / "repro.json")
    tokenizer = tiny_tokenizer()
    expected = [tokenizer("hello there")["input_ids"], tokenizer("speculative decoding")["input_ids"]]
    assert [r["prompt"] for r in repro["requests"]] == expected
    assert repro["target"] == str(target_dir.resolve()) and repro["engine"] == f"{HERE}:good_engine"
