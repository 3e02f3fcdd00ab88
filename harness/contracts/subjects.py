"""The one table of subject kinds: every kind of subject specaudit judges, one name each.

A subject kind is what an audit runs and a user replays: a decoder on the built-in models, a
real-model batch, an engine through the state machine, a black box, vLLM's black box and white
box, transformers' continuous batching, a sampling decoder, OpenVINO GenAI. Each row says, under
its one `name` (the vocabulary code uses: the plan's `Item.kind`, replay's dispatch):

- `evidence`: the registry subject it is judged as (`checks.registry.SUBJECTS`, the evidence
  type a check reads; several kinds share one: vLLM's white box and transformers-cb are both
  "paged engine");
- `reproducer`: the `"kind"` its reproducer envelope is written with (None: it writes none);
- `report`: the `"kind"` of its report.json entries (None: it writes none);
- `replay`: the options of `specaudit replay` its reproducers take (`commands.replay.ReplayOptions`);
- `noun`: how a message names one of its reproducers ("a decoder case");
- `payload`: the keys its reproducer's payload must hold (`artifacts.reproducer.validate`; a kind
  whose payload needs parsing adds a check of its own there);
- `replayer`: `module:function` that runs one of its reproducers again, `(Reproducer,
  ReplayOptions) -> outcome` (imported by `commands.replay` when a file of its kind is replayed,
  so this table names an adapter's function without importing it);
- `driver`: `module:attribute` of its `audits.subject.SubjectDriver` when `specaudit audit` and
  the gate run it (None: another command does); `audits.plan.SUBJECTS` is these, in table order;
- `written_before`: the reproducer kinds its files were written with before they took `reproducer`
  (upgraded on load, `artifacts.reproducer.upgrade`).

The written strings (`reproducer`, `report`, `written_before`) are the ones files were written
with, kept so that every reproducer and report.json written before still loads; only this table
spells them. Two kinds may write one string: a string read back resolves to the first row that
writes it, its home (`by_reproducer`, `by_report`; vLLM's black box writes the black box's
reproducers), unless the rows' payloads hold `engine`, the name of the row that wrote it: the two
paged white boxes (vLLM's, transformers-cb's) write one kind, `paged-engine`, and each replays
through its own row.
Standard library only: the formats, the registry, the plan and replay all import it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

EVIDENCE_DECODER = "decoder"  # a decoder's run (`running.runner.Run`)
EVIDENCE_ENGINE = "engine"  # a white-box engine session after every step (`checks.engine_step.EngineStep`)
EVIDENCE_BLACK_BOX = "black box"  # answers at the output level (`checks.outputs.OutputEvidence`)
EVIDENCE_PAGED = "paged engine"  # a paged engine's forwards and outputs (`running.paged.PagedRun`)
EVIDENCE_SAMPLER = "sampling decoder"  # a sampling decoder's seeded runs (`running.sampling.SampledRun`)
EVIDENCE = (EVIDENCE_DECODER, EVIDENCE_ENGINE, EVIDENCE_BLACK_BOX, EVIDENCE_PAGED, EVIDENCE_SAMPLER)
"""The registry's subjects: the evidence a check's implementation reads (`checks.registry.SUBJECTS`)."""

REPLAY_OPTIONS = ("decoder", "engine", "server", "target", "draft", "device")
"""What `specaudit replay` may put in place of a reproducer's own subject (`--decoder`, ...)."""
ENGINE_KEY = "engine"
"""The payload key naming the row that wrote a reproducer of a kind several rows write."""
PAGED_PAYLOAD = (ENGINE_KEY, "workload")
"""A paged white box's reproducer payload: its row's name and its workload (and engine `settings`)."""


@dataclass(frozen=True)
class SubjectKind:
    """One kind of subject (see the module docstring for each field)."""

    name: str
    evidence: str
    reproducer: str | None
    report: str | None
    replay: tuple[str, ...]
    noun: str
    payload: tuple[str, ...] = ()
    replayer: str | None = None
    driver: str | None = None
    written_before: tuple[str, ...] = ()

    @property
    def named_in_payload(self) -> bool:
        """Whether its reproducers name their row (`engine`), so rows sharing the kind are told apart."""
        return ENGINE_KEY in self.payload


REPLAY = "specaudit.commands.replay:"
"""The replayers of the kinds that `commands.replay` runs itself."""
AUDITS = "specaudit.audits."

DECODER = SubjectKind(
    "decoder", EVIDENCE_DECODER, "decoder-case", "decoder", ("decoder",), "a decoder case",
    payload=("case",), replayer=REPLAY + "replay_decoder_case", driver=AUDITS + "plan:DECODERS",
)  # fmt: skip
REAL_MODEL = SubjectKind(
    "real-model", EVIDENCE_DECODER, "real-model", "real-model batch", ("decoder", "target", "draft", "device"),
    "a real-model case", payload=("case",), replayer=REPLAY + "replay_real_model",
)  # fmt: skip
ENGINE = SubjectKind(
    "engine", EVIDENCE_ENGINE, "engine-ops", "engine", ("engine",), "an engine reproducer",
    payload=("ops",), replayer=REPLAY + "replay_engine_ops", driver=AUDITS + "plan:ENGINES",
)  # fmt: skip
BLACK_BOX = SubjectKind(
    "black-box", EVIDENCE_BLACK_BOX, "blackbox", "blackbox", ("engine", "server", "target"), "a black-box reproducer",
    payload=("requests",), replayer=REPLAY + "replay_blackbox",
)  # fmt: skip
VLLM_BLACK_BOX = SubjectKind(
    "vllm-black-box", EVIDENCE_BLACK_BOX, BLACK_BOX.reproducer, "vllm configuration", BLACK_BOX.replay,
    BLACK_BOX.noun, payload=BLACK_BOX.payload, replayer=BLACK_BOX.replayer,
)  # fmt: skip
VLLM_WHITE_BOX = SubjectKind(
    "vllm-white-box", EVIDENCE_PAGED, "paged-engine", "vllm white box", ("target", "draft"),
    "a vLLM white-box reproducer", payload=PAGED_PAYLOAD, replayer=REPLAY + "replay_vllm_paged",
    written_before=("vllm-paged",),
)  # fmt: skip
TRANSFORMERS_CB = SubjectKind(
    "transformers-cb", EVIDENCE_PAGED, "paged-engine", "paged engine", (),
    "a transformers continuous-batching reproducer", payload=PAGED_PAYLOAD,
    replayer=REPLAY + "replay_transformers_cb", driver=AUDITS + "transformers_cb:TRANSFORMERS_CB",
    written_before=("transformers-cb",),
)  # fmt: skip
SAMPLING_DECODER = SubjectKind(
    "sampling-decoder", EVIDENCE_SAMPLER, "sampling-case", "sampling decoder", ("decoder",),
    "a sampling decoder's case", payload=("case",), replayer=REPLAY + "replay_sampling_case",
    driver=AUDITS + "sampling:SAMPLING",
)  # fmt: skip
OPENVINO = SubjectKind(
    "openvino", EVIDENCE_BLACK_BOX, "openvino", None, (), "an OpenVINO GenAI reproducer",
    payload=("workload",), replayer="specaudit.adapters.openvino.audit:replay_reproducer",
)  # fmt: skip

KINDS: tuple[SubjectKind, ...] = (
    DECODER,
    REAL_MODEL,
    ENGINE,
    BLACK_BOX,
    VLLM_BLACK_BOX,
    VLLM_WHITE_BOX,
    TRANSFORMERS_CB,
    SAMPLING_DECODER,
    OPENVINO,
)
"""Every subject kind. A new kind is one row here: its reproducers load, validate and replay
through it (tests/contracts/test_subjects.py holds every reader to it)."""


def distinct(values: list[str | None]) -> tuple[str, ...]:
    """The values that are set, each once, in table order."""
    return tuple(dict.fromkeys(value for value in values if value is not None))


REPRODUCER_KINDS = distinct([kind.reproducer for kind in KINDS])
"""Every reproducer envelope's `"kind"`, in table order."""
REPORT_KINDS = distinct([kind.report for kind in KINDS])
"""Every report.json entry's `"kind"`, in table order."""
NAMES = tuple(kind.name for kind in KINDS)


def resolve(path: str) -> Any:
    """The object a row's `module:attribute` path names (`replayer`, `driver`), imported now: the
    table names an adapter's function without importing it."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def named(name: str) -> SubjectKind:
    """The row of `name` (the one vocabulary); ValueError naming every kind otherwise."""
    for kind in KINDS:
        if kind.name == name:
            return kind
    raise ValueError(f"{name!r} is no subject kind; the kinds are {', '.join(NAMES)} (contracts.subjects.KINDS)")


def by_reproducer(written: str, engine: Any = None) -> SubjectKind | None:
    """The row of a reproducer envelope's `"kind"`: the one its payload's `engine` names where the
    rows writing it are told apart so, else its home (None: no row writes it)."""
    writers = [kind for kind in KINDS if kind.reproducer == written]
    chosen = [kind for kind in writers if kind.named_in_payload and kind.name == engine]
    return (chosen or writers or [None])[0]


def written_before(written: str) -> SubjectKind | None:
    """The row whose files were written with this kind before they took the row's `reproducer`."""
    return next((kind for kind in KINDS if written in kind.written_before), None)


def by_report(written: str) -> SubjectKind | None:
    """The home row of a report entry's `"kind"` (None: no row writes it)."""
    return next((kind for kind in KINDS if kind.report == written), None)


def homes() -> tuple[SubjectKind, ...]:
    """The rows a reproducer resolves to (a kind's home, or a row its payload names): the ones replay
    dispatches on."""
    return tuple(
        kind for kind in KINDS if kind.reproducer is not None and by_reproducer(kind.reproducer, kind.name) is kind
    )


def check(kinds: tuple[SubjectKind, ...]) -> list[str]:
    """What is wrong with a table: each problem a line ([]: none)."""
    names = [kind.name for kind in kinds]
    twice = [f"{name!r} names two rows" for name in sorted({n for n in names if names.count(n) > 1})]
    return twice + [problem for kind in kinds for problem in row_problems(kind, kinds)]


def row_problems(kind: SubjectKind, kinds: tuple[SubjectKind, ...]) -> list[str]:
    """What is wrong with one row of `kinds`."""
    problems = []
    if kind.evidence not in EVIDENCE:
        problems.append(f"{kind.name}: evidence {kind.evidence!r} is none of {', '.join(EVIDENCE)}")
    if not set(kind.replay) <= set(REPLAY_OPTIONS):
        problems.append(f"{kind.name}: replay options {kind.replay} beyond {', '.join(REPLAY_OPTIONS)}")
    if kind.reproducer is None and kind.report is None:
        problems.append(f"{kind.name}: writes neither a reproducer nor a report entry")
    if kind.reproducer is not None and (kind.replayer or "").count(":") != 1:
        problems.append(f"{kind.name}: writes reproducers; its replayer {kind.replayer!r} is no module:function")
    if kind.driver is not None and kind.driver.count(":") != 1:
        problems.append(f"{kind.name}: its driver {kind.driver!r} is no module:attribute")
    home = next((k for k in kinds if kind.reproducer is not None and k.reproducer == kind.reproducer), kind)
    told_apart = home.named_in_payload and kind.named_in_payload
    if home.payload != kind.payload or (
        not told_apart and (home.replay, home.replayer) != (kind.replay, kind.replayer)
    ):
        problems.append(f"{kind.name}: writes {home.name}'s reproducers ({kind.reproducer}), but reads them "
                        "with other replay options, payload or replayer, and its payload names no row")  # fmt: skip
    taken = {k.reproducer for k in kinds} | {s for k in kinds if k is not kind for s in k.written_before}
    problems += [
        f"{kind.name}: {s!r}, written before, is another row's kind too" for s in kind.written_before if s in taken
    ]
    return problems


PROBLEMS = check(KINDS)
if PROBLEMS:  # a broken table is an import error, never a KeyError during a run
    raise ValueError("contracts.subjects.KINDS: " + "; ".join(PROBLEMS))
