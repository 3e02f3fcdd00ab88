"""The black-box engine adapter: staggered arrivals, output-level comparison with the oracle.

Positive controls: EQSPEC as a step-wise engine, behind an in-process OpenAI-compatible server
and called directly, passes. Negative controls: a planted admission bug (positions counted from
the batch width, `AdmitPositionsFromWidth`) behind the same server and called directly fails,
naming the late requests that diverged; a batch decoder with attended pads fails; servers that
answer malformed JSON, wrong token counts or nothing at all give per-request contract errors.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch
from hypothesis import given, settings

from specaudit.adapters import DecoderEngine
from specaudit.adapters.engine_blackbox import EVIDENCE, Request, arrival_offsets, make_requests, seeded_arrivals
from specaudit.adapters.transports import (
    CompletionsClient,
    audit_callable,
    audit_server,
    read_completion,
    run_steps,
    staggered_batches,
)
from specaudit.fixtures.pairs import draft_model, target_model
from specaudit.reference.engine_mutants import AdmitPositionsFromWidth
from specaudit.reference.engines import EqSpecEngine
from specaudit.reference.oracle import greedy_oracle

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [1, 2, 3, 4, 5, 6, 7], [12, 13], [40, 41, 42, 43, 44]]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    return target_model("llama"), draft_model("llama", "tiny", [])


def make_engine(cls: type, pair: tuple[torch.nn.Module, torch.nn.Module], k: int = 2) -> Any:
    return cls(pair[0], pair[1], num_draft_tokens=k, eos_token_id=None, pad_token_id=0)


# ---------------------------------------------------------------------------------------
# An OpenAI-compatible completions server on 127.0.0.1, in process


class EngineApp:
    """Continuous batching behind HTTP: handlers queue requests, one loop thread steps the engine."""

    def __init__(self, engine: Any, step_s: float) -> None:
        self.engine, self.step_s = engine, step_s
        self.lock = threading.Lock()
        self.inbox: list[tuple[int, list[int], int]] = []
        self.tokens: dict[int, list[int]] = {}
        self.limits: dict[int, int] = {}
        self.done: dict[int, threading.Event] = {}
        self.failure: str | None = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def __call__(self, body: dict[str, Any]) -> tuple[int, bytes]:
        with self.lock:
            rid = len(self.done)
            self.done[rid], self.tokens[rid], self.limits[rid] = threading.Event(), [], int(body["max_tokens"])
            self.inbox.append((rid, list(body["prompt"]), int(body["max_tokens"])))
        self.done[rid].wait(30)
        if self.failure is not None:
            return 500, self.failure.encode()
        choice = {"index": 0, "text": "", "token_ids": self.tokens[rid], "finish_reason": "length"}
        return 200, json.dumps({"object": "text_completion", "choices": [choice]}).encode()

    def loop(self) -> None:
        try:
            while not self.stopped.is_set():
                with self.lock:
                    new, self.inbox = self.inbox, []
                for rid, prompt, limit in new:
                    self.engine.add_request(rid, prompt, limit)
                if self.engine.has_unfinished():
                    for rid, tokens in self.engine.step().items():
                        self.tokens[rid] += tokens
                        if len(self.tokens[rid]) >= self.limits[rid]:
                            self.done[rid].set()
                time.sleep(self.step_s)
        except Exception as exc:  # the engine crashed: every waiting handler answers 500
            self.failure = f"{type(exc).__name__}: {exc}"
            for event in list(self.done.values()):
                event.set()


class FaultApp:
    """A server with one fault: the oracle's tokens, served wrongly in the way `kind` says."""

    def __init__(self, kind: str, target: torch.nn.Module, eos: int | None = None) -> None:
        self.kind, self.target, self.eos = kind, target, eos

    def __call__(self, body: dict[str, Any]) -> tuple[int, bytes]:
        if self.kind == "malformed":
            return 200, b'{"choices": [{"token_ids": [1, 2'
        if self.kind == "status":
            return 503, b"overloaded"
        prompt, limit = tuple(body["prompt"]), int(body["max_tokens"])
        with torch.no_grad():
            tokens = list(greedy_oracle(self.target, prompt, max_new_tokens=limit, eos_token_id=self.eos).tokens)
        finish = "length"
        if self.kind == "slow":
            time.sleep(1.0)
        elif self.kind == "long":
            tokens.append(tokens[0])
        elif self.kind == "short":
            tokens = tokens[:-1]
        elif self.kind == "strip-eos" and tokens[-1] == self.eos:
            tokens, finish = tokens[:-1], "stop"  # as vLLM's text: the EOS it stopped at is left out
        choice = {"index": 0, "token_ids": tokens, "finish_reason": finish}
        return 200, json.dumps({"choices": [choice]}).encode()


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body)  # type: ignore[attr-defined]
        status, payload = self.server.app(body)  # type: ignore[attr-defined]
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (its timeout): nothing to answer

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[dict[str, Any]], tuple[int, bytes]]], tuple[str, list[dict[str, Any]]]]]:
    """Start a server on 127.0.0.1 (port 0) for an app; returns (url, bodies seen); stopped afterwards."""
    servers: list[ThreadingHTTPServer] = []
    apps: list[Any] = []

    def start(app: Callable[[dict[str, Any]], tuple[int, bytes]]) -> tuple[str, list[dict[str, Any]]]:
        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        server.app, server.seen = app, []  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        apps.append(app)
        return f"http://127.0.0.1:{server.server_address[1]}", server.seen  # type: ignore[attr-defined]

    yield start
    for app in apps:
        if isinstance(app, EngineApp):
            app.stopped.set()
            app.thread.join(5)
    for server in servers:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------------------------
# (b) the server path


def test_server_with_correct_engine_passes(pair, serve) -> None:
    """EQSPEC stepping behind HTTP, requests at seeded staggered arrivals: every output is the oracle's."""
    url, seen = serve(EngineApp(make_engine(EqSpecEngine, pair), step_s=0.02))
    result = audit_server(url, "llama", PROMPTS, max_new_tokens=10, seed=3, spread_s=0.25)
    assert result.passed and result.exact_match == 1.0, result.render()
    assert result.overlapped >= 2, f"expected requests in flight together, found {result.overlapped}"
    assert {b["temperature"] for b in seen} == {0} and all(b["return_token_ids"] and b["ignore_eos"] for b in seen)
    assert result.to_json()["evidence"] == EVIDENCE and "output level only" in result.render()


def test_server_with_planted_admission_bug_fails_naming_requests(pair, serve) -> None:
    """Positions counted from the batch width for late arrivals: the late requests diverge, by name."""
    url, _ = serve(EngineApp(make_engine(AdmitPositionsFromWidth, pair), step_s=0.03))
    result = audit_server(url, "llama", PROMPTS, max_new_tokens=12, arrivals=[0, 0.05, 0.1, 0.15, 0.2])
    assert not result.passed and result.diverged, result.render()
    assert 0 not in result.diverged, "the first request runs alone and cannot be hit by an admission bug"
    text = result.render()
    for rid in result.diverged:
        outcome = result.outcomes[rid]
        assert outcome.overlapped and outcome.first_divergence is not None
        assert f"request {rid} " in text and "DIVERGED at index" in text
    assert "no diagnosis" in result.verdict


@pytest.mark.parametrize(
    ("kind", "rule", "words"),
    [
        ("malformed", "json-response", "malformed JSON"),
        ("status", "http-status", "HTTP 503"),
        ("long", "max-new-tokens", "5 tokens for max_tokens 4"),
        ("short", "token-count", "3 tokens for max_tokens 4"),
        ("slow", "responds", "no response within 0.3 s"),
    ],
)
def test_server_faults_are_clear_errors(pair, serve, kind: str, rule: str, words: str) -> None:
    """Malformed JSON, an HTTP error, a wrong token count or a timeout: a per-request contract error, no crash."""
    url, _ = serve(FaultApp(kind, pair[0]))
    result = audit_server(url, pair[0], PROMPTS[:2], max_new_tokens=4, arrivals=[0, 0.01], timeout_s=0.3)
    assert not result.passed and result.errors == [0, 1], result.render()
    assert all(o.error is not None and o.error.rule == rule and words in o.error.found for o in result.outcomes)
    assert f"ERROR [{rule}]" in result.render()


def test_unreachable_server_is_a_clear_error(pair) -> None:
    """Nothing listening: each request says it could not reach the server."""
    result = audit_server("http://127.0.0.1:9", pair[0], PROMPTS[:1], max_new_tokens=2, timeout_s=2)
    assert result.errors == [0] and result.outcomes[0].error.rule == "responds", result.render()
    assert "cannot reach" in result.outcomes[0].error.found or "failed" in result.outcomes[0].error.found


def test_server_eos_left_out_is_put_back(pair, serve) -> None:
    """A server that stops at EOS but leaves it out of token_ids passes, with the normalisation noted."""
    target = pair[0]
    continuation = greedy_oracle(target, tuple(PROMPTS[0]), max_new_tokens=8, eos_token_id=None).tokens
    eos = next(t for i, t in enumerate(continuation) if i >= 2 and t not in continuation[:i])
    url, seen = serve(FaultApp("strip-eos", target, eos))
    result = audit_server(url, target, PROMPTS[:1], max_new_tokens=8, eos_token_id=eos, arrivals=[0])
    assert result.passed, result.render()
    assert result.outcomes[0].tokens[-1] == eos and "EOS put back" in result.outcomes[0].note
    assert seen[0]["ignore_eos"] and seen[0]["stop_token_ids"] == [eos], "the judged EOS is the only stop token"


# ---------------------------------------------------------------------------------------
# (a) the callable path


def test_stepwise_engine_passes_and_planted_bug_fails(pair) -> None:
    """A step-wise engine driven as a black box: EQSPEC passes, the admission bug fails on the late arrivals."""
    arrivals = [0, 0, 1, 2, 4]
    good = audit_callable(make_engine(EqSpecEngine, pair, 3), "llama", PROMPTS, max_new_tokens=10, arrivals=arrivals)
    assert good.passed and good.transport == "steps" and good.exact_match == 1.0, good.render()
    bad = audit_callable(
        make_engine(AdmitPositionsFromWidth, pair, 3), "llama", PROMPTS, max_new_tokens=10, arrivals=arrivals
    )
    assert not bad.passed and bad.diverged and set(bad.diverged) <= {2, 3, 4}, bad.render()
    assert all(bad.outcomes[r].violation.request == r for r in bad.diverged)


@settings(max_examples=3, deadline=None)
@given(arrivals=arrival_offsets(4, 3, steps=True))
def test_stepwise_engine_passes_any_drawn_schedule(pair, arrivals: list[float]) -> None:
    """Arrival schedules drawn by the Hypothesis strategy: EQSPEC's outputs are the oracle's on each."""
    engine = make_engine(EqSpecEngine, pair)
    result = audit_callable(engine, pair[0], PROMPTS[:4], max_new_tokens=[6, 9, 4, 7], arrivals=arrivals)
    assert result.passed, result.render()


def test_batch_callable_passes_and_planted_bug_fails(pair) -> None:
    """`generate(prompts, max_new_tokens)` called once per staggered batch: EQSPEC passes, attended pads fail."""
    target, draft = pair
    good = DecoderEngine("specaudit.reference.eqspec:EqSpec", target, draft, num_draft_tokens=3)
    result = audit_callable(lambda p, n: good.generate(p, n, None), target, PROMPTS, max_new_tokens=8, max_batch=4)
    assert result.passed and result.transport == "callable", result.render()
    bad = DecoderEngine("specaudit.reference.mutants:pads_attended", target, draft, num_draft_tokens=3)
    failed = audit_callable(bad, target, PROMPTS, max_new_tokens=8, max_batch=5, seed=1)
    assert not failed.passed and failed.diverged, failed.render()
    assert all(f"request {r} " in failed.render() for r in failed.diverged)


class _Misbehaving:
    """Step-wise engine that emits a token for a request it was never given."""

    def __init__(self) -> None:
        self.n = 0

    def add_request(self, request_id: int, prompt_ids: list[int], max_new_tokens: int) -> None:
        self.n += 1

    def step(self) -> dict[int, list[int]]:
        return {99: [1]}

    def has_unfinished(self) -> bool:
        return True


def test_engine_contract_breaches_are_errors_not_crashes(pair) -> None:
    """A step-wise engine breaking its contract, a generate() that raises: errors in the result."""
    result = audit_callable(_Misbehaving(), pair[0], PROMPTS[:2], max_new_tokens=3, arrivals=[0, 1])
    assert not result.passed and result.engine_error is not None and result.engine_error.rule == "known-request"
    assert result.errors == [0, 1], result.render()

    def down(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        raise RuntimeError("engine down")

    raised = audit_callable(down, pair[0], PROMPTS[:2], max_new_tokens=3)
    assert raised.errors == [0, 1] and "engine down" in raised.outcomes[0].error.found


class _Stalls:
    """Step-wise engine that serves request 0 to the end and never emits for request 1 (it keeps it live)."""

    def __init__(self, max_new_tokens: int) -> None:
        self.left: dict[int, int] = {}
        self.n = max_new_tokens

    def add_request(self, request_id: int, prompt_ids: list[int], max_new_tokens: int) -> None:
        self.left[request_id] = max_new_tokens

    def step(self) -> dict[int, list[int]]:
        if self.left.get(0, 0) > 0:
            self.left[0] -= 1
            return {0: [7]}
        return {}

    def has_unfinished(self) -> bool:
        return True


def test_unfinished_request_is_the_ledgers_request_finishes(pair) -> None:
    """A request the engine never finishes within the step budget: liveness request-finishes, the
    rule a white-box engine's and a decoder's unfinished requests break (`checks.liveness`)."""
    result = audit_callable(_Stalls(3), pair[0], PROMPTS[:2], max_new_tokens=3, arrivals=[0, 0], max_steps=6)
    assert not result.passed and result.errors == [1], result.render()
    error = result.outcomes[1].error
    assert (error.check, error.rule, error.request) == ("liveness", "request-finishes", 1), error
    assert error.evidence == {"tokens": 0, "max_new_tokens": 3, "steps": 6}, error.evidence
    assert "0 of 3 tokens when the run ended (request-finishes" in error.found, error.found
    assert result.verdict.startswith("unfinished (requests [1])"), result.verdict


class _Counting:
    """Step-wise engine emitting one counted token per live request per step; a request with a stop
    string ends itself after two tokens (`finished`); `leaky`: it goes on emitting after an abort or its
    own end (the breaches the step loop must name)."""

    def __init__(self, leaky: str = "") -> None:
        self.live: dict[int, int] = {}
        self.stop_after: dict[int, int] = {}
        self.got: dict[int, dict[str, Any]] = {}
        self.leaky = leaky

    def add_request(self, request_id: int, prompt_ids: list[int], max_new_tokens: int, **extras: Any) -> None:
        self.live[request_id], self.got[request_id] = max_new_tokens, extras
        if "stop" in extras:
            self.stop_after[request_id] = 2

    def step(self) -> dict[int, list[int]]:
        out = {rid: [10 + rid] for rid, left in self.live.items() if left > 0}
        for rid in out:
            self.live[rid] -= 1
            if self.stop_after.get(rid) is not None:
                self.stop_after[rid] -= 1
                if self.stop_after[rid] == 0 and self.leaky != "stop":
                    self.live[rid] = 0
        return out

    def has_unfinished(self) -> bool:
        return any(left > 0 for left in self.live.values())

    def abort(self, request_id: int) -> None:
        if self.leaky != "abort":
            self.live[request_id] = 0

    def finished(self, request_id: int) -> bool:
        return self.live.get(request_id, 1) == 0 or self.stop_after.get(request_id) == 0


def test_step_loop_sends_extras_cancels_and_hears_the_engines_end() -> None:
    """The one step loop (`run_steps`, OpenVINO's driver too): a request's K and stop string reach
    add_request as keywords, a cancel lands its steps after the add, an engine's own end (a stop string)
    finishes a request; emitting after an abort or after that end is the contract breach that ends the run."""
    requests = [
        Request(0, (1,), 5, 0),
        Request(1, (2,), 5, 1, stop="w", include_stop=True, k=3),
        Request(2, (3,), 5, 0, cancel=1),
    ]
    engine = _Counting()
    run = run_steps(engine, requests, None, 10.0)
    assert run.error is None, run.error
    assert engine.got == {0: {}, 1: {"k": 3, "stop": "w", "include": True}, 2: {}}
    assert run.tokens == {0: [10] * 5, 1: [11, 11], 2: [12]} and run.cancelled == {2: 1}
    assert run.added == {0: 0, 1: 1, 2: 0} and run.done == {0: 4, 1: 2, 2: 1}
    after_abort = run_steps(_Counting("abort"), requests, None, 10.0)
    assert after_abort.error is not None and after_abort.error.rule == "aborted-silent", after_abort.error
    after_stop = run_steps(_Counting("stop"), requests, None, 10.0)
    assert after_stop.error is not None and after_stop.error.rule == "finished-silent", after_stop.error


def test_verdict_table_rows(pair) -> None:
    """The CLI's table: one row per request with its verdict; errors spelled out below, evidence last."""
    result = audit_callable(_Misbehaving(), pair[0], PROMPTS[:2], max_new_tokens=3, arrivals=[0, 1])
    lines = result.table().splitlines()
    assert lines[1].split()[:3] == ["request", "arrival", "(step)"], lines[1]
    assert [line.split()[0] for line in lines[2:4]] == ["0", "1"], lines
    assert all("error [known-request]" in line for line in lines[2:4]), lines
    assert lines[4].startswith("  engine: ") and lines[-1] == f"level of evidence: {EVIDENCE}", lines


def test_schedules_are_seeded() -> None:
    """The arrival schedule and batch cut come from the seed alone: same seed, same schedule."""
    assert seeded_arrivals(6, 7, 0.5) == seeded_arrivals(6, 7, 0.5) != seeded_arrivals(6, 8, 0.5)
    steps = seeded_arrivals(6, 7, 5, steps=True)
    assert min(steps) == 0 and all(float(s).is_integer() and 0 <= s <= 5 for s in steps)
    requests = make_requests(PROMPTS, seeded_arrivals(5, 2, 1.0), 4)
    cut = [[r.id for r in b] for b in staggered_batches(requests, 2, 3)]
    assert cut == [[r.id for r in b] for b in staggered_batches(requests, 2, 3)]
    assert sorted(i for b in cut for i in b) == list(range(5))


def test_target_from_a_model_directory(pair, tmp_path) -> None:
    """The oracle's target given as a Hugging Face directory (the tiny llama saved): same verdict."""
    from specaudit.models.loading import save_tiny_pair

    target_dir, _ = save_tiny_pair(tmp_path)
    result = audit_callable(make_engine(EqSpecEngine, pair), str(target_dir), PROMPTS[:3], max_new_tokens=6)
    assert result.passed, result.render()


def test_completion_parsing_and_urls() -> None:
    """token_ids, vLLM's "token_id:N" logprob strings, and a completion without token ids (a clear rule)."""
    assert read_completion({"choices": [{"token_ids": [4, 5], "finish_reason": "length"}]}, 0)[:2] == ([4, 5], "length")
    logprobs = {"choices": [{"text": "ab", "logprobs": {"tokens": ["token_id:7", "token_id:8"]}}]}
    assert read_completion(logprobs, 0)[0] == [7, 8]
    tokens, _, error = read_completion({"choices": [{"text": "ab", "logprobs": None}]}, 3)
    assert tokens is None and error is not None and error.rule == "token-ids" and error.request == 3
    assert read_completion([1, 2], 0)[2].rule == "json-response"
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/completions"):
        assert CompletionsClient(url).url == "http://h:1/v1/completions"
