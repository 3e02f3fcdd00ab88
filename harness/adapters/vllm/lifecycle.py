"""A vLLM server's process: the command that serves a model, started in a process group of its
own, waited for on /health, and stopped by that group on every exit path (success, error,
/health timeout, SIGTERM, Ctrl-C); and the check that the vLLM venv's python imports vLLM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from specaudit.contracts.errors import UsageError

HOST = "127.0.0.1"
SERVER_LENGTH = 224  # the longest prompt and output a request may have (`adapters.vllm.server.SERVER_BLOCKS`)
SERVER_ARGS = ("--dtype", "float32", "--max-model-len", str(SERVER_LENGTH), "--max-num-seqs", "8", "--enforce-eager",
               "--seed", "0", "--enable-prompt-tokens-details")  # fmt: skip
"""`--enable-prompt-tokens-details`: each completion's usage reports its cached prompt tokens (judged by
`engine_blackbox.usage_violation`)."""
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
LOG_TAIL_LINES = 30


class ServerError(Exception):
    """The server did not come up: it exited, or /health did not answer in time (with its log tail)."""


def free_port(host: str = HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def server_command(python: str, target: Path, port: int, spec: dict[str, Any] | None) -> list[str]:
    """`vllm serve` by its module (the console script of vllm-cpu fails with PackageNotFoundError)."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), "--host", HOST,
               "--port", str(port), *SERVER_ARGS]  # fmt: skip
    return command + ([] if spec is None else ["--speculative-config", json.dumps(spec)])


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class Server:
    """One server child: its pid (a process group of its own), URL and log file."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_healthy(self, timeout_s: float, poll_s: float = 0.5) -> float:
        """Seconds until GET /health answers 200; ServerError (with the log tail) if it exits or times out."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            code = self.process.poll()
            if code is not None:
                raise ServerError(f"the server exited with status {code} before /health answered; its log "
                                  f"({self.log}) ends:\n{log_tail(self.log)}")  # fmt: skip
            if http_status(self.url + "/health") == 200:
                return time.monotonic() - start
            time.sleep(poll_s)
        raise ServerError(f"/health did not answer within {timeout_s:g} s; the server's log ({self.log}) "
                          f"ends:\n{log_tail(self.log)}")  # fmt: skip

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the process group, SIGKILL after `grace_s`; the group's stragglers go too."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # children that outlived the leader (vLLM's engine core)
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 5.0  # a signal is delivered, not done: wait until the group is gone
        while group_members(self.pid) and time.monotonic() < deadline:
            time.sleep(0.05)


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of a process group, read from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(group) == pgid and state != "Z":
            members.append(int(stat.parent.name))
    return members


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise in the main thread, so that the `finally` that stops the server runs."""

    def raise_exit(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    saved = {sig: signal.signal(sig, raise_exit) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@contextmanager
def serving(
    command: Sequence[str], url: str, log: Path, health_timeout_s: float, env: dict[str, str] | None = None
) -> Iterator[Server]:
    """Start `command` in its own process group, wait for /health, yield it; stop its group however we leave."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with stop_on_signals(), log.open("wb") as sink:
        process = subprocess.Popen(
            list(command), stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )  # fmt: skip
        server = Server(process, url, log)
        try:
            server.wait_healthy(health_timeout_s)
            yield server
        finally:
            server.stop()


def check_python(python: str) -> str:
    """The vLLM venv's python must exist and import vllm, before any model is built; its vLLM version."""
    if not Path(python).exists():
        raise UsageError(f"no vLLM python at {python!r}: build the venv with `make vllm-venv` (or give --vllm-python)")
    done = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        raise UsageError(f"{python} cannot import vllm: {last}")
    return (done.stdout.strip().splitlines() or ["?"])[-1]
