"""Every failure leaves a reproducer on disk: the case as versioned JSON plus its evidence."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specaudit.runner import Run
from specaudit.violation import Violation

_last: dict[str, Any] = {}


def remember_failure(run: Run, violations: list[Violation]) -> None:
    """Note the latest failing run; Hypothesis replays the minimal example last, so the note a
    failed test ends with is its shrunk counterexample."""
    _last.clear()
    _last.update(case=run.case.to_json(), decoder=run.decoder, evidence=[asdict(v) for v in violations[:20]])


def take_failure() -> dict[str, Any] | None:
    failure = dict(_last) or None
    _last.clear()
    return failure


def write_reproducer(directory: Path, name: str, failure: dict[str, Any]) -> Path:
    """`DIR/<name>.json`: the case fields at top level (replayable as a case), plus the decoder
    and the evidence it produced."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")[:150]
    path = Path(directory) / f"{safe}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    document = dict(failure["case"], decoder=failure["decoder"], evidence=failure["evidence"])
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path
