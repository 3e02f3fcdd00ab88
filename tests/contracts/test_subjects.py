"""One table of subject kinds (`specaudit.contracts.subjects.KINDS`), read by every place that keys on a kind.

The reproducer kinds, the report entry kinds, replay's options and dispatch, the payload checks,
the plan's drivers and the registry's evidence all resolve to its rows, and every row is reached;
a kind spelled in the source (a writer's `Reproducer("...")`, an `entry("...")`, a plan kind)
that no row names fails here. A file of every kind as written before (tests/data/subject_kinds)
loads as its row and replays through its row's replayer.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import specaudit
from specaudit.artifacts import report, reproducer
from specaudit.artifacts.report import load_report, subject_kind
from specaudit.artifacts.reproducer import LEGACY_BLACKBOX, Reproducer, load_reproducer
from specaudit.audits import plan
from specaudit.audits.plan import SUBJECTS as DRIVERS
from specaudit.checks.registry import SUBJECTS as EVIDENCE_JUDGED
from specaudit.commands import replay
from specaudit.contracts import subjects
from specaudit.contracts.errors import UsageError
from specaudit.contracts.subjects import KINDS, REPORT_KINDS, REPRODUCER_KINDS, SubjectKind, by_report, by_reproducer

DATA = Path(__file__).resolve().parents[1] / "data" / "subject_kinds"
SOURCE = Path(specaudit.__file__).parent
SOURCES = [SOURCE, *(SOURCE.parent / name for name in ("reference", "fixtures", "properties"))]
"""The wheel's folders (tests/test_layers.py's `FOLDERS`)."""
HOMES = subjects.homes()


def test_every_reader_keys_on_the_table() -> None:
    """Every row that writes reproducers names a replayer that imports; the payload checks and the
    plan drivers are keyed by rows' names; the derived tables are the table's."""
    for kind in HOMES:
        assert callable(replay.replayer(kind)), kind
    assert set(reproducer.PAYLOAD_CHECKS) <= {kind.name for kind in HOMES}, reproducer.PAYLOAD_CHECKS
    assert tuple(dict.fromkeys(kind.reproducer for kind in HOMES)) == REPRODUCER_KINDS
    assert report.KINDS == REPORT_KINDS
    assert [d.kind for d in DRIVERS] == [kind.name for kind in KINDS if kind.driver], [d.kind for d in DRIVERS]
    options = [f.name for f in dataclasses.fields(replay.ReplayOptions) if f.name != "quiet"]
    assert tuple(options) == subjects.REPLAY_OPTIONS, options
    assert EVIDENCE_JUDGED == subjects.EVIDENCE and {kind.evidence for kind in KINDS} == set(subjects.EVIDENCE)


def test_every_row_is_reachable() -> None:
    """A row is where one of its written kinds resolves (its home), or a plan driver's kind."""
    planned = {d.kind for d in DRIVERS}
    unreached = [kind.name for kind in KINDS if not (home(kind) or kind.name in planned)]
    assert not unreached, f"rows no reader resolves to: {unreached}"


def home(kind: SubjectKind) -> bool:
    """Whether one of the strings `kind` writes resolves to it."""
    return bool(
        (kind.reproducer and by_reproducer(kind.reproducer) is kind) or (kind.report and by_report(kind.report) is kind)
    )


def written_file(kind: SubjectKind) -> Path:
    """The file of `kind`'s reproducers in tests/data/subject_kinds (a kind several rows write: one per row)."""
    shared = sum(k.reproducer == kind.reproducer for k in HOMES) > 1
    name = reproducer.identifier(str(kind.reproducer)) + (f"_{reproducer.identifier(kind.name)}" if shared else "")
    return DATA / f"{name}.json"


@pytest.mark.parametrize("kind", HOMES, ids=lambda kind: kind.name)
def test_a_file_of_each_reproducer_kind_loads_and_replays_as_its_row(
    kind: SubjectKind, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file written before loads (payload checked), resolves to its row and goes to its row's replayer."""
    path = written_file(kind)
    loaded = load_reproducer(path)
    assert (loaded.kind, loaded.subject_kind) == (kind.reproducer, kind), loaded
    called: list[str | None] = []
    monkeypatch.setattr(replay, "replayer", lambda row: lambda r, options: called.append(row.replayer))
    replay.replay(path)
    assert called == [kind.replayer], called


@pytest.mark.parametrize(
    ("kind", "before"), [(k, s) for k in KINDS for s in k.written_before], ids=lambda x: getattr(x, "name", x)
)
def test_a_file_of_a_kind_a_row_wrote_before_loads_as_its_row(
    kind: SubjectKind, before: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The paged white boxes' files of their former kinds (`vllm-paged`, `transformers-cb`) load as
    today's kind, naming their row, with the same workload, and replay through the row's replayer."""
    path = DATA / f"{reproducer.identifier(before)}.json"
    loaded, now = load_reproducer(path), load_reproducer(written_file(kind))
    assert (loaded.kind, loaded.subject_kind, loaded.legacy) == (kind.reproducer, kind, before), loaded
    assert (loaded.payload, loaded.subject, loaded.evidence) == (now.payload, now.subject, now.evidence)
    called: list[str | None] = []
    monkeypatch.setattr(replay, "replayer", lambda row: lambda r, options: called.append(row.replayer))
    replay.replay(path)
    assert called == [kind.replayer], called


def test_a_paged_engine_file_naming_no_paged_row_is_refused(tmp_path: Path) -> None:
    data = json.loads(written_file(subjects.TRANSFORMERS_CB).read_text())
    (tmp_path / "x.json").write_text(json.dumps(data | {"payload": {**data["payload"], "engine": "sglang"}}))
    with pytest.raises(UsageError, match="names its engine, one of vllm-white-box, transformers-cb; it names 'sglang'"):
        load_reproducer(tmp_path / "x.json")


@pytest.mark.parametrize("kind", HOMES, ids=lambda kind: kind.name)
def test_each_kind_takes_its_rows_replay_options(kind: SubjectKind) -> None:
    """An option its row does not list is refused, naming the kind as the row's noun does."""
    refused = next(option for option in subjects.REPLAY_OPTIONS if option not in kind.replay)
    with pytest.raises(UsageError, match=f"is {kind.noun} \\(kind {kind.reproducer}\\): --{refused} does not apply"):
        replay.replay(written_file(kind), **{refused: "x"})


TOY = SubjectKind("toy-engine", subjects.EVIDENCE_BLACK_BOX, "toy-engine", None, ("target",),
                  "a toy engine's reproducer", ("workload",), f"{__name__}:replay_toy")  # fmt: skip
"""A new engine's row, and nothing else: its reproducers are written, loaded, checked and replayed through it."""


def replay_toy(found: Reproducer, options: replay.ReplayOptions) -> tuple[str, dict[str, Any], str | None]:
    return found.kind, found.payload, options.target


def test_a_new_kind_is_one_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy's row alone: its file loads as its row, lacks what its row's payload names, takes
    the options its row lists and replays through the replayer its row names."""
    monkeypatch.setattr(subjects, "KINDS", (*KINDS, TOY))
    path = reproducer.save(tmp_path, "toy", Reproducer("toy-engine", {"engine": "toy"}, {"workload": [1, 2]}))
    assert load_reproducer(path).subject_kind is TOY
    assert replay.replay(path, target="llama") == ("toy-engine", {"workload": [1, 2]}, "llama")
    with pytest.raises(UsageError, match="is a toy engine's reproducer \\(kind toy-engine\\): --engine does not apply"):
        replay.replay(path, engine="x:y")
    empty = reproducer.save(tmp_path, "empty", Reproducer("toy-engine", {}, {}))
    with pytest.raises(UsageError, match="empty.json: a toy engine's reproducer \\(kind toy-engine\\) lacks workload"):
        load_reproducer(empty)


def test_a_row_naming_another_kinds_driver_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    wrong = dataclasses.replace(subjects.REAL_MODEL, driver=subjects.DECODER.driver)
    monkeypatch.setattr(subjects, "KINDS", (*KINDS, wrong))
    with pytest.raises(
        ValueError, match="row 'real-model' names specaudit.audits.plan:DECODERS, a driver of kind 'decoder'"
    ):
        plan.drivers()


def test_a_report_of_every_entry_kind_loads_as_its_rows() -> None:
    document = load_report(DATA / "report.json")
    kinds = [e["kind"] for e in document["entries"]]
    assert set(kinds) == set(REPORT_KINDS), set(kinds) ^ set(REPORT_KINDS)
    assert all(subject_kind(e).report == e["kind"] for e in document["entries"])
    with pytest.raises(UsageError, match="report entry kind 'vllm thing' is none of"):
        subject_kind({"kind": "vllm thing"})


def test_a_reproducer_of_a_kind_no_row_writes_is_refused(tmp_path: Path) -> None:
    """Written (a writer's own kind) and read back (a file's): both name the table."""
    with pytest.raises(ValueError, match="'vllm-white' is in no row of contracts.subjects.KINDS"):
        Reproducer("vllm-white", {}, {})
    data = json.loads((DATA / "openvino.json").read_text()) | {"kind": "openvino-v2"}
    (tmp_path / "x.json").write_text(json.dumps(data))
    with pytest.raises(UsageError, match="reproducer kind 'openvino-v2' is none of decoder-case"):
        load_reproducer(tmp_path / "x.json")


def test_the_table_check_sees_each_problem() -> None:
    """The import-time check: a name twice, unknown evidence and replay options, a row writing
    nothing, a row sharing another's reproducers with other options and no replayer (two problems),
    a row writing reproducers that names no replayer, a row claiming another's former kind (a row
    sharing the paged kind with its own replayer is fine: its payload names it)."""
    rows = (
        *KINDS,
        SubjectKind("decoder", "decoder", None, "x", (), "again"),
        SubjectKind("odd", "nothing", None, None, ("flag",), "odd"),
        SubjectKind("vllm-too", "black box", "blackbox", "y", (), "a black box"),
        SubjectKind("unplayable", "black box", "unplayable", None, (), "an unplayable one"),
        SubjectKind(
            "sglang",
            "paged engine",
            "paged-engine",
            None,
            (),
            "an SGLang one",
            subjects.PAGED_PAYLOAD,
            "m:f",
            written_before=("vllm-paged",),
        ),  # fmt: skip
    )
    problems = subjects.check(rows)
    assert len(problems) == 9 and subjects.check(KINDS) == [], problems
    assert [p for p in problems if p.startswith("sglang")] == [
        "sglang: 'vllm-paged', written before, is another row's kind too"
    ], problems
    assert ["names two rows" in p for p in problems] == [True] + [False] * 8, problems
    assert "unplayable: writes reproducers; its replayer None is no module:function" in problems, problems
    with pytest.raises(ValueError, match="'nope' is no subject kind"):
        subjects.named("nope")


# ---------------------------------------------------------------------------------------
# Kinds spelled in the source


WRITTEN = {"entry": 0, "Reproducer": 0}
"""Calls whose first argument is a written kind (a report entry's, a reproducer's)."""
PLANNED = {"EntryVerdict": 0, "SubjectDriver": 0}
"""Calls whose first argument is a plan kind (a row's name); `Item(kind=...)` too."""


def spelled(path: Path) -> Iterator[tuple[str, str, int]]:
    """(what, the string, line) for each kind spelled as a literal: "written" (an entry's or a
    reproducer's kind, or a module constant named KIND or ..._KIND), "planned" (a plan kind)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            args: list[Any] = list(node.args)
            for table, what in ((WRITTEN, "written"), (PLANNED, "planned")):
                if name in table and len(args) > table[name] and isinstance(args[table[name]], ast.Constant):
                    yield what, args[table[name]].value, node.lineno
            for keyword in node.keywords:
                if name == "Item" and keyword.arg == "kind" and isinstance(keyword.value, ast.Constant):
                    yield "planned", keyword.value.value, node.lineno
        elif isinstance(node, ast.Assign) and isinstance(getattr(node.value, "value", None), str):
            for target in node.targets:
                if isinstance(target, ast.Name) and (target.id == "KIND" or target.id.endswith("_KIND")):
                    yield "written", node.value.value, node.lineno


def strays(paths: list[Path]) -> list[str]:
    """Each literal kind that no row of the table names, as "path:line what 'kind'"."""
    allowed = {"written": {*REPRODUCER_KINDS, *REPORT_KINDS, LEGACY_BLACKBOX}, "planned": set(subjects.NAMES)}
    return [
        f"{path}:{line} {what} {value!r}"
        for path in paths
        for what, value, line in spelled(path)
        if value not in allowed[what]
    ]


def test_every_kind_spelled_in_the_source_is_a_row() -> None:
    found = strays(sorted(path for folder in SOURCES for path in folder.rglob("*.py")))
    assert not found, "kinds spelled in the source that no row of contracts.subjects.KINDS names:\n" + "\n".join(found)


def test_the_source_check_sees_a_stray_kind(tmp_path: Path) -> None:
    """The negative control: a new entry kind, reproducer kind and plan kind, spelled but not in the table."""
    path = tmp_path / "adapter.py"
    path.write_text(
        'KIND = "sglang"\nentry("sglang configuration", {}, True, None, None, {})\n'
        'Reproducer(KIND, {}, {})\nItem("s", "m", False, 1, 0, kind="sglang")\nentry("blackbox", {})\n'
    )
    assert [s.split(" ", 1)[1] for s in strays([path])] == [
        "written 'sglang'",
        "written 'sglang configuration'",
        "planned 'sglang'",
    ], strays([path])
