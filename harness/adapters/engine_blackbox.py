"""Black-box continuous-batching engines: the evidence and its judgement, at the output level.

For engines that own their models (a vLLM `LLM`, an OpenAI-compatible server, a step-wise
engine whose models the harness cannot hook). Requests arrive on a seeded schedule, so that
some join while others run, which is where continuous batching goes wrong (positions counted
from the wrong origin, stale cache rows, masks not extended); each request's tokens are then
compared with the batch-size-1 greedy oracle of a target the harness holds in process (the same
weights the engine serves), tie-aware as `specaudit.checks.compare_row` does.

This module is what every transport shares, so that the judge knows no transport: the requests
and their arrival schedule, the output-contract rules (`RULES`), the judgement (`judge_answers`:
oracles, tie-aware comparison, overlaps) and the result (`EngineAuditResult`). The transports
(a server, a callable, a step-wise engine) are `specaudit.adapters.transports`; the
`specaudit blackbox` command is `specaudit.commands.blackbox`.

Level of evidence: OUTPUT ONLY. What is checked is each request's tokens, length and stop
against the oracle: exact match, partial match, first divergence. The harness sees no forward
of the engine's models, so there is no I1, no I2, no row identity, no token preservation and no
diagnosis of the cause; a pass is evidence that these schedules produced oracle outputs, not
that the engine's cache and masks are right (a wrong row can still produce the right argmax).
For engines whose models can be hooked, the step-wise engine contract and its state machine
(`specaudit.search.engine_machine`) check all of that.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st

from specaudit._moved import forward as _forward
from specaudit.adapters.blackbox import dtype_name
from specaudit.artifacts.report import entry
from specaudit.checks.coverage import OUTPUTS, Coverage, coverage_of_answers
from specaudit.checks.equivalence import RowEquivalence, divergence
from specaudit.checks.outputs import OUTPUT_RULES, OutputEvidence, compared, token_violation
from specaudit.checks.registry import BLACK_BOX, Evaluation, evaluate
from specaudit.checks.stops import check_stop, check_usage, expected_with_stop, finish_violation
from specaudit.contracts import subjects
from specaudit.contracts.builtins import MODELS
from specaudit.contracts.violation import Violation
from specaudit.reference.oracle import OracleResult, answer_oracles, greedy_oracle
from specaudit.running.record import Entry, Record

EVIDENCE = (
    "output level only: each request's tokens against the batch-size-1 greedy oracle; the engine's "
    "model forwards are not observed, so no I1, no I2, no row identity and no diagnosis of the cause"
)

RULES: dict[str, str] = {
    "responds": "a response within the time limit",
    "http-status": "HTTP 200",
    "json-response": "a JSON completion object",
    "token-ids": "choices[0].token_ids, a list of int token ids (send return_token_ids)",
    **OUTPUT_RULES,  # token-count, max-new-tokens, ends-at-eos: `checks.outputs`, shared with paged engines
    "stop-string": "the oracle's tokens and text cut at the request's stop string (`stop_violation`)",
    "usage-count": "usage counting the tokens returned: completion tokens, prompt tokens, cached at most the prompt",
    "generate-returns": "generate() returning one list of int token ids per prompt, without raising",
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
    stop: str | None = None  # a stop string (vLLM's `stop`), drawn from the oracle's text (`with_stops`)
    include_stop: bool = False  # vLLM's `include_stop_str_in_output`
    k: int | None = None  # this request's draft count (step-wise engines that take one); the engine's own when None
    cancel: int | None = None  # steps after its add at which it is cancelled (step-wise engines); never when None


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


def mixed_limits(n: int, limit: int, seed: int) -> list[int]:
    """Each request's max_new_tokens: the first `limit`, the others drawn from [limit // 4, limit] by
    the seed, so the limits land at different places (inside an accepted run, at a block boundary)."""
    rng = random.Random(f"limits-{seed}")
    return [limit] + [rng.randint(max(1, limit // 4), limit) for _ in range(n - 1)]


def likely_eos(target: torch.nn.Module, prompts: Sequence[Sequence[int]], limits: Sequence[int]) -> int | None:
    """An EOS that ends some requests early: of the tokens the target's greedy continuations emit,
    the one first emitted strictly inside the most continuations (neither first, which would test
    nothing, nor last), preferring one that leaves some request to run to its limit. None if no
    token qualifies (an EOS nobody produces would never be tested)."""
    inside: Counter[int] = Counter()
    everywhere: set[int] | None = None
    with torch.no_grad():
        for prompt, limit in zip(prompts, limits):
            tokens = greedy_oracle(target, tuple(prompt), max_new_tokens=limit, eos_token_id=None).tokens
            first = {t: i for i, t in reversed(list(enumerate(tokens)))}
            inside.update(t for t, i in first.items() if 0 < i < limit - 1)
            everywhere = set(first) if everywhere is None else everywhere & set(first)
    ranked = sorted(inside, key=lambda t: (t in (everywhere or set()), -inside[t], t))
    return ranked[0] if ranked else None


def arrival_offsets(n: int, spread: float, *, steps: bool = False) -> st.SearchStrategy[list[float]]:
    """Hypothesis strategy for `n` arrival offsets in [0, spread] (integer step indices when `steps`)."""
    one = (
        st.integers(0, int(spread)).map(float)
        if steps
        else st.floats(0.0, spread, allow_nan=False, allow_infinity=False)
    )
    return st.lists(one, min_size=n, max_size=n).map(lambda xs: [round(x - min(xs), 4) for x in xs])


# ---------------------------------------------------------------------------------------
# Stop strings: drawn from the oracle's text, judged on the ids and the text returned

Decode = Callable[[list[int]], str]
STOP_SHARE = 0.5
"""The share of a server black box's requests that carry a stop string, when the target has a tokenizer."""
STOP_KINDS = ("token", "across", "inside")
"""A drawn stop string: one token's text, a text starting inside the token before it, or a token's text
less its last character (completed inside the token: the text is trimmed mid-token)."""


class TokenizerText:
    """A `tokenizers` tokenizer's text of token ids, special tokens skipped (vLLM's default); `after(prompt)`
    the text of output tokens as vLLM's detokenizer makes it, a `DecodeStream` primed with the prompt."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(path))

    def __call__(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def after(self, prompt: Sequence[int]) -> Decode:
        from tokenizers.decoders import DecodeStream

        def text(ids: list[int]) -> str:
            stream = DecodeStream(ids=list(prompt), skip_special_tokens=True)
            return "".join(stream.step(self.tokenizer, int(t)) or "" for t in ids)

        return text


def detokenizer(*targets: torch.nn.Module | str | Path) -> Decode | None:
    """The first target directory's `tokenizer.json` (`TokenizerText`) among the directories given or
    the ones loaded models came from; None without one (no stop strings)."""
    for target in targets:
        loaded_from = getattr(getattr(target, "config", None), "_name_or_path", "")
        name = target if isinstance(target, str | Path) else loaded_from
        path = Path(str(name or "")) / "tokenizer.json"
        if name and path.is_file():
            return TokenizerText(path)
    return None


def in_context(decode: Decode, prompt: Sequence[int]) -> Decode:
    """The text of output tokens as vLLM's incremental detokenizer gives it: after the prompt's text, so
    with the separator before the first token (" w5" for the tiny Llama, not "w5"). A `TokenizerText`
    streams it as vLLM does; any other decode gives the text of prompt and outputs less the prompt's."""
    after = getattr(decode, "after", None)
    if after is not None:
        return after(prompt)  # type: ignore[no-any-return]
    head = decode(list(prompt))
    return lambda ids: decode([*prompt, *ids])[len(head) :]


def draw_stop(rng: random.Random, tokens: Sequence[int], decode: Decode, eos: int | None) -> str | None:
    """A stop string completed by a token of the oracle's continuation `tokens` that has a token after it
    before any EOS (so a multi-token step can carry it past the stop), of a kind drawn from `STOP_KINDS`;
    None when the continuation is too short or its text is not built token by token."""
    end = list(tokens).index(eos) if eos is not None and eos in tokens else len(tokens)
    if end < 3:
        return None
    j = rng.randint(1, end - 2)
    before, upto = decode(list(tokens[:j])), decode(list(tokens[: j + 1]))
    if not upto.startswith(before) or not upto[len(before) :].strip():
        return None
    piece = upto[len(before) :].strip()
    kind = rng.choice(STOP_KINDS)
    if kind == "across" and before.strip():
        return upto[max(0, len(before) - 2) :]
    return piece[:-1] if kind == "inside" and len(piece) > 2 else piece


def with_stops(
    target: torch.nn.Module, requests: Sequence[Request], eos_token_id: int | None, decode: Decode, seed: int,
    share: float = STOP_SHARE,
) -> list[Request]:  # fmt: skip
    """The requests, a seeded `share` of them given a stop string drawn from their greedy continuation's
    text (`draw_stop`) and `include_stop` drawn: the same seed, prompts and limits draw the same stops."""
    rng = random.Random(f"stops-{seed}")
    out = []
    for r in requests:
        if rng.random() >= share:
            out.append(r)
            continue
        with torch.no_grad():
            tokens = greedy_oracle(target, r.prompt, max_new_tokens=r.max_new_tokens, eos_token_id=eos_token_id).tokens
        stop = draw_stop(rng, tokens, in_context(decode, r.prompt), eos_token_id)
        out.append(r if stop is None else replace(r, stop=stop, include_stop=rng.random() < 0.5))
    return out


def with_given_stops(requests: Sequence[Request], stops: Sequence[tuple[str | None, bool]]) -> list[Request]:
    """The requests with the stop strings and include flags a reproducer stored (one per request, in
    order), as they are: a replay sends what was sent, not what the seed draws on today's target."""
    if len(stops) != len(requests):
        raise ValueError(f"one stop per request: {len(stops)} stops for {len(requests)} requests")
    if any(s is not None and (not isinstance(s, str) or not s) for s, _ in stops):
        raise ValueError(f"a stop is a non-empty string or None, got {[s for s, _ in stops]!r}")
    return [replace(r, stop=s, include_stop=bool(i)) for r, (s, i) in zip(requests, stops)]


def stop_text(decode: Decode, ids: Sequence[int], stop: str, include: bool) -> str:
    """vLLM's text of a request that its stop string ended: the text of its ids cut at the stop string's
    first appearance, after it with `include_stop_str_in_output`, before it without."""
    text = decode(list(ids))
    start = text.find(stop)
    return text if start < 0 else text[: start + (len(stop) if include else 0)]


def stop_violation(decode: Decode, request: Request, oracle: Sequence[int], answer: Answer) -> Violation | None:
    """A `stop-string` violation of a request with a stop string, against its oracle's tokens (enough of
    them to hold the stop string): its ids must be the oracle's through the token that completes it, whatever
    `include_stop` says (vLLM trims the text only; `checks.stops.check_stop` with include), its text
    `stop_text`, and it must finish on "stop" when the stop string ended it."""
    assert request.stop is not None and answer.tokens is not None
    head = f"request {request.id} with stop string {request.stop!r} (include_stop_str_in_output={request.include_stop})"
    want = expected_with_stop(decode, oracle, request.stop, True)
    if check_stop(decode, oracle, answer.tokens, request.stop, True, request.id) is not None:
        found = f"{head} returned the ids {list(answer.tokens)} ({answer.text!r})"
        wanted = "the oracle's ids through the token completing the stop string" if want else "the oracle's ids"
        return Violation("contract", "stop-string", found, f"{wanted}: {want or list(oracle)}", request=request.id)
    if want is None:
        return None
    text = stop_text(decode, want, request.stop, request.include_stop)
    if answer.text is not None and answer.text != text:
        found = f"{head} returned the text {answer.text!r} for ids {list(answer.tokens)}"
        return Violation("contract", "stop-string", found, f"the text {text!r}", request=request.id)
    return finish_violation(answer.finish, request.stop, request.id)


def usage_violation(request: Request, ids: Sequence[int], usage: Any) -> Violation | None:
    """A `usage-count` violation when a completion's `usage` (where it reports one) does not count what
    came back: `completion_tokens` the ids returned (vLLM counts them, a stop string's included), and
    `prompt_tokens` the prompt; `prompt_tokens_details.cached_tokens`, where reported, at most the prompt."""
    if not isinstance(usage, dict):
        return None
    found = check_usage(usage.get("completion_tokens", -1), len(ids), request.id, "completion tokens")
    found = found or check_usage(usage.get("prompt_tokens", -1), len(request.prompt), request.id, "prompt tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if found is None and cached is not None and not 0 <= cached <= len(request.prompt):
        what = f"request {request.id} reported {cached} cached prompt tokens"
        return Violation("contract", "usage-count", what, f"0 to {len(request.prompt)}, its prompt", request=request.id)
    return found


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
    coverage: Coverage = Coverage(level=OUTPUTS)  # arrivals, requests in flight, longest output, EOS stops
    evaluation: Evaluation | None = None  # the registry's checks of a black box (`evaluate(BLACK_BOX, ...)`)

    @property
    def errors(self) -> list[int]:
        return [o.request.id for o in self.outcomes if o.error is not None]

    @property
    def diverged(self) -> list[int]:
        return [o.request.id for o in self.outcomes if o.violation is not None]

    @property
    def passed(self) -> bool:
        """No request broke the output contract or diverged, and the registry's checks agree."""
        agreed = self.evaluation is None or self.evaluation.passed
        return self.engine_error is None and not self.errors and not self.diverged and agreed

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
            contract = any(v.check == "contract" for v in self.violations)
            what = "contract broken" if contract else f"unfinished (requests {self.errors})"
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
        coverage = f"coverage: {self.coverage.summary()}" + "".join(f" [{f}]" for f in self.coverage.flags)
        return "\n".join([summary, *lines, *notes, coverage, f"level of evidence: {self.evidence}"])

    def report_entry(self, target: str, **figures: Any) -> dict[str, Any]:
        """Output level only: the first violation names a request and a token, no signature (no diagnosis)."""
        subject = {"engine": self.engine, "transport": self.transport, "target": target}
        first = self.violations[0] if self.violations else None
        return entry(
            subjects.BLACK_BOX.report, subject, self.passed, first, None, {**figures, **self.to_json()}, self.coverage
        )

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
            "coverage": self.coverage.to_json(),
            "requests": [
                {
                    "id": o.request.id,
                    "prompt": list(o.request.prompt),
                    "max_new_tokens": o.request.max_new_tokens,
                    "stop": o.request.stop,
                    "include_stop": o.request.include_stop,
                    "arrival": o.request.arrival,
                    "start": o.start,
                    "end": o.end,
                    "overlapped": o.overlapped,
                    "status": o.status,
                    "tokens": None if o.tokens is None else list(o.tokens),
                    "expected": None if o.row is None else list(o.row.expected),
                    "expected_complete": None if o.row is None else o.row.complete,  # False: cut at the divergence
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
    found = answer_oracles(target, wanted, eos_token_id, cut=True)
    return {r.id: result for r, result in zip(requests, found)}, time.perf_counter() - start


def stop_cut(decode: Decode, request: Request, oracle: OracleResult) -> tuple[int, OracleResult]:
    """(the limit, the oracle) a request with a stop string is judged by: the oracle's tokens through the
    token that completes the stop string, as if that were the request's `max_new_tokens`."""
    want = expected_with_stop(decode, oracle.tokens, request.stop or "", True)
    if want is None:
        return request.max_new_tokens, oracle
    return len(want), OracleResult(tuple(want), "length", oracle.margins[: len(want)])


def judge_stop(
    target: torch.nn.Module, decode: Decode, request: Request, answer: Answer, oracle: OracleResult,
    eos_token_id: int | None,
) -> tuple[Violation | None, int, OracleResult]:  # fmt: skip
    """A request with a stop string: its `stop_violation` and (limit, oracle) to judge it by (`stop_cut`).
    The oracle cut at the answer's end holds the stop string when the answer is right (one forward);
    otherwise the whole continuation is decoded, so the violation shows what was wanted. An answer
    that leaves the oracle's tokens is equivalence's to judge (tie-aware), not the stop string's."""
    text = in_context(decode, request.prompt)
    diverged = answer.tokens is None or any(a != b for a, b in zip(answer.tokens, oracle.tokens))
    violation = None if diverged else stop_violation(text, request, oracle.tokens, answer)
    missing = expected_with_stop(text, oracle.tokens, request.stop or "", True) is None
    if not oracle.complete and (violation is not None or missing):
        with torch.no_grad():
            oracle = greedy_oracle(target, request.prompt, max_new_tokens=request.max_new_tokens,
                                   eos_token_id=eos_token_id)  # fmt: skip
        violation = None if diverged else stop_violation(text, request, oracle.tokens, answer)
    return (violation, *stop_cut(text, request, oracle))


def answers_evidence(
    target: torch.nn.Module, record: Record, answers: dict[int, Answer], engine_error: Violation | None, dtype: str
) -> OutputEvidence:
    """The black box's evidence for the registry (`evaluate(BLACK_BOX, ...)`): its record, the
    output-contract breaks the transport found (per request, the engine's under None), ties judged
    by the oracle's margin against the dtype's rounding tolerance and re-synced on the target."""
    eos = record.eos_token_id

    def oracle_from(prefix: tuple[int, ...], n: int) -> OracleResult:
        with torch.no_grad():
            return greedy_oracle(target, prefix, max_new_tokens=n, eos_token_id=eos)

    errors: dict[int | None, Violation] = {r: a.error for r, a in answers.items() if a.error is not None}
    errors.update({r: missing(r) for r, a in answers.items() if a.error is None and a.tokens is None})
    if engine_error is not None:
        errors[None] = engine_error
    return OutputEvidence(record, dtype, oracle_from, errors)


def missing(request: int) -> Violation:
    return contract_violation("responds", "no answer and no error for the request", request)


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
    text: str | None = None  # the text the server returned (judged for a request with a stop string)
    finish: str | None = None  # its finish reason
    usage: dict[str, Any] | None = None  # its usage counts, as reported


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
    decode: Decode | None = None,
) -> EngineAuditResult:
    """Compare every answered request with its oracle; requests with an error are not compared.
    The answers are first the record every subject's evidence is (`running.record`): no calls,
    each request admitted and retired when the transport sent and got it. A request with a stop
    string (judged with `decode`, the target's tokenizer) is held to `stop_violation` and then, as
    any other, to its oracle cut at the stop string (`stop_cut`), its text read after its prompt's
    (`in_context`)."""
    if say is not None:
        say(f"engine done in {seconds:.2f} s; batch-size-1 greedy oracle for {len(requests)} requests")
    oracle, oracle_seconds = oracles(target, requests, answers, eos_token_id)
    dtype = dtype or dtype_name(target)
    unit = {"http": "seconds", "steps": "steps"}.get(transport, "calls")  # what arrivals count in (`Request`)
    record = Record(label, subjects.EVIDENCE_BLACK_BOX, unit, eos_token_id)
    for r in requests:
        a, limit, expected = answers[r.id], r.max_new_tokens, oracle[r.id]
        if r.stop is not None and decode is not None:
            error, limit, expected = judge_stop(target, decode, r, a, expected, eos_token_id)
            a.error = a.error or error
        record.admit(Entry(r.id, r.prompt, limit, expected, list(a.tokens or ()), a.start, a.end))
    evidence = answers_evidence(target, record, answers, engine_error, dtype)
    evaluation = evaluate(BLACK_BOX, evidence)
    rows = compared(evidence)  # the equivalence check's comparison (made here too if a contract break skipped it)
    flags = overlaps({r.id: (answers[r.id].start, answers[r.id].end) for r in requests})
    outcomes = []
    for r in requests:
        a, row = answers[r.id], rows.get(r.id)
        violation = None if row is None or row.equivalent else divergence(row)
        outcomes.append(RequestOutcome(r, a.tokens, a.error, row, violation, a.start, a.end, flags[r.id], a.note))
    covered = coverage_of_answers(record)
    return EngineAuditResult(label, transport, tuple(outcomes), engine_error, seconds, oracle_seconds, coverage=covered,
                             evaluation=evaluation)  # fmt: skip


def check_tokens(request: Request, tokens: list[int], eos_token_id: int | None) -> Violation | None:
    """The length and EOS rules on one request's tokens (`checks.outputs.token_violation`, the
    registry's contract on a black box's or a paged engine's record)."""
    return token_violation(request.id, tokens, request.max_new_tokens, eos_token_id)


__all__ = [
    "EVIDENCE",
    "RULES",
    "Answer",
    "EngineAuditResult",
    "Request",
    "RequestOutcome",
    "arrival_offsets",
    "judge_answers",
    "load_target",
    "make_requests",
    "seeded_arrivals",
    "with_given_stops",
    "with_stops",
]


# audit_server, audit_callable and CompletionsClient moved to specaudit.adapters.transports (ceb6d45);
# their old path still resolves here, with a DeprecationWarning (specaudit._moved).
__getattr__ = _forward(__name__)
