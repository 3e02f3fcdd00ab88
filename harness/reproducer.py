"""Every failure leaves a reproducer on disk: the one writer of reproducers and regression tests.

A reproducer `DIR/<name>.json` is a case file (the case fields at top level, replayable with
`specaudit replay` and minimizable with `specaudit minimize`) plus the decoder and the
evidence it produced. With it, `DIR/test_regression_<name>.py` embeds the case in a
self-contained pytest file. The audit, the gate, `specaudit minimize`, real-model mode and
the pytest plugin all write through here.
"""

from __future__ import annotations

import json
import pprint
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specaudit.case import Case
from specaudit.diagnosis import Diagnosis, diagnose
from specaudit.errors import UsageError
from specaudit.models import check_model
from specaudit.runner import Run, run_case
from specaudit.violation import Violation, render

EVIDENCE_LIMIT = 20
"""Violations kept in a reproducer: the first ones name the bug; the rest repeat it."""

_last: dict[str, Any] = {}


def failure_record(case: Case, decoder: str, violations: list[Violation] | tuple[Violation, ...]) -> dict[str, Any]:
    """What a reproducer holds: the case's JSON form, the decoder and the first violations."""
    return {"case": case.to_json(), "decoder": decoder, "evidence": [asdict(v) for v in violations[:EVIDENCE_LIMIT]]}


def remember_failure(run: Run, violations: list[Violation]) -> None:
    """Note the latest failing run; Hypothesis replays the minimal example last, so the note a
    failed test ends with is its shrunk counterexample."""
    _last.clear()
    _last.update(failure_record(run.case, run.decoder, violations))


def take_failure() -> dict[str, Any] | None:
    failure = dict(_last) or None
    _last.clear()
    return failure


def identifier(text: str) -> str:
    """`text` as a file-name and Python-identifier fragment: runs of other characters become one `_`."""
    name = re.sub(r"[^A-Za-z0-9_]+", "_", text).strip("_")[:100]
    return name or "case"


def write_reproducer(directory: Path, name: str, failure: dict[str, Any]) -> Path:
    """`DIR/<name>.json` from a `failure_record`: the case fields at top level, plus the decoder
    and the evidence it produced."""
    path = Path(directory) / f"{identifier(name)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    document = dict(failure["case"], decoder=failure["decoder"], evidence=failure["evidence"])
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path


_TEMPLATE = '''"""Regression test written by specaudit: a minimized failing case, embedded.

Run it against a decoder with `pytest THIS_FILE --specaudit-decoder MODULE:ATTR`; without it the
specaudit plugin runs it against the reference decoders, which pass it.
"""

# Failed by:     {decoder}
# Failure class: first check {first_check}, signature {signature}
# Minimized:     {summary}
# Evidence when written:
{evidence}

from __future__ import annotations

import pytest

from specaudit.case import Case
from specaudit.registry import all_violations
from specaudit.reproducer import remember_failure
from specaudit.violation import explain
from specaudit.runner import run_case

pytestmark = pytest.mark.specaudit

CASE = {case}


def test_regression_{name}(specaudit_decoder: str) -> None:
    """The minimized case passes every check of the registry (specaudit.registry.CHECKS)."""
    case = Case.from_json(CASE)
    run = run_case(specaudit_decoder, case)
    violations = all_violations(run)
    if violations:
        remember_failure(run, violations)  # the plugin writes it to --specaudit-out
    assert violations == [], explain(run, violations)
'''


def _comment(text: str) -> str:
    return "\n".join(f"#   {line}" for line in text.splitlines()) or "#   (none)"


def regression_test_source(diagnosis: Diagnosis, name: str, summary: str = "") -> str:
    """A ready pytest file: `CASE` holds the case's JSON form as a Python literal; every
    free-text part (decoder, evidence) sits in comments, so any text is safe to embed."""
    return _TEMPLATE.format(
        decoder=diagnosis.decoder.replace("\n", " "),
        first_check=diagnosis.first_check,
        signature=diagnosis.signature,
        summary=summary.replace("\n", " ") or "-",
        evidence=_comment(render(list(diagnosis.violations))),
        case=pprint.pformat(diagnosis.case.to_json(), indent=1, width=100, sort_dicts=False),
        name=identifier(name),
    )


def write_failure(
    directory: Path, name: str, diagnosis: Diagnosis, summary: str = "", *, test: bool = True
) -> list[Path]:
    """The reproducer `DIR/<name>.json` and, with `test` (cases on the built-in models only),
    the regression test `DIR/test_regression_<name>.py`; returns the paths written."""
    name = identifier(name)
    paths = [write_reproducer(directory, name, failure_record(diagnosis.case, diagnosis.decoder, diagnosis.violations))]
    if test:
        path = Path(directory) / f"test_regression_{name}.py"
        path.write_text(regression_test_source(diagnosis, name, summary))
        paths.append(path)
    return paths


def load_case(path: Path) -> Case:
    """A case file (or reproducer) on the built-in models; UsageError when it cannot be one."""
    case = Case.load(path)
    try:
        check_model(case.model, case.draft, case.dtype)
    except ValueError as exc:
        raise UsageError(f"{path}: {exc}") from None
    return case


def replay(case_file: Path, decoder: str) -> Diagnosis:
    """The diagnosis of one case file run against `decoder` (`specaudit replay`)."""
    from specaudit.contract import load_decoder

    case = load_case(case_file)
    return diagnose(run_case(decoder, case, factory=load_decoder(decoder)))
