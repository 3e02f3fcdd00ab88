"""`specaudit audit-vllm` without vLLM: /metrics parsing on a captured sample, the report, the server lifecycle.

The lifecycle tests start small real child processes (a standard-library HTTP server) and prove that
their process group is gone after success, an exception, a /health timeout, an early exit and a signal.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from specaudit.adapters.vllm.drafts import DRAFTS_ENV
from specaudit.adapters.vllm.lifecycle import SERVER_ARGS, ServerError, check_python, free_port, server_command, serving
from specaudit.adapters.vllm.metrics import SpecCounts, parse_metrics
from specaudit.adapters.vllm.report import (
    NOTHING_ACCEPTED,
    ConfigurationOutcome,
    from_report,
    peak_in_flight,
    render_markdown,
    write_reports,
)
from specaudit.adapters.vllm.server import (
    BLACKBOX_LENGTHS,
    DISAGREE,
    SERVER_BLOCKS,
    WHITEBOX,
    boundary_prompts,
    sampling_size,
    server_block,
    server_env,
    speculative_config,
    whitebox_arguments,
)
from specaudit.config.settings import VLLM_CONFIGURATIONS, VllmAuditSettings
from specaudit.contracts.errors import UsageError

DATA = Path(__file__).resolve().parents[1] / "data"

HEALTHY = textwrap.dedent(
    """
    import http.server, os, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print("server", os.getpid(), "grandchild", child.pid, flush=True)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
    """
)
NEVER_HEALTHY = 'import os, time; print("server", os.getpid(), "grandchild", 0, flush=True); time.sleep(120)'


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def pids_in(log: Path) -> list[int]:
    """The server's and its grandchild's pids, as the child printed them to its log."""
    words = log.read_text().split()
    assert words[:1] == ["server"], f"child log {log} holds {words[:6]}, should start with 'server PID'"
    return [int(words[1])] + ([int(words[3])] if int(words[3]) else [])


def healthy_command(port: int) -> list[str]:
    return [sys.executable, "-c", HEALTHY, str(port)]


def assert_gone(pids: list[int], where: str) -> None:
    left = [pid for pid in pids if alive(pid)]
    assert not left, f"processes {left} still running after {where}, should all have been stopped"


# ---------------------------------------------------------------------------------------
# /metrics


def test_metrics_counts_from_a_real_vllm_sample() -> None:
    before = SpecCounts.from_metrics(parse_metrics((DATA / "vllm_metrics_before.txt").read_text()))
    after = SpecCounts.from_metrics(parse_metrics((DATA / "vllm_metrics_after.txt").read_text()))
    assert before == SpecCounts(0.0, 0.0, 0.0, 0.0), f"fresh server counts {before}, should be all zero"
    delta = after - before
    want = SpecCounts(22.0, 88.0, 9.0, 0.0)
    assert delta == want, f"counts {delta}, should be 22 drafts, 88 drafted, 9 accepted, no preemption"
    preempted = parse_metrics('vllm:num_preemptions_total{engine="0"} 3.0\n')
    assert SpecCounts.from_metrics(preempted).preemptions == 3.0, preempted
    hits = parse_metrics('vllm:prefix_cache_hits_total{engine="0"} 32.0\nvllm:prefix_cache_hits_created 1.7e9\n')
    assert SpecCounts.from_metrics(hits).prefix_hits == 32.0, hits
    assert delta.acceptance == pytest.approx(9 / 88), f"acceptance {delta.acceptance}, should be 9/88"


def test_metrics_sum_labels_and_skip_comments_and_created_gauges() -> None:
    text = (
        "# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.\n"
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="a b"} 3.0\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="a b"} 4.0 1700000000\n'
        'vllm:spec_decode_num_accepted_tokens_created{engine="0"} 1.79e+09\n'
        "plain_counter 5\n"
        "garbage line with no number\n"
    )
    metrics = parse_metrics(text)
    assert metrics["vllm:spec_decode_num_accepted_tokens_total"] == 7.0, f"summed to {metrics}, should be 7"
    assert metrics["plain_counter"] == 5.0, f"unlabelled sample read as {metrics.get('plain_counter')}, should be 5"
    assert SpecCounts.from_metrics(metrics).accepted == 7.0, "the _created gauge must not count as accepted"
    assert "garbage" not in metrics, f"an unparsable line became a metric: {metrics}"


def test_no_drafts_means_no_acceptance_rate() -> None:
    assert SpecCounts().acceptance is None, "an acceptance rate with nothing drafted should be None"


# ---------------------------------------------------------------------------------------
# The report


def outcome(
    configuration: str, accepted: float, *, passed: bool = True, error: str = "", whitebox: dict | None = None
) -> ConfigurationOutcome:
    spec = None if configuration == "control" else {"method": configuration}
    drafted = 0.0 if spec is None else 40.0
    return ConfigurationOutcome("tiny", configuration, spec, passed, "diverged (requests [3])" if not passed else
                                "exact", requests=8, overlapped=8, peak_in_flight=6, exact_match=1.0 if passed else 0.5,
                                partial_match=1.0, counts=SpecCounts(10, drafted, accepted, 2, 32), error=error,
                                whitebox=whitebox)  # fmt: skip


def whitebox(passed: bool = True, ragged: float | None = 0.3) -> dict:
    acceptance = {"rate": 0.9, "ragged_share": ragged, "lengths": {"7": 4, "1": 9, "3": 2}}
    warnings = [] if ragged is not None and ragged >= 0.05 else ["ragged acceptance 0.00 (below 0.05)"]
    violations = [] if passed else [{"check": "contract", "rule": "max-new-tokens", "found": "7 tokens for 2"}]
    return {"passed": passed, "examples": 6, "preemptions": 3, "acceptance": acceptance, "seconds": 40.0,
            "warnings": warnings, "violations": violations, "reproducer": "out/vllm_paged.json"}  # fmt: skip


def test_report_warns_when_nothing_was_accepted() -> None:
    text = render_markdown([outcome("control", 0), outcome("ngram", 0), outcome("draft", 12)])
    warned = [line for line in text.splitlines() if NOTHING_ACCEPTED in line]
    assert len(warned) == 1 and "ngram" in warned[0], f"warnings {warned}, should be one, for ngram only"
    assert "proves little" in NOTHING_ACCEPTED, f"warning text {NOTHING_ACCEPTED!r} should say it proves little"
    assert "| tiny | draft | PASS | 1.00 | 1.00 | 8 of 8 / 6 | 40 | 12 | 0.30 |" in text, f"draft row missing:\n{text}"
    assert "3 of 3 configurations passed (both levels)." in text, f"summary wrong:\n{text}"
    assert "Level of evidence: black box output level only" in text, f"no level of evidence in:\n{text}"


def test_report_shows_failures_and_errors() -> None:
    text = render_markdown([outcome("draft", 5, passed=False), outcome("ngram", 0, passed=False, error="boom\nx")])
    assert "| tiny | draft | FAIL |" in text, f"failed row not marked FAIL:\n{text}"
    assert "diverged (requests [3])" in text, f"the failing verdict is not shown:\n{text}"
    assert "ERROR: boom" in text, f"the server error is not shown:\n{text}"
    assert "0 of 2 configurations passed (both levels)." in text, f"summary wrong:\n{text}"


def test_report_shows_the_white_box_per_configuration() -> None:
    """Each row carries the white box's verdict, workloads drawn, preemptions, the drafts a query
    verified (least-most), acceptance and ragged share; a failing white box fails the
    configuration, a low ragged share is flagged."""
    rows = [outcome("ngram", 3, whitebox=whitebox()), outcome("draft", 3, whitebox=whitebox(False, None))]
    text = render_markdown(rows)
    assert "| PASS | 6 | 3 | 1-7 | 0.90 | 0.30 | 40 |" in text, f"white-box cells missing:\n{text}"
    assert "| FAIL | 6 | 3 | 1-7 | 0.90 | - | 40 |" in text, f"failing white box not shown:\n{text}"
    assert "white box FAIL: contract/max-new-tokens" in text and "out/vllm_paged.json" in text, text
    assert "white box: ragged acceptance" in text, f"the low ragged share is not flagged:\n{text}"
    assert "1 of 2 configurations passed (both levels)." in text, f"summary wrong:\n{text}"
    assert [o.all_passed for o in rows] == [True, False]


def test_json_outcome_carries_warnings_and_counts() -> None:
    data = outcome("ngram", 0).to_json()
    assert data["warnings"] == [NOTHING_ACCEPTED], f"json warnings {data['warnings']}, should be the nothing-accepted"
    want = {"drafts": 10, "drafted": 40.0, "accepted": 0, "preemptions": 2, "prefix_hits": 32, "acceptance": 0.0}
    assert data["counts"] == want, f"{data['counts']}"


def test_a_black_box_that_never_preempted_or_hit_the_prefix_cache_is_flagged() -> None:
    """By the server's own counters: a pass whose requests reached neither a preemption nor a
    prefix-cache hit says nothing of them, and says so (a warning, not a failure)."""
    reached = outcome("draft", 3)
    assert reached.unexercised == [] and not any("flagged" in w for w in reached.warnings)
    bare = ConfigurationOutcome(**{**reached.__dict__, "counts": SpecCounts(10, 40.0, 3.0)})
    assert bare.unexercised == ["a preemption", "a prefix-cache hit"] and bare.all_passed
    assert "flagged: the black box's requests never reached a prefix-cache hit" in render_markdown([bare])
    sampled = ConfigurationOutcome(**{**bare.__dict__, "sampling": {"passed": True, "counts": {"preemptions": 23.0}}})
    assert sampled.unexercised == ["a prefix-cache hit"], "the sampling black box's preemptions count"
    assert "| 0 / 23 |" in render_markdown([sampled])


def test_reports_written_with_version_and_verdicts(tmp_path: Path) -> None:
    settings = VllmAuditSettings(models=("tiny",), out=tmp_path / "vllm")
    text = write_reports(settings, [outcome("control", 0), outcome("ngram", 0)], 12.0, "0.32.0")
    data = json.loads((tmp_path / "vllm" / "report.json").read_text())
    assert (tmp_path / "vllm" / "report.md").read_text() == text, "report.md differs from the text returned"
    assert "vLLM 0.32.0" in text and data["vllm"] == "0.32.0", f"vLLM version missing: {text.splitlines()[2]}"
    configurations = data["entries"]
    assert data["passed"] is True and [c["configuration"] for c in configurations] == ["control", "ngram"]
    assert {c["kind"] for c in configurations} == {"vllm configuration"}, configurations
    assert configurations[1]["warnings"] == [NOTHING_ACCEPTED], f"{configurations[1]}"


def test_reports_have_an_entry_per_level_per_configuration(tmp_path: Path) -> None:
    settings = VllmAuditSettings(models=("tiny",), out=tmp_path / "vllm")
    write_reports(settings, [outcome("ngram", 3, whitebox=whitebox(False))], 12.0, "0.32.0")
    entries = json.loads((tmp_path / "vllm" / "report.json").read_text())["entries"]
    levels = [(e["kind"], e["subject"]["level"], e["passed"]) for e in entries]
    assert levels == [("vllm configuration", "black box", True), ("vllm white box", "white box", False)], levels
    assert entries[1]["examples"] == 6 and entries[1]["acceptance"]["ragged_share"] == 0.3, entries[1]


def test_figures_from_a_blackbox_report() -> None:
    spans = [(0.0, 2.0, True), (1.0, 3.0, True), (2.5, 4.0, True), (5.0, 6.0, False)]
    rows = [{"start": s, "end": e, "overlapped": o} for s, e, o in spans]
    report = {"passed": True, "verdict": "exact", "requests": rows, "exact_match": 1.0, "partial_match": 1.0,
              "seconds": 6.0, "oracle_seconds": 2.0}  # fmt: skip
    figures = from_report(report)
    assert (figures["overlapped"], figures["peak_in_flight"]) == (3, 2), f"figures {figures}, should be 3 and peak 2"
    assert (figures["stop_strings"], figures["ended_at_stop"]) == (0, 0)
    rows[0] |= {"stop": "w5", "tokens": [5], "max_new_tokens": 4}
    rows[1] |= {"stop": "w6", "tokens": [6] * 4, "max_new_tokens": 4}
    figures = from_report(report)
    assert (figures["stop_strings"], figures["ended_at_stop"]) == (2, 1), figures
    outcome = ConfigurationOutcome("tiny", "control", None, True, "exact", stop_strings=2, ended_at_stop=1)
    assert "2 requests carried one, 1 ended short of max_tokens" in render_markdown([outcome])
    assert peak_in_flight([(0, 1), (1, 2)]) == 2, "a request answered as another is sent should count as overlapping"


# ---------------------------------------------------------------------------------------
# Settings and the server command


def test_server_command_per_configuration(tmp_path: Path) -> None:
    assert speculative_config("control", tmp_path) is None, "the control must run without speculation"
    assert speculative_config("ngram", tmp_path)["method"] == "ngram"
    draft = speculative_config("draft", tmp_path)
    assert draft == {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 4}, f"{draft}"
    command = server_command("py", tmp_path, 1234, draft)
    assert command[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"], f"command starts {command[:3]}"
    assert command[-2] == "--speculative-config" and '"draft_model"' in command[-1], f"command ends {command[-2:]}"
    assert "--speculative-config" not in server_command("py", tmp_path, 1234, None), "control got a spec config"
    with pytest.raises(UsageError, match="unknown configuration"):
        speculative_config("eagle", tmp_path)
    own = speculative_config("self-draft", tmp_path / "d", tmp_path / "t")
    assert own == {"method": "draft_model", "model": str(tmp_path / "t"), "num_speculative_tokens": 5}, own
    assert speculative_config("disagree", tmp_path / "d", tmp_path / "t") == own  # its drafts shaped by the plugin


@pytest.mark.parametrize(("requests", "tokens"), [(8, 24), (16, 32)], ids=["smoke", "full"])
def test_the_blackbox_server_cache_holds_one_longest_request_but_not_the_sampled_ones(
    requests: int, tokens: int
) -> None:
    """`--num-gpu-blocks-override`: vLLM refuses a cache below `--max-model-len` (one block is its null
    block); the sampling black box's requests run to their limits, and `--max-num-seqs` of them need
    more than twice the cache's blocks, so the server preempts and recomputes requests whatever
    the timing (CI's 8 greedy requests of 24 tokens, the full audit's 16 of 32)."""
    block = server_block("tiny")
    blocks = int(block[block.index("--num-gpu-blocks-override") + 1])
    size = int(block[block.index("--block-size") + 1])
    length = int(SERVER_ARGS[SERVER_ARGS.index("--max-model-len") + 1])
    assert (blocks - 1) * size >= length, f"{blocks} blocks of {size} cannot hold one request of {length}"
    assert set(SERVER_BLOCKS) == set(VllmAuditSettings().models) and min(SERVER_BLOCKS.values()) == blocks
    assert length >= max(BLACKBOX_LENGTHS) + VllmAuditSettings().max_new_tokens
    prompts, _ = sampling_size(requests)
    needed = [-(-(len(p) + tokens) // size) for p in boundary_prompts(512, prompts, seed=0)]
    in_flight = int(SERVER_ARGS[SERVER_ARGS.index("--max-num-seqs") + 1])
    assert in_flight * sum(needed) / len(needed) > 2 * (blocks - 1), (needed, blocks)


def test_blackbox_prompts_sit_on_both_sides_of_block_boundaries() -> None:
    """With the server's 32-token blocks, prompts end just before and just after a boundary, and
    repeat a motif (so drafts are found); the same seed gives the same prompts."""
    prompts = boundary_prompts(512, 8, seed=3)
    lengths = [len(p) for p in prompts]
    assert {31, 33, 64, 65} <= set(lengths) and max(lengths) > 64, lengths
    assert all(4 <= t < 512 for p in prompts for t in p)
    assert all(p[: len(p) // 2] and any(p[i] == p[i + k] for k in range(2, 6) for i in range(5)) for p in prompts)
    assert boundary_prompts(512, 8, seed=3) == prompts != boundary_prompts(512, 8, seed=4)
    shared = [i for i, p in enumerate(prompts) if any(p[:32] == q[:32] for q in prompts[:i] if len(q) >= 32)]
    assert shared and all(i % 2 and len(prompts[i]) > 32 for i in shared), shared  # a full block for the cache


def test_whitebox_configurations_cover_the_layouts_hard_paths(tmp_path: Path) -> None:
    """Together the white box's engines take small blocks and the default, chunked prefill, a KV
    cache small enough to preempt, prefix caching on and off, K 7 (each workload's drawn from 1 to
    7), every drafter, and the target drafting for itself with a share of its drafts made wrong."""
    options = list(WHITEBOX.values())
    assert {o.block_size for o in options} == {32, 128} and {o.prefix_caching for o in options} == {True, False}
    assert any(o.kv_blocks for o in options) and any(o.max_num_batched_tokens for o in options)
    assert {o.method for o in options} == {"none", "ngram", "draft", "self-draft"} and set(WHITEBOX) == set(
        VLLM_CONFIGURATIONS
    )
    assert {o.k for o in options if o.method != "none"} == {7}
    assert [o.disagree for o in options if o.disagree] == [DISAGREE] and 0.1 <= DISAGREE <= 0.5
    for o in options:
        if o.kv_blocks is not None:
            room = (o.kv_blocks - 1) * o.block_size  # vLLM keeps one block aside (its null block)
            assert room >= o.max_model_len, f"{o}: vLLM refuses a cache below max_model_len"
    args = whitebox_arguments(WHITEBOX["draft"], tmp_path / "t", tmp_path / "d")
    assert args[args.index("--draft") + 1] == str(tmp_path / "d") and "--prefix-caching" in args, args
    args = whitebox_arguments(WHITEBOX["disagree"], tmp_path / "t", tmp_path / "d")
    assert args[args.index("--disagree") + 1] == str(DISAGREE) and "--draft" not in args, args
    assert server_env("disagree") == {DRAFTS_ENV: f"disagree={DISAGREE}"} and server_env("self-draft") == {}


@pytest.mark.parametrize("configuration", sorted(WHITEBOX))
def test_each_white_box_engine_is_toured_before_the_draws(configuration: str) -> None:
    """The fixed workload judged first (`whitebox.tour`) fits the engine's `max_model_len` with K
    slots to spare, and reaches every feature the engine enables however few workloads are drawn:
    two identical prompts of a full block and more arriving together and one later (prefix hits in
    the step and across steps), a prompt longer than a step's token budget (chunked), more blocks
    in flight than a small cache holds (preemption)."""
    from specaudit.adapters.vllm.whitebox import Features, Shape, tour

    options = WHITEBOX[configuration]
    workload = tour(Shape(512, options.block_size, 48, 48, max_k=options.k if options.method != "none" else 0), options)
    lengths = [len(r.prompt) + r.max_tokens for r in workload.requests]
    assert all(r.max_tokens >= 1 for r in workload.requests) and max(lengths) + options.k < options.max_model_len
    shared = [r for r in workload.requests if r.prompt == workload.requests[0].prompt]
    enabled = Features.enabled(options)
    if "prefix hits in the step" in enabled:
        assert len(shared[0].prompt) > options.block_size and [r.arrival for r in shared] == [0, 0, 3]
    if options.max_num_batched_tokens is not None:
        assert max(len(r.prompt) for r in workload.requests) > options.max_num_batched_tokens
    if options.kv_blocks is not None:
        blocks = sum(-(-n // options.block_size) for n in lengths[:2]) - options.prefix_caching  # one shared
        assert blocks > options.kv_blocks - 1, (blocks, options)  # the pair in flight together overflows
    assert workload.k == (options.k or None)
    assert configuration != "draft" or enabled == ()  # vLLM's block of 128 at a length of 128: nothing to cross


def test_settings_and_python_are_checked(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="unknown"):
        VllmAuditSettings(models=("tiny", "gpt9"))
    with pytest.raises(UsageError, match="no vLLM python"):
        check_python(str(tmp_path / "missing" / "python"))
    with pytest.raises(UsageError, match="cannot import vllm"):
        check_python(sys.executable)  # the project venv has no vLLM (it needs an older transformers)


# ---------------------------------------------------------------------------------------
# The server lifecycle, with a real child process


def test_server_stopped_after_success(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "server.log"
    with serving(healthy_command(port), f"http://127.0.0.1:{port}", log, 20.0) as server:
        pids = pids_in(log)
        assert pids[0] == server.pid and all(alive(p) for p in pids), f"pids {pids} should run while serving"
    assert_gone(pids, "a successful run")


def test_server_stopped_after_an_exception(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "server.log"
    with pytest.raises(RuntimeError, match="audit failed"):
        with serving(healthy_command(port), f"http://127.0.0.1:{port}", log, 20.0):
            pids = pids_in(log)
            raise RuntimeError("audit failed")
    assert_gone(pids, "an exception in the audit")


def test_server_stopped_when_health_times_out(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "server.log"
    with pytest.raises(ServerError, match=r"did not answer within 1\.5 s(.|\n)*server \d+"):
        with serving([sys.executable, "-c", NEVER_HEALTHY], f"http://127.0.0.1:{port}", log, 1.5):
            pytest.fail("a server that never got healthy was yielded")
    assert_gone(pids_in(log), "a /health timeout")


def test_server_that_exits_early_is_reported_with_its_log(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "server.log"
    crash = 'import sys; print("cannot load the model"); sys.exit(3)'
    with pytest.raises(ServerError, match=r"exited with status 3(.|\n)*cannot load the model"):
        with serving([sys.executable, "-c", crash], f"http://127.0.0.1:{port}", log, 20.0):
            pytest.fail("a server that exited was yielded")


def test_server_stopped_on_sigterm(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "server.log"
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with serving(healthy_command(port), f"http://127.0.0.1:{port}", log, 20.0):
            pids = pids_in(log)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5.0)
            pytest.fail("SIGTERM did not interrupt the audit")
    assert_gone(pids, "SIGTERM to the audit")
    assert signal.getsignal(signal.SIGTERM) == before, "the SIGTERM handler was not restored"


def test_cli_bad_input_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from specaudit.commands.cli import main

    assert main(["audit-vllm", "--vllm-python", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no vLLM python" in err[0], f"stderr {err}, should be one line naming the python"
    assert main(["audit-vllm", "--models", "gpt9"]) == 2, "an unknown served model should be a usage error"


def test_a_kv_cache_smaller_than_the_model_length_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM would refuse to start with a traceback; the white box says which option to change, in one line."""
    from specaudit.commands.cli import main

    argv = ["whitebox-vllm", "--model", "m", "--json", "out.json", "--block-size", "32", "--kv-blocks", "5",
            "--max-model-len", "512"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give a --max-model-len of at most 128" in err, err
