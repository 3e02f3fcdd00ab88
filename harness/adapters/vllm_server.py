"""`specaudit audit-vllm`: a real vLLM server, per speculative configuration, under the black-box audit.

For each served model (a config-built tiny Llama, the built-in SmolLM2-135M) and each configuration
(no speculation as the control, ngram prompt lookup, a draft model), a vLLM OpenAI-compatible
server is started with the vLLM venv's python on 127.0.0.1 at a free port, waited for on
/health, audited with `specaudit blackbox` (`run_blackbox`: staggered token-id requests judged
against the batch-size-1 greedy oracle in this process), read on /metrics before and after
(drafted and accepted tokens), and stopped by its process group on every exit path. The driver
that runs `specaudit blackbox` per configuration (`run_audit_vllm`, `audit_configuration`) is
`specaudit.commands.audit_vllm`, as an adapter may not import a command; this module keeps the
server's lifecycle, /metrics, the report and the white-box in-process observation.

vLLM pins a transformers older than this project's, so it lives in a venv of its own
(`make audit-vllm` builds it); only the server runs there. The oracle runs here, on the same
directory the server loads, in float32 as served.

Level of evidence: OUTPUT ONLY (see `specaudit.adapters.engine_blackbox`): a pass says these
staggered schedules produced oracle outputs, not that the engine's cache and masks are right.
A speculative run in which nothing was accepted never exercised the accept path and proves
little; the report says so.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from specaudit.adapters.vllm_observer import NGRAM
from specaudit.artifacts.report import entry, write_report
from specaudit.config.settings import VLLM_CONFIGURATIONS, VLLM_MODEL_NAMES, VllmAuditSettings
from specaudit.contracts.errors import UsageError
from specaudit.contracts.violation import Violation

HOST = "127.0.0.1"
SERVER_ARGS = ("--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8", "--enforce-eager",
               "--seed", "0")  # fmt: skip
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
DRAFT_TOKENS = 4
NOTHING_ACCEPTED = "nothing was accepted: a run in which nothing was accepted proves little"
LOG_TAIL_LINES = 30
IN_FLIGHT = ("In flight: requests sent and not yet answered, seen at the client (overlapped: in flight with another; "
             "peak: the most at once); the server runs at most `--max-num-seqs` 8 of them together.")  # fmt: skip

SPEC_METRICS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "drafted": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
}
"""The /metrics counters read before and after each audit (summed over their labels)."""


class ServerError(Exception):
    """The server did not come up: it exited, or /health did not answer in time (with its log tail)."""


# ---------------------------------------------------------------------------------------
# Served models: the tiny Llama (built here, nothing downloaded) and SmolLM2 (specaudit.models.pretrained)

TINY = {"vocab": 512, "hidden": 128, "heads": 2, "kv_heads": 1, "ffn": 256, "layers": 2, "positions": 512}
"""head_dim 64: vLLM's CPU attention supports it, and GQA (2 heads over 1 KV head) is exercised."""
TINY_RANGE = 0.4
"""Weight std: HF's 0.02 gives near-uniform logits, so greedy argmaxes would be near-ties."""
TINY_LATER_SCALE = 0.5
"""Factor on the output projections after layer 0, so the layer-0 draft agrees often, not always."""
TINY_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")


def tiny_tokenizer(out: Path, vocab: int) -> None:
    """A WordLevel tokenizer over `vocab` ids (`w4` ... plus four specials), saved as a fast HF tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {tok: i for i, tok in enumerate(TINY_SPECIALS)} | {f"w{i}": i for i in range(len(TINY_SPECIALS), vocab)}
    core = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(out)


def tiny_llama(out: Path, seed: int = 0) -> None:
    """A seeded random-weight Llama (float32) with its tokenizer, saved with `save_pretrained`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = TINY
    config = LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], max_position_embeddings=s["positions"],
        initializer_range=TINY_RANGE, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(TINY_LATER_SCALE)
            layer.mlp.down_proj.weight.mul_(TINY_LATER_SCALE)
    model.save_pretrained(out)
    tiny_tokenizer(out, s["vocab"])


def model_directories(name: str, root: Path, say: Callable[[str], None]) -> tuple[Path, Path]:
    """(target, draft) directories of a served model, built on first use."""
    from specaudit.models.pretrained import built, layer_skip, resolve

    def tell(text: str) -> None:  # pretrained's lines carry the prefix already
        say(text.removeprefix("specaudit: "))

    if name == "smollm2":
        return resolve("smollm2", say=tell), resolve("smollm2-draft", say=tell)
    if name != "tiny":
        raise UsageError(f"unknown served model {name!r}; choose from {', '.join(VLLM_MODEL_NAMES)}")
    target = built(root / "tiny-llama", tiny_llama, tell)
    return target, built(root / "tiny-llama-draft", lambda out: layer_skip(target, out, 1), tell)


# ---------------------------------------------------------------------------------------
# The server process: started in its own process group, stopped by that group on every path


def free_port(host: str = HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def speculative_config(configuration: str, draft: Path) -> dict[str, Any] | None:
    if configuration == "control":
        return None
    if configuration == "ngram":
        return dict(NGRAM)
    if configuration == "draft":
        return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": DRAFT_TOKENS}
    raise UsageError(f"unknown configuration {configuration!r}; choose from {', '.join(VLLM_CONFIGURATIONS)}")


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


# ---------------------------------------------------------------------------------------
# /metrics: Prometheus text, the speculative-decoding counters


SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")
"""A Prometheus text sample: `name{labels} value [timestamp]`."""


def parse_metrics(text: str) -> dict[str, float]:
    """Each sample's value summed by metric name over its labels (comments and unparsable lines skipped)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = SAMPLE.match(line.strip())
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        totals[match.group(1)] = totals.get(match.group(1), 0.0) + value
    return totals


@dataclass(frozen=True)
class SpecCounts:
    """Speculative-decoding counters of one server: drafting rounds, draft tokens proposed, accepted."""

    drafts: float = 0.0
    drafted: float = 0.0
    accepted: float = 0.0

    @classmethod
    def from_metrics(cls, metrics: dict[str, float]) -> SpecCounts:
        return cls(**{key: metrics.get(name, 0.0) for key, name in SPEC_METRICS.items()})

    def __sub__(self, other: SpecCounts) -> SpecCounts:
        return SpecCounts(self.drafts - other.drafts, self.drafted - other.drafted, self.accepted - other.accepted)

    @property
    def acceptance(self) -> float | None:
        return None if self.drafted <= 0 else self.accepted / self.drafted


def fetch_counts(url: str, timeout_s: float = 10.0) -> SpecCounts:
    with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as response:
        return SpecCounts.from_metrics(parse_metrics(response.read().decode(errors="replace")))


# ---------------------------------------------------------------------------------------
# One configuration's audit and the report


@dataclass(frozen=True)
class Outcome:
    """One served model x configuration: the black-box verdict and the server's speculative counters."""

    model: str
    configuration: str
    speculative: dict[str, Any] | None
    passed: bool
    verdict: str
    requests: int = 0
    overlapped: int = 0
    peak_in_flight: int = 0
    exact_match: float = 0.0
    partial_match: float = 0.0
    counts: SpecCounts = field(default_factory=SpecCounts)
    startup_s: float = 0.0
    engine_s: float = 0.0
    oracle_s: float = 0.0
    wall_s: float = 0.0
    error: str = ""
    coverage: dict[str, Any] | None = None  # the black-box audit's (`checks.coverage`); None: it never ran

    @property
    def nothing_accepted(self) -> bool:
        return self.speculative is not None and self.counts.accepted <= 0

    @property
    def warnings(self) -> list[str]:
        out = [NOTHING_ACCEPTED] if self.nothing_accepted else []
        if self.speculative is None and self.counts.drafted > 0:
            out.append(f"the control drafted {self.counts.drafted:g} tokens: speculation was on")
        return out

    def to_json(self) -> dict[str, Any]:
        counts = asdict(self.counts) | {"acceptance": self.counts.acceptance}
        skip = ("counts",)
        data = {k: v for k, v in asdict(self).items() if k not in skip}
        return data | {"counts": counts, "warnings": self.warnings}


def peak_in_flight(spans: Sequence[tuple[float, float]]) -> int:
    """The most requests in flight at one instant (a request answered as another is sent counts as overlapping)."""
    events = sorted([(s, 0) for s, _ in spans] + [(e, 1) for _, e in spans])
    now = peak = 0
    for _, kind in events:
        now += 1 if kind == 0 else -1
        peak = max(peak, now)
    return peak


def from_report(report: dict[str, Any]) -> dict[str, Any]:
    """The figures of a black-box report entry that the vLLM report shows."""
    rows = report.get("requests", [])
    spans = [(r["start"], r["end"]) for r in rows if r.get("start") is not None and r.get("end") is not None]
    return {
        "passed": bool(report["passed"]),
        "verdict": str(report["verdict"]),
        "requests": len(rows),
        "overlapped": sum(bool(r.get("overlapped")) for r in rows),
        "peak_in_flight": peak_in_flight(spans),
        "exact_match": float(report["exact_match"]),
        "partial_match": float(report["partial_match"]),
        "engine_s": float(report["seconds"]),
        "oracle_s": float(report["oracle_seconds"]),
        "coverage": report.get("coverage"),
    }


def render_markdown(outcomes: Sequence[Outcome], header: str = "") -> str:
    """The report: one table row per configuration, then each warning and error, then the level of evidence."""
    from specaudit.adapters.engine_blackbox import EVIDENCE

    lines = ["# specaudit audit-vllm", ""] + ([header, ""] if header else [])
    lines += [
        "| model | configuration | verdict | exact | partial | in flight (overlapped / peak) | drafted | accepted "
        "| acceptance | startup s | engine s | oracle s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        rate = "-" if o.counts.acceptance is None else f"{o.counts.acceptance:.2f}"
        verdict = "PASS" if o.passed else "FAIL"
        lines.append(
            f"| {o.model} | {o.configuration} | {verdict} | {o.exact_match:.2f} | {o.partial_match:.2f} | "
            f"{o.overlapped} of {o.requests} / {o.peak_in_flight} | {o.counts.drafted:g} | {o.counts.accepted:g} | "
            f"{rate} | {o.startup_s:.1f} | {o.engine_s:.1f} | {o.oracle_s:.1f} |"
        )
    notes = [f"- **{o.model} / {o.configuration}**: {w}" for o in outcomes for w in o.warnings]
    notes += [f"- **{o.model} / {o.configuration}**: {o.verdict}" for o in outcomes if not o.passed and not o.error]
    notes += [f"- **{o.model} / {o.configuration}** ERROR: {o.error.splitlines()[0]}" for o in outcomes if o.error]
    lines += ["", IN_FLIGHT] + ([""] + notes if notes else [])
    passed = sum(o.passed for o in outcomes)
    lines += ["", f"{passed} of {len(outcomes)} configurations passed.", "", f"Level of evidence: {EVIDENCE}."]
    return "\n".join(lines) + "\n"


def check_python(python: str) -> str:
    """The vLLM venv's python must exist and import vllm, before any model is built; its vLLM version."""
    if not Path(python).exists():
        raise UsageError(f"no vLLM python at {python!r}: build the venv with `make vllm-venv` (or give --vllm-python)")
    done = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        raise UsageError(f"{python} cannot import vllm: {last}")
    return (done.stdout.strip().splitlines() or ["?"])[-1]


def write_reports(settings: VllmAuditSettings, outcomes: Sequence[Outcome], wall_s: float, version: str) -> str:
    header = (f"vLLM {version} (`{' '.join(SERVER_ARGS)}`); {settings.requests} requests of "
              f"{settings.max_new_tokens} tokens per configuration, arrivals over {settings.spread:g} s, seed "
              f"{settings.seed}; total wall time {wall_s:.0f} s.")  # fmt: skip
    text = render_markdown(outcomes, header)
    settings.out.mkdir(parents=True, exist_ok=True)
    (settings.out / "report.md").write_text(text)
    entries = [
        entry(
            "vllm configuration",
            {"model": o.model, "configuration": o.configuration},
            o.passed,
            None,
            None,
            o.to_json(),
        )  # fmt: skip
        for o in outcomes
    ]
    write_report(settings.out, "audit-vllm", entries, wall_s=wall_s, vllm=version, settings=asdict(settings))
    return text


# ---------------------------------------------------------------------------------------
# In process, white box: every target forward of vLLM's model runner observed


@dataclass(frozen=True)
class PagedRun:
    """One white-box run: what ran (`subject`, `workload`), the trace and the paged violations."""

    subject: dict[str, Any]
    workload: dict[str, Any]
    trace: Any  # specaudit.adapters.vllm_observer.PagedTrace
    violations: list[Violation]

    @property
    def passed(self) -> bool:
        return not self.violations

    def render(self) -> str:
        calls, requests = len(self.trace.calls), len(self.trace.prompts)
        lines = [f"white box (every target forward): {calls} forwards, {requests} requests"]
        lines += [v.render() for v in self.violations[:10]]
        lines.append(f"{len(self.violations)} violation(s)" if self.violations else "no paged rule broken")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        found = [asdict(v) for v in self.violations]
        return {**self.subject, **self.workload, "passed": self.passed, "violations": found}


def default_workload(new_tokens: int) -> dict[str, Any]:
    from specaudit.adapters.vllm_observer import ABORTS, ARRIVALS, PROMPTS

    return {"new_tokens": new_tokens, "prompts": PROMPTS, "arrivals": ARRIVALS, "aborts": ABORTS}


def observe_in_process(model: str, draft: str | None, workload: dict[str, Any]) -> PagedRun:
    """A workload (prompts, arrival and abort steps, tokens per request) through an in-process
    `vllm.LLM`, judged by the paged-layout checks with the batch-size-1 K/V of the model. Run
    with the vLLM venv's python (`VLLM_ENABLE_V1_MULTIPROCESSING=0` is set before vLLM is imported)."""
    from specaudit.adapters.vllm_observer import build_llm, hf_kv_reference, staggered
    from specaudit.checks.paged import check_paged
    from specaudit.models.pretrained import resolve

    path = str(resolve(model))
    spec = NGRAM
    if draft is not None:
        spec = {"method": "draft_model", "model": str(resolve(draft)), "num_speculative_tokens": 4}
    prompts = {rid: tuple(int(t) for t in p) for rid, p in workload["prompts"].items()}
    llm = build_llm(path, spec)
    trace = staggered(llm, int(workload["new_tokens"]), prompts, workload["arrivals"], workload["aborts"])
    subject = {"model": path, "draft": None if draft is None else spec["model"], "speculative": spec["method"]}
    return PagedRun(subject, dict(workload), trace, check_paged(trace, hf_kv_reference(path, trace.kv_layers)))


def write_paged_failure(directory: Path, run: PagedRun) -> Path:
    """`DIR/vllm-paged-<method>.json`: a reproducer `specaudit replay` runs again (with vLLM installed)."""
    from specaudit.artifacts.reproducer import paged_reproducer, save

    reproducer = paged_reproducer(run.subject, run.workload, run.violations)
    return save(directory, f"vllm-paged-{run.subject['speculative']}", reproducer)
