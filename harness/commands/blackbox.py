"""`specaudit blackbox`: a continuous-batching engine audited at the output level.

The command part of the black-box engine audit, kept in the commands layer because it reads the
user's settings, prints and writes files: the input checked (URL, target, engine, server) before
the slow work, the plan (prompts and arrivals, drawn from the seed or read from a reproducer)
written before any request is sent, the run through `specaudit.adapters.transports`, and the
verdict printed and written.
"""

from __future__ import annotations

import inspect
import json
import random
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from specaudit.adapters.engine_blackbox import (
    EngineAuditResult,
    Request,
    detokenizer,
    likely_eos,
    load_target,
    make_requests,
    mixed_limits,
    seeded_arrivals,
    with_given_stops,
    with_stops,
)
from specaudit.adapters.transports import audit_callable, audit_server, is_stepwise
from specaudit.artifacts.report import write_report
from specaudit.config.settings import BlackboxSettings
from specaudit.contracts.builtins import MODELS
from specaudit.contracts.decoder import resolve_spec
from specaudit.contracts.errors import UsageError
from specaudit.contracts.subjects import BLACK_BOX

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
    stops_recorded: bool = True  # False: a reproducer written before stops were stored: drawn from the seed

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
            "stops_recorded": self.stops_recorded,
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
    if reproducer.kind != BLACK_BOX.reproducer:
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


def stored_request(request: dict[str, Any]) -> Request:
    """One reproducer request, without its stop (`replayed_plan` gives the stored ones)."""
    prompt = tuple(int(t) for t in request["prompt"])
    return Request(int(request["id"]), prompt, int(request["max_new_tokens"]), float(request["arrival"]))


def replayed_plan(settings: BlackboxSettings, data: dict[str, Any], transport: str, where: str, target: str) -> Plan:
    """The reproducer's requests, their stop strings and schedule, sent to `where`. A file without
    `stops_recorded` (written before stops were stored) has its stops drawn from the seed again, as then."""
    recorded = bool(data.get("stops_recorded"))
    try:
        requests = tuple(stored_request(r) for r in data["requests"])
        if recorded:  # checked as `audit_server` checks given stops: a string or None per request
            stops = [(r.get("stop"), bool(r.get("include_stop", False))) for r in data["requests"]]
            requests = tuple(with_given_stops(requests, stops))
        seed, spread, max_batch = int(data["seed"]), float(data["spread"]), int(data["max_batch"])
        eos = None if data.get("eos_token_id") is None else int(data["eos_token_id"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"reproducer {str(settings.replay)!r} is malformed: {type(exc).__name__} {exc}") from None
    if not requests or any(not r.prompt or r.max_new_tokens < 1 for r in requests):
        raise UsageError(f"reproducer {str(settings.replay)!r} has no requests, an empty prompt or a limit below 1")
    served = settings.served_model or data.get("served_model")
    dtype = settings.dtype or data.get("dtype")
    return Plan(transport, where, target, requests, seed, spread, eos, served, max_batch, dtype, recorded)


def fresh_plan(
    settings: BlackboxSettings,
    transport: str,
    where: str,
    target: str,
    model: torch.nn.Module,
    given: list[list[int]] | None,
) -> Plan:
    """Prompts (`given`, from --prompts, else drawn from the seed), arrivals drawn from the seed, each
    request's limit (drawn too with --mixed-max-tokens) and the EOS (chosen from the target's own
    continuations with --likely-eos), and for a server each request's stop string, drawn from the seed
    (`with_stops`): all recorded in the reproducer, so a replay needs none of it."""
    seed = settings.seed or 0
    spread = DEFAULT_SPREAD[transport] if settings.spread is None else settings.spread
    if given is not None:
        prompts = given[: settings.requests or None]
    else:
        vocab = vocab_bound(target, model)
        prompts = drawn_prompts(settings.requests or DEFAULT_REQUESTS, seed, vocab, settings.eos_token_id)
    limit = settings.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    limits = mixed_limits(len(prompts), limit, seed) if settings.mixed_max_tokens else [limit] * len(prompts)
    eos = likely_eos(model, prompts, limits) if settings.likely_eos else settings.eos_token_id
    arrivals = seeded_arrivals(len(prompts), seed, spread, steps=transport == "engine")
    requests = make_requests(prompts, arrivals, limits)
    decode = detokenizer(target, model) if transport == "http" else None
    requests = requests if decode is None else with_stops(model, requests, eos, decode, seed)
    return Plan(transport, where, target, tuple(requests), seed, spread, eos,
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
        stops = [(r.stop, r.include_stop) for r in plan.requests] if plan.stops_recorded else None
        return audit_server(plan.where, model, prompts, model=plan.served_model, stops=stops, **common)
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
    if any(r.stop is not None for r in plan.requests) and detokenizer(target, model) is None:
        raise UsageError(f"reproducer {str(settings.replay)!r} sends stop strings, and --target {target!r} has no "
                         "tokenizer to judge their text: give the target directory it was written with")  # fmt: skip
    repro = None if settings.out is None else settings.out / "repro.json"
    if repro is not None:
        write_json(repro, blackbox_reproducer(plan.to_json()).to_json())
        say(f"reproducer written to {repro} (before any request is sent)")
    result = run_plan(plan, model, engine, settings)
    if settings.out is not None and repro is not None:
        write_report(settings.out, "blackbox", [result.report_entry(plan.target, plan=plan.to_json())])
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
    "Plan",
    "blackbox_result",
    "replay_plan",
    "run_blackbox",
]
