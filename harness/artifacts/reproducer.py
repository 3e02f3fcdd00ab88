"""The reproducer envelope: one file format for every kind of failure, written, read, checked, upgraded.

A reproducer `DIR/<name>.json` is one envelope for every kind of failure:

    {"format": "specaudit-reproducer", "version": 2, "kind": KIND,
     "subject": what was under test, "payload": what to run again, "evidence": what it gave}

| kind | subject | payload |
|---|---|---|
| decoder-case | decoder | the case (`Case.to_json`) on a built-in model |
| real-model | decoder, target and draft directories, device, dtype | the case (model "external:...") |
| engine-ops | engine, built-in model | K, EOS, pad and the rules ("ops") of the engine state machine |
| blackbox | transport, server or engine, target, served model, dtype | seed, spread, batch cut, EOS, requests |
| paged-engine | vLLM's model, method; transformers-cb's entry point, version | `engine` (its row), the workload |
| sampling-case | decoder | the sampling case (`SamplingCase.to_json`: batch, settings, draft, runs, seed) |
| openvino | configuration, pipeline options, openvino-genai version | the workload (`adapters.openvino`) |

Each kind is the `reproducer` of a row of `specaudit.contracts.subjects.KINDS`, the one table of
subject kinds; `Reproducer.subject_kind` is that row (replay dispatches on its name; a
paged-engine file names its row in its payload). The strings are the ones files were written
with, so version 2 files of every kind load: the two paged white boxes' former kinds
(`vllm-paged`, `transformers-cb`) are upgraded to `paged-engine` (`PAGED_BEFORE`).

`load_reproducer` reads the envelope and upgrades the four formats written before it (a
versioned case file, an engine file with "ops", a `"kind": "specaudit-blackbox"` file, a case
on `external:` models); `validate` says what a payload lacks, naming the file. A format only:
this module runs nothing (`tests/test_layers.py` holds it to that). Elsewhere:

- running a reproducer again, any kind: `specaudit.commands.replay` (`specaudit replay FILE`);
- the regression test written beside a decoder case or an engine's rules, and the writers that
  pair it with the reproducer (`write_failure`, `write_engine_failure`): `specaudit.audits.regression`;
- a failing property's record noted on its pytest item for the plugin (`remember_failure`,
  `remember_engine_failure`): `specaudit.commands.pytest_notes`.

Those names were here before; their old path still resolves, with a DeprecationWarning
(`specaudit._moved`), so regression tests written by older versions keep running.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specaudit._moved import forward as _forward
from specaudit.checks.diagnosis import Diagnosis, Finding
from specaudit.contracts import subjects
from specaudit.contracts.builtins import MODELS, check_model
from specaudit.contracts.case import CASE_FORMAT, ENVELOPE_FORMAT, Case, CaseFormatError
from specaudit.contracts.errors import UsageError
from specaudit.contracts.sampling import SamplingCase
from specaudit.contracts.subjects import SubjectKind
from specaudit.contracts.violation import Violation

EVIDENCE_LIMIT = 20
"""Violations kept in a reproducer: the first ones name the bug; the rest repeat it."""


def failure_record(case: Case, decoder: str, violations: list[Violation] | tuple[Violation, ...]) -> dict[str, Any]:
    """What a reproducer holds: the case's JSON form, the decoder and the first violations."""
    return {"case": case.to_json(), "decoder": decoder, "evidence": [asdict(v) for v in violations[:EVIDENCE_LIMIT]]}


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
    """`DIR/<name>.json` from a `failure_record`: a decoder-case reproducer (real-model when the
    case runs on `external:` models). A record's "signature", where its writer diagnosed it (the
    pytest plugin, once, when it writes the file), goes in the evidence, as
    `specaudit.audits.regression.write_failure`'s does."""
    return save(directory, name, decoder_reproducer(failure, failure.get("signature")))


# ---------------------------------------------------------------------------------------
# Engine reproducers: a logged rule sequence of the engine state machine (a file with "ops")

ENGINE_KEYS = ("engine", "num_draft_tokens", "eos_token_id", "pad_token_id", "ops")
ENGINE_MODEL_DEFAULT = "transparent"
"""The model of a reproducer without a "model" key (written before engines ran on tiny real models)."""
ENGINE_OPS = {"add": ("id", "prompt", "max_new_tokens", "accept"), "step": (), "abort": ("id",), "drain": ()}
"""Each rule of an engine reproducer and the fields it needs (`specaudit.search.engine_replay.replay`
reads them)."""


def engine_failure_record(
    reproducer: dict[str, Any], violations: list[Violation], diagnosis: Finding | None = None
) -> dict[str, Any]:
    """What an engine reproducer file holds: the rules to replay, then the evidence they gave and,
    where the writer diagnosed it (`specaudit.search.engine_replay.diagnose_engine`), the signature
    and the whole diagnosis (first check, rule, step, call, request, row, slot, signature, reason)."""
    first = violations[0] if violations else None
    record = dict(
        reproducer,
        first_check=first.check if first else None,
        rule=first.rule if first else None,
        signature=diagnosis.signature if diagnosis is not None else None,
        evidence=[asdict(v) for v in violations[:EVIDENCE_LIMIT]],
    )
    if diagnosis is not None:
        record["diagnosis"] = diagnosis.to_json()
    return record


def write_engine_reproducer(directory: Path, name: str, record: dict[str, Any]) -> Path:
    """`DIR/<name>.json` from an `engine_failure_record`: an engine-ops reproducer."""
    return save(directory, name, engine_reproducer(record))


# ---------------------------------------------------------------------------------------
# The envelope: one reproducer of any kind, written, loaded and upgraded here

REPRODUCER_VERSION = 2


def written(kind: SubjectKind) -> str:
    """The reproducer kind a subject kind writes."""
    assert kind.reproducer is not None, kind
    return kind.reproducer


CASE_KIND, REAL_MODEL_KIND, ENGINE_KIND = (
    written(subjects.DECODER),
    written(subjects.REAL_MODEL),
    written(subjects.ENGINE),
)
BLACKBOX_KIND = written(subjects.BLACK_BOX)
EXTERNAL = "external:"
"""The model prefix of a case on real models (`specaudit.adapters.realmodel.real_case`)."""
LEGACY_BLACKBOX = "specaudit-blackbox"
"""The `kind` of a black-box reproducer written before the envelope."""
ENGINE_PAYLOAD = ("num_draft_tokens", "eos_token_id", "pad_token_id", "ops")
BLACKBOX_SUBJECT = ("transport", "server", "engine", "target", "served_model", "dtype")
BLACKBOX_PAYLOAD = ("seed", "spread", "eos_token_id", "max_batch", "requests", "stops_recorded")
VLLM_WORKLOAD = ("new_tokens", "prompts", "arrivals", "aborts")


@dataclass(frozen=True)
class Reproducer:
    """One reproducer: what was under test (`subject`), what to run again (`payload`) and what it
    gave (`evidence`). `source` is the file it was read from, `legacy` the pre-envelope format or
    former kind it was upgraded from (None: an envelope of its kind), both for messages only."""

    kind: str
    subject: dict[str, Any]
    payload: dict[str, Any]
    evidence: dict[str, Any] = field(default_factory=dict)
    source: Path | None = None
    legacy: str | None = None

    def __post_init__(self) -> None:
        if subjects.by_reproducer(self.kind) is None:  # a writer's kind the table lacks fails where it is written
            raise ValueError(f"reproducer kind {self.kind!r} is in no row of contracts.subjects.KINDS")

    @property
    def subject_kind(self) -> SubjectKind:
        """The row of the one table of subject kinds this reproducer's kind (and `engine`) resolves to."""
        kind = subjects.by_reproducer(self.kind, self.payload.get(subjects.ENGINE_KEY))
        assert kind is not None, self.kind  # `__post_init__`
        return kind

    def to_json(self) -> dict[str, Any]:
        return {
            "format": ENVELOPE_FORMAT,
            "version": REPRODUCER_VERSION,
            "kind": self.kind,
            "subject": self.subject,
            "payload": self.payload,
            "evidence": self.evidence,
        }

    @property
    def where(self) -> str:
        return str(self.source) if self.source is not None else "the reproducer"

    @property
    def case(self) -> Case:
        """The case of a decoder or real-model reproducer; UsageError naming the file otherwise."""
        try:
            return Case.from_json(self.payload.get("case"))
        except CaseFormatError as exc:
            raise UsageError(f"{self.where}: {exc}") from None

    @property
    def sampling_case(self) -> SamplingCase:
        """The sampling case of a sampling-case reproducer; UsageError naming the file otherwise."""
        try:
            return SamplingCase.from_json(self.payload.get("case"))
        except CaseFormatError as exc:
            raise UsageError(f"{self.where}: {exc}") from None

    def engine_rules(self, engine: str | None = None) -> dict[str, Any]:
        """An engine-ops reproducer as `specaudit.search.engine_replay.replay` takes it (`engine` replaces its own)."""
        model = self.subject.get("model") or ENGINE_MODEL_DEFAULT
        return {"engine": engine or self.subject.get("engine"), **self.payload, "model": model}

    def plan_document(self) -> dict[str, Any]:
        """A black-box reproducer as `specaudit.commands.blackbox.replayed_plan` takes it."""
        return {"kind": LEGACY_BLACKBOX, **self.subject, **self.payload, "outcome": self.evidence.get("outcome")}


def save(directory: Path, name: str, reproducer: Reproducer) -> Path:
    """`DIR/<name>.json`, the envelope; returns the path."""
    path = Path(directory) / f"{identifier(name)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(reproducer.to_json(), indent=1) + "\n")
    return path


def violations_evidence(violations: list[dict[str, Any]], signature: str | None = None) -> dict[str, Any]:
    """The evidence part: the first check and rule (the failure class), the diagnosis's signature
    where there is one, and the first violations (as `asdict(Violation)`)."""
    first = violations[0] if violations else {}
    evidence = {"first_check": first.get("check"), "rule": first.get("rule")}
    if signature is not None:
        evidence["signature"] = signature
    return evidence | {"violations": list(violations[:EVIDENCE_LIMIT])}


def decoder_reproducer(failure: dict[str, Any], signature: str | None = None) -> Reproducer:
    """A `failure_record` as a decoder-case reproducer, or a real-model one when its case runs on
    `external:` models (then only the target is known: the directory its label names)."""
    case, evidence = failure["case"], violations_evidence(failure["evidence"], signature)
    target = str(case.get("model", {}).get("target", ""))
    if target.startswith(EXTERNAL):
        subject = {"decoder": failure["decoder"], "target": target[len(EXTERNAL) :], "draft": None, "device": None}
        subject |= {"dtype": case["model"].get("dtype")}
        return Reproducer(REAL_MODEL_KIND, subject, {"case": case}, evidence)
    return Reproducer(CASE_KIND, {"decoder": failure["decoder"]}, {"case": case}, evidence)


def write_real_failure(directory: Path, name: str, diagnosis: Diagnosis, *, target: Path, draft: Path,
                       device: str) -> Path:  # fmt: skip
    """`DIR/<name>.json`: a real-model reproducer naming both model directories, so that
    `specaudit replay FILE` loads them again (no regression test: it needs the real models)."""
    failure = failure_record(diagnosis.case, diagnosis.decoder, diagnosis.violations)
    subject = {"decoder": diagnosis.decoder, "target": str(Path(target).resolve()), "draft": str(Path(draft).resolve()),
               "device": device, "dtype": diagnosis.case.dtype}  # fmt: skip
    evidence = violations_evidence(failure["evidence"], diagnosis.signature)
    return save(directory, name, Reproducer(REAL_MODEL_KIND, subject, {"case": failure["case"]}, evidence))


def engine_reproducer(record: dict[str, Any]) -> Reproducer:
    """An `engine_failure_record` (or the rules alone) as an engine-ops reproducer; its diagnosis,
    where it has one, goes in the evidence beside the signature, where a decoder's signature goes."""
    subject = {"engine": record.get("engine"), "model": record.get("model", ENGINE_MODEL_DEFAULT)}
    payload = {key: record[key] for key in ENGINE_PAYLOAD if key in record}
    evidence = {"first_check": record.get("first_check"), "rule": record.get("rule")}
    if record.get("signature") is not None:
        evidence["signature"] = record["signature"]
    if record.get("diagnosis") is not None:
        evidence["diagnosis"] = record["diagnosis"]
    return Reproducer(ENGINE_KIND, subject, payload, evidence | {"violations": record.get("evidence") or []})


def blackbox_reproducer(plan: dict[str, Any], outcome: dict[str, Any] | None = None) -> Reproducer:
    """A black-box plan (`Plan.to_json`, or a reproducer written before the envelope) and, after
    the run, its outcome."""
    subject = {key: plan.get(key) for key in BLACKBOX_SUBJECT}
    payload = {key: plan[key] for key in BLACKBOX_PAYLOAD if key in plan}
    return Reproducer(BLACKBOX_KIND, subject, payload, {} if outcome is None else {"outcome": outcome})


def paged_reproducer(
    kind: SubjectKind,
    subject: dict[str, Any],
    workload: dict[str, Any],
    violations: list[Violation],
    settings: dict[str, Any] | None = None,
) -> Reproducer:
    """A paged white box's failure (`kind`: its row, named in the payload): what ran (`subject`),
    its workload, the engine's `settings` where the workload does not fix them, the violations."""
    payload = {subjects.ENGINE_KEY: kind.name, "workload": workload} | (
        {} if settings is None else {"settings": settings}
    )
    return Reproducer(written(kind), subject, payload, violations_evidence([asdict(v) for v in violations]))


def vllm_paged_before(payload: dict[str, Any]) -> dict[str, Any]:
    """A `vllm-paged` payload (the workload's fields, its engine settings under `engine`) as paged-engine's."""
    workload = {key: value for key, value in payload.items() if key != subjects.ENGINE_KEY}
    settings = payload.get(subjects.ENGINE_KEY)
    return {subjects.ENGINE_KEY: subjects.VLLM_WHITE_BOX.name, "workload": workload} | (
        {"settings": settings} if settings else {}
    )


def transformers_cb_before(payload: dict[str, Any]) -> dict[str, Any]:
    """A `transformers-cb` payload (its workload) as paged-engine's."""
    return {**payload, subjects.ENGINE_KEY: subjects.TRANSFORMERS_CB.name}


PAGED_BEFORE = {subjects.VLLM_WHITE_BOX.name: vllm_paged_before, subjects.TRANSFORMERS_CB.name: transformers_cb_before}
"""How each row's payload written before (`SubjectKind.written_before`) reads as its kind's now."""


def read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot read reproducer {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read reproducer {path}: not JSON ({exc})") from None


def upgrade(data: dict[str, Any], path: Path) -> Reproducer:
    """The envelope as it is, or one of the four formats written before it, told apart as they
    were: a case file ("format": "specaudit-case"), an engine file (an "ops" key), a black-box
    file ("kind": "specaudit-blackbox"); a case on `external:` models is a real-model one."""
    if data.get("format") == ENVELOPE_FORMAT:
        return from_envelope(data, path)
    if data.get("format") == CASE_FORMAT:
        case = {key: value for key, value in data.items() if key not in ("decoder", "evidence")}
        failure = {"case": case, "decoder": data.get("decoder"), "evidence": data.get("evidence") or []}
        found = decoder_reproducer(failure)
        return Reproducer(found.kind, found.subject, found.payload, found.evidence, path, f"{CASE_FORMAT} 1")
    if "ops" in data:
        found = engine_reproducer(data)
        return Reproducer(found.kind, found.subject, found.payload, found.evidence, path, "engine ops")
    if data.get("kind") == LEGACY_BLACKBOX:
        found = blackbox_reproducer(data, data.get("outcome"))
        return Reproducer(found.kind, found.subject, found.payload, found.evidence, path, LEGACY_BLACKBOX)
    raise UsageError(
        f'{path} is not a specaudit reproducer: expected "format": "{ENVELOPE_FORMAT}" (or a case file, an engine '
        f'file with "ops", or a "kind": "{LEGACY_BLACKBOX}" file)'
    )


def from_envelope(data: dict[str, Any], path: Path) -> Reproducer:
    if data.get("version") != REPRODUCER_VERSION:
        raise UsageError(f"{path}: reproducer version {data.get('version')!r} is not supported (this is "
                         f"{REPRODUCER_VERSION})")  # fmt: skip
    kind, before = str(data.get("kind")), subjects.written_before(str(data.get("kind")))
    if subjects.by_reproducer(kind) is None and before is None:
        kinds = ", ".join(subjects.REPRODUCER_KINDS)
        raise UsageError(f"{path}: reproducer kind {data.get('kind')!r} is none of {kinds}")
    parts = {part: data.get(part, {} if part == "evidence" else None) for part in ("subject", "payload", "evidence")}
    wrong = [part for part, value in parts.items() if not isinstance(value, dict)]
    if wrong:
        raise UsageError(f"{path}: the reproducer's {' and '.join(wrong)} must be a JSON object, each")
    if before is not None:  # a kind the row wrote before: its payload upgraded, the old kind kept for messages
        payload = PAGED_BEFORE[before.name](parts["payload"])
        return Reproducer(written(before), parts["subject"], payload, parts["evidence"], path, kind)
    return Reproducer(kind, parts["subject"], parts["payload"], parts["evidence"], path)


def validate(reproducer: Reproducer) -> Reproducer:
    """The reproducer, if its payload can be run; else a UsageError saying what is wrong where: its
    kind's own check where it has one, then the keys its row says a payload holds."""
    kind = reproducer.subject_kind
    if kind.named_in_payload and reproducer.payload.get(subjects.ENGINE_KEY) != kind.name:
        rows = ", ".join(k.name for k in subjects.homes() if k.reproducer == reproducer.kind)
        raise UsageError(f"{reproducer.where}: a {reproducer.kind} reproducer's payload names its engine, one of "
                         f"{rows}; it names {reproducer.payload.get(subjects.ENGINE_KEY)!r}")  # fmt: skip
    if kind.name in PAYLOAD_CHECKS:
        PAYLOAD_CHECKS[kind.name](reproducer)
    missing = [key for key in kind.payload if key not in reproducer.payload]
    if missing:
        raise UsageError(f"{reproducer.where}: {kind.noun} (kind {reproducer.kind}) lacks {', '.join(missing)}")
    return reproducer


def check_case(reproducer: Reproducer) -> None:
    reproducer.case  # noqa: B018 (parsed for its errors)


def check_engine_ops(reproducer: Reproducer) -> None:
    check_engine_rules(reproducer.engine_rules(), reproducer.where)


def check_blackbox(reproducer: Reproducer) -> None:
    if not isinstance(reproducer.payload.get("requests"), list):
        raise UsageError(f"{reproducer.where}: black-box reproducer has no list of requests")


def check_vllm_paged(reproducer: Reproducer) -> None:
    workload = reproducer.payload.get("workload")
    has = {**(workload if isinstance(workload, dict) else {}), **reproducer.subject}
    missing = [key for key in (*VLLM_WORKLOAD, "model") if key not in has]
    if missing:
        raise UsageError(f"{reproducer.where}: vLLM white-box reproducer lacks {', '.join(missing)}")


def check_transformers_cb(reproducer: Reproducer) -> None:
    if not isinstance((reproducer.payload.get("workload") or {}).get("requests"), list):
        raise UsageError(f"{reproducer.where}: transformers-cb reproducer has no workload with requests")


def check_sampling_case(reproducer: Reproducer) -> None:
    reproducer.sampling_case  # noqa: B018 (parsed for its errors)


def check_openvino(reproducer: Reproducer) -> None:
    if not isinstance((reproducer.payload.get("workload") or {}).get("prompts"), list):
        raise UsageError(f"{reproducer.where}: OpenVINO reproducer has no workload with prompts")


PAYLOAD_CHECKS = {
    subjects.DECODER.name: check_case,
    subjects.REAL_MODEL.name: check_case,
    subjects.ENGINE.name: check_engine_ops,
    subjects.BLACK_BOX.name: check_blackbox,
    subjects.VLLM_WHITE_BOX.name: check_vllm_paged,
    subjects.TRANSFORMERS_CB.name: check_transformers_cb,
    subjects.SAMPLING_DECODER.name: check_sampling_case,
    subjects.OPENVINO.name: check_openvino,
}
"""What a payload needs beyond its row's keys (`contracts.subjects.SubjectKind.payload`), per
subject kind whose payload is parsed or typed; UsageError naming the file otherwise."""


def check_engine_rules(rules: dict[str, Any], where: str) -> None:
    """Every field the engine state machine needs, and every rule one it knows."""
    missing = [key for key in ENGINE_KEYS if key not in rules or (key == "engine" and rules[key] is None)]
    if missing:
        raise UsageError(f"{where}: engine reproducer lacks {', '.join(missing)}")
    if not isinstance(rules["ops"], list):
        raise UsageError(f"{where}: 'ops' must be a list of rules")
    if rules["model"] not in MODELS:
        raise UsageError(f"{where}: model {rules['model']!r} is not a built-in model ({', '.join(MODELS)})")
    for i, op in enumerate(rules["ops"]):
        kind = op.get("op") if isinstance(op, dict) else None
        if kind not in ENGINE_OPS:
            raise UsageError(f"{where}: rule {i} is {op!r}; rules are {', '.join(ENGINE_OPS)}")
        lacking = [key for key in ENGINE_OPS[kind] if key not in op]
        if lacking:
            raise UsageError(f"{where}: rule {i} ({kind}) lacks {', '.join(lacking)}")


def load_reproducer(path: Path, *, check: bool = True) -> Reproducer:
    """Any reproducer file, the envelope or a legacy one upgraded; with `check`, its payload
    checked too (`validate`). Every problem is a UsageError that names the file."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise UsageError(f"{path} is not a specaudit reproducer: a JSON object is expected, not {type(data).__name__}")
    reproducer = upgrade(data, Path(path))
    return validate(reproducer) if check else reproducer


def load_case(path: Path) -> Case:
    """The case of a decoder-case reproducer (or a plain case file) on the built-in models."""
    reproducer = load_reproducer(path)
    if reproducer.kind not in (CASE_KIND, REAL_MODEL_KIND):
        raise UsageError(f"{path} is {reproducer.subject_kind.noun} (kind {reproducer.kind}), not a case file")
    case = reproducer.case
    try:
        check_model(case.model, case.draft, case.dtype)
    except ValueError as exc:
        raise UsageError(f"{path}: {exc}") from None
    return case


def is_engine_reproducer(path: Path) -> bool:
    """Whether `path` reads as an engine-ops reproducer (an unreadable file is left to the case
    loader's own message)."""
    try:
        return load_reproducer(path, check=False).kind == ENGINE_KIND
    except UsageError:
        return False


def load_engine_reproducer(path: Path, engine: str | None = None) -> dict[str, Any]:
    """An engine-ops reproducer's rules, checked field by field; `engine` replaces the engine it names."""
    reproducer = load_reproducer(path, check=False)
    if reproducer.kind != ENGINE_KIND:
        raise UsageError(f"{path} is {reproducer.subject_kind.noun} (kind {reproducer.kind}), not an engine reproducer")
    rules = reproducer.engine_rules()
    check_engine_rules(rules, str(path))
    return dict(rules, engine=engine or rules["engine"])


__getattr__ = _forward(__name__)  # the names that left for audits.regression, commands.replay, commands.pytest_notes
