"""How the black-box audit's requests reach an engine that owns its models, and its answers come back.

Kept apart from the judge (`specaudit.adapters.engine_blackbox`), which every transport shares:
a transport only sends the requests at their arrivals and collects an `Answer` per request (its
tokens, or the output-contract violation that stands for them); `judge_answers` does the rest.

Three ways in:

  - `audit_server(url, target, prompts)`: an OpenAI-compatible completions server on localhost.
    One `POST {url}/v1/completions` per request, from its own thread at its arrival time, with
    `prompt` as token ids, `max_tokens`, `temperature: 0` and `return_token_ids: true` (vLLM's
    extension), and `ignore_eos: true`: the EOS the oracle judges against (`eos_token_id`) is sent
    as the only stop token (`stop_token_ids`), so a model whose configuration names other stop ids
    is held to the one EOS the audit knows, and any token can be chosen as EOS. Tokens are read from
    `choices[0].token_ids`, else from vLLM's `"token_id:N"` logprob strings. An EOS the server
    stopped at (`finish_reason: "stop"`) but left out of the list is put back, as the oracle
    includes it. Where the target has a tokenizer, a seeded share of the requests also carry a
    stop string (`stop`, `include_stop_str_in_output`) drawn from their oracle's text, judged on
    their ids and text; every answer's `usage` is judged against its ids. Standard library only.
  - `audit_callable(generate, target, prompts)`: `generate(prompts, max_new_tokens) -> list[list[int]]`
    (vLLM's `LLM.generate` behind a two-line wrapper) called repeatedly, one staggered batch after
    another in arrival order: batches of seeded sizes, so consecutive calls mix requests differently.
  - `audit_callable(engine, target, prompts)` with a step-wise engine object (`add_request`,
    `step`, `has_unfinished`, see `specaudit.contracts.engine`): requests are added at seeded step indices
    and the engine is stepped, its calls held to the engine contract (`EngineBook`), its models
    never hooked.

Level of evidence: output only (see `specaudit.adapters.engine_blackbox`).
"""

from __future__ import annotations

import inspect
import json
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from specaudit.adapters.engine_blackbox import (
    STOP_SHARE,
    Answer,
    Decode,
    EngineAuditResult,
    Request,
    check_tokens,
    contract_violation,
    detokenizer,
    judge_answers,
    load_target,
    make_requests,
    seeded_arrivals,
    usage_violation,
    with_given_stops,
    with_stops,
)
from specaudit.checks.liveness import WaitLedger, unfinished
from specaudit.checks.outputs import returned_violation
from specaudit.contracts.decoder import ContractError, DecoderTimeout, time_limit, validate_output
from specaudit.contracts.engine import ENGINE_METHODS, EngineBook
from specaudit.contracts.violation import Violation

# ---------------------------------------------------------------------------------------
# (b) An OpenAI-compatible completions server


class CompletionsClient:
    """POST /v1/completions with token-id prompts, greedy, one request per call (standard library only)."""

    def __init__(
        self, url: str, *, model: str | None = None, timeout_s: float = 60.0, extra: dict[str, Any] | None = None
    ) -> None:
        base = url.rstrip("/")
        if base.endswith("/completions"):
            self.url = base
        else:
            self.url = base + ("/completions" if base.endswith("/v1") else "/v1/completions")
        self.model, self.timeout_s, self.extra = model, timeout_s, dict(extra or {})

    def body(self, request: Request, eos_token_id: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": list(request.prompt),
            "max_tokens": request.max_new_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
        if self.model is not None:
            body["model"] = self.model
        body["ignore_eos"] = True  # the judged EOS, if any, is the only stop token
        if eos_token_id is not None:
            body["stop_token_ids"] = [eos_token_id]
        if request.stop is not None:
            body["stop"] = [request.stop]
            body["include_stop_str_in_output"] = request.include_stop
        return {**body, **self.extra}

    def post(self, body: dict[str, Any], request_id: int) -> tuple[Any, Violation | None]:
        """The decoded JSON answer, or the violation that says why there is none."""
        data = json.dumps(body).encode()
        http = urllib.request.Request(self.url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(http, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            text = exc.read()[:200].decode(errors="replace")
            return None, contract_violation("http-status", f"HTTP {exc.code}: {text}", request_id, {"status": exc.code})
        except TimeoutError:
            return None, contract_violation("responds", f"no response within {self.timeout_s:g} s", request_id)
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                return None, contract_violation("responds", f"no response within {self.timeout_s:g} s", request_id)
            return None, contract_violation("responds", f"cannot reach {self.url}: {exc.reason}", request_id)
        except (ConnectionError, OSError) as exc:
            return None, contract_violation("responds", f"connection to {self.url} failed: {exc}", request_id)
        try:
            return json.loads(raw), None
        except ValueError:
            text = raw[:80].decode(errors="replace")
            return None, contract_violation("json-response", f"malformed JSON {text!r}", request_id)

    def complete(self, request: Request, eos_token_id: int | None) -> Answer:
        """One request: its tokens (EOS put back where the server stopped at it but left it out), its
        text, finish reason and usage; its usage counts judged against the ids it returned. A request
        with a stop string may end short of its limit: the judge holds it to its stop string."""
        payload, error = self.post(self.body(request, eos_token_id), request.id)
        if error is not None:
            return Answer(error=error)
        tokens, finish, error = read_completion(payload, request.id)
        if error is not None:
            return Answer(error=error)
        assert tokens is not None
        usage = payload.get("usage")
        counted = usage_violation(request, tokens, usage)
        note = ""
        ends = bool(tokens) and tokens[-1] == eos_token_id
        stopped = request.stop is None and finish == "stop"
        if stopped and eos_token_id is not None and not ends and len(tokens) < request.max_new_tokens:
            tokens, note = [*tokens, eos_token_id], "EOS put back: the server stopped at it and left it out"
        if request.stop is None:
            violation = check_tokens(request, tokens, eos_token_id)
        else:
            violation = returned_violation(request.id, tokens, request.max_new_tokens, eos_token_id)
        text = payload["choices"][0].get("text")
        return Answer(tuple(tokens), violation or counted, note=note, text=text if isinstance(text, str) else None,
                      finish=finish, usage=usage if isinstance(usage, dict) else None)  # fmt: skip


def read_completion(payload: Any, request_id: int) -> tuple[list[int] | None, str | None, Violation | None]:
    """(tokens, finish_reason, error) from a completion object: `token_ids`, else `"token_id:N"` logprob tokens."""
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        found = f"a {type(payload).__name__} without choices: {str(payload)[:80]}"
        return None, None, contract_violation("json-response", found, request_id)
    choice = choices[0]
    tokens = choice.get("token_ids")
    if tokens is None:
        logprobs = choice.get("logprobs")
        logprob_tokens = (logprobs.get("tokens") if isinstance(logprobs, dict) else None) or []
        if logprob_tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in logprob_tokens):
            tokens = [int(t.split(":", 1)[1]) for t in logprob_tokens]
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        found = f"choices[0] with token_ids {str(tokens)[:60]} (keys {sorted(choice)})"
        return None, None, contract_violation("token-ids", found, request_id)
    return tokens, choice.get("finish_reason"), None


def send_staggered(
    requests: Sequence[Request],
    send: Callable[[Request], Answer],
    max_workers: int | None = None,
    say: Callable[[str], None] | None = None,
) -> dict[int, Answer]:
    """Each request from its own thread at its arrival offset (seconds); spans measured from the first send.
    `say` gets one line per answer, as it comes (progress)."""
    origin = time.perf_counter()

    def one(r: Request) -> Answer:
        time.sleep(max(0.0, r.arrival - (time.perf_counter() - origin)))
        start = time.perf_counter() - origin
        try:
            answer = send(r)
        except Exception as exc:  # a transport failure is this request's evidence, not a crash of the audit
            answer = Answer(error=contract_violation("responds", f"{type(exc).__name__}: {exc}", r.id))
        answer.start, answer.end = round(start, 4), round(time.perf_counter() - origin, 4)
        if say is not None:
            what = f"error [{answer.error.rule}]" if answer.error else f"{len(answer.tokens or ())} tokens"
            say(f"request {r.id}: sent at {answer.start:.2f} s, answered at {answer.end:.2f} s, {what}")
        return answer

    with ThreadPoolExecutor(max_workers=max_workers or len(requests)) as pool:
        futures = {r.id: pool.submit(one, r) for r in requests}
        return {i: f.result() for i, f in futures.items()}


def audit_server(
    url: str,
    target: torch.nn.Module | str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int] = 16,
    eos_token_id: int | None = None,
    seed: int = 0,
    spread_s: float = 0.5,
    arrivals: Sequence[float] | None = None,
    model: str | None = None,
    timeout_s: float = 60.0,
    dtype: str | None = None,
    name: str | None = None,
    say: Callable[[str], None] | None = None,
    stop_share: float | None = None,
    decode: Decode | None = None,
    stops: Sequence[tuple[str | None, bool]] | None = None,
) -> EngineAuditResult:
    """Send every prompt to an OpenAI-compatible completions server at a staggered arrival and judge the outputs.

    `arrivals` (seconds, one per prompt) overrides the schedule drawn from `seed` over `spread_s`.
    `target` is the served model in process (module, built-in name or HF directory); `eos_token_id`
    must be the server's EOS id (None: `ignore_eos` is sent and every request runs to `max_tokens`).
    Where the target has a tokenizer (`decode`, else its directory's `tokenizer.json`), a seeded
    `stop_share` of the requests (default `STOP_SHARE`; 0: none) carry a stop string drawn from their
    oracle's text (`engine_blackbox.with_stops`), judged on their ids and text; `stops` (a reproducer's:
    stop string or None and `include_stop`, one per prompt) are sent as given instead. Every answer's usage
    counts are judged against its ids. Nothing is raised for the server's faults: errors are
    per-request contract violations. `say` gets progress lines.
    """
    target_model = load_target(target, dtype)
    offsets = list(arrivals) if arrivals is not None else seeded_arrivals(len(prompts), seed, spread_s)
    requests = make_requests(prompts, offsets, max_new_tokens)
    requests = requests if stops is None else with_given_stops(requests, stops)
    share = STOP_SHARE if stop_share is None else stop_share
    wanted = share > 0 if stops is None else any(r.stop is not None for r in requests)
    decode = decode or (detokenizer(target, target_model) if wanted else None)
    if stops is None and decode is not None and share > 0:
        requests = with_stops(target_model, requests, eos_token_id, decode, seed, share)
    if stops is not None and wanted and decode is None:
        raise ValueError("stop strings given, and the target has no tokenizer to judge their text")
    client = CompletionsClient(url, model=model, timeout_s=timeout_s)
    start = time.perf_counter()
    if say is not None:
        say(f"sending {len(requests)} requests to {client.url} over {max(r.arrival for r in requests):.2f} s")
    answers = send_staggered(requests, lambda r: client.complete(r, eos_token_id), say=say)
    seconds = time.perf_counter() - start
    label = name or f"server {client.url}"
    return judge_answers(label, "http", target_model, requests, answers, eos_token_id, dtype, seconds, say=say,
                         decode=decode)  # fmt: skip


# ---------------------------------------------------------------------------------------
# (a) A Python callable or a step-wise engine object


def is_stepwise(engine: Any) -> bool:
    return all(callable(getattr(engine, m, None)) for m in ENGINE_METHODS)


def staggered_batches(requests: Sequence[Request], seed: int, max_batch: int) -> list[list[Request]]:
    """Requests in arrival order cut into consecutive batches of seeded sizes 1..max_batch (one limit per batch)."""
    rng = random.Random(seed)
    ordered = sorted(requests, key=lambda r: (r.arrival, r.id))
    batches: list[list[Request]] = []
    while ordered:
        size = rng.randint(1, max(1, max_batch))
        batch = [ordered.pop(0)]
        while ordered and len(batch) < size and ordered[0].max_new_tokens == batch[0].max_new_tokens:
            batch.append(ordered.pop(0))
        batches.append(batch)
    return batches


def eos_kwarg(generate: Callable[..., Any], eos_token_id: int | None) -> dict[str, Any]:
    """`eos_token_id=` for a generate that takes it (the batch black-box interface), else nothing."""
    try:
        return {"eos_token_id": eos_token_id} if "eos_token_id" in inspect.signature(generate).parameters else {}
    except (TypeError, ValueError):
        return {}


def call_batches(
    generate: Callable[..., Any], batches: list[list[Request]], eos_token_id: int | None, timeout_s: float
) -> dict[int, Answer]:
    """One `generate(prompts, max_new_tokens)` call per batch, in order; spans are call indices."""
    answers: dict[int, Answer] = {}
    for index, batch in enumerate(batches):
        limit = batch[0].max_new_tokens
        try:
            with time_limit(timeout_s):
                raw = generate([list(r.prompt) for r in batch], limit, **eos_kwarg(generate, eos_token_id))
            rows = validate_output(raw, len(batch), limit, eos_token_id)
        except ContractError as exc:
            err = exc.violation(batch=index)
            rows = None
        except (Exception, DecoderTimeout) as exc:  # the engine's failure is evidence
            err = contract_violation("generate-returns", f"generate() raising {type(exc).__name__}: {exc}", None)
            rows = None
        for i, r in enumerate(batch):
            if rows is None:
                answers[r.id] = Answer(error=replace(err, request=r.id), start=index, end=index)
            else:
                tokens = rows[i]
                answers[r.id] = Answer(tuple(tokens), check_tokens(r, tokens, eos_token_id), index, index)
    return answers


@dataclass
class StepRun:
    """What driving a step-wise engine left: the tokens of each request it was given, the step each
    was added at, the step it ended at (finished or aborted), the tokens it held when cancelled, the
    contract breach that ended the run, and the steps taken."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    added: dict[int, int] = field(default_factory=dict)
    done: dict[int, int] = field(default_factory=dict)
    cancelled: dict[int, int] = field(default_factory=dict)
    error: Violation | None = None
    steps: int = 0


def request_extras(request: Request) -> dict[str, Any]:
    """The keywords a request carries beyond the contract's three (`EngineBook.add`): only those set."""
    extras: dict[str, Any] = {} if request.k is None else {"k": request.k}
    if request.stop is not None:
        extras |= {"stop": request.stop, "include": request.include_stop}
    return extras


def run_steps(
    engine: Any, requests: Sequence[Request], eos_token_id: int | None, timeout_s: float, max_steps: int | None = None
) -> StepRun:
    """The one step loop of every step-wise engine (`blackbox --engine`, OpenVINO): add each request at
    its arrival step, cancel it `cancel` steps after its add, step until every request has ended,
    the engine's every call held to the contract (`EngineBook`); a breach ends the run as its error."""
    book = EngineBook(engine, eos_token_id, timeout_s)
    arrive: dict[int, list[Request]] = {}
    for r in requests:
        arrive.setdefault(int(r.arrival), []).append(r)
    last = max(arrive)
    cancels = max((r.cancel or 0 for r in requests), default=0)
    budget = max_steps or last + sum(r.max_new_tokens for r in requests) + cancels + 8
    run = StepRun()
    try:
        for step in range(budget):
            run.steps = step + 1
            for r in arrive.get(step, []):
                book.add(r.id, r.prompt, r.max_new_tokens, **request_extras(r))
                run.added[r.id] = step
            for r in requests:
                due = r.cancel is not None and r.id in run.added and run.added[r.id] + r.cancel == step
                if due and r.id not in run.done:
                    book.abort(r.id)
                    run.cancelled[r.id] = len(book.requests[r.id].tokens)
            book.step()
            book.check_unfinished()
            run.done |= {rid: step for rid in run.added if rid not in run.done and not book.live(rid)}
            if step >= last and len(run.done) == len(requests):
                break
    except ContractError as exc:  # a breach about one request names it
        error = exc.violation()
        run.error = replace(error, request=error.evidence.get("request"))
    run.tokens = {rid: list(state.tokens) for rid, state in book.requests.items()}
    return run


def drive_steps(
    engine: Any, requests: Sequence[Request], eos_token_id: int | None, timeout_s: float, max_steps: int | None
) -> tuple[dict[int, Answer], Violation | None]:
    """Each request's answer from `run_steps`; one that never ended carries the breach, or `request-finishes`."""
    run = run_steps(engine, requests, eos_token_id, timeout_s, max_steps)
    late = unfinished_requests(requests, run.tokens, set(run.done), run.steps)
    answers = {}
    for r in requests:
        tokens = tuple(run.tokens[r.id]) if r.id in run.tokens else None
        if r.id in run.done:
            answers[r.id] = Answer(tokens, None, run.added[r.id], run.done[r.id])
        else:
            why = cut_short(run.error or late[r.id], r.id, len(tokens or ()), r.max_new_tokens)
            answers[r.id] = Answer(tokens, why, run.added.get(r.id), None)
    return answers, run.error


def cut_short(why: Violation, request: int, held: int, limit: int) -> Violation:
    """`why` as the violation of a request the run ended before it finished, holding `held` tokens."""
    return replace(why, found=f"{held} of {limit} tokens when the run ended ({why.rule}: {why.found})", request=request)


def unfinished_requests(
    requests: Sequence[Request], tokens: dict[int, list[int]], done: set[int], budget: int
) -> dict[int, Violation]:
    """'request-finishes' over a ledger of the run (`checks.liveness`), as a white-box engine's or a
    decoder's requests are judged: each request not done within the `budget` of steps."""
    ledger = WaitLedger("steps", None, "max_wait_steps")
    for r in requests:
        tenure = ledger.tenure(r.id, r.max_new_tokens)
        tenure.tokens, tenure.finished = len(tokens.get(r.id, ())), r.id in done
    return {
        int(v.request): replace(v, evidence={**v.evidence, "steps": budget})
        for v in unfinished(ledger)
        if v.request is not None
    }


def audit_callable(
    engine: Any,
    target: torch.nn.Module | str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int] = 16,
    eos_token_id: int | None = None,
    seed: int = 0,
    spread: float = 6,
    arrivals: Sequence[float] | None = None,
    max_batch: int = 3,
    timeout_s: float = 60.0,
    max_steps: int | None = None,
    dtype: str | None = None,
    name: str | None = None,
    say: Callable[[str], None] | None = None,
) -> EngineAuditResult:
    """Run the prompts through an in-process black-box engine at staggered arrivals and judge the outputs.

    Arrivals are `arrivals` (integers: step indices or arrival order), else seeded integers in
    [0, spread]. A step-wise engine object gets each request added at its arrival step (at most
    `max_steps` steps); anything else is `generate(prompts, max_new_tokens)` (the callable itself or
    its `.generate`, given `eos_token_id=` if it takes it), called once per staggered batch
    (`staggered_batches`: arrival order, seeded sizes up to `max_batch`). The engine's own faults
    are contract violations in the result, never raised. `say` gets progress lines.
    """
    target_model = load_target(target, dtype)
    stepwise = is_stepwise(engine)
    offsets = list(arrivals) if arrivals is not None else seeded_arrivals(len(prompts), seed, spread, steps=True)
    requests = make_requests(prompts, offsets, max_new_tokens)
    label = name or str(getattr(engine, "name", None) or getattr(engine, "__name__", None) or type(engine).__name__)
    if say is not None:
        how = "added at steps" if stepwise else "generate() in staggered batches"
        say(f"running {len(requests)} requests through {label} ({how}, arrivals up to {max(offsets):g})")
    start = time.perf_counter()
    engine_error = None
    if stepwise:
        answers, engine_error = drive_steps(engine, requests, eos_token_id, timeout_s, max_steps)
    else:
        generate = engine if not callable(getattr(engine, "generate", None)) else engine.generate
        answers = call_batches(generate, staggered_batches(requests, seed, max_batch), eos_token_id, timeout_s)
    seconds = time.perf_counter() - start
    transport = "steps" if stepwise else "callable"
    return judge_answers(
        label, transport, target_model, requests, answers, eos_token_id, dtype, seconds, engine_error, say
    )


__all__ = [
    "CompletionsClient",
    "audit_callable",
    "audit_server",
    "cut_short",
    "is_stepwise",
    "read_completion",
    "run_steps",
    "send_staggered",
    "staggered_batches",
]
