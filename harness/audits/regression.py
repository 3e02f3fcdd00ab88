"""Regression tests written beside a reproducer: a minimized decoder case or engine rule sequence,
embedded in a self-contained pytest file.

`write_failure` and `write_engine_failure` are what the audit, the gate, `specaudit minimize` and
the real-model audit call for a failure: the reproducer (`specaudit.artifacts.reproducer`, the
format) and, for cases on the built-in models and engine rules, `DIR/test_regression_<name>.py`.
The written test imports only `specaudit.__all__`, the public API, so no internal move can break
it (files written by older versions import old paths that `specaudit._moved` keeps until their
removal release).
"""

from __future__ import annotations

import pprint
from pathlib import Path
from typing import Any

from specaudit.artifacts.reproducer import (
    ENGINE_KEYS,
    ENGINE_MODEL_DEFAULT,
    decoder_reproducer,
    engine_failure_record,
    failure_record,
    identifier,
    save,
    write_engine_reproducer,
)
from specaudit.checks.diagnosis import Diagnosis
from specaudit.contracts.violation import Violation, render
from specaudit.search.engine_replay import diagnose_engine

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

from specaudit import Case, all_violations, explain, remember_failure, run_case

pytestmark = pytest.mark.specaudit

CASE = {case}


def test_regression_{name}(specaudit_decoder: str, request: pytest.FixtureRequest) -> None:
    """The minimized case passes every check of the registry (specaudit.checks.registry.CHECKS)."""
    case = Case.from_json(CASE)
    run = run_case(specaudit_decoder, case)
    violations = all_violations(run)
    if violations:
        remember_failure(run, violations, request.node)  # the plugin writes it to --specaudit-out
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
    failure = failure_record(diagnosis.case, diagnosis.decoder, diagnosis.violations)
    paths = [save(directory, name, decoder_reproducer(failure, diagnosis.signature))]
    if test:
        path = Path(directory) / f"test_regression_{name}.py"
        path.write_text(regression_test_source(diagnosis, name, summary))
        paths.append(path)
    return paths


_ENGINE_TEMPLATE = '''"""Regression test written by specaudit: a minimized failing engine rule sequence, embedded.

Run it with `pytest THIS_FILE`: it replays the rules against the engine that failed them
(below), so it fails until that engine is fixed; `SPECAUDIT_ENGINE=MODULE:ATTR pytest THIS_FILE`
runs it against another engine (the reference engines pass it).
"""

# Failed by:     {engine}
# Failure class: first check {first_check}, rule {rule}
# Minimized:     {summary}
# Evidence when written:
{evidence}

from __future__ import annotations

import os

import pytest

from specaudit import remember_engine_failure, render
from specaudit import replay_engine as replay

pytestmark = pytest.mark.specaudit

REPRODUCER = {reproducer}


def test_regression_{name}(request: pytest.FixtureRequest) -> None:
    """The engine passes every check of the engine state machine on these rules."""
    engine = os.environ.get("SPECAUDIT_ENGINE") or REPRODUCER["engine"]
    violations = replay(dict(REPRODUCER, engine=engine))
    if violations:
        remember_engine_failure(dict(REPRODUCER, engine=engine), violations, request.node)  # for --specaudit-out
    assert violations == [], f"{{engine}} after {{len(REPRODUCER['ops'])}} rules:\\n{{render(violations)}}"
'''


def engine_regression_test_source(
    reproducer: dict[str, Any], violations: list[Violation], name: str, summary: str = ""
) -> str:
    """A ready pytest file holding the rules as a Python literal; free text only in comments."""
    first = violations[0] if violations else None
    rules = {key: reproducer[key] for key in ENGINE_KEYS}
    rules["model"] = reproducer.get("model", ENGINE_MODEL_DEFAULT)
    return _ENGINE_TEMPLATE.format(
        engine=str(reproducer["engine"]).replace("\n", " "),
        first_check=first.check if first else "-",
        rule=first.rule if first else "-",
        summary=summary.replace("\n", " ") or "-",
        evidence=_comment(render(violations)),
        reproducer=pprint.pformat(rules, indent=1, width=100, sort_dicts=False),
        name=identifier(name),
    )


def write_engine_failure(
    directory: Path,
    name: str,
    reproducer: dict[str, Any],
    violations: list[Violation],
    summary: str = "",
    *,
    test: bool = True,
) -> list[Path]:
    """`DIR/<name>.json` (replayable with `specaudit replay FILE --engine X`) and, with `test`,
    `DIR/test_regression_<name>.py`; returns the paths written."""
    name = identifier(name)
    diagnosis = diagnose_engine(violations, reproducer) if violations else None
    paths = [write_engine_reproducer(directory, name, engine_failure_record(reproducer, violations, diagnosis))]
    if test:
        test_path = Path(directory) / f"test_regression_{name}.py"
        test_path.write_text(engine_regression_test_source(reproducer, violations, name, summary))
        paths.append(test_path)
    return paths
