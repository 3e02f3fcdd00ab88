"""A transformers CB failure on disk, and run again from there.

The file is the one reproducer envelope (`artifacts.reproducer.Reproducer`) of kind `paged-engine`,
which vLLM's white box writes too (`transformers-cb` before, still read): the subject (engine,
entry point, model, transformers' version), the payload (the engine's row, `transformers-cb`, and
the workload, `workload_json`) and the evidence (the first check and rule, the violations).
The workload is all a replay needs: the schedule is by step, not by wall clock, so the same
workload gives the same forwards. `replay_workload` also takes a bare workload (the
`minimal_workload` or `workload_spec` of a report entry).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specaudit.adapters.transformers_cb.driver import run_workload
from specaudit.adapters.transformers_cb.verdict import CbVerdict, verdict_of
from specaudit.adapters.transformers_cb.workload import ENGINE, CbWorkload, workload_from_json, workload_json
from specaudit.artifacts.reproducer import Reproducer, load_reproducer, paged_reproducer, save
from specaudit.contracts.case import ENVELOPE_FORMAT
from specaudit.contracts.errors import UsageError
from specaudit.contracts.subjects import TRANSFORMERS_CB


def reproducer_of(verdict: CbVerdict) -> Reproducer:
    """A failing verdict as the paged-engine envelope: what ran, the workload, what it broke."""
    import transformers

    workload = verdict.run.workload
    subject = {"engine": ENGINE, "entry_point": workload.entry, "target": "llama", "seed": workload.seed,
               "transformers": transformers.__version__}  # fmt: skip
    return paged_reproducer(TRANSFORMERS_CB, subject, workload_json(workload), verdict.violations)


def write_reproducer(directory: Path, verdict: CbVerdict, name: str | None = None) -> Path:
    """`DIR/<name>.json` (default `transformers-cb-<entry point>`); returns the path."""
    return save(Path(directory), name or f"{ENGINE}-{verdict.run.workload.entry}", reproducer_of(verdict))


def read_workload(path: Path) -> CbWorkload:
    """The workload of a transformers-cb reproducer (of any version), or of a bare workload file;
    UsageError naming the file when it is neither."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read reproducer {path}: {exc}") from None
    return parse_workload(_workload_part(data, path), path)


def parse_workload(data: dict[str, Any], where: Path | str) -> CbWorkload:
    try:
        return workload_from_json(data)
    except (TypeError, ValueError, KeyError, AssertionError) as exc:
        raise UsageError(f"{where}: not a transformers-cb workload ({exc!r})") from None


def _workload_part(data: Any, path: Path) -> dict[str, Any]:
    if isinstance(data, dict) and data.get("format") == ENVELOPE_FORMAT:
        reproducer = load_reproducer(path)
        if reproducer.subject_kind is not TRANSFORMERS_CB:
            raise UsageError(f"{path}: {reproducer.subject_kind.noun} (kind {reproducer.legacy or reproducer.kind}), "
                             f"expected {TRANSFORMERS_CB.noun}")  # fmt: skip
        data = reproducer.payload["workload"]
    if not isinstance(data, dict) or "requests" not in data:
        raise UsageError(f"{path}: expected a {TRANSFORMERS_CB.noun} or a workload with requests")
    return data


def replay_json(workload: dict[str, Any], where: Path | str, timeout: float = 60.0) -> CbVerdict:
    """A workload (`workload_json`) run again through its entry point on the installed transformers,
    and judged by every paged-engine check (a planted bug must be in place around the call)."""
    return verdict_of(run_workload(parse_workload(workload, where), timeout=timeout))


def replay_workload(path: Path, timeout: float = 60.0) -> CbVerdict:
    """The file's workload run again, as `replay_json` runs one."""
    return verdict_of(run_workload(read_workload(path), timeout=timeout))
