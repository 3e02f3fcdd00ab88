"""`specaudit audit-vllm`: vLLM at both levels, once per served model and configuration
(control, ngram, draft model, the target as its own draft).

The black box: `specaudit blackbox` against a vLLM OpenAI-compatible server (started with
`--block-size 32`, so outputs cross block boundaries; each request's `max_tokens` drawn, an EOS
the target emits part-way sent as the only stop token), /metrics read around it. The white box:
`python -m specaudit whitebox-vllm` with the vLLM venv's python, Hypothesis drawing
workloads through an in-process engine whose settings the configuration names
(`adapters.vllm.server.WHITEBOX`). One report, an entry per level per configuration
(`adapters.vllm.report`). In the commands layer because it runs commands.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specaudit.adapters.sampling_blackbox import SamplingVerdict, audit_sampling_server
from specaudit.adapters.vllm.lifecycle import (
    HOST,
    SERVER_ENV,
    SERVER_LENGTH,
    ServerError,
    check_python,
    free_port,
    server_command,
    serving,
)
from specaudit.adapters.vllm.metrics import SpecCounts, fetch_counts
from specaudit.adapters.vllm.models import model_directories
from specaudit.adapters.vllm.report import ConfigurationOutcome, from_report, write_reports
from specaudit.adapters.vllm.server import (
    BLACKBOX_LENGTHS,
    SERVER_CHUNK,
    boundary_prompts,
    sampling_size,
    server_block,
    server_env,
    speculative_config,
    whitebox_arguments,
    whitebox_options,
    workaround_env,
    write_prompts,
)
from specaudit.artifacts.report import load_report
from specaudit.commands.blackbox import run_blackbox
from specaudit.config.settings import BlackboxSettings, VllmAuditSettings
from specaudit.contracts.errors import UsageError
from specaudit.models.pretrained import cache_dir
from specaudit.reference.vllm_mutants import BY_NAME, PLANT_ENV

WHITEBOX_STARTUP_S = 240.0  # building the engine and the model before the budget starts
WHITEBOX_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **SERVER_ENV}
FLAT = "the sampled distributions are nearly flat (mean top-1 probability {:.2f}): the fit sees little"
ALL_ACCEPTED = "every draft was accepted while sampling: no token was drawn after a rejection"


def audit_configuration(
    settings: VllmAuditSettings, model: str, configuration: str, target: Path, draft: Path, say: Callable[[str], None]
) -> ConfigurationOutcome:
    """Both levels of one configuration; the server always stops."""
    outcome = blackbox_configuration(settings, model, configuration, target, draft, say)
    if settings.whitebox_examples <= 0:
        return outcome
    whitebox = whitebox_configuration(settings, model, configuration, target, draft, say)
    return ConfigurationOutcome(**{**outcome.__dict__, "whitebox": whitebox})


def blackbox_configuration(
    settings: VllmAuditSettings, model: str, configuration: str, target: Path, draft: Path, say: Callable[[str], None]
) -> ConfigurationOutcome:
    """Serve `target` with the configuration, audit it black-box, read /metrics around it."""
    spec = speculative_config(configuration, draft, target)
    port = free_port()
    url = f"http://{HOST}:{port}"
    out = settings.out / f"{model}-{configuration}"
    start = time.monotonic()
    say(f"{model} / {configuration}: starting vLLM on {url} (log {out / 'server.log'})")
    command = server_command(settings.python, target, port, spec) + [*server_block(model), *SERVER_CHUNK]
    try:
        env = {**SERVER_ENV, **server_env(configuration), **workaround_env(),
               **({PLANT_ENV: settings.plant} if settings.plant else {})}  # fmt: skip
        with serving(command, url, out / "server.log", settings.health_timeout_s, env) as server:
            startup = time.monotonic() - start
            say(f"{model} / {configuration}: healthy after {startup:.1f} s (pid {server.pid}); auditing")
            before = fetch_counts(url)
            prompts = write_prompts(out / "prompts.jsonl", target, settings.requests, settings.seed)
            blackbox = BlackboxSettings(
                target=str(target), server=url, requests=settings.requests, max_new_tokens=settings.max_new_tokens,
                seed=settings.seed, spread=settings.spread, served_model=str(target), prompts=prompts,
                likely_eos=True, mixed_max_tokens=True, timeout_s=settings.request_timeout_s,
                dtype="float32", out=out, quiet=True,
            )  # fmt: skip
            run_blackbox(blackbox)
            counts = fetch_counts(url) - before
            sampling = sampling_configuration(settings, model, configuration, target, url, say)
    except (ServerError, OSError, UsageError) as exc:
        return ConfigurationOutcome(model, configuration, spec, False, "server or audit error", error=str(exc),
                                    wall_s=time.monotonic() - start)  # fmt: skip
    (report,) = load_report(out / "report.json")["entries"]
    figures = from_report(report)
    return ConfigurationOutcome(model, configuration, spec, counts=counts, startup_s=startup,
                                wall_s=time.monotonic() - start, sampling=sampling, **figures)  # fmt: skip


def sampling_configuration(
    settings: VllmAuditSettings, model: str, configuration: str, target: Path, url: str, say: Callable[[str], None]
) -> dict[str, Any]:
    """The sampling black box on the running server (`adapters.sampling_blackbox`): its summary, the
    server's acceptance meanwhile and any warning; everything, tokens included, in `sampling.json`.
    A failure of its own (the server gone, the oracle not loading) is its verdict, not the greedy one's."""
    out = settings.out / f"{model}-{configuration}"
    prompts, per_prompt = sampling_size(settings.requests, model)
    vocab = int(json.loads((target / "config.json").read_text())["vocab_size"])
    try:
        before = fetch_counts(url)
        verdict = audit_sampling_server(
            url, target, boundary_prompts(vocab, prompts, settings.seed), per_prompt=per_prompt,
            max_new_tokens=settings.max_new_tokens, seed=settings.seed, spread_s=settings.spread,
            model=str(target), timeout_s=settings.request_timeout_s,
        )  # fmt: skip
        counts = fetch_counts(url) - before
    except (OSError, UsageError) as exc:
        return {"passed": False, "verdict": f"sampling error: {exc}", "error": str(exc)}
    data = verdict.to_json() | {"counts": asdict(counts) | {"acceptance": counts.acceptance}}
    data["warnings"] = sampling_warnings(verdict, counts)
    (out / "sampling.json").write_text(json.dumps(data, indent=1) + "\n")
    say(f"{model} / {configuration}: sampling {'passed' if verdict.passed else 'FAILED'}: {verdict.verdict}")
    return {key: value for key, value in data.items() if key != "samples"}


def sampling_warnings(verdict: SamplingVerdict, counts: SpecCounts) -> list[str]:
    """What makes a passing sampling verdict weak: flat distributions, no rejection to draw after."""
    found = [FLAT.format(verdict.mean_top)] if verdict.flat else []
    return found + ([ALL_ACCEPTED] if counts.drafted > 0 and counts.accepted >= counts.drafted else [])


def whitebox_configuration(
    settings: VllmAuditSettings, model: str, configuration: str, target: Path, draft: Path, say: Callable[[str], None]
) -> dict[str, Any]:
    """The white box in the vLLM venv (one engine per process); its JSON result, or a failed
    one with the error when it did not finish."""
    out = settings.out / f"{model}-{configuration}"
    result = out / "whitebox.json"
    result.unlink(missing_ok=True)
    command = [settings.python, "-m", "specaudit", "whitebox-vllm",
               *whitebox_arguments(whitebox_options(configuration), target, draft),
               "--examples", str(settings.whitebox_examples), "--minutes", str(settings.whitebox_minutes),
               "--seed", str(settings.seed), "--json", str(result), "--out", str(out),
               *(["--mutant", settings.plant] if settings.plant else [])]  # fmt: skip
    say(f"{model} / {configuration}: white box, up to {settings.whitebox_examples} drawn workloads")
    timeout = WHITEBOX_STARTUP_S + 60.0 * settings.whitebox_minutes * 2
    out.mkdir(parents=True, exist_ok=True)
    try:
        with (out / "whitebox.log").open("wb") as log:
            subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                           env={**os.environ, **WHITEBOX_ENV})  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"passed": False, "error": f"the white box did not finish within {timeout:g} s ({out / 'whitebox.log'})"}
    if not result.is_file():
        return {"passed": False, "error": f"the white box wrote no result; see {out / 'whitebox.log'}"}
    found: dict[str, Any] = json.loads(result.read_text())
    verdict = "passed" if found.get("passed") else f"FAILED (reproducer {found.get('reproducer')})"
    say(f"{model} / {configuration}: white box {verdict} after {found.get('examples')} workloads")
    return found


def run_audit_vllm(settings: VllmAuditSettings, say: Callable[[str], None] | None = None) -> int:
    """Every model x configuration in turn, both levels; write report.md and report.json; exit 0
    only if all pass."""
    say = say or (lambda text: print(f"specaudit: {text}", file=sys.stderr, flush=True))
    if settings.plant is not None and settings.plant not in BY_NAME:
        raise UsageError(f"--plant {settings.plant!r} names no planted vLLM bug; known: {', '.join(BY_NAME)}")
    if max(BLACKBOX_LENGTHS) + settings.max_new_tokens > SERVER_LENGTH:
        raise UsageError(f"--max-new-tokens {settings.max_new_tokens}: the served prompts of up to "
                         f"{max(BLACKBOX_LENGTHS)} tokens and their outputs must fit the servers' --max-model-len "
                         f"{SERVER_LENGTH}; give at most {SERVER_LENGTH - max(BLACKBOX_LENGTHS)}")  # fmt: skip
    version = check_python(settings.python)
    root = settings.cache or cache_dir() / "vllm"
    outcomes: list[ConfigurationOutcome] = []
    start = time.monotonic()
    for model in settings.models:
        target, draft = model_directories(model, root, say)
        for configuration in settings.configurations:
            outcomes.append(audit_configuration(settings, model, configuration, target, draft, say))
            write_reports(settings, outcomes, time.monotonic() - start, version)
    text = write_reports(settings, outcomes, time.monotonic() - start, version)
    print(text, end="")
    return 0 if all(o.all_passed for o in outcomes) else 1
