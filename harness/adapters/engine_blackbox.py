"""Black-box continuous-batching engines: requests with staggered arrivals, judged at the output level.

For engines that own their models (a vLLM `LLM`, an OpenAI-compatible server, a step-wise
engine whose models the harness cannot hook). Requests arrive on a seeded schedule, so that
some join while others run, which is where continuous batching goes wrong (positions counted
from the wrong origin, stale cache rows, masks not extended); each request's tokens are then
compared with the batch-size-1 greedy oracle of a target the harness holds in process (the same
weights the engine serves), tie-aware as `specaudit.checks.compare_row` does.

Three ways in:

  - `audit_server(url, target, prompts)`: an OpenAI-compatible completions server on localhost.
    One `POST {url}/v1/completions` per request, from its own thread at its arrival time, with
    `prompt` as token ids, `max_tokens`, `temperature: 0` and `return_token_ids: true` (vLLM's
    extension; `ignore_eos: true` when no EOS id is given). Tokens are read from
    `choices[0].token_ids`, else from vLLM's `"token_id:N"` logprob strings. An EOS the server
    stopped at (`finish_reason: "stop"`) but left out of the list is put back, as the oracle
    includes it. Standard library only.
  - `audit_callable(generate, target, prompts)`: `generate(prompts, max_new_tokens) -> list[list[int]]`
    (vLLM's `LLM.generate` behind a two-line wrapper) called repeatedly, one staggered batch after
    another in arrival order: batches of seeded sizes, so consecutive calls mix requests differently.
  - `audit_callable(engine, target, prompts)` with a step-wise engine object (`add_request`,
    `step`, `has_unfinished`, see `specaudit.contracts.engine`): requests are added at seeded step indices
    and the engine is stepped, its calls held to the engine contract (`EngineBook`), its models
    never hooked.

Level of evidence: OUTPUT ONLY. What is checked is each request's tokens, length and stop
against the oracle: exact match, partial match, first divergence. The harness sees no forward
of the engine's models, so there is no I1, no I2, no row identity, no token preservation and no
diagnosis of the cause; a pass is evidence that these schedules produced oracle outputs, not
that the engine's cache and masks are right (a wrong row can still produce the right argmax).
For engines whose models can be hooked, the step-wise engine contract and its state machine
(`specaudit.search.engine_machine`) check all of that.
"""

from __future__ import annotations

import inspect
import json
import random
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
from hypothesis import strategies as st

from specaudit.adapters.blackbox import dtype_name
from specaudit.checks import RowEquivalence, check_equivalence, equivalence
from specaudit.config.settings import BlackboxSettings
from specaudit.contracts.builtins import MODELS
from specaudit.contracts.case import Case
from specaudit.contracts.decoder import ContractError, DecoderTimeout, resolve_spec, time_limit, validate_output
from specaudit.contracts.engine import ENGINE_METHODS, EngineBook
from specaudit.contracts.errors import UsageError
from specaudit.contracts.violation import Violation
from specaudit.reference.oracle import OracleResult, answer_oracles
from specaudit.running.instrument import Recording
from specaudit.running.runner import Run

EVIDENCE = (
    "output level only: each request's tokens against the batch-size-1 greedy oracle; the engine's "
    "model forwards are not observed, so no I1, no I2, no row identity and no diagnosis of the cause"
)

RULES: dict[str, str] = {
    "responds": "a response within the time limit",
    "http-status": "HTTP 200",
    "json-response": "a JSON completion object",
    "token-ids": "choices[0].token_ids, a list of int token ids (send return_token_ids)",
    "token-count": "max_tokens tokens unless the output ends at EOS",
    "max-new-tokens": "at most max_tokens new tokens",
    "ends-at-eos": "nothing after the first EOS",
    "generate-returns": "generate() returning one list of int token ids per prompt, without raising",
    "finishes": "every request finished within the step budget",
}
"""Each output-contract rule of the black-box engine audit and what it wants."""


def contract_violation(rule: str, found: str, request: int | None, evidence: dict[str, Any] | None = None) -> Violation:
    return Violation("contract", rule, found, RULES.get(rule, rule), request=request, evidence=evidence or {})


# ---------------------------------------------------------------------------------------
# Requests and their arrival schedule


@dataclass(frozen=True)
class Request:
    """One request of the audit. `arrival`: seconds after the start (server), the step it is added at
    (step-wise engine) or its place in the arrival order (generate callable)."""

    id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival: float


def per_request(max_new_tokens: int | Sequence[int], n: int) -> list[int]:
    limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else [int(m) for m in max_new_tokens]
    if len(limits) != n or any(m < 1 for m in limits):
        raise ValueError(f"max_new_tokens: one value >= 1 per prompt ({n}), got {max_new_tokens!r}")
    return limits


def make_requests(
    prompts: Sequence[Sequence[int]], arrivals: Sequence[float], max_new_tokens: int | Sequence[int]
) -> list[Request]:
    """Requests 0..n-1 with the given arrivals (one per prompt)."""
    if len(arrivals) != len(prompts) or not prompts:
        raise ValueError(f"one arrival per prompt: {len(arrivals)} arrivals for {len(prompts)} prompts")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    limits = per_request(max_new_tokens, len(prompts))
    return [
        Request(i, tuple(int(t) for t in p), m, float(a)) for i, (p, m, a) in enumerate(zip(prompts, limits, arrivals))
    ]


def seeded_arrivals(n: int, seed: int, spread: float, *, steps: bool = False) -> list[float]:
    """Arrival offsets in [0, spread] from `random.Random(seed)`, the earliest at 0 (integers when `steps`)."""
    rng = random.Random(seed)
    raw = [float(rng.randint(0, int(spread))) if steps else rng.uniform(0.0, spread) for _ in range(n)]
    first = min(raw)
    return [round(a - first, 4) for a in raw]


def arrival_offsets(n: int, spread: float, *, steps: bool = False) -> st.SearchStrategy[list[float]]:
    """Hypothesis strategy for `n` arrival offsets in [0, spread] (integer step indices when `steps`)."""
    one = (
        st.integers(0, int(spread)).map(float)
        if steps
        else st.floats(0.0, spread, allow_nan=False, allow_infinity=False)
    )
    return st.lists(one, min_size=n, max_size=n).map(lambda xs: [round(x - min(xs), 4) for x in xs])


# ---------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class RequestOutcome:
    """One request: what came back, when it was in flight, and how it compares with the oracle."""

    request: Request
    tokens: tuple[int, ...] | None  # None: no usable answer (see `error`)
    error: Violation | None  # the output contract broken for this request
    row: RowEquivalence | None  # tie-aware comparison with the oracle
    violation: Violation | None  # the first divergence, as an equivalence violation
    start: float | None  # sent (seconds), added (step index) or its generate call's index
    end: float | None  # answered (seconds), finished (step index) or its generate call's index
    overlapped: bool  # in flight with another request (same generate call, for callables)
    note: str = ""  # a normalisation applied to the answer (e.g. an EOS put back)

    @property
    def status(self) -> str:
        if self.error is not None:
            return "error"
        assert self.row is not None
        return self.row.verdict

    @property
    def first_divergence(self) -> int | None:
        return None if self.row is None else self.row.first_divergence

    @property
    def partial(self) -> float:
        return 0.0 if self.row is None else self.row.partial

    def render(self) -> str:
        r = self.request
        head = f"request {r.id} (arrival {r.arrival:g}, {len(r.prompt)} prompt tokens"
        head += ", overlapped)" if self.overlapped else ")"
        if self.error is not None:
            return f"{head}: ERROR [{self.error.rule}] {self.error.found}; wants {self.error.expected}"
        assert self.row is not None
        if self.violation is not None:
            i, found, ref = self.first_divergence, self.row.found, self.row.reference
            assert i is not None
            got = f"token {found[i]}" if i < len(found) else f"the end ({self.row.found_stop})"
            want = f"token {ref[i]}" if i < len(ref) else f"the end ({self.row.expected_stop})"
            ties = f", after {len(self.row.ties)} tie(s)" if self.row.ties else ""
            return (
                f"{head}: DIVERGED at index {i}: {got} where the batch-size-1 oracle has {want} "
                f"(partial match {self.row.partial:.2f}{ties})"
            )
        tail = f" ({self.note})" if self.note else ""
        return f"{head}: {self.row.verdict}, {len(self.row.found)} tokens{tail}"


@dataclass(frozen=True)
class EngineAuditResult:
    """Every request of one staggered run of a black-box engine, judged at the output level."""

    engine: str
    transport: str  # "http", "callable" or "steps"
    outcomes: tuple[RequestOutcome, ...]
    engine_error: Violation | None  # a breach that ended the run (step-wise engines)
    seconds: float  # wall time of the engine run
    oracle_seconds: float
    evidence: str = EVIDENCE

    @property
    def errors(self) -> list[int]:
        return [o.request.id for o in self.outcomes if o.error is not None]

    @property
    def diverged(self) -> list[int]:
        return [o.request.id for o in self.outcomes if o.violation is not None]

    @property
    def passed(self) -> bool:
        return self.engine_error is None and not self.errors and not self.diverged

    @property
    def violations(self) -> list[Violation]:
        out = [] if self.engine_error is None else [self.engine_error]
        return out + [v for o in self.outcomes for v in (o.error, o.violation) if v is not None]

    @property
    def exact_match(self) -> float:
        return sum(o.row is not None and o.row.exact for o in self.outcomes) / max(len(self.outcomes), 1)

    @property
    def partial_match(self) -> float:
        return sum(o.partial for o in self.outcomes) / max(len(self.outcomes), 1)

    @property
    def ties(self) -> int:
        return sum(len(o.row.ties) for o in self.outcomes if o.row is not None)

    @property
    def overlapped(self) -> int:
        return sum(o.overlapped for o in self.outcomes)

    @property
    def verdict(self) -> str:
        if self.engine_error is not None or self.errors:
            what = "contract broken"
        elif self.diverged:
            what = f"diverged (requests {self.diverged})"
        elif self.ties:
            what = f"equivalent modulo numerics ({self.ties} tie(s))"
        else:
            what = "exact"
        return f"{what}; {self.evidence}"

    def render(self) -> str:
        lines = [f"{self.engine} [{self.transport}]: {'PASS' if self.passed else 'FAIL'}, {self.verdict}"]
        lines.append(
            f"  {len(self.outcomes)} requests ({self.overlapped} in flight together), exact match "
            f"{self.exact_match:.2f}, partial match {self.partial_match:.2f}, ties {self.ties}, "
            f"engine {self.seconds:.2f} s, oracle {self.oracle_seconds:.2f} s"
        )
        if self.engine_error is not None:
            lines.append(f"  engine: {self.engine_error.render()}")
        lines += ["  " + o.render() for o in self.outcomes]
        return "\n".join(lines)

    def table(self) -> str:
        """The verdict table: one row per request, its schedule, verdict and first divergence."""
        unit = TIME_UNITS.get(self.transport, "")
        head = ("request", f"arrival{unit}", f"start{unit}", f"end{unit}", "overlap", "verdict", "diverges at",
                "found", "expected")  # fmt: skip
        rows = [head] + [outcome_row(o) for o in self.outcomes]
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        status = "PASS" if self.passed else "FAIL"
        summary = (
            f"{self.engine} [{self.transport}]: {status}; exact match {self.exact_match:.2f}, partial match "
            f"{self.partial_match:.2f}, ties {self.ties}, {self.overlapped} of {len(self.outcomes)} requests in "
            f"flight together; engine {self.seconds:.2f} s, oracle {self.oracle_seconds:.2f} s"
        )
        notes = [f"  request {o.request.id}: {o.render().split(': ', 1)[1]}" for o in self.outcomes if o.error]
        if self.engine_error is not None:
            notes.insert(0, f"  engine: {self.engine_error.render()}")
        return "\n".join([summary, *lines, *notes, f"level of evidence: {self.evidence}"])

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "transport": self.transport,
            "passed": self.passed,
            "verdict": self.verdict,
            "evidence": self.evidence,
            "exact_match": self.exact_match,
            "partial_match": self.partial_match,
            "ties": self.ties,
            "diverged": self.diverged,
            "errors": self.errors,
            "engine_error": None if self.engine_error is None else asdict(self.engine_error),
            "seconds": self.seconds,
            "oracle_seconds": self.oracle_seconds,
            "requests": [
                {
                    "id": o.request.id,
                    "prompt": list(o.request.prompt),
                    "max_new_tokens": o.request.max_new_tokens,
                    "arrival": o.request.arrival,
                    "start": o.start,
                    "end": o.end,
                    "overlapped": o.overlapped,
                    "status": o.status,
                    "tokens": None if o.tokens is None else list(o.tokens),
                    "expected": None if o.row is None else list(o.row.expected),
                    "first_divergence": o.first_divergence,
                    "partial": o.partial,
                    "note": o.note,
                    "violations": [asdict(v) for v in (o.error, o.violation) if v is not None],
                }
                for o in self.outcomes
            ],
        }


TIME_UNITS = {"http": " (s)", "steps": " (step)", "callable": " (call)"}
"""What a request's arrival, start and end count in, per transport."""


def outcome_row(o: RequestOutcome) -> tuple[str, ...]:
    """One request's cells of the verdict table: found/expected are the tokens at the first divergence."""
    r = o.request

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:g}"

    found = expected = where = "-"
    if o.error is not None:
        verdict = f"error [{o.error.rule}]"
    else:
        assert o.row is not None
        verdict = "DIVERGED" if o.violation is not None else o.row.verdict
        i = o.first_divergence
        if o.violation is not None and i is not None:
            where = str(i)
            found = str(o.row.found[i]) if i < len(o.row.found) else f"end ({o.row.found_stop})"
            expected = str(o.row.reference[i]) if i < len(o.row.reference) else f"end ({o.row.expected_stop})"
    overlap = "yes" if o.overlapped else "no"
    return (str(r.id), num(r.arrival), num(o.start), num(o.end), overlap, verdict, where, found, expected)


# ---------------------------------------------------------------------------------------
# The target and its oracle


def load_target(target: torch.nn.Module | str | Path, dtype: str | None = None, device: str = "cpu") -> torch.nn.Module:
    """The target the oracle runs on: a module as is, a built-in model name (`llama`, `qwen3`,
    `gpt2`, `transparent`: the fixtures' weights), or a Hugging Face directory (or `smollm2`)."""
    if isinstance(target, torch.nn.Module):
        return target
    if str(target) in MODELS:
        from specaudit.fixtures.pairs import target_model

        return target_model(str(target), dtype or "float64")
    from specaudit.models.loading import load_model, resolve_device
    from specaudit.models.pretrained import resolve

    return load_model("target", resolve(target), resolve_device(device), dtype or "auto")


def oracles(
    target: torch.nn.Module, requests: Sequence[Request], answers: dict[int, Answer], eos_token_id: int | None
) -> tuple[dict[int, OracleResult], float]:
    """Each request's batch-size-1 greedy output, found by checking its answer (`answer_oracles`:
    one teacher-forced forward for a right one), and the time taken."""
    start = time.perf_counter()
    wanted = [(r.prompt, answers[r.id].tokens or (), r.max_new_tokens) for r in requests]
    found = answer_oracles(target, wanted, eos_token_id)
    return {r.id: result for r, result in zip(requests, found)}, time.perf_counter() - start


def compare(
    target: torch.nn.Module,
    request: Request,
    tokens: tuple[int, ...],
    oracle: OracleResult,
    eos_token_id: int | None,
    dtype: str,
    label: str,
) -> tuple[RowEquivalence, Violation | None]:
    """The tie-aware comparison of `specaudit.checks.equivalence`, on a one-request Run with no recording."""
    case = Case(
        prompts=(request.prompt,),
        accept=((),),
        num_draft_tokens=0,
        max_new_tokens=request.max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        model=f"external:{label}",
        draft="blackbox",
        dtype=dtype,
    )
    run = Run(case, label, [list(tokens)], None, [oracle], [], Recording(), target, 0.0)
    with torch.no_grad():
        row = equivalence(run).rows[0]
        found = check_equivalence(run)
    violation = replace(found[0], request=request.id, row=None, call=None, slot=None) if found else None
    return row, violation


def overlaps(spans: dict[int, tuple[float | None, float | None]]) -> dict[int, bool]:
    """Whether each request's in-flight span [start, end] meets another's."""
    known = {i: (s, e) for i, (s, e) in spans.items() if s is not None and e is not None}

    def meets(i: int, j: int) -> bool:
        return i != j and known[j][0] <= known[i][1] and known[i][0] <= known[j][1]

    return {i: i in known and any(meets(i, j) for j in known) for i in spans}


@dataclass
class Answer:
    """What the transport got for one request, before the comparison."""

    tokens: tuple[int, ...] | None = None
    error: Violation | None = None
    start: float | None = None
    end: float | None = None
    note: str = ""


def judge_answers(
    label: str,
    transport: str,
    target: torch.nn.Module,
    requests: Sequence[Request],
    answers: dict[int, Answer],
    eos_token_id: int | None,
    dtype: str | None,
    seconds: float,
    engine_error: Violation | None = None,
    say: Callable[[str], None] | None = None,
) -> EngineAuditResult:
    """Compare every answered request with its oracle; requests with an error are not compared."""
    if say is not None:
        say(f"engine done in {seconds:.2f} s; batch-size-1 greedy oracle for {len(requests)} requests")
    oracle, oracle_seconds = oracles(target, requests, answers, eos_token_id)
    dtype = dtype or dtype_name(target)
    flags = overlaps({r.id: (answers[r.id].start, answers[r.id].end) for r in requests})
    outcomes = []
    for r in requests:
        a = answers[r.id]
        row = violation = None
        if a.error is None and a.tokens is not None:
            row, violation = compare(target, r, a.tokens, oracle[r.id], eos_token_id, dtype, label)
        outcomes.append(RequestOutcome(r, a.tokens, a.error, row, violation, a.start, a.end, flags[r.id], a.note))
    return EngineAuditResult(label, transport, tuple(outcomes), engine_error, seconds, oracle_seconds)


def check_tokens(request: Request, tokens: list[int], eos_token_id: int | None) -> Violation | None:
    """The length and EOS rules on one request's tokens."""
    if len(tokens) > request.max_new_tokens:
        found = f"{len(tokens)} tokens for max_tokens {request.max_new_tokens}"
        return contract_violation("max-new-tokens", found, request.id, {"tokens": len(tokens)})
    if eos_token_id is not None and eos_token_id in tokens[:-1]:
        index = tokens.index(eos_token_id)
        return contract_violation("ends-at-eos", f"tokens going on after EOS at index {index}", request.id)
    ends = eos_token_id is not None and bool(tokens) and tokens[-1] == eos_token_id
    if len(tokens) < request.max_new_tokens and not ends:
        found = f"{len(tokens)} tokens for max_tokens {request.max_new_tokens}, not ending at EOS"
        return contract_violation("token-count", found, request.id, {"tokens": len(tokens)})
    return None


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
        if eos_token_id is None:
            body["ignore_eos"] = True
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
        """One request: its tokens (EOS put back where the server stopped at it but left it out)."""
        payload, error = self.post(self.body(request, eos_token_id), request.id)
        if error is not None:
            return Answer(error=error)
        tokens, finish, error = read_completion(payload, request.id)
        if error is not None:
            return Answer(error=error)
        assert tokens is not None
        note = ""
        ends = bool(tokens) and tokens[-1] == eos_token_id
        if finish == "stop" and eos_token_id is not None and not ends and len(tokens) < request.max_new_tokens:
            tokens, note = [*tokens, eos_token_id], "EOS put back: the server stopped at it and left it out"
        violation = check_tokens(request, tokens, eos_token_id)
        return Answer(tuple(tokens), violation, note=note)


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
) -> EngineAuditResult:
    """Send every prompt to an OpenAI-compatible completions server at a staggered arrival and judge the outputs.

    `arrivals` (seconds, one per prompt) overrides the schedule drawn from `seed` over `spread_s`.
    `target` is the served model in process (module, built-in name or HF directory); `eos_token_id`
    must be the server's EOS id (None: `ignore_eos` is sent and every request runs to `max_tokens`).
    Nothing is raised for the server's faults: errors are per-request contract violations.
    `say` gets progress lines.
    """
    target_model = load_target(target, dtype)
    offsets = list(arrivals) if arrivals is not None else seeded_arrivals(len(prompts), seed, spread_s)
    requests = make_requests(prompts, offsets, max_new_tokens)
    client = CompletionsClient(url, model=model, timeout_s=timeout_s)
    start = time.perf_counter()
    if say is not None:
        say(f"sending {len(requests)} requests to {client.url} over {max(r.arrival for r in requests):.2f} s")
    answers = send_staggered(requests, lambda r: client.complete(r, eos_token_id), say=say)
    seconds = time.perf_counter() - start
    label = name or f"server {client.url}"
    return judge_answers(label, "http", target_model, requests, answers, eos_token_id, dtype, seconds, say=say)


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
            err = Violation("contract", exc.rule, exc.found, exc.expected, evidence={**exc.evidence, "batch": index})
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


def drive_steps(
    engine: Any, requests: Sequence[Request], eos_token_id: int | None, timeout_s: float, max_steps: int | None
) -> tuple[dict[int, Answer], Violation | None]:
    """Add each request at its arrival step and step the engine until all are done (EngineBook holds the contract)."""
    book = EngineBook(engine, eos_token_id, timeout_s)
    arrive: dict[int, list[Request]] = {}
    for r in requests:
        arrive.setdefault(int(r.arrival), []).append(r)
    last = max(arrive)
    budget = max_steps or last + sum(r.max_new_tokens for r in requests) + 8
    added: dict[int, int] = {}
    done: dict[int, int] = {}
    error: Violation | None = None
    try:
        for step in range(budget):
            for r in arrive.get(step, []):
                book.add(r.id, r.prompt, r.max_new_tokens)
                added[r.id] = step
            book.step()
            book.check_unfinished()
            for rid in added:
                if rid not in done and book.requests[rid].finished(eos_token_id):
                    done[rid] = step
            if step >= last and len(done) == len(requests):
                break
    except ContractError as exc:
        error = Violation("contract", exc.rule, exc.found, exc.expected, evidence=dict(exc.evidence or {}))
    answers = {}
    for r in requests:
        state = book.requests.get(r.id)
        tokens = tuple(state.tokens) if state is not None else None
        if r.id in done:
            answers[r.id] = Answer(tokens, None, added[r.id], done[r.id])
        else:
            why = error or contract_violation("finishes", f"unfinished after {budget} steps", r.id, {"budget": budget})
            found = f"{len(tokens or ())} of {r.max_new_tokens} tokens when the run ended ({why.rule}: {why.found})"
            answers[r.id] = Answer(tokens, replace(why, found=found, request=r.id), added.get(r.id), None)
    return answers, error


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


# ---------------------------------------------------------------------------------------
# `specaudit blackbox`: settings, checks of the user's input, the run and what it writes

DEFAULT_REQUESTS = 8
DEFAULT_MAX_NEW_TOKENS = 16
DEFAULT_SPREAD = {"http": 0.5, "engine": 6.0}
"""Arrival spread: seconds for a server, step indices (or arrival order) for an in-process engine."""
REPRO_KIND = "specaudit-blackbox"


@dataclass(frozen=True)
class Plan:
    """What one run sends: resolved from the settings or a reproducer, written before anything is sent."""

    transport: str  # "http" or "engine"
    where: str  # the server's URL or the engine's MODULE:ATTR
    target: str
    requests: tuple[Request, ...]
    seed: int
    spread: float
    eos_token_id: int | None
    served_model: str | None
    max_batch: int
    dtype: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": REPRO_KIND,
            "transport": self.transport,
            "server": self.where if self.transport == "http" else None,
            "engine": self.where if self.transport == "engine" else None,
            "target": self.target,
            "seed": self.seed,
            "spread": self.spread,
            "eos_token_id": self.eos_token_id,
            "served_model": self.served_model,
            "max_batch": self.max_batch,
            "dtype": self.dtype,
            "requests": [asdict(r) | {"prompt": list(r.prompt)} for r in self.requests],
            "replay": "specaudit blackbox --replay THIS_FILE [--server URL | --engine MODULE:ATTR] [--target T]",
        }


def check_url(url: str) -> tuple[str, int]:
    """(host, port) of an http(s) URL, or a UsageError that shows what a good one looks like."""
    example = "e.g. http://127.0.0.1:8000"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UsageError(f"--server {url!r} is not a valid URL ({exc}); {example}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"--server {url!r} is not an http(s) URL with a host; {example}")
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


def probe_server(url: str, timeout_s: float) -> None:
    """A TCP connection to the server before any request: nothing listening is a usage error, not a verdict."""
    host, port = check_url(url)
    try:
        socket.create_connection((host, port), timeout=min(timeout_s, 5.0)).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UsageError(f"cannot reach the server at {host}:{port} ({reason}); is it running?") from None


def check_target(target: str) -> None:
    """A built-in name or a Hugging Face directory, checked before the slow work starts."""
    from specaudit.models.pretrained import is_builtin

    if target in MODELS or is_builtin(target):
        return
    path = Path(target)
    if not path.exists():
        names = ", ".join((*MODELS, "smollm2"))
        raise UsageError(f"--target {target!r}: no such directory, and not a built-in model ({names})")
    if not (path / "config.json").is_file():
        raise UsageError(f"--target {target!r} is not a Hugging Face model directory (no config.json)")


def required_parameters(fn: Any) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return -1
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return sum(p.default is inspect.Parameter.empty and p.kind not in variadic for p in params)


def load_blackbox_engine(spec: str) -> Any:
    """`MODULE:ATTR` as an engine owning its models: a step-wise engine or an object with `generate` as
    is; a class or a zero-argument factory built; any other callable taken as `generate(prompts, max_new_tokens)`."""
    obj = resolve_spec(spec, "engine", "myserving.audit:make_engine", UsageError)
    if not isinstance(obj, type) and (is_stepwise(obj) or callable(getattr(obj, "generate", None))):
        return obj
    if isinstance(obj, type) or (callable(obj) and required_parameters(obj) == 0):
        try:
            built = obj()
        except Exception as exc:  # the user's factory failing is bad input, in one line
            raise UsageError(
                f"engine {spec!r} failed to build with no arguments ({type(exc).__name__}: {exc}); a black-box "
                "engine owns its models, so MODULE:ATTR must build it alone"
            ) from None
        if is_stepwise(built) or callable(getattr(built, "generate", None)) or callable(built):
            return built
        raise UsageError(f"engine {spec!r} built a {type(built).__name__}: no add_request/step/has_unfinished, "
                         "no generate(), not callable")  # fmt: skip
    if callable(obj):
        return obj
    raise UsageError(f"engine {spec!r} is a {type(obj).__name__}: neither an engine, a factory nor a generate()")


def vocab_bound(target: str, model: torch.nn.Module) -> int:
    """Token ids a drawn prompt may use: the model's vocabulary, cut to the tokenizer's where there is one
    (a server refuses ids its tokenizer does not know)."""
    config = getattr(model, "config", None)
    size = int(getattr(config, "vocab_size", 0) or model.get_output_embeddings().weight.shape[0])
    tokenizer = target_tokenizer(target)
    return size if tokenizer is None else min(size, len(tokenizer))


def target_tokenizer(target: str) -> Any:
    if target in MODELS:
        return None
    from specaudit.models.loading import load_tokenizer
    from specaudit.models.pretrained import resolve

    try:
        return load_tokenizer(resolve(target, say=lambda _: None))
    except UsageError:
        return None


def drawn_prompts(n: int, seed: int, vocab: int, eos_token_id: int | None) -> list[list[int]]:
    """`n` prompts of 2..12 token ids in [1, vocab), EOS left out, from `random.Random(seed)`."""
    rng = random.Random(f"prompts-{seed}")
    pool = [t for t in range(1, max(vocab, 2)) if t != eos_token_id]
    return [[rng.choice(pool) for _ in range(rng.randint(2, 12))] for _ in range(n)]


def token_id_lines(text: str) -> list[list[int]] | None:
    """Token-id prompts: one JSON list of ints, or a JSON list of them, per file; None if the file is text."""
    try:
        whole = json.loads(text)
        lines = whole if isinstance(whole, list) and all(isinstance(x, list) for x in whole) else None
    except ValueError:
        lines = None
    if lines is None:
        try:
            lines = [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError:
            return None
    ok = all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
             for p in lines)  # fmt: skip
    return lines if ok and lines else None


def file_prompts(path: Path, target: str) -> list[list[int]]:
    """Prompts from `--prompts`: token ids as they are, or text tokenized with the target directory's tokenizer."""
    from specaudit.models.loading import read_prompts, tokenize

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read --prompts {str(path)!r}: {getattr(exc, 'strerror', None) or exc}") from None
    ids = token_id_lines(text)
    if ids is not None:
        return ids
    tokenizer = target_tokenizer(target)
    if tokenizer is None:
        raise UsageError(f"--prompts {str(path)!r} holds text, and --target {target!r} has no tokenizer: give token "
                         "ids (one JSON list per line) or a target directory with a tokenizer")  # fmt: skip
    return [list(p) for p in tokenize(tokenizer, read_prompts(path))]


def read_reproducer(path: Path) -> dict[str, Any]:
    """A black-box reproducer's plan (`specaudit.artifacts.reproducer.load_reproducer`: the envelope, or the
    file written before it), as `endpoints` and `replayed_plan` read it."""
    from specaudit.artifacts.reproducer import load_reproducer

    reproducer = load_reproducer(path)
    if reproducer.kind != "blackbox":
        raise UsageError(f"{str(path)!r} is not a black-box reproducer (its kind is {reproducer.kind})")
    return reproducer.plan_document()


def endpoints(settings: BlackboxSettings, data: dict[str, Any] | None) -> tuple[str, str, str]:
    """(transport, server URL or engine spec, target): the flags', else the reproducer's."""
    if settings.server or settings.engine:
        transport, where = ("http", settings.server) if settings.server else ("engine", settings.engine)
    else:
        transport, where = (data or {}).get("transport"), (data or {}).get("server") or (data or {}).get("engine")
    target = settings.target or (data or {}).get("target")
    if transport not in ("http", "engine") or not where or not target:
        raise UsageError(f"reproducer {str(settings.replay)!r} names no server/engine or no target: give them")
    target = str(target)
    if target not in MODELS and Path(target).is_dir():  # a reproducer replays from any directory
        target = str(Path(target).resolve())
    return str(transport), str(where), target


def replayed_plan(settings: BlackboxSettings, data: dict[str, Any], transport: str, where: str, target: str) -> Plan:
    """The reproducer's requests and schedule, sent to `where`."""
    try:
        requests = tuple(
            Request(int(r["id"]), tuple(int(t) for t in r["prompt"]), int(r["max_new_tokens"]), float(r["arrival"]))
            for r in data["requests"]
        )
        seed, spread, max_batch = int(data["seed"]), float(data["spread"]), int(data["max_batch"])
        eos = None if data.get("eos_token_id") is None else int(data["eos_token_id"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"reproducer {str(settings.replay)!r} is malformed: {type(exc).__name__} {exc}") from None
    if not requests or any(not r.prompt or r.max_new_tokens < 1 for r in requests):
        raise UsageError(f"reproducer {str(settings.replay)!r} has no requests, an empty prompt or a limit below 1")
    served = settings.served_model or data.get("served_model")
    dtype = settings.dtype or data.get("dtype")
    return Plan(transport, where, target, requests, seed, spread, eos, served, max_batch, dtype)


def fresh_plan(
    settings: BlackboxSettings,
    transport: str,
    where: str,
    target: str,
    model: torch.nn.Module,
    given: list[list[int]] | None,
) -> Plan:
    """Prompts (`given`, from --prompts, else drawn from the seed) and arrivals drawn from the seed."""
    seed = settings.seed or 0
    spread = DEFAULT_SPREAD[transport] if settings.spread is None else settings.spread
    if given is not None:
        prompts = given[: settings.requests or None]
    else:
        vocab = vocab_bound(target, model)
        prompts = drawn_prompts(settings.requests or DEFAULT_REQUESTS, seed, vocab, settings.eos_token_id)
    arrivals = seeded_arrivals(len(prompts), seed, spread, steps=transport == "engine")
    requests = make_requests(prompts, arrivals, settings.max_new_tokens or DEFAULT_MAX_NEW_TOKENS)
    return Plan(transport, where, target, tuple(requests), seed, spread, settings.eos_token_id,
                settings.served_model, settings.max_batch, settings.dtype)  # fmt: skip


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Written beside and renamed: an interrupted run leaves the previous file or the new one, whole."""
    partial = path.with_name(f".{path.name}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(data, indent=1) + "\n")
        partial.replace(path)
    except OSError as exc:
        raise UsageError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None


def run_plan(plan: Plan, model: torch.nn.Module, engine: Any, settings: BlackboxSettings) -> EngineAuditResult:
    """The plan's requests, at its arrivals, through the server or the engine (the oracle on `model` as loaded)."""
    common: dict[str, Any] = {
        "max_new_tokens": [r.max_new_tokens for r in plan.requests],
        "eos_token_id": plan.eos_token_id,
        "seed": plan.seed,
        "arrivals": [r.arrival for r in plan.requests],
        "timeout_s": settings.timeout_s,
        "say": None if settings.quiet else status_line,
    }
    prompts = [r.prompt for r in plan.requests]
    if plan.transport == "http":
        return audit_server(plan.where, model, prompts, model=plan.served_model, **common)
    return audit_callable(engine, model, prompts, max_batch=plan.max_batch, name=plan.where, **common)


def status_line(text: str) -> None:
    print(f"specaudit: {text}", file=sys.stderr, flush=True)


def run_blackbox(settings: BlackboxSettings) -> int:
    """Check the input (URL, target, engine, server), write the reproducer, run, print and write the verdict.
    Exit status: 0 every request matches its oracle, 1 otherwise; bad input is a UsageError (exit 2)."""
    data = read_reproducer(settings.replay) if settings.replay is not None else None
    result = blackbox_result(settings, data)
    print(json.dumps(result.to_json(), indent=1) if settings.json else result.table())
    return 0 if result.passed else 1


def replay_plan(
    data: dict[str, Any],
    source: Path | None,
    *,
    server: str | None = None,
    engine: str | None = None,
    target: str | None = None,
    quiet: bool = True,
) -> EngineAuditResult:
    """A reproducer's plan (`Reproducer.plan_document`) sent again: `specaudit replay FILE` on a black-box file."""
    settings = BlackboxSettings(target=target, server=server, engine=engine, replay=source or Path("-"), quiet=quiet)
    return blackbox_result(settings, data)


def blackbox_result(settings: BlackboxSettings, data: dict[str, Any] | None) -> EngineAuditResult:
    """The run of `run_blackbox` (a reproducer's plan `data`, else a fresh one), its files written."""
    from specaudit.artifacts.reproducer import blackbox_reproducer

    say = (lambda _: None) if settings.quiet else status_line
    transport, where, target = endpoints(settings, data)
    plan = replayed_plan(settings, data, transport, where, target) if data is not None else None
    if transport == "http":
        check_url(where)
    check_target(target)
    if settings.out is not None and settings.out.exists() and not settings.out.is_dir():
        raise UsageError(f"--out {str(settings.out)!r} is not a directory")
    engine = load_blackbox_engine(where) if transport == "engine" else None
    if transport == "http":
        probe_server(where, settings.timeout_s)
    given = file_prompts(settings.prompts, target) if settings.prompts is not None else None
    dtype = (plan.dtype if plan is not None else settings.dtype) or "auto"
    say(f"loading target {target} for the oracle")
    model = load_target(target, None if dtype == "auto" and target in MODELS else dtype)
    plan = plan or fresh_plan(settings, transport, where, target, model, given)
    repro = None if settings.out is None else settings.out / "repro.json"
    if repro is not None:
        write_json(repro, blackbox_reproducer(plan.to_json()).to_json())
        say(f"reproducer written to {repro} (before any request is sent)")
    result = run_plan(plan, model, engine, settings)
    if settings.out is not None and repro is not None:
        write_json(settings.out / "report.json", {"plan": plan.to_json(), **result.to_json()})
        write_json(repro, blackbox_reproducer(plan.to_json(), outcome_summary(result)).to_json())
        say(f"report written to {settings.out / 'report.json'}")
    return result


def outcome_summary(result: EngineAuditResult) -> dict[str, Any]:
    """What the run found, kept in the reproducer so that a replay can be compared with it."""
    return {
        "passed": result.passed,
        "verdict": result.verdict,
        "diverged": {str(o.request.id): o.first_divergence for o in result.outcomes if o.violation is not None},
        "errors": {str(o.request.id): o.error.rule for o in result.outcomes if o.error is not None},
    }


__all__ = [
    "EVIDENCE",
    "RULES",
    "CompletionsClient",
    "EngineAuditResult",
    "Request",
    "RequestOutcome",
    "arrival_offsets",
    "audit_callable",
    "audit_server",
    "load_target",
    "make_requests",
    "run_blackbox",
    "seeded_arrivals",
    "staggered_batches",
]
