"""The step-wise engine contract: requests that arrive, finish and leave while the batch runs.

An engine is named `module:attr`; `attr` is a class or callable taking
`(target, draft, *, num_draft_tokens, eos_token_id, pad_token_id)` whose object has

    add_request(request_id: int, prompt_ids: list[int], max_new_tokens: int) -> None
    step() -> dict[int, list[int]]     # new tokens of each request that advanced, EOS included
    has_unfinished() -> bool           # waiting requests count too
    abort(request_id: int) -> None     # optional; unknown or finished ids do nothing
    finished(request_id: int) -> bool  # optional; true once the engine ended the request itself (a stop string)

and optionally declares `max_batch_size` (rows it runs at once) and `max_wait_steps` (the most
steps a request may wait, from add_request to its first token and between two emissions,
while no more than `max_batch_size` requests are unfinished). Greedy; models are called as
under the batch contract, so the harness's hooks see every target forward. A request that carries
a draft count or a stop string (an engine that owns its models: `adapters.openvino`) is added with
them as keywords, `add_request(..., k=K, stop=TEXT, include=BOOL)`, and only then.

`EngineBook` drives one engine object and holds it to the contract's fixed points: each
breach is a ContractError naming the rule, what was found and what the rule wants.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from specaudit.contracts.decoder import ContractError, DecoderTimeout, resolve_spec, time_limit
from specaudit.contracts.errors import UsageError


class Engine(Protocol):
    def add_request(self, request_id: int, prompt_ids: list[int], max_new_tokens: int) -> None: ...

    def step(self) -> dict[int, list[int]]: ...

    def has_unfinished(self) -> bool: ...


class EngineLoadError(UsageError):
    """A `module:attr` spec that does not name a usable engine."""


ENGINE_METHODS = ("add_request", "step", "has_unfinished")

ENGINE_RULES: dict[str, str] = {
    "engine-builds": "the engine built from (target, draft, *, num_draft_tokens, eos_token_id, pad_token_id)",
    "add-request-returns": "add_request() returning None within the time limit, without raising",
    "step-returns": "step() returning within the time limit, without raising",
    "step-result": "a dict mapping request ids (int) to non-empty lists of int token ids",
    "known-request": "tokens only for request ids given to add_request()",
    "aborted-silent": "no token for an aborted request after abort()",
    "finished-silent": "no token for a request after its EOS or its max_new_tokens-th token",
    "max-new-tokens": "at most max_new_tokens tokens per request",
    "ends-at-eos": "a request ending at its first EOS (included)",
    "has-unfinished": "has_unfinished() true exactly while a request is waiting or running",
    "abort-returns": "abort() returning within the time limit, without raising",
    "models-unchanged": (
        "target and draft left as they were handed to the engine: parameters, buffers, config, mode and hooks"
    ),
    "unobserved-forward": (
        "every target forward made through target(...) or its base model's __call__, where the harness's hooks see it"
    ),
    "unsupported-input": "target calls with 2-D input_ids, a 2-D attention_mask (or none) and a readable cache",
}
"""Each engine contract rule and what it wants: the `expected` half of its ContractError."""


def engine_error(rule: str, found: str, evidence: dict[str, Any] | None = None) -> ContractError:
    return ContractError(rule, found, ENGINE_RULES[rule], evidence)


def load_engine(spec: str) -> Any:
    """Resolve `module:attr` to an engine class or factory; errors say which part failed."""
    factory = resolve_spec(spec, "engine", "specaudit.reference.engines:EqSpecEngine", EngineLoadError)
    if not callable(factory):
        raise EngineLoadError(f"{spec!r} is neither a class nor a callable")
    if isinstance(factory, type):
        missing = [m for m in ENGINE_METHODS if not callable(getattr(factory, m, None))]
        if missing:
            raise EngineLoadError(f"{spec!r} lacks {', '.join(missing)} (see the engine contract in docs/engines.md)")
    return factory


def build_engine(
    factory: Any,
    spec: str,
    target: Any,
    draft: Any,
    *,
    num_draft_tokens: int,
    eos_token_id: int | None,
    pad_token_id: int,
    timeout_s: float = 60.0,
) -> Any:
    """Call the factory with the models; an object without the contract's methods is refused."""
    try:
        with time_limit(timeout_s):
            engine = factory(
                target,
                draft,
                num_draft_tokens=num_draft_tokens,
                eos_token_id=eos_token_id,
                pad_token_id=pad_token_id,
            )
    except (Exception, DecoderTimeout) as exc:
        raise engine_error("engine-builds", f"{spec} raising {type(exc).__name__}: {exc}") from exc
    missing = [m for m in ENGINE_METHODS if not callable(getattr(engine, m, None))]
    if missing:
        raise EngineLoadError(f"{spec!r} built an object without {', '.join(missing)}")
    return engine


def declared(engine: Any, name: str) -> int | None:
    """An optional declared capability (`max_batch_size`, `max_wait_steps`) as an int, or None."""
    value = getattr(engine, name, None)
    if value is None or isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return int(value)


def reached_end(tokens: list[int], max_new_tokens: int, eos: int | None) -> bool:
    """A request's tokens end it: EOS last, or `max_new_tokens` of them (the engine book's and
    every run record's test)."""
    return len(tokens) >= max_new_tokens or bool(tokens and tokens[-1] == eos)


@dataclass
class RequestState:
    """What the harness knows about one request: what it asked for and what it got so far."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    aborted: bool = False
    stopped: bool = False  # the engine's `finished()` said it ended the request (a stop string)

    def finished(self, eos: int | None) -> bool:
        return self.stopped or reached_end(self.tokens, self.max_new_tokens, eos)

    def live(self, eos: int | None) -> bool:
        return not self.aborted and not self.finished(eos)


class EngineBook:
    """Drives one engine and holds every call to the contract; the requests' state lives here."""

    def __init__(self, engine: Any, eos_token_id: int | None, timeout_s: float = 30.0) -> None:
        self.engine = engine
        self.eos = eos_token_id
        self.timeout_s = timeout_s
        self.requests: dict[int, RequestState] = {}
        self.steps = 0

    def live_ids(self) -> list[int]:
        return [r for r in self.requests if self.live(r)]

    def add(self, request_id: int, prompt: tuple[int, ...], max_new_tokens: int, **extras: Any) -> None:
        """`extras`: the request's own keywords (`k`, `stop`, `include`), passed only when given."""
        self.requests[request_id] = RequestState(prompt, max_new_tokens)
        result = self._call("add-request-returns", "add_request", request_id, list(prompt), max_new_tokens, **extras)
        if result is not None:
            raise engine_error("add-request-returns", f"add_request() returning a {type(result).__name__}")

    def abort(self, request_id: int) -> bool:
        """Abort through the engine; False when the engine has no abort()."""
        if not callable(getattr(self.engine, "abort", None)):
            return False
        self._call("abort-returns", "abort", request_id)
        state = self.requests.get(request_id)
        if state is not None and not state.finished(self.eos):
            state.aborted = True
        return True

    def step(self) -> dict[int, list[int]]:
        """One step(): the validated result, with every request's tokens appended."""
        self.steps += 1
        out = self._call("step-returns", "step")
        emitted = self.validate(out)
        for request_id, tokens in emitted.items():
            self.requests[request_id].tokens += tokens
        self.note_stopped()
        return emitted

    def note_stopped(self) -> None:
        """Live requests the engine says it ended (its optional `finished()`): a stop string ends a
        request the book cannot tell ended, and after it the request must stay silent."""
        if not callable(getattr(self.engine, "finished", None)):
            return
        for request_id in self.live_ids():
            if self._call("step-returns", "finished", request_id):
                self.requests[request_id].stopped = True

    def live(self, request_id: int) -> bool:
        """Neither finished (EOS, limit, or the engine's own end) nor aborted: more is due."""
        return self.requests[request_id].live(self.eos)

    def check_unfinished(self) -> None:
        """'has-unfinished': the engine's answer against the harness's own count."""
        expected = bool(self.live_ids())
        found = self._call("step-returns", "has_unfinished")
        if bool(found) != expected:
            live = self.live_ids()
            raise engine_error(
                "has-unfinished",
                f"has_unfinished() = {found!r} with {len(live)} unfinished request(s) {live[:8]}",
                {"found": bool(found), "unfinished": live[:8]},
            )

    def _call(self, rule: str, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            with time_limit(self.timeout_s):
                return getattr(self.engine, method)(*args, **kwargs)
        except DecoderTimeout as exc:
            raise engine_error(
                rule, f"{method}() not returning within {self.timeout_s:g} s (a hang)", {"timeout_s": self.timeout_s}
            ) from exc
        except Exception as exc:  # one line, at most 400 characters: an engine's message can span a page
            said = " ".join(str(exc).split())
            raise engine_error(rule, f"{method}() raising {type(exc).__name__}: {said}"[:400]) from exc

    def validate(self, out: Any) -> dict[int, list[int]]:
        """step()'s result against the fixed points: types, known live ids, limits, EOS."""
        if not isinstance(out, dict):
            raise engine_error("step-result", f"step() returning a {type(out).__name__}")
        emitted: dict[int, list[int]] = {}
        for request_id, tokens in out.items():
            if not isinstance(request_id, int) or isinstance(request_id, bool):
                raise engine_error("step-result", f"a key {request_id!r} of type {type(request_id).__name__}")
            if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (list, tuple)):
                raise engine_error(
                    "step-result", f"request {request_id} given a {type(tokens).__name__}", {"request": request_id}
                )
            bad = [t for t in tokens if not isinstance(t, int) or isinstance(t, bool)]
            if bad:
                found = f"request {request_id} given {type(bad[0]).__name__} {bad[0]!r}"
                raise engine_error("step-result", found, {"request": request_id})
            if not tokens:
                continue  # "nothing new" spelled as an empty list: harmless
            state = self.requests.get(request_id)
            if state is None:
                raise engine_error(
                    "known-request",
                    f"tokens {list(tokens)[:8]} for unknown request {request_id}",
                    {"request": request_id},
                )
            self.judge_emission(request_id, state, list(tokens))
            emitted[request_id] = list(tokens)
        return emitted

    def judge_emission(self, request_id: int, state: RequestState, tokens: list[int]) -> None:
        where = {"request": request_id, "tokens": tokens[:8], "step": self.steps}
        if state.aborted:
            raise engine_error("aborted-silent", f"tokens {tokens[:8]} for aborted request {request_id}", where)
        if state.finished(self.eos):
            found = f"tokens {tokens[:8]} for request {request_id}, finished after {len(state.tokens)} tokens"
            raise engine_error("finished-silent", found, where)
        total = len(state.tokens) + len(tokens)
        if total > state.max_new_tokens:
            found = f"request {request_id} at {total} tokens (max_new_tokens {state.max_new_tokens})"
            raise engine_error("max-new-tokens", found, where)
        if self.eos is not None and self.eos in tokens[:-1]:
            index = len(state.tokens) + tokens.index(self.eos)
            raise engine_error("ends-at-eos", f"request {request_id} going on after EOS at index {index}", where)


__all__ = [
    "ENGINE_RULES",
    "Engine",
    "EngineBook",
    "EngineLoadError",
    "RequestState",
    "build_engine",
    "declared",
    "engine_error",
    "load_engine",
    "reached_end",
]
