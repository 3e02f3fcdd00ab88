"""An engine rule sequence: the engine state machine's rules as plain data, and their JSON form.

What a decoder's `Case` is to a decoder run, `EngineRules` is to an engine session: the engine,
the built-in model, K, EOS and pad, and the rules applied in order (`Op`: add a request, step,
abort, drain). The machine logs one (`specaudit.running.engine_session`), ddmin shrinks one and
replay runs one again (`specaudit.search`), an `EngineFailure` carries one.

The JSON form is the one engine reproducers have always held (`to_json`):

    {"engine": "module:attr", "num_draft_tokens": K, "eos_token_id": EOS | null,
     "pad_token_id": PAD, "model": "transparent",
     "ops": [{"op": "add", "id": 0, "prompt": [5, 6], "max_new_tokens": 3, "accept": "0100"},
             {"op": "step"}, {"op": "abort", "id": 0}, {"op": "drain"}]}

`from_json` also reads every older form: a file without "model" (written before engines ran on
tiny real models: the transparent one), an `engine_failure_record` (its evidence, signature and
diagnosis keys ignored), and the reproducer envelope of kind "engine-ops" (rules split into its
subject and payload).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from specaudit.contracts.case import ENVELOPE_FORMAT, parse_pattern, pattern_text
from specaudit.contracts.errors import UsageError
from specaudit.contracts.subjects import ENGINE

DEFAULT_MODEL = "transparent"
"""The model of rules that name none (written before engines ran on tiny real models)."""
ENGINE_KIND = ENGINE.reproducer
"""The reproducer envelope's kind for an engine rule sequence."""


class RulesFormatError(UsageError, ValueError):
    """Data that cannot be read as an engine rule sequence; the message says what is wrong where."""


@dataclass(frozen=True)
class AddRequest:
    """Add request `request_id`: its prompt, its limit, and per generated index whether the
    scripted draft proposes the oracle's token (`accept`, written "0110" in JSON)."""

    request_id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    accept: tuple[bool, ...]
    name: ClassVar[str] = "add"

    def __post_init__(self) -> None:
        # "0110" strings and lists are read so that `eval(repr(op)) == op`; stored as tuples.
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        object.__setattr__(self, "accept", parse_pattern(self.accept))
        if not self.prompt:
            raise ValueError(f"request {self.request_id}: a prompt needs at least one token")

    def to_json(self) -> dict[str, Any]:
        return {
            "op": self.name,
            "id": self.request_id,
            "prompt": list(self.prompt),
            "max_new_tokens": self.max_new_tokens,
            "accept": pattern_text(self.accept),
        }

    def __repr__(self) -> str:
        return (
            f"AddRequest({self.request_id}, prompt={self.prompt!r}, max_new_tokens={self.max_new_tokens}, "
            f"accept={pattern_text(self.accept)!r})"
        )


@dataclass(frozen=True)
class Step:
    """One engine step(), judged."""

    name: ClassVar[str] = "step"

    def to_json(self) -> dict[str, Any]:
        return {"op": self.name}


@dataclass(frozen=True)
class Abort:
    """abort(request_id): a live, finished or unknown request (the last two must change nothing)."""

    request_id: int
    name: ClassVar[str] = "abort"

    def to_json(self) -> dict[str, Any]:
        return {"op": self.name, "id": self.request_id}

    def __repr__(self) -> str:
        return f"Abort({self.request_id})"


@dataclass(frozen=True)
class Drain:
    """Step until the engine has nothing left; a request still unfinished breaks liveness."""

    name: ClassVar[str] = "drain"

    def to_json(self) -> dict[str, Any]:
        return {"op": self.name}


Op = AddRequest | Step | Abort | Drain
"""One rule of an engine rule sequence."""

OP_FIELDS: dict[str, tuple[str, ...]] = {"add": ("id", "prompt", "max_new_tokens", "accept"), "step": (),
                                         "abort": ("id",), "drain": ()}  # fmt: skip
"""Each rule's JSON name and the fields it needs."""


def op_from_json(data: Any, index: int = 0) -> Op:
    """One rule from its JSON form; a RulesFormatError names the rule's index and what is wrong."""
    kind = data.get("op") if isinstance(data, dict) else None
    if kind not in OP_FIELDS:
        raise RulesFormatError(f"rule {index} is {data!r}; rules are {', '.join(OP_FIELDS)}")
    lacking = [key for key in OP_FIELDS[kind] if key not in data]
    if lacking:
        raise RulesFormatError(f"rule {index} ({kind}) lacks {', '.join(lacking)}")
    try:
        if kind == "add":
            return AddRequest(int(data["id"]), tuple(data["prompt"]), int(data["max_new_tokens"]), data["accept"])
        if kind == "abort":
            return Abort(int(data["id"]))
    except (TypeError, ValueError) as exc:
        raise RulesFormatError(f"rule {index} ({kind}) has a malformed field: {exc}") from None
    return Step() if kind == "step" else Drain()


RULES_KEYS = ("engine", "num_draft_tokens", "eos_token_id", "pad_token_id", "ops")
"""The fields every engine rule sequence's JSON form has ("model" may be missing: `DEFAULT_MODEL`)."""


@dataclass(frozen=True)
class EngineRules:
    """One engine session as data: the engine and model it runs on, K, EOS and pad, and its rules.

    Its repr is evaluable with the op classes in scope (pin a found sequence in a test); its
    JSON form is `to_json`.
    """

    engine: str
    num_draft_tokens: int
    eos_token_id: int | None
    pad_token_id: int
    ops: tuple[Op, ...] = ()
    model: str = DEFAULT_MODEL
    kind: ClassVar[str] = ENGINE_KIND

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        bad = [op for op in self.ops if not isinstance(op, (AddRequest, Step, Abort, Drain))]
        if bad:
            raise TypeError(f"ops must be AddRequest, Step, Abort or Drain, not {type(bad[0]).__name__}")

    def with_ops(self, ops: Sequence[Op]) -> EngineRules:
        """The same engine, model and settings with other rules (a ddmin candidate, a request alone)."""
        return EngineRules(self.engine, self.num_draft_tokens, self.eos_token_id, self.pad_token_id, tuple(ops),
                           self.model)  # fmt: skip

    def with_engine(self, engine: str) -> EngineRules:
        """The same rules against another engine (`specaudit replay FILE --engine X`)."""
        return EngineRules(engine, self.num_draft_tokens, self.eos_token_id, self.pad_token_id, self.ops, self.model)

    def added(self, request_id: int | None) -> AddRequest | None:
        """The rule that added `request_id` (None: no such rule)."""
        return next((op for op in self.ops if isinstance(op, AddRequest) and op.request_id == request_id), None)

    def to_json(self) -> dict[str, Any]:
        """The form engine reproducers hold (`specaudit.artifacts.reproducer` splits it into the
        envelope's subject and payload)."""
        return {
            "engine": self.engine,
            "num_draft_tokens": self.num_draft_tokens,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "model": self.model,
            "ops": [op.to_json() for op in self.ops],
        }

    @classmethod
    def from_json(cls, data: Any, engine: str | None = None) -> EngineRules:
        """Rules from any form engine rules were written in (the module's docstring), or rules
        as they are; `engine` replaces the engine they name."""
        if isinstance(data, EngineRules):
            return data if engine is None else data.with_engine(engine)
        if not isinstance(data, Mapping):
            raise RulesFormatError(f"engine rules are a JSON object, not {type(data).__name__}")
        flat = unwrap(data)
        if engine is not None:
            flat = {**flat, "engine": engine}
        missing = [key for key in RULES_KEYS if key not in flat or (key != "eos_token_id" and flat[key] is None)]
        if missing:
            raise RulesFormatError(f"engine rules lack {', '.join(missing)}")
        if not isinstance(flat["ops"], list | tuple):
            raise RulesFormatError(f"'ops' must be a list of rules, not {type(flat['ops']).__name__}")
        try:
            eos = flat["eos_token_id"]
            return cls(
                str(flat["engine"]),
                int(flat["num_draft_tokens"]),
                None if eos is None else int(eos),
                int(flat["pad_token_id"]),
                tuple(op if isinstance(op, Op) else op_from_json(op, i) for i, op in enumerate(flat["ops"])),
                str(flat.get("model") or DEFAULT_MODEL),
            )
        except RulesFormatError:
            raise
        except (TypeError, ValueError) as exc:
            raise RulesFormatError(f"engine rules have a malformed field: {exc}") from None

    def __repr__(self) -> str:
        ops = "".join(f"\n    {op!r}," for op in self.ops)
        return (
            f"EngineRules(engine={self.engine!r}, model={self.model!r}, num_draft_tokens={self.num_draft_tokens}, "
            f"eos_token_id={self.eos_token_id}, pad_token_id={self.pad_token_id}, ops=({ops}\n))"
        )


def unwrap(data: Mapping[str, Any]) -> dict[str, Any]:
    """The flat form of engine rules held in the reproducer envelope (its subject and payload);
    other forms as they are."""
    if data.get("format") != ENVELOPE_FORMAT:
        return dict(data)
    if data.get("kind") != ENGINE_KIND:
        raise RulesFormatError(f"a reproducer of kind {data.get('kind')!r}, not {ENGINE_KIND!r}")
    subject, payload = data.get("subject"), data.get("payload")
    if not isinstance(subject, dict) or not isinstance(payload, dict):
        raise RulesFormatError("an engine reproducer's subject and payload must be JSON objects")
    return {**payload, "engine": subject.get("engine"), "model": subject.get("model")}


def as_rules(rules: EngineRules | Mapping[str, Any]) -> EngineRules:
    """Rules as they are, or read from any dict form (the boundary with callers that still pass dicts)."""
    return EngineRules.from_json(rules)


__all__ = [
    "ENGINE_KIND",
    "Abort",
    "AddRequest",
    "Drain",
    "EngineRules",
    "Op",
    "RulesFormatError",
    "Step",
    "as_rules",
    "op_from_json",
]
