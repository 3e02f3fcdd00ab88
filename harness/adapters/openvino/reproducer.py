"""OpenVINO reproducers: a failing (or known-defect) workload written as the one envelope
(`artifacts.reproducer.Reproducer`, kind "openvino") and run again by `specaudit replay FILE`.

Subject: the configuration's name and pipeline options (hints, budget, speculation) and the
openvino-genai version it failed on. Payload: the workload (`Workload.to_json`). Evidence: the
first check and rule, the violations, and the known defect that explains it (None: a verdict).
Replaying (`audit.replay_reproducer`) builds a fresh pipeline on the same exported models (no
state carried between workloads, so one workload replays alone); it needs the OpenVINO venv.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specaudit.artifacts.reproducer import Reproducer, save, violations_evidence
from specaudit.contracts.subjects import OPENVINO

KIND = OPENVINO.reproducer


def genai_version() -> str | None:
    try:
        import openvino_genai

        return str(openvino_genai.__version__)
    except (ImportError, AttributeError):
        return None


def reproducer_of(configuration: str, options: Any, run: Any, known: str | None) -> Reproducer:
    """One run (`audit.Run`) of one configuration as a reproducer; `known` names the known defect explaining it."""
    subject = {"engine": "openvino-genai", "version": genai_version(), "configuration": configuration,
               "options": options.to_json()}  # fmt: skip
    evidence = violations_evidence([asdict(v) for v in run.result.violations]) | {"known_defect": known}
    return Reproducer(KIND, subject, {"workload": run.workload.to_json()}, evidence)


def write_reproducer(directory: Path, configuration: str, options: Any, run: Any, known: str | None) -> Path:
    """`DIR/openvino-<configuration>[-<known defect>].json`; returns the path."""
    name = f"openvino-{configuration}" + (f"-{known}" if known else "")
    return save(Path(directory), name, reproducer_of(configuration, options, run, known))


@dataclass(frozen=True)
class OpenVinoReplay:
    """A reproducer's workload run again: the judged result, and the rule the file recorded beside
    the one found now (the same on a deterministic engine)."""

    result: Any  # specaudit.adapters.engine_blackbox.EngineAuditResult
    recorded: dict[str, Any]

    @property
    def passed(self) -> bool:
        return bool(self.result.passed)

    def first(self) -> str:
        v = self.result.violations[0] if self.result.violations else None
        return "none (passes)" if v is None else f"[{v.check}: {v.rule}] request {v.request}"

    def render(self) -> str:
        known = self.recorded.get("known_defect")
        was = f"[{self.recorded.get('first_check')}: {self.recorded.get('rule')}]"
        return "\n".join([self.result.table(), f"first violation now: {self.first()}; recorded: {was}"
                          + (f" (known defect {known})" if known else "")])  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {**self.result.to_json(), "recorded": self.recorded}
