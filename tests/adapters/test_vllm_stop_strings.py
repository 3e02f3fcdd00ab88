"""The black box's stop strings and usage counts, without vLLM: a server that answers as vLLM 0.32 does.

`transports.audit_server` draws a stop string for a seeded share of its requests from the oracle's
text (the served tiny Llama's tokenizer: token t reads "w<t>", tokens joined by spaces) and judges
each answer's ids, text and finish reason (`engine_blackbox.stop_violation`) and its usage counts
(`engine_blackbox.usage_violation`). The fake server here follows vLLM's semantics (ids through the
token completing the stop string, text cut at it); its two faults are the planted vLLM bugs'
(`reference.vllm_mutants.SERVED_MUTANTS`), which tests/adapters/test_vllm_stops.py plants in a real one.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from specaudit.adapters.engine_blackbox import (
    Answer,
    Request,
    detokenizer,
    draw_stop,
    in_context,
    load_target,
    stop_text,
    stop_violation,
    usage_violation,
)
from specaudit.adapters.transports import audit_server
from specaudit.adapters.vllm.server import boundary_prompts
from specaudit.checks.stops import expected_with_stop
from specaudit.reference.oracle import greedy_oracle

pytestmark = pytest.mark.usefixtures("one_thread")
REQUESTS, LIMIT = 8, 16


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """The black box's served tiny Llama (`adapters.vllm.models`), and its target for the oracle."""
    from specaudit.adapters.vllm.models import tiny_llama

    out = tmp_path_factory.mktemp("served") / "target"
    tiny_llama(out)
    return out, load_target(str(out), "float32")


class FakeVllm:
    """Greedy answers as vLLM 0.32 gives them; `fault` "ids": a stop string's step keeps its later tokens
    in the ids (text still trimmed); "usage": completion_tokens counts them; "token": a request with a
    stop string gets a wrong first token (then the oracle's from there, to the limit)."""

    def __init__(self, target: torch.nn.Module, directory: Path, fault: str | None = None) -> None:
        decode = detokenizer(directory)
        assert decode is not None
        self.target, self.decode, self.fault = target, decode, fault

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt, limit = tuple(body["prompt"]), int(body["max_tokens"])
        eos = (body.get("stop_token_ids") or [None])[0]
        with torch.no_grad():
            tokens = list(greedy_oracle(self.target, prompt, max_new_tokens=limit, eos_token_id=eos).tokens)
        decode = in_context(self.decode, prompt)  # vLLM's text follows the prompt's: " w5 w6"
        ids, text, finish, counted = tokens, decode(tokens), "stop" if eos in tokens else "length", len(tokens)
        stop = (body.get("stop") or [None])[0]
        if stop is not None and self.fault == "token":
            ids = [tokens[0] + 1, *tokens[1:]]
            return {"choices": [{"index": 0, "text": decode(ids), "token_ids": ids, "finish_reason": "length"}]}
        want = None if stop is None else expected_with_stop(decode, tokens, stop, True)
        if want is not None:
            run = tokens[: len(want) + 2]  # the accepted run that completed the stop string went on
            ids, text, finish = (run if self.fault == "ids" else want), None, "stop"
            text = stop_text(decode, want, stop, bool(body.get("include_stop_str_in_output")))
            counted = len(run) if self.fault in ("ids", "usage") else len(want)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": counted, "total_tokens": len(prompt) + counted,
                 "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
        choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}
        return {"choices": [choice], "usage": usage}


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body)  # type: ignore[attr-defined]
        payload = json.dumps(self.server.app(body)).encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


@pytest.fixture
def serve() -> Iterator[Any]:
    """start(app) -> (url, bodies seen): a server on 127.0.0.1, stopped afterwards."""
    servers: list[ThreadingHTTPServer] = []

    def start(app: FakeVllm) -> tuple[str, list[dict[str, Any]]]:
        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        server.app, server.seen = app, []  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", server.seen  # type: ignore[attr-defined]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def audited(served: tuple[Path, torch.nn.Module], serve: Any, fault: str | None) -> tuple[Any, list[dict[str, Any]]]:
    directory, target = served
    url, seen = serve(FakeVllm(target, directory, fault))
    prompts = boundary_prompts(512, REQUESTS, 0)
    result = audit_server(url, str(directory), prompts, max_new_tokens=LIMIT, seed=0, spread_s=0.1, dtype="float32")
    return result, seen


def test_stop_strings_are_drawn_and_a_right_server_passes(served: Any, serve: Any) -> None:
    """Half the requests carry a stop string, both ways of `include_stop_str_in_output`; each completes
    inside the oracle's continuation, so it ends its request short of the limit, and vLLM's answer passes."""
    result, seen = audited(served, serve, None)
    assert result.passed, result.render()
    stops = [b for b in seen if "stop" in b]
    assert 2 <= len(stops) < REQUESTS and {b["include_stop_str_in_output"] for b in stops} == {True, False}, stops
    short = [o for o in result.outcomes if o.request.stop is not None and len(o.tokens or ()) < LIMIT]
    assert len(short) == len(stops), result.render()
    assert all(o.request.stop == json.loads(json.dumps(o.request.stop)) for o in short)


def test_ids_kept_past_a_stop_string_fail_as_stop_string(served: Any, serve: Any) -> None:
    """The planted `stop-string-ids-kept`'s answers: text trimmed, the run's later ids kept."""
    result, _ = audited(served, serve, "ids")
    rules = {v.rule for v in result.violations}
    assert not result.passed and rules == {"stop-string"}, result.render()
    assert set(result.errors) == {o.request.id for o in result.outcomes if o.request.stop is not None}


def test_usage_counting_past_a_stop_string_fails_as_usage_count(served: Any, serve: Any) -> None:
    """The planted `usage-past-stop`'s answers: right ids and text, completion_tokens counting the run."""
    result, _ = audited(served, serve, "usage")
    assert not result.passed and {v.rule for v in result.violations} == {"usage-count"}, result.render()
    assert all("completion tokens" in v.found for v in result.violations)


def test_a_wrong_token_before_the_stop_string_is_a_divergence(served: Any, serve: Any) -> None:
    """An answer that leaves the oracle before its stop string is equivalence's (tie-aware), named at
    the token where it leaves, not a stop-string break."""
    result, _ = audited(served, serve, "token")
    stopped = [o for o in result.outcomes if o.request.stop is not None]
    assert stopped and all(o.violation is not None and o.first_divergence == 0 for o in stopped), result.render()
    assert {v.check for v in result.violations} == {"equivalence"}, result.render()


def sent_stops(bodies: list[dict[str, Any]]) -> list[tuple[tuple[int, ...], str | None, bool]]:
    """(prompt, stop string or None, include flag) of each body a server saw, sorted."""
    stops = [(tuple(b["prompt"]), (b.get("stop") or [None])[0], bool(b.get("include_stop_str_in_output")))
             for b in bodies]  # fmt: skip
    return sorted(stops, key=repr)


def stored_stops(plan: dict[str, Any]) -> list[tuple[tuple[int, ...], str | None, bool]]:
    return sorted(((tuple(r["prompt"]), r["stop"], r["include_stop"]) for r in plan["requests"]), key=repr)


def test_a_blackbox_reproducer_stores_its_stop_strings_and_replays_them(
    served: Any, serve: Any, tmp_path: Path
) -> None:
    """`specaudit blackbox --out` stores each request's stop string and include flag in the reproducer,
    written before any request is sent; its replay sends the stored ones (here edited: flags flipped,
    one stop dropped), not the seed's draw. A file written before stops were stored replays as then."""
    from specaudit.commands.cli import main

    directory, target = served
    fake = FakeVllm(target, directory)
    before: list[dict[str, Any]] = []
    repro = tmp_path / "run" / "repro.json"

    def peeking(body: dict[str, Any]) -> dict[str, Any]:
        before.append(json.loads(repro.read_text())) if not before else None
        return fake(body)

    url, seen = serve(peeking)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in boundary_prompts(512, REQUESTS, 0)))
    argv = ["--target", str(directory), "--prompts", str(prompts), "--max-new-tokens", str(LIMIT), "--seed", "0",
            "--spread", "0.1", "--dtype", "float32", "--quiet"]  # fmt: skip
    assert main(["blackbox", "--server", url, *argv, "--out", str(repro.parent)]) == 0
    data = json.loads(repro.read_text())
    first, stored = sent_stops(seen), stored_stops(data["payload"])
    assert data["payload"]["stops_recorded"] is True and stored == first, (stored, first)
    assert stored_stops(before[0]["payload"]) == first  # written before the first request
    assert 2 <= sum(stop is not None for _, stop, _ in first) < REQUESTS, first

    edited = [
        dict(r, include_stop=r["stop"] is not None and not r["include_stop"]) for r in data["payload"]["requests"]
    ]
    dropped = next(r for r in edited if r["stop"] is not None)
    dropped.update(stop=None, include_stop=False)
    data["payload"]["requests"] = edited
    repro.write_text(json.dumps(data))
    count = len(seen)
    assert main(["blackbox", "--replay", str(repro), "--quiet"]) == 0
    assert sent_stops(seen[count:]) == stored_stops(data["payload"]) != first

    del data["payload"]["stops_recorded"]  # as written before stops were stored: every stop null
    data["payload"]["requests"] = [dict(r, stop=None, include_stop=False) for r in edited]
    repro.write_text(json.dumps(data))
    count = len(seen)
    assert main(["blackbox", "--replay", str(repro), "--quiet"]) == 0
    assert sent_stops(seen[count:]) == first  # drawn from the seed again, as the first run drew them


def test_stop_text_and_ids_follow_vllm() -> None:
    """vLLM keeps the ids through the completing token either way and cuts the text at the stop string
    (mid-token too), its text following the prompt's; a text, finish reason or ids that differ each
    break `stop-string`."""
    decode = lambda ids: " ".join(f"w{t}" for t in ids)  # noqa: E731 (the served tokenizer's decode)
    assert in_context(decode, (4, 4))([5, 51]) == " w5 w51" and in_context(decode, ())([5]) == "w5"
    oracle = (5, 51, 7, 8, 9)
    assert expected_with_stop(decode, oracle, "w5", True) == [5]
    assert stop_text(decode, [5, 51, 7], "1 w7", False) == "w5 w5" and stop_text(decode, [5, 51], "w5", True) == "w5"
    request = Request(0, (4, 4), 5, 0.0, stop="51 w", include_stop=False)
    right = Answer((5, 51, 7), text="w5 w", finish="stop")
    assert stop_violation(decode, request, oracle, right) is None
    for wrong in (Answer((5, 51, 7, 8), text="w5 w", finish="stop"), Answer((5, 51, 7), text="w5 w51 w7"),
                  Answer((5, 51, 7), text="w5 w", finish="length")):  # fmt: skip
        violation = stop_violation(decode, request, oracle, wrong)
        assert violation is not None and violation.rule == "stop-string", wrong


def test_the_served_tokenizer_reads_as_vllm_streams_it(served: Any) -> None:
    """Token t reads "w<t>", joined by spaces, specials skipped; after a prompt, vLLM's stream starts with
    the separator, as the text of prompt and outputs less the prompt's."""
    decode = detokenizer(served[0])
    assert decode is not None and decode([5, 2, 51]) == "w5 w51"
    assert in_context(decode, [4, 6])([5, 51]) == " w5 w51" == in_context(lambda ids: decode(ids), [4, 6])([5, 51])
    assert detokenizer(served[0].parent) is None and detokenizer(served[1]) is not None  # a loaded model's directory


def test_usage_counts_are_judged_against_the_answer() -> None:
    request = Request(3, (4, 5, 6), 8, 0.0)
    good = {"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}
    assert usage_violation(request, [7, 8], good) is None and usage_violation(request, [7, 8], None) is None
    for bad in ({**good, "completion_tokens": 3}, {**good, "prompt_tokens": 4},
                {**good, "prompt_tokens_details": {"cached_tokens": 4}}):  # fmt: skip
        violation = usage_violation(request, [7, 8], bad)
        assert violation is not None and violation.rule == "usage-count" and violation.request == 3, bad


def test_drawn_stops_complete_before_the_last_token() -> None:
    """Each kind of drawn stop string appears in the oracle's text and is completed by a token with
    another after it (so an accepted run can carry tokens past it)."""
    decode = lambda ids: " ".join(f"w{t}" for t in ids)  # noqa: E731
    tokens = (12, 130, 7, 256, 9, 33)
    kinds = set()
    for seed in range(40):
        stop = draw_stop(random.Random(seed), tokens, decode, None)
        assert stop and stop in decode(list(tokens))
        want = expected_with_stop(decode, tokens, stop, True)
        assert want is not None and 2 <= len(want) <= len(tokens) - 1, (stop, want)
        kinds.add("across" if " " in stop else "token" if stop in {f"w{t}" for t in tokens} else "inside")
    assert kinds == {"token", "across", "inside"}
    assert draw_stop(random.Random(0), (12, 130), decode, None) is None
