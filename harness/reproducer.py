"""Every failure leaves a reproducer on disk: the one writer of reproducers and regression tests.

A reproducer `DIR/<name>.json` is a case file (the case fields at top level, replayable with
`specaudit replay` and minimizable with `specaudit minimize`) plus the decoder and the
evidence it produced. With it, `DIR/test_regression_<name>.py` embeds the case in a
self-contained pytest file. The audit, the gate, `specaudit minimize`, real-model mode and
the pytest plugin all write through here. A failing property notes its record on its own pytest
item (`remember_failure`, `remember_engine_failure`), where the plugin finds it.
"""

from __future__ import annotations

import hashlib
import json
import pprint
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specaudit.case import Case
from specaudit.diagnosis import Diagnosis, diagnose
from specaudit.errors import UsageError
from specaudit.models import MODELS, check_model
from specaudit.runner import Run, run_case
from specaudit.settings import EngineReplaySettings
from specaudit.violation import Violation, render

EVIDENCE_LIMIT = 20
"""Violations kept in a reproducer: the first ones name the bug; the rest repeat it."""


def failure_record(case: Case, decoder: str, violations: list[Violation] | tuple[Violation, ...]) -> dict[str, Any]:
    """What a reproducer holds: the case's JSON form, the decoder and the first violations."""
    return {"case": case.to_json(), "decoder": decoder, "evidence": [asdict(v) for v in violations[:EVIDENCE_LIMIT]]}


def note_on_item(node: Any, record: dict[str, Any]) -> None:
    """Keep `record` on the pytest item (`request.node`), replacing any earlier one: Hypothesis
    replays the minimal example last, so the record a failed test ends with is its shrunk
    counterexample. On the item, not in a global, so no test can pick up another's failure."""
    from specaudit.pytest_plugin import FAILURE

    node.stash[FAILURE] = record


def remember_failure(run: Run, violations: list[Violation], node: Any = None) -> None:
    """Note a failing run on its pytest item for the plugin (--specaudit-out, --specaudit-xfails).
    Without `node` (regression tests written before failures travelled on the item) nothing is
    noted: the test still fails, only no reproducer is written."""
    if node is not None:
        note_on_item(node, failure_record(run.case, run.decoder, violations))


def remember_engine_failure(reproducer: dict[str, Any], violations: list[Violation], node: Any) -> None:
    """Note a failing engine rule sequence on its pytest item, as the engine reproducer
    `specaudit replay FILE --engine X` reads (`engine_failure_record`)."""
    note_on_item(node, engine_failure_record(reproducer, violations))


IDENTIFIER_LIMIT = 100


def identifier(text: str) -> str:
    """`text` as a file-name and Python-identifier fragment: runs of other characters become one `_`.
    A longer one is cut with a hash of the whole text appended, so two long names that share a
    start (two engines of one module) do not overwrite each other's reproducer."""
    name = re.sub(r"[^A-Za-z0-9_]+", "_", text).strip("_")
    if len(name) > IDENTIFIER_LIMIT:
        name = f"{name[: IDENTIFIER_LIMIT - 9]}_{hashlib.sha256(text.encode()).hexdigest()[:8]}"
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


def test_regression_{name}(specaudit_decoder: str, request: pytest.FixtureRequest) -> None:
    """The minimized case passes every check of the registry (specaudit.registry.CHECKS)."""
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


# ---------------------------------------------------------------------------------------
# Engine reproducers: a logged rule sequence of the engine state machine (a file with "ops")

ENGINE_KEYS = ("engine", "num_draft_tokens", "eos_token_id", "pad_token_id", "ops")
ENGINE_MODEL_DEFAULT = "transparent"
"""The model of a reproducer without a "model" key (written before engines ran on tiny real models)."""
ENGINE_OPS = {"add": ("id", "prompt", "max_new_tokens", "accept"), "step": (), "abort": ("id",), "drain": ()}
"""Each rule of an engine reproducer and the fields it needs (`specaudit.engine_machine.replay`)."""


def read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not JSON: {exc}") from None


def is_engine_reproducer(path: Path) -> bool:
    """A readable JSON object with an "ops" key: an engine reproducer, not a case file (an
    unreadable file is left to the case loader's own message)."""
    try:
        document = read_json(path)
    except UsageError:
        return False
    return isinstance(document, dict) and "ops" in document


def load_engine_reproducer(path: Path, engine: str | None = None) -> dict[str, Any]:
    """An engine reproducer, checked field by field (UsageError naming what is wrong); `engine`
    replaces the engine it names."""
    document = read_json(path)
    if not isinstance(document, dict):
        raise UsageError(f"{path}: an engine reproducer is a JSON object")
    missing = [key for key in ENGINE_KEYS if key not in document]
    if missing:
        raise UsageError(f"{path}: engine reproducer lacks {', '.join(missing)}")
    if not isinstance(document["ops"], list):
        raise UsageError(f"{path}: 'ops' must be a list of rules")
    model = document.get("model", ENGINE_MODEL_DEFAULT)
    if model not in MODELS:
        raise UsageError(f"{path}: model {model!r} is not a built-in model ({', '.join(MODELS)})")
    for i, op in enumerate(document["ops"]):
        kind = op.get("op") if isinstance(op, dict) else None
        if kind not in ENGINE_OPS:
            raise UsageError(f"{path}: rule {i} is {op!r}; rules are {', '.join(ENGINE_OPS)}")
        lacking = [key for key in ENGINE_OPS[kind] if key not in op]
        if lacking:
            raise UsageError(f"{path}: rule {i} ({kind}) lacks {', '.join(lacking)}")
    if engine is not None:
        document["engine"] = engine
    return document


def engine_failure_record(reproducer: dict[str, Any], violations: list[Violation]) -> dict[str, Any]:
    """What an engine reproducer file holds: the rules to replay, then the evidence they gave."""
    first = violations[0] if violations else None
    return dict(
        reproducer,
        first_check=first.check if first else None,
        rule=first.rule if first else None,
        evidence=[asdict(v) for v in violations[:EVIDENCE_LIMIT]],
    )


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

from specaudit.engine_machine import replay
from specaudit.reproducer import remember_engine_failure
from specaudit.violation import render

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


def write_engine_reproducer(directory: Path, name: str, record: dict[str, Any]) -> Path:
    """`DIR/<name>.json` from an `engine_failure_record`, replayable with `specaudit replay FILE --engine X`."""
    path = Path(directory) / f"{identifier(name)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


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
    paths = [write_engine_reproducer(directory, name, engine_failure_record(reproducer, violations))]
    if test:
        test_path = Path(directory) / f"test_regression_{name}.py"
        test_path.write_text(engine_regression_test_source(reproducer, violations, name, summary))
        paths.append(test_path)
    return paths


def replay_engine_rules(reproducer: dict[str, Any]) -> list[Violation]:
    """`specaudit.engine_machine.replay`, with an engine that does not build ('engine-builds')
    reported as its violation rather than raised."""
    from specaudit.contract import ContractError
    from specaudit.engine_machine import replay as replay_rules

    try:
        return replay_rules(reproducer)
    except ContractError as exc:
        return [Violation("contract", exc.rule, exc.found, exc.expected, evidence=exc.evidence)]


def replay_engine(settings: EngineReplaySettings) -> int:
    """`specaudit replay FILE --engine X` on an engine reproducer: the rules run again, every
    check after every step; prints the violations (or that it passes), exit 1 / 0."""
    from specaudit.engine import load_engine

    reproducer = load_engine_reproducer(settings.case, settings.engine)
    load_engine(reproducer["engine"])  # an unloadable engine is a usage error
    violations = replay_engine_rules(reproducer)
    if settings.json:
        print(json.dumps(engine_failure_record(reproducer, violations), indent=1))
    elif violations:
        print(f"{reproducer['engine']} fails {settings.case} ({len(reproducer['ops'])} rules):\n{render(violations)}")
    else:
        print(f"{reproducer['engine']} passes every check on {settings.case} ({len(reproducer['ops'])} rules)")
    return 1 if violations else 0
