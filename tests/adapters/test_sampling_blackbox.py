"""The sampling black box (`adapters.sampling_blackbox`): a served engine's sampled tokens against the
target's exact distribution, without vLLM. A fake completions server samples the built-in tiny Llama
(float64) as a lossless engine would, or with a planted fault; the boundary tolerance, the report's
sampling cells and the vLLM plugin's workarounds are checked on their own."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from specaudit.adapters.engine_blackbox import Request, load_target
from specaudit.adapters.sampling_blackbox import (
    SUPPORT_MARGIN,
    Sample,
    audit_sampling_server,
    exact_logits,
    favouring,
    judge_samples,
    prompt_cache,
    sampling_requests,
    tolerant_distribution,
    within_noise,
)
from specaudit.adapters.vllm.report import ConfigurationOutcome, render_markdown, write_reports
from specaudit.adapters.vllm.server import sampling_size, workaround_env
from specaudit.config.settings import VllmAuditSettings
from specaudit.contracts.sampling import Sampling, target_distribution
from specaudit.reference.vllm_mutants import (
    BY_NAME,
    CPU_EXPAND,
    CPU_REWIND,
    MUTANTS,
    SAMPLING_MUTANTS,
    WORKAROUNDS,
    WORKAROUNDS_ENV,
    plant_from_env,
)

SETTINGS = Sampling(temperature=1.0, top_k=12, top_p=0.9)
PROMPTS = [[5, 9, 11, 5, 9], [17, 3, 17, 3, 17, 3, 40], [60]]


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return load_target("llama")  # the built-in tiny Llama in float64: its top token holds 0.3-0.6


# ---------------------------------------------------------------------------------------
# A fake sampling server: the lossless engine, and planted faults


def sample_request(model: torch.nn.Module, body: dict[str, Any], fault: str) -> list[int]:
    """`max_tokens` draws from the body's settings with the body's seed, step by step at batch size 1."""
    sampling = Sampling(body["temperature"], body.get("top_k"), body.get("top_p"))
    if fault == "hot":
        sampling = Sampling(2.0 * sampling.temperature, sampling.top_k, sampling.top_p)
    generator = torch.Generator().manual_seed(body["seed"])
    tokens = list(body["prompt"])
    with torch.no_grad():
        for step in range(body["max_tokens"]):
            logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]  # [V]
            if fault == "outside" and step == 2:
                tokens.append(int(logits.argmin()))  # a token top-k drops by far
                continue
            tokens.append(int(torch.multinomial(target_distribution(logits, sampling), 1, generator=generator)))
    out = tokens[len(body["prompt"]) :]
    return out[:-1] if fault == "short" else out


class Server(ThreadingHTTPServer):
    request_queue_size = 128  # every request at once, as a serving engine's listener takes them
    daemon_threads = True


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body)  # type: ignore[attr-defined]
        tokens = sample_request(self.server.model, body, self.server.fault)  # type: ignore[attr-defined]
        payload = json.dumps({"choices": [{"index": 0, "token_ids": tokens, "finish_reason": "length"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


@pytest.fixture
def serve(llama: torch.nn.Module) -> Iterator[Callable[[str], tuple[str, list[dict[str, Any]]]]]:
    """A sampling server on 127.0.0.1 (port 0) with a fault ("" for none); (url, bodies seen)."""
    servers: list[ThreadingHTTPServer] = []

    def start(fault: str) -> tuple[str, list[dict[str, Any]]]:
        server = Server(("127.0.0.1", 0), Handler)
        server.model, server.fault, server.seen = llama, fault, []  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", server.seen  # type: ignore[attr-defined]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def audit(url: str, llama: torch.nn.Module, per_prompt: int = 16) -> Any:
    return audit_sampling_server(url, llama, PROMPTS, sampling=SETTINGS, per_prompt=per_prompt, max_new_tokens=12,
                                 seed=3, spread_s=0.1, timeout_s=60)  # fmt: skip


def test_a_lossless_server_passes_and_each_request_carries_its_own_seed(serve, llama) -> None:
    """Draws of the exact p, 16 per prompt: the pooled fit passes with its bound and power stated;
    every request asked for the settings, token ids, no stop token and a seed of its own."""
    url, seen = serve("")
    verdict = audit(url, llama)
    assert verdict.passed, [v.render() for v in verdict.violations]
    assert verdict.tokens == 3 * 16 * 12 and verdict.fit.bound < 0.15 and "lossless in distribution" in verdict.verdict
    assert not verdict.flat and verdict.mean_top > 0.3, verdict.mean_top
    assert len({b["seed"] for b in seen}) == len(seen) == 48, "requests share a seed"
    assert all(b["temperature"] == 1.0 and b["top_k"] == 12 and b["top_p"] == 0.9 for b in seen)
    assert all(b["return_token_ids"] and b["ignore_eos"] and "stop_token_ids" not in b for b in seen)
    data = verdict.to_json()
    assert data["passed"] and len(data["samples"]) == 48 and data["fit"]["bound"] == verdict.fit.bound


@pytest.mark.parametrize(
    ("fault", "rule"),
    [("hot", "pooled-fit"), ("outside", "impossible-token"), ("short", "token-count")],
    ids=["wrong-temperature", "outside-top-k", "a-token-short"],
)
def test_a_faulty_server_fails_with_its_rule(serve, llama, fault: str, rule: str) -> None:
    """A sampler at twice the temperature fails the fit; one that emits a token top-k drops by far,
    the impossible-token rule; an answer a token short, the output contract."""
    url, _ = serve(fault)
    verdict = audit(url, llama)
    assert not verdict.passed and rule in {v.rule for v in verdict.violations}, verdict.verdict


def test_plan_interleaves_prompts_with_distinct_seeds() -> None:
    planned = sampling_requests(PROMPTS, 4, 8, seed=1, spread_s=0.5)
    assert [p for _, p, _ in planned] == [0, 1, 2] * 4 and len({s for _, _, s in planned}) == 12
    assert all(r.max_new_tokens == 8 and 0 <= r.arrival <= 0.5 for r, _, _ in planned)
    assert sampling_requests(PROMPTS, 4, 8, seed=1, spread_s=0.5) == planned != sampling_requests(PROMPTS, 4, 8, 2, 0.5)


def test_the_prompt_cache_gives_the_full_forwards_logits(llama) -> None:
    """A request scored after a copy of its prompt's cache gets the logits of one forward over it all."""
    prompt, tokens = PROMPTS[1], [8, 99, 3, 3]
    cached = exact_logits(llama, prompt, tokens, prompt_cache(llama, prompt))
    with torch.no_grad():
        full = llama(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    assert cached.shape == (4, llama.config.vocab_size) and torch.allclose(cached, full.double(), atol=1e-10)
    assert torch.equal(
        exact_logits(llama, [60], [1, 2], prompt_cache(llama, [60])), exact_logits(llama, [60], [1, 2], None)
    )


# ---------------------------------------------------------------------------------------
# The boundary tolerance


def test_a_token_just_outside_top_k_is_within_the_noise_one_far_outside_is_not() -> None:
    logits = torch.tensor([5.0, 4.0, 3.0, 3.0 - SUPPORT_MARGIN / 2, 1.0], dtype=torch.float64)
    top3 = Sampling(1.0, 3)
    assert target_distribution(logits, top3)[3] == 0 and within_noise(logits, 3, top3)
    assert not within_noise(logits, 4, top3)
    moved = favouring(logits, 3, SUPPORT_MARGIN)
    assert torch.allclose((moved - logits).abs(), torch.full_like(logits, SUPPORT_MARGIN)) and moved[3] > moved[2]


def test_a_token_just_past_top_p_is_within_the_noise() -> None:
    """Two tokens of 0.6 and 0.4 (nearly): top-p 0.6 keeps the first alone, by a hair."""
    logits = torch.tensor([0.0, -0.4054651 - 1e-4, -30.0], dtype=torch.float64)  # p ~ (0.6, 0.4)
    top_p = Sampling(1.0, None, 0.6)
    assert target_distribution(logits, top_p)[1] == 0 and within_noise(logits, 1, top_p)
    assert not within_noise(logits, 2, top_p)


def test_only_boundary_tokens_get_the_perturbed_distribution() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 3.0 - 1e-3, 1.0]] * 3, dtype=torch.float64)  # [3, V]
    top3 = Sampling(1.0, 3)
    p, near = tolerant_distribution(logits, [0, 3, 4], top3)
    assert near == [1] and p[1, 3] > 0 and torch.equal(p[0], target_distribution(logits[0], top3))
    assert p[2, 4] == 0, "a token far outside top-k must stay impossible"


def test_a_boundary_token_passes_and_an_impossible_one_fails(llama) -> None:
    """Through `judge_samples`, on the model's own logits: the token top-k drops when the k-th and
    the next are closer than the margin is scored (a boundary token); the least likely token is an
    impossible-token."""
    prompt = PROMPTS[0]
    with torch.no_grad():
        z = llama(input_ids=torch.tensor([prompt])).logits[0, -1]
    ranked = z.sort(descending=True)
    gaps = ranked.values[:-1] - ranked.values[1:]  # gaps[i]: between the (i+1)-th and the (i+2)-th
    k = next(i + 1 for i in range(1, 60) if gaps[i] < SUPPORT_MARGIN / 2)  # a near tie at the k-th
    top_k = Sampling(1.0, k)
    boundary = Sample(Request(0, tuple(prompt), 1, 0.0), 0, 1, (int(ranked.indices[k]),))
    verdict = judge_samples("x", llama, [boundary], top_k, 0)
    assert verdict.passed and verdict.boundary == [(0, 0)], verdict.verdict
    last = Sample(Request(3, tuple(prompt), 1, 0.0), 0, 1, (int(ranked.indices[-1]),))
    verdict = judge_samples("x", llama, [last], top_k, 0)
    assert [v.rule for v in verdict.violations] == ["impossible-token"] and not verdict.boundary, verdict.verdict
    # no forward is seen at the output level: the message names the request, not a role or a run
    assert "(its role unseen: output level) at index 0 of request 3," in verdict.violations[0].found


# ---------------------------------------------------------------------------------------
# audit-vllm's report, sizes and workarounds


def sampled(passed: bool) -> dict[str, Any]:
    fit = {"distance": 0.03 if passed else 0.2, "bound": 0.072, "shift": 0.107}
    return {"passed": passed, "verdict": "lossless in distribution" if passed else "FAIL distribution/pooled-fit",
            "tokens": 1536, "fit": fit, "counts": {"acceptance": 0.4}, "engine_s": 4.0, "oracle_s": 1.0,
            "warnings": [] if passed else ["the sampled distributions are nearly flat"]}  # fmt: skip


def test_a_failing_sampling_verdict_fails_its_configuration_in_the_report(tmp_path: Path) -> None:
    rows = [ConfigurationOutcome("tiny", "draft", {}, True, "exact", sampling=sampled(True)),
            ConfigurationOutcome("tiny", "self-draft", {}, True, "exact", sampling=sampled(False))]  # fmt: skip
    text = render_markdown(rows)
    assert "| PASS | 1536 | 0.030 / 0.072 | 0.40 | 5 |" in text and "| FAIL | 1536 | 0.200 / 0.072 |" in text, text
    assert "self-draft** sampling FAIL: FAIL distribution/pooled-fit" in text and "sampling: the sampled" in text
    assert [o.all_passed for o in rows] == [True, False] and "1 of 2 configurations passed" in text
    write_reports(VllmAuditSettings(models=("tiny",), out=tmp_path), rows, 1.0, "0.32.0")
    entries = json.loads((tmp_path / "report.json").read_text())["entries"]
    levels = [(e["subject"]["configuration"], e["subject"]["level"], e["passed"]) for e in entries]
    want = [("draft", "black box", True), ("draft", "black box, sampling", True),
            ("self-draft", "black box", True), ("self-draft", "black box, sampling", False)]  # fmt: skip
    assert levels == want, levels
    assert (
        "Sampling black box: seeded requests of 32 tokens (tiny 8 prompts x 32)" in (tmp_path / "report.md").read_text()
    )


def test_sampling_size_grows_with_the_greedy_requests() -> None:
    assert sampling_size(8) == (4, 16) and sampling_size(16) == (8, 32) and sampling_size(1) == (1, 16)
    assert sampling_size(16, "smollm2") == (4, 16) and sampling_size(8, "smollm2") == (2, 16)


def test_servers_get_the_cpu_expand_workaround_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WORKAROUNDS_ENV, raising=False)
    assert workaround_env() == {WORKAROUNDS_ENV: f"{CPU_EXPAND},{CPU_REWIND}"} and {CPU_EXPAND, CPU_REWIND} <= set(
        WORKAROUNDS
    )
    monkeypatch.setenv(WORKAROUNDS_ENV, "")
    assert workaround_env() == {WORKAROUNDS_ENV: ""}


def test_the_plugin_refuses_an_unknown_workaround(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECAUDIT_VLLM_PLANT", raising=False)
    monkeypatch.setenv(WORKAROUNDS_ENV, "no-such-fix")
    with pytest.raises(ValueError, match="'no-such-fix' names no vLLM workaround; known: cpu-expand-dtype"):
        plant_from_env()
    monkeypatch.setenv(WORKAROUNDS_ENV, "")
    plant_from_env()  # empty: inert (planting would import vLLM, absent here)


def test_the_sampling_bug_is_plantable_but_outside_the_paged_catalog() -> None:
    """`--plant residual-from-target` reaches servers and white boxes by name; the paged catalog's
    tests (each mutant caught by a paged rule) never see it, since greedy output cannot."""
    (bug,) = SAMPLING_MUTANTS
    assert BY_NAME[bug.name] is bug and bug not in MUTANTS and (bug.check, bug.rule) == ("distribution", "pooled-fit")
    assert not bug.output_visible and bug.target.endswith("rejection_sampler.sample_recovered_tokens")


def test_a_planted_sampling_bug_is_announced_as_seen_by_sampling_only(tmp_path: Path) -> None:
    settings = VllmAuditSettings(models=("tiny",), out=tmp_path, plant="residual-from-target")
    text = write_reports(settings, [ConfigurationOutcome("tiny", "draft", {}, True, "exact")], 1.0, "0.32.0")
    assert "`residual-from-target` (a negative control only sampling sees" in text, text.splitlines()[2]
    settings = VllmAuditSettings(models=("tiny",), out=tmp_path, plant="bonus-from-draft")
    assert "both levels should fail" in write_reports(settings, [], 1.0, "0.32.0")
