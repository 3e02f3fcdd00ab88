"""Replay: any reproducer (`specaudit.artifacts.reproducer`'s one envelope, every kind) run again.

`specaudit replay FILE` lands here, and so do the pytest plugin's re-runs of a failure it is
about to write (`replay_failures`, `replay_engine_rules`). Apart from the reproducer format,
because replaying reaches the subjects themselves: decoders, real models, engines, and servers
through the black-box adapter, which writes reproducers of its own. A reproducer's kind resolves
to its row of `specaudit.contracts.subjects.KINDS`: the row lists the options it takes and names
the function that runs it again (`replayer`), so a new kind is replayed without an entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specaudit.artifacts.reproducer import Reproducer, engine_failure_record, load_reproducer, validate
from specaudit.checks.diagnosis import Diagnosis, diagnose
from specaudit.checks.registry import SAMPLER, all_violations, evaluate
from specaudit.contracts import subjects
from specaudit.contracts.builtins import check_model
from specaudit.contracts.case import Case
from specaudit.contracts.decoder import ContractError, load_decoder
from specaudit.contracts.errors import UsageError
from specaudit.contracts.subjects import SubjectKind
from specaudit.contracts.violation import Violation, render
from specaudit.running.runner import run_case
from specaudit.running.sampling import run_sampling_case
from specaudit.search.engine_replay import replay as replay_rules


def replay_failures(spec: str, case: Case, factory: Any = None, n: int = 5) -> int:
    """How many of `n` fresh runs of `case` fail a check: 0 or n for a deterministic decoder.

    Anything in between is a nondeterministic decoder; report it with the rate k/n.
    """
    factory = factory or load_decoder(spec)
    return sum(bool(all_violations(run_case(spec, case, factory=factory))) for _ in range(n))


def replay_engine_rules(reproducer: dict[str, Any]) -> list[Violation]:
    """`specaudit.search.engine_replay.replay`, with an engine that does not build ('engine-builds')
    reported as its violation rather than raised."""
    try:
        return replay_rules(reproducer)
    except ContractError as exc:
        return [exc.violation()]


@dataclass(frozen=True)
class ReplayOptions:
    """What `specaudit replay` may put in place of the file's own subject; None keeps the file's."""

    decoder: str | None = None
    engine: str | None = None
    server: str | None = None
    target: str | None = None
    draft: str | None = None
    device: str | None = None
    quiet: bool = True


@dataclass(frozen=True)
class EngineReplay:
    """An engine's rules run again: the violations of the first failing rule ([] if none)."""

    engine: str
    where: str
    rules: dict[str, Any]
    violations: list[Violation]

    @property
    def passed(self) -> bool:
        return not self.violations

    def render(self) -> str:
        n = len(self.rules["ops"])
        if self.violations:
            return f"{self.engine} fails {self.where} ({n} rules):\n{render(self.violations)}"
        return f"{self.engine} passes every check on {self.where} ({n} rules)"

    def to_json(self) -> dict[str, Any]:
        return dict(engine_failure_record(self.rules, self.violations), passed=self.passed)


@dataclass(frozen=True)
class BlackboxReplay:
    """A black-box reproducer's requests sent again: the engine audit's result (output level only)."""

    result: Any  # specaudit.adapters.engine_blackbox.EngineAuditResult

    @property
    def passed(self) -> bool:
        return bool(self.result.passed)

    def render(self) -> str:
        return str(self.result.table())

    def to_json(self) -> dict[str, Any]:
        return dict(self.result.to_json())


@dataclass(frozen=True)
class PagedReplay:
    """A paged engine's workload run again in process (transformers' continuous batching): its
    verdict, every forward and request judged by the registry's paged-engine checks."""

    verdict: Any  # specaudit.adapters.transformers_cb.CbVerdict

    @property
    def passed(self) -> bool:
        return bool(self.verdict.passed)

    def render(self) -> str:
        return "\n".join([self.verdict.render(), *(f"  {v.render()}" for v in self.verdict.violations)])

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "violations": [asdict(v) for v in self.verdict.violations]}


@dataclass(frozen=True)
class SamplingReplay:
    """A sampling case run again: every run judged, the runs pooled, with the same seeds and sample size."""

    decoder: str
    case: Any  # specaudit.contracts.sampling.SamplingCase
    evaluation: Any  # specaudit.checks.registry.Evaluation

    @property
    def passed(self) -> bool:
        return bool(self.evaluation.passed)

    def render(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        checks = ", ".join(f"{check} {status}" for check, status in self.evaluation.statuses)
        return "\n".join([f"{self.decoder}: {verdict}", f"  case: {self.case!r}", f"  checks: {checks}",
                          *(f"  {v.render()}" for v in self.evaluation.violations)])  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "case": self.case.to_json(),
                "violations": [asdict(v) for v in self.evaluation.violations]}  # fmt: skip


def check_options(reproducer: Reproducer, options: ReplayOptions) -> None:
    """A UsageError for an option the reproducer's kind does not take (--decoder on an engine's rules)."""
    taken = reproducer.subject_kind.replay
    given = [name for name in subjects.REPLAY_OPTIONS if getattr(options, name)]
    wrong = [f"--{name}" for name in given if name not in taken]
    if wrong:
        verb = "does" if len(wrong) == 1 else "do"
        what = f"{reproducer.where} is {reproducer.subject_kind.noun} (kind {reproducer.kind})"
        takes = ", ".join(f"--{t}" for t in taken)
        raise UsageError(f"{what}: {', '.join(wrong)} {verb} not apply; it takes {takes}")
    if options.engine and options.server:
        raise UsageError("give --server URL or --engine MODULE:ATTR, not both")


def replay(reproducer: Reproducer | Path, decoder: str | None = None, **options: Any) -> Any:
    """Run any reproducer again, against its own subject or the one given (`ReplayOptions`).
    Returns an outcome with `passed`, `render()` and `to_json()`: a `Diagnosis` (decoder and
    real-model cases), an `EngineReplay`, a `BlackboxReplay`."""
    if not isinstance(reproducer, Reproducer):
        reproducer = load_reproducer(Path(reproducer), check=False)
    given = ReplayOptions(decoder=decoder, **options)
    check_options(reproducer, given)
    validate(reproducer)
    return replayer(reproducer.subject_kind)(reproducer, given)


Replayer = Callable[[Reproducer, ReplayOptions], Any]


def replayer(kind: SubjectKind) -> Replayer:
    """The function its row names (`module:function`), imported now: an adapter's replayer loads
    only when a file of its kind is replayed."""
    function: Replayer = subjects.resolve(str(kind.replayer))
    return function


DECODER_FLAG = "--decoder MODULE:ATTR"


def named(value: Any, flag: str, reproducer: Reproducer, what: str) -> str:
    if not value:
        raise UsageError(f"{reproducer.where} names no {what}: give {flag}")
    return str(value)


def replay_decoder_case(reproducer: Reproducer, options: ReplayOptions) -> Diagnosis:
    """The case run against the decoder, every check on every call, diagnosed."""
    decoder = named(options.decoder or reproducer.subject.get("decoder"), DECODER_FLAG, reproducer, "decoder")
    case = reproducer.case
    try:
        check_model(case.model, case.draft, case.dtype)
    except ValueError as exc:
        raise UsageError(f"{reproducer.where}: {exc}") from None
    return diagnose(run_case(decoder, case, factory=load_decoder(decoder)))


def replay_real_model(reproducer: Reproducer, options: ReplayOptions) -> Diagnosis:
    """The batch run again on the real models it names (or those given), I2 on every target call,
    judged against their measured noise floor. A case written before the envelope names only
    its target (in its model label), so its draft must be given."""
    from specaudit.adapters.realmodel import audit_batch, run_batch
    from specaudit.models.loading import load_pair
    from specaudit.models.pretrained import cache_dir
    from specaudit.numerics.noise import measure_noise

    subject = reproducer.subject
    decoder = named(options.decoder or subject.get("decoder"), DECODER_FLAG, reproducer, "decoder")
    target = named(options.target or subject.get("target"), "--target DIR", reproducer, "target model")
    draft = named(options.draft or subject.get("draft"), "--draft DIR", reproducer, "draft model")
    case, device = reproducer.case, options.device or subject.get("device") or "cpu"
    target_model, draft_model, _ = load_pair(target, draft, device, case.dtype)
    calibration = cache_dir() / "calibration"
    noise = measure_noise(target_model, case.prompts, label=target, steps=case.max_new_tokens,
                          pad_token_id=case.pad_token_id, store=calibration, say=lambda _: None)  # fmt: skip
    factory = load_decoder(decoder)
    run = run_batch(decoder, factory, case, target_model, draft_model, sample=lambda _: True, sample_rate=1.0,
                    baseline=False, noise=noise)  # fmt: skip
    return audit_batch(run)


def replay_engine_ops(reproducer: Reproducer, options: ReplayOptions) -> EngineReplay:
    """The rules run again against the engine, every check after every step."""
    from specaudit.contracts.engine import load_engine

    rules = reproducer.engine_rules(options.engine)
    load_engine(rules["engine"])  # an unloadable engine is a usage error
    return EngineReplay(rules["engine"], reproducer.where, rules, replay_engine_rules(rules))


def replay_blackbox(reproducer: Reproducer, options: ReplayOptions) -> BlackboxReplay:
    """The requests sent again at their arrivals, to the server or engine named (or given)."""
    from specaudit.commands.blackbox import replay_plan

    given = {"server": options.server, "engine": options.engine, "target": options.target, "quiet": options.quiet}
    return BlackboxReplay(replay_plan(reproducer.plan_document(), reproducer.source, **given))


def replay_vllm_paged(reproducer: Reproducer, options: ReplayOptions) -> Any:
    """The workload through vLLM in process again, every target forward judged (needs vLLM: run
    with the vLLM venv's python)."""
    import importlib.util

    from specaudit.adapters.vllm.whitebox import observe_in_process

    if importlib.util.find_spec("vllm") is None:
        raise UsageError(f"{reproducer.where} replays vLLM in process: run it with the vLLM venv's python")
    model = options.target or reproducer.subject["model"]
    draft = options.draft or reproducer.subject.get("draft")
    return observe_in_process(model, draft, reproducer.payload["workload"], reproducer.payload.get("settings"))


def replay_transformers_cb(reproducer: Reproducer, options: ReplayOptions) -> PagedReplay:
    """The workload through the installed transformers' continuous batching again."""
    from specaudit.adapters.transformers_cb import replay_json

    return PagedReplay(replay_json(reproducer.payload["workload"], reproducer.where))


def replay_sampling_case(reproducer: Reproducer, options: ReplayOptions) -> SamplingReplay:
    """The sampling case's seeded runs again, judged by the sampling-decoder checks."""
    decoder = named(options.decoder or reproducer.subject.get("decoder"), DECODER_FLAG, reproducer, "decoder")
    case = reproducer.sampling_case
    return SamplingReplay(
        decoder, case, evaluate(SAMPLER, run_sampling_case(decoder, case, factory=load_decoder(decoder)))
    )
