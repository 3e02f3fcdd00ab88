"""Typed settings, one frozen dataclass per command, built once at the CLI boundary.

The layers below (`specaudit.audits.audit`, `.gate`, `.realaudit`, `specaudit.commands.minimize`) take these
and never see argparse. Each dataclass checks its own ranges on construction and raises `UsageError`
naming the flag, so a library caller gets the same message as a command-line user.
Torch-free, like `specaudit.contracts.builtins`: the CLI builds them before anything heavy is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from specaudit.config.shards import Shard
from specaudit.config.xfails import KnownFailures
from specaudit.contracts.builtins import DEFAULT_DECODERS, DTYPE_NAMES, MODELS
from specaudit.contracts.errors import UsageError

REAL_DTYPES = ("auto", *DTYPE_NAMES)
"""Real-model `--dtype` choices: the checkpoint's own ("auto") or a built-in dtype name."""

DEFAULT_EXAMPLES = 25
DEFAULT_CHECK_RATE = 1.0
"""I2 on every target call: with its reference sliced from the oracle's own cache it costs at most
+13% of the decoder's time on SmolLM2 on the CPU (bench/results/overhead.md); lower it on a GPU."""
DEFAULT_JUNIT = Path("specaudit-junit.xml")
DEFAULT_GATE_OUT = Path("specaudit-out") / "gate"
DEFAULT_MINIMIZE_OUT = Path("specaudit-out") / "minimized"
DEFAULT_MINIMIZE_BUDGET = 500

DEVICE_EVIDENCE_ENV = "SPECAUDIT_DEVICE_EVIDENCE_MB"
DEVICE_EVIDENCE_SHARE = 0.25
"""Unless `$SPECAUDIT_DEVICE_EVIDENCE_MB` says otherwise, a run keeps its K/V snapshots on an
accelerator while they fit in this share of the memory free there at its first snapshot, and
copies the rest to the host. A snapshot is one call's cache, kept for the checks after the
decoder returns: a quarter of what is free leaves the decoder's own growth (its cache, the
verification chunks) three times the room the evidence takes. On the CPU a snapshot is in host
memory already, and the budget applies only when the variable sets one."""


def device_evidence_mb(environ: Mapping[str, str]) -> float | None:
    """`$SPECAUDIT_DEVICE_EVIDENCE_MB` as megabytes (0: every snapshot to the host), None when
    unset or empty (the default above)."""
    text = environ.get(DEVICE_EVIDENCE_ENV, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{DEVICE_EVIDENCE_ENV} must be a number of megabytes, got {text!r}") from None
    if not value >= 0:  # NaN too
        raise UsageError(f"{DEVICE_EVIDENCE_ENV} must be at least 0, got {text!r}")
    return value


def at_least(flag: str, value: int | float, low: int) -> None:
    if value < low:
        raise UsageError(f"{flag} must be at least {low}, got {value}")


def within(flag: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise UsageError(f"{flag} must be between {low:g} and {high:g}, got {value:g}")


@dataclass(frozen=True)
class AuditSettings:
    """`specaudit audit` on the built-in models. No decoders: the default audit (the
    reference decoders must pass, every planted bug must be caught)."""

    decoders: tuple[str, ...] = ()
    models: tuple[str, ...] = MODELS
    examples: int = DEFAULT_EXAMPLES
    seed: int = 0
    quiet: bool = False
    out: Path | None = None
    engines: tuple[str, ...] = ()  # engines named with --engine (the engine state machine)
    xfails: KnownFailures = field(default_factory=KnownFailures)
    jobs: int | None = None  # worker processes; None: one per available core
    strict_efficiency: bool = False  # an efficiency finding (token preservation alone) fails the decoder
    shard: Shard | None = None  # --shard i/n: the plan's cells of this shard only (needs --out)
    ray: bool = False  # --ray: the cells as Ray tasks (`specaudit.fleet.ray_sweep`), not worker processes

    def __post_init__(self) -> None:
        at_least("--examples", self.examples, 1)
        if self.jobs is not None:
            at_least("--jobs", self.jobs, 1)
        if self.shard is not None and self.out is None:
            raise UsageError(f"--shard {self.shard} needs --out DIR (the shard's report.json, for specaudit merge)")


@dataclass(frozen=True)
class GateSettings:
    """`specaudit gate`: the audit of `decoders` x `models` with its thresholds and outputs."""

    decoders: tuple[str, ...] = DEFAULT_DECODERS
    models: tuple[str, ...] = MODELS
    examples: int = DEFAULT_EXAMPLES
    seed: int = 0
    junit: Path = DEFAULT_JUNIT
    out: Path = DEFAULT_GATE_OUT
    min_exact_match: float = 0.0
    xfails: KnownFailures = field(default_factory=KnownFailures)
    quiet: bool = False
    engines: tuple[str, ...] = ()  # engines named with --engine, each through the engine state machine
    jobs: int | None = None  # worker processes; None: one per available core (as the audit's)
    strict_efficiency: bool = False  # an efficiency finding (token preservation alone) fails the gate
    shard: Shard | None = None  # --shard i/n: the plan's cells of this shard only
    ray: bool = False  # --ray: the cells as Ray tasks (`specaudit.fleet.ray_sweep`), not worker processes

    def __post_init__(self) -> None:
        at_least("--examples", self.examples, 1)
        if self.jobs is not None:
            at_least("--jobs", self.jobs, 1)
        within("--min-exact-match", self.min_exact_match, 0.0, 1.0)
        if not self.models:
            raise UsageError("--models names no model")


@dataclass(frozen=True)
class RealAuditSettings:
    """`specaudit audit --target ...`: decoders on a real target/draft pair loaded from disk."""

    target: Path
    draft: Path
    prompts: Path
    decoders: tuple[str, ...] = DEFAULT_DECODERS[:1]
    device: str = "cpu"
    dtype: str = "auto"
    check_rate: float = DEFAULT_CHECK_RATE
    batch_size: int = 8
    max_new_tokens: int = 64
    num_draft_tokens: int = 4
    max_prompts: int | None = None
    timeout_s: float = 600.0
    seed: int = 0
    out: Path | None = None

    def __post_init__(self) -> None:
        within("--check-rate", self.check_rate, 0.0, 1.0)
        at_least("--batch-size", self.batch_size, 1)
        at_least("--max-new-tokens", self.max_new_tokens, 1)
        at_least("--num-draft-tokens", self.num_draft_tokens, 1)
        if self.max_prompts is not None:
            at_least("--max-prompts", self.max_prompts, 1)
        if self.timeout_s <= 0:
            raise UsageError(f"--timeout must be positive, got {self.timeout_s:g}")
        if self.dtype not in REAL_DTYPES:
            raise UsageError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(REAL_DTYPES)}")
        if not self.decoders:
            raise UsageError("no decoder to audit")


@dataclass(frozen=True)
class MinimizeSettings:
    """`specaudit minimize FILE --decoder D`: delta-debug a failing case file."""

    case: Path
    decoder: str
    out: Path = DEFAULT_MINIMIZE_OUT
    budget: int = DEFAULT_MINIMIZE_BUDGET
    keep_divergence: bool = True  # a diverging case shrinks only to diverging cases (--allow-exact-output: off)

    def __post_init__(self) -> None:
        at_least("--budget", self.budget, 1)


@dataclass(frozen=True)
class EngineMinimizeSettings:
    """`specaudit minimize FILE --engine E`: delta-debug an engine reproducer's rules."""

    case: Path
    engine: str | None = None
    out: Path = DEFAULT_MINIMIZE_OUT
    budget: int = DEFAULT_MINIMIZE_BUDGET

    def __post_init__(self) -> None:
        at_least("--budget", self.budget, 1)


@dataclass(frozen=True)
class BlackboxSettings:
    """`specaudit blackbox`: one staggered run of a server or an in-process engine against `target`'s oracle.

    `replay`: a reproducer written by an earlier run; its requests, arrivals, seed and EOS are
    used, and its server/engine/target unless given here."""

    target: str | None = None
    server: str | None = None
    engine: str | None = None
    requests: int | None = None
    max_new_tokens: int | None = None
    seed: int | None = None
    spread: float | None = None
    prompts: Path | None = None
    eos_token_id: int | None = None
    likely_eos: bool = False  # EOS: a token the target's greedy continuations emit (`engine_blackbox.likely_eos`)
    mixed_max_tokens: bool = False  # each request's limit drawn from the seed (`engine_blackbox.mixed_limits`)
    served_model: str | None = None
    timeout_s: float = 60.0
    max_batch: int = 3
    dtype: str | None = None
    replay: Path | None = None
    out: Path | None = None
    json: bool = False
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.server is not None and self.engine is not None:
            raise UsageError("give --server URL or --engine MODULE:ATTR, not both")
        counts = {"--requests": self.requests, "--max-new-tokens": self.max_new_tokens, "--max-batch": self.max_batch}
        for flag, value in counts.items():
            if value is not None:
                at_least(flag, value, 1)
        if self.spread is not None and self.spread < 0:
            raise UsageError(f"--spread must not be negative, got {self.spread:g}")
        if self.timeout_s <= 0:
            raise UsageError(f"--timeout must be positive, got {self.timeout_s:g}")
        if self.likely_eos and self.eos_token_id is not None:
            raise UsageError("give --eos-token-id ID or --likely-eos, not both")
        if self.replay is not None:
            fixed = {
                "--requests": self.requests,
                "--prompts": self.prompts,
                "--max-new-tokens": self.max_new_tokens,
                "--seed": self.seed,
                "--spread": self.spread,
                "--eos-token-id": self.eos_token_id,
                "--likely-eos": self.likely_eos or None,
                "--mixed-max-tokens": self.mixed_max_tokens or None,
            }
            given = [flag for flag, value in fixed.items() if value is not None]
            if given:
                raise UsageError(f"{', '.join(given)}: the reproducer given with --replay fixes the requests")
        elif self.server is None and self.engine is None:
            raise UsageError("give --server URL (an OpenAI-compatible server) or --engine MODULE:ATTR")
        elif self.target is None:
            raise UsageError("--target is required: the model the server or engine runs (name or directory)")


VLLM_DEFAULT_PYTHON = ".venv-vllm/bin/python"
VLLM_CONFIGURATIONS = ("control", "ngram", "draft", "self-draft", "disagree")
VLLM_MODEL_NAMES = ("tiny", "smollm2")


@dataclass(frozen=True)
class VllmAuditSettings:
    """Which models and configurations, how many requests, where the vLLM venv is."""

    python: str = VLLM_DEFAULT_PYTHON
    models: tuple[str, ...] = VLLM_MODEL_NAMES
    configurations: tuple[str, ...] = VLLM_CONFIGURATIONS
    requests: int = 16
    max_new_tokens: int = 32
    seed: int = 0
    spread: float = 0.5
    health_timeout_s: float = 300.0
    request_timeout_s: float = 300.0
    out: Path = Path("specaudit-out/vllm")
    cache: Path | None = None
    whitebox_examples: int = 6  # workloads the white box draws per configuration (0: black box only)
    whitebox_minutes: float = 2.0  # the white box's budget per configuration, drawing and shrinking
    plant: str | None = None  # a planted vLLM bug in every server and white box (a negative control)

    def __post_init__(self) -> None:
        bad = [m for m in self.models if m not in VLLM_MODEL_NAMES] + [
            c for c in self.configurations if c not in VLLM_CONFIGURATIONS
        ]
        if bad or not self.models or not self.configurations:
            raise UsageError(f"unknown or no models/configurations {bad}; models: {', '.join(VLLM_MODEL_NAMES)}; "
                             f"configurations: {', '.join(VLLM_CONFIGURATIONS)}")  # fmt: skip
        if self.requests < 1 or self.max_new_tokens < 1:
            raise UsageError(f"--requests and --max-new-tokens must be >= 1, got {self.requests}, "
                             f"{self.max_new_tokens}")  # fmt: skip
