"""One reproducer envelope, one loader (`specaudit.artifacts.reproducer`), one replay (`specaudit.commands.replay`).

Files of the four formats written before the envelope (tests/data/legacy_reproducers, written
at 288abca, see its README) load and replay with the failure they recorded; every writer's file
is the envelope and loads back as written; a malformed file is one usage error line, exit 2.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from specaudit.artifacts.reproducer import (
    Reproducer,
    blackbox_reproducer,
    load_case,
    load_engine_reproducer,
    load_reproducer,
    paged_reproducer,
    save,
    write_real_failure,
)
from specaudit.audits.regression import write_engine_failure, write_failure
from specaudit.commands.cli import main
from specaudit.commands.replay import replay
from specaudit.contracts.errors import UsageError
from specaudit.contracts.subjects import REPRODUCER_KINDS, VLLM_WHITE_BOX
from specaudit.contracts.violation import Violation

pytestmark = pytest.mark.usefixtures("one_thread")

LEGACY = Path(__file__).resolve().parents[1] / "data" / "legacy_reproducers"
EQSPEC = "specaudit.reference.eqspec:EqSpec"
EQSPEC_ENGINE = "specaudit.reference.engines:EqSpecEngine"
ENVELOPE_KEYS = ["format", "version", "kind", "subject", "payload", "evidence"]
LEGACY_FILES = {
    "decoder_case.json": ("decoder-case", "specaudit-case 1"),
    "engine_ops.json": ("engine-ops", "engine ops"),
    "blackbox.json": ("blackbox", "specaudit-blackbox"),
    "real_model.json": ("real-model", "specaudit-case 1"),
}


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny Llama pair on disk: seeded, so the same weights the real-model file was written on."""
    from specaudit.models.loading import save_tiny_pair

    return save_tiny_pair(tmp_path_factory.mktemp("tiny-llama"))


def first_class(outcome) -> tuple[str | None, str | None]:
    """(check, rule) of an engine replay's first violation."""
    found = outcome.to_json()
    return found["first_check"], found["rule"]


def recorded(reproducer: Reproducer) -> tuple[str, str]:
    first = reproducer.evidence["violations"][0]
    return first["check"], first["rule"]


# ---------------------------------------------------------------------------------------
# The files written before the envelope


@pytest.mark.parametrize("name", sorted(LEGACY_FILES))
def test_legacy_file_loads_as_its_kind(name: str) -> None:
    """Each of today's four formats is upgraded to the envelope of its kind, its evidence kept."""
    reproducer = load_reproducer(LEGACY / name)
    kind, legacy = LEGACY_FILES[name]
    assert (reproducer.kind, reproducer.legacy) == (kind, legacy), f"{name}: got {reproducer.kind}/{reproducer.legacy}"
    assert list(reproducer.to_json()) == ENVELOPE_KEYS
    evidence = reproducer.evidence.get("outcome") or reproducer.evidence["violations"]
    assert evidence, f"{name}: the recorded evidence was lost in the upgrade: {reproducer.evidence}"


def test_legacy_decoder_case_replays_its_failure() -> None:
    """The planted bug's case fails again with its recorded check and rule; EQSPEC passes it."""
    reproducer = load_reproducer(LEGACY / "decoder_case.json")
    diagnosis = replay(reproducer)
    assert not diagnosis.passed and diagnosis.first is not None, diagnosis.render()
    found = (diagnosis.first.check, diagnosis.first.rule)
    assert found == recorded(reproducer), f"replay failed {found}, the file recorded {recorded(reproducer)}"
    assert replay(reproducer, EQSPEC).passed, "the reference decoder should pass the planted bug's case"
    assert load_case(LEGACY / "decoder_case.json") == reproducer.case


def test_legacy_engine_ops_replay_their_failure(capsys: pytest.CaptureFixture[str]) -> None:
    """The planted engine bug's rules fail again (contract, has-unfinished); the reference engine passes."""
    reproducer = load_reproducer(LEGACY / "engine_ops.json")
    outcome = replay(reproducer)
    assert not outcome.passed and first_class(outcome) == recorded(reproducer), outcome.render()
    assert replay(reproducer, engine=EQSPEC_ENGINE).passed
    assert main(["replay", str(LEGACY / "engine_ops.json"), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["rule"] == "has-unfinished"
    assert load_engine_reproducer(LEGACY / "engine_ops.json")["ops"] == reproducer.payload["ops"]


def test_legacy_blackbox_plan_replays_its_divergence() -> None:
    """The black-box plan sent again to the planted engine diverges on the requests it recorded.
    The file names the engine where it was when written (`tests.test_blackbox_cli`, before the
    tests moved into folders), so it is given where it is now, as a user would with --engine."""
    reproducer = load_reproducer(LEGACY / "blackbox.json")
    assert reproducer.subject["engine"] == "tests.test_blackbox_cli:bad_engine"
    outcome = replay(reproducer, engine="tests.commands.test_blackbox_cli:bad_engine")
    assert not outcome.passed, outcome.render()
    diverged = sorted(str(i) for i in outcome.to_json()["diverged"])
    assert diverged == sorted(reproducer.evidence["outcome"]["diverged"]), outcome.render()


def test_legacy_real_model_case_replays_on_the_models_given(tiny_pair: tuple[Path, Path]) -> None:
    """A real-model case names only its target (a temporary directory then): with the pair given
    it fails again with its recorded check and rule; without a draft it is a usage error."""
    reproducer = load_reproducer(LEGACY / "real_model.json")
    target, draft = tiny_pair
    with pytest.raises(UsageError, match="names no draft model: give --draft DIR"):
        replay(reproducer)
    diagnosis = replay(reproducer, target=str(target), draft=str(draft))
    assert not diagnosis.passed and diagnosis.first is not None, diagnosis.render()
    assert (diagnosis.first.check, diagnosis.first.rule) == recorded(reproducer), diagnosis.render()


# ---------------------------------------------------------------------------------------
# Every writer writes the envelope, and it loads back as written


def written_back(path: Path) -> Reproducer:
    data = json.loads(path.read_text())
    assert list(data) == ENVELOPE_KEYS and data["format"] == "specaudit-reproducer" and data["version"] == 2, data
    return load_reproducer(path)


def test_decoder_writer_round_trips(tmp_path: Path) -> None:
    """write_failure: the envelope (kind, decoder, case, evidence with the signature) and a regression test."""
    diagnosis = replay(load_reproducer(LEGACY / "decoder_case.json"))
    path, test = write_failure(tmp_path, "planted", diagnosis, "a summary")
    back = written_back(path)
    assert (back.kind, back.subject["decoder"], back.case) == ("decoder-case", diagnosis.decoder, diagnosis.case)
    assert back.evidence["signature"] == diagnosis.signature, back.evidence
    assert recorded(back) == (diagnosis.first_check, diagnosis.first.rule), back.evidence
    compile(test.read_text(), str(test), "exec")
    assert not replay(path).passed


def test_engine_writer_round_trips(tmp_path: Path) -> None:
    """write_engine_failure: the engine and model as subject, the rules as payload, which replay the same."""
    rules = load_engine_reproducer(LEGACY / "engine_ops.json")
    outcome = replay(load_reproducer(LEGACY / "engine_ops.json"))
    path, test = write_engine_failure(tmp_path, "engine", rules, outcome.violations, "a summary")
    back = written_back(path)
    assert back.kind == "engine-ops" and back.engine_rules() == rules, back
    assert back.evidence["rule"] == "has-unfinished" and first_class(replay(path)) == recorded(back)
    assert back.evidence["signature"] == "contract", back.evidence  # the engine diagnosis's, kept with the rules
    diagnosis = back.evidence.get("diagnosis") or {}  # the whole diagnosis beside it: where the failure is
    assert (diagnosis.get("first_check"), diagnosis.get("signature")) == ("contract", "contract"), back.evidence
    assert {"step", "call", "request", "row", "slot", "reason"} <= set(diagnosis), diagnosis
    compile(test.read_text(), str(test), "exec")


def test_blackbox_writer_round_trips(tmp_path: Path) -> None:
    """A black-box plan and outcome in the envelope give back the plan `replayed_plan` reads."""
    legacy = json.loads((LEGACY / "blackbox.json").read_text())
    path = save(tmp_path, "bb", blackbox_reproducer(legacy, legacy["outcome"]))
    document = written_back(path).plan_document()
    assert {key: value for key, value in legacy.items() if key != "replay"} == document


def test_real_model_writer_names_both_models(tmp_path: Path, tiny_pair: tuple[Path, Path]) -> None:
    """write_real_failure: both directories in the subject, so the replay needs no option."""
    target, draft = tiny_pair
    legacy = load_reproducer(LEGACY / "real_model.json")
    diagnosis = replay(legacy, target=str(target), draft=str(draft))
    path = write_real_failure(tmp_path, "real", diagnosis, target=target, draft=draft, device="cpu")
    back = written_back(path)
    assert back.subject == {"decoder": diagnosis.decoder, "target": str(target.resolve()),
                            "draft": str(draft.resolve()), "device": "cpu", "dtype": "float64"}  # fmt: skip
    assert back.case == legacy.case and recorded(back) == recorded(legacy)
    again = replay(path)
    assert again.first is not None and (again.first.check, again.first.rule) == recorded(back), again.render()


PAGED_SUBJECT = {"model": "/models/tiny", "draft": None, "speculative": "ngram"}
PAGED_WORKLOAD = {"new_tokens": 8, "prompts": {"a": [5, 6, 5, 6]}, "arrivals": {"a": 0}, "aborts": {}}


def test_vllm_paged_writer_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A vLLM white-box run's reproducer keeps its models, workload and first rule; replaying it
    without vLLM installed is a usage error that says where to run it (the vLLM venv runs it:
    tests/adapters/test_vllm_observer.py)."""
    found = Violation("paged", "query-positions", "position 9", "position 8", call=3, row=1, slot=8)
    path = save(tmp_path, "paged", paged_reproducer(VLLM_WHITE_BOX, PAGED_SUBJECT, PAGED_WORKLOAD, [found]))
    back = written_back(path)
    payload = {"engine": "vllm-white-box", "workload": PAGED_WORKLOAD}
    assert (back.kind, back.subject, back.payload, back.subject_kind) == ("paged-engine", PAGED_SUBJECT, payload,
                                                                          VLLM_WHITE_BOX), back  # fmt: skip
    assert recorded(back) == ("paged", "query-positions") and back.evidence["violations"][0]["slot"] == 8
    if importlib.util.find_spec("vllm") is None:
        assert main(["replay", str(path)]) == 2
        assert "run it with the vLLM venv's python" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# A malformed file, or an option its kind does not take: one line, exit 2


def envelope(**changes: object) -> dict:
    data = load_reproducer(LEGACY / "decoder_case.json").to_json()
    return {**data, **changes}


MALFORMED = [
    ("not-json", "{", "cannot read reproducer"),
    ("a-list", [1, 2], "a JSON object is expected, not list"),
    ("unknown", {"hello": 1}, "is not a specaudit reproducer"),
    ("version", envelope(version=3), "reproducer version 3 is not supported (this is 2)"),
    ("kind", envelope(kind="nope"), "reproducer kind 'nope' is none of " + ", ".join(REPRODUCER_KINDS)),
    ("payload", envelope(payload=[]), "the reproducer's payload must be a JSON object"),
    ("case", envelope(payload={"case": {"format": "specaudit-case", "version": 1}}), "missing the field 'requests'"),
    ("no-case", envelope(payload={}), "not a specaudit case"),
    (
        "rules",
        {"engine": EQSPEC_ENGINE, "num_draft_tokens": 1, "eos_token_id": None, "pad_token_id": 0, "ops": [{}]},
        "rule 0 is {}",
    ),
    ("no-requests", {"kind": "specaudit-blackbox", "engine": "x:y"}, "black-box reproducer has no list of requests"),
    ("no-workload", envelope(kind="vllm-paged", subject={"model": "m"}, payload={}), "lacks new_tokens, prompts"),
    (
        "paged-no-workload",
        envelope(kind="paged-engine", subject={"model": "m"}, payload={"engine": "vllm-white-box"}),
        "lacks new_tokens, prompts",
    ),
]


@pytest.mark.parametrize(("label", "content", "message"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_file_is_a_usage_error(tmp_path: Path, capsys, label: str, content: object, message: str) -> None:
    """Unreadable, not the envelope nor a legacy format, or a payload that cannot run: one line, exit 2."""
    path = tmp_path / f"{label}.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specaudit: error: ") and str(path) in err, err
    assert message in err, f"{label}: got {err!r}, should say {message!r}"


@pytest.mark.parametrize(
    ("name", "argv", "message"),
    [
        ("decoder_case.json", ["--engine", EQSPEC_ENGINE], "is a decoder case (kind decoder-case): --engine does not"),
        ("engine_ops.json", ["--decoder", EQSPEC], "is an engine reproducer"),
        ("blackbox.json", ["--draft", "d"], "--draft does not apply; it takes --engine, --server, --target"),
        ("real_model.json", ["--server", "http://x"], "--server does not apply"),
        ("missing.json", [], "cannot read reproducer"),
    ],
)
def test_option_the_kind_does_not_take_is_a_usage_error(capsys, name: str, argv: list[str], message: str) -> None:
    """An option for another kind (--decoder on an engine's rules) is refused before anything runs."""
    assert main(["replay", str(LEGACY / name), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


# ---------------------------------------------------------------------------------------
# One report.json for every command


def test_report_entries_share_the_verdict_fields(tmp_path: Path) -> None:
    """Whatever the subject, an entry opens with kind, subject, passed, first and signature."""
    from specaudit.artifacts.report import entry, load_report, write_report
    from specaudit.contracts.violation import Violation

    broke = Violation("I2", "attends-wrong-slot", "slot 3", "slot 2", call=2, row=1, slot=3, request=1)
    entries = [
        entry("decoder", {"decoder": "d", "model": "m"}, False, broke, "kv-drift", {"cases": 4, "passed": True}),
        entry("blackbox", {"engine": "e", "transport": "http", "target": "t"}, True, None, None, {}),
    ]
    data = load_report(write_report(tmp_path, "audit", entries))
    assert (data["format"], data["version"], data["command"], data["passed"]) == ("specaudit-report", 1, "audit", False)
    first, second = data["entries"]
    assert first["passed"] is False, "a figure named like a shared field does not override it"
    assert first["first"] == {"check": "I2", "rule": "attends-wrong-slot", "call": 2, "row": 1, "slot": 3, "request": 1}
    assert (second["kind"], second["first"], second["signature"]) == ("blackbox", None, None), second


def test_reports_written_before_the_envelope_load(tmp_path: Path) -> None:
    """A bare list (audit, real-model audit) and a black-box object load as the envelope."""
    from specaudit.artifacts.report import load_report

    old_audit = [{"decoder": "d", "model": "m", "diagnosis": None}, {"decoder": "x", "diagnosis": {"passed": False}}]
    (tmp_path / "a.json").write_text(json.dumps(old_audit))
    data = load_report(tmp_path / "a.json")
    assert [e["passed"] for e in data["entries"]] == [True, False] and data["passed"] is False, data
    (tmp_path / "b.json").write_text(json.dumps({"plan": {}, "passed": True, "engine": "e"}))
    data = load_report(tmp_path / "b.json")
    assert data["command"] == "blackbox" and data["entries"][0]["kind"] == "blackbox" and data["passed"], data
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(UsageError, match="not a specaudit report.json"):
        load_report(tmp_path / "c.json")
