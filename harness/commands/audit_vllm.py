"""`specaudit audit-vllm`: `specaudit blackbox` against a real vLLM server, once per served
configuration (control, ngram, draft model).

The server's lifecycle, /metrics and the report are `specaudit.adapters.vllm_server`'s; this
module drives them with the black-box command, in the commands layer because it runs one.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from specaudit.adapters.vllm_server import (
    HOST,
    SERVER_ENV,
    Outcome,
    ServerError,
    check_python,
    fetch_counts,
    free_port,
    from_report,
    model_directories,
    server_command,
    serving,
    speculative_config,
    write_reports,
)
from specaudit.artifacts.report import load_report
from specaudit.commands.blackbox import run_blackbox
from specaudit.config.settings import BlackboxSettings, VllmAuditSettings
from specaudit.contracts.errors import UsageError
from specaudit.models.pretrained import cache_dir


def audit_configuration(
    settings: VllmAuditSettings, model: str, configuration: str, target: Path, draft: Path, say: Callable[[str], None]
) -> Outcome:
    """Serve `target` with the configuration, audit it black-box, read /metrics around it; the server always stops."""

    spec = speculative_config(configuration, draft)
    port = free_port()
    url = f"http://{HOST}:{port}"
    out = settings.out / f"{model}-{configuration}"
    start = time.monotonic()
    say(f"{model} / {configuration}: starting vLLM on {url} (log {out / 'server.log'})")
    try:
        with serving(server_command(settings.python, target, port, spec), url, out / "server.log",
                     settings.health_timeout_s, SERVER_ENV) as server:  # fmt: skip
            startup = time.monotonic() - start
            say(f"{model} / {configuration}: healthy after {startup:.1f} s (pid {server.pid}); auditing")
            before = fetch_counts(url)
            blackbox = BlackboxSettings(
                target=str(target), server=url, requests=settings.requests, max_new_tokens=settings.max_new_tokens,
                seed=settings.seed, spread=settings.spread, served_model=str(target),
                timeout_s=settings.request_timeout_s,
                dtype="float32", out=out, quiet=True,
            )  # fmt: skip
            run_blackbox(blackbox)
            counts = fetch_counts(url) - before
    except (ServerError, OSError, UsageError) as exc:
        return Outcome(model, configuration, spec, False, "server or audit error", error=str(exc),
                       wall_s=time.monotonic() - start)  # fmt: skip
    (report,) = load_report(out / "report.json")["entries"]
    figures = from_report(report)
    return Outcome(model, configuration, spec, counts=counts, startup_s=startup, wall_s=time.monotonic() - start,
                   **figures)  # fmt: skip


def run_audit_vllm(settings: VllmAuditSettings, say: Callable[[str], None] | None = None) -> int:
    """Every model x configuration in turn; write report.md and report.json; exit 0 only if all pass."""
    say = say or (lambda text: print(f"specaudit: {text}", file=sys.stderr, flush=True))
    version = check_python(settings.python)
    root = settings.cache or cache_dir() / "vllm"
    outcomes: list[Outcome] = []
    start = time.monotonic()
    for model in settings.models:
        target, draft = model_directories(model, root, say)
        for configuration in settings.configurations:
            outcomes.append(audit_configuration(settings, model, configuration, target, draft, say))
            write_reports(settings, outcomes, time.monotonic() - start, version)
    text = write_reports(settings, outcomes, time.monotonic() - start, version)
    print(text, end="")
    return 0 if all(o.passed for o in outcomes) else 1
