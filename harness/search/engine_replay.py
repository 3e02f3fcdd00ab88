"""Engine rule sequences run again: a session judged by `EngineJudge`, a reproducer replayed,
and a failure's diagnosis, whose signature for a wrong token replays the request alone (the
engine analogue of `Run.again`, made here so that checks run no model)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from specaudit.checks.diagnosis import Finding
from specaudit.checks.engine import EngineFailure, EngineJudge
from specaudit.checks.registry import alone_signature, check_named
from specaudit.contracts.case import ENVELOPE_FORMAT
from specaudit.contracts.violation import Violation
from specaudit.running.engine_session import EngineSession, Request


def engine_session(
    spec: str,
    num_draft_tokens: int,
    eos_token_id: int | None,
    pad_token_id: int,
    model: str = "transparent",
    **options: Any,
) -> EngineSession:
    """A session judged by `EngineJudge`, whose failures `diagnose_engine` diagnoses (the state
    machine's and replay's)."""
    judge = functools.partial(EngineJudge, diagnose=diagnose_engine)
    return EngineSession(spec, num_draft_tokens, eos_token_id, pad_token_id, model, judge=judge, **options)


def engine_signature(first: Violation, reproducer: dict[str, Any]) -> tuple[str, str]:
    """The registry's signature of an engine's first violation. Every check but equivalence maps
    from the violation's fields; a wrong token is judged as a decoder's is (`alone_signature`):
    the request re-run alone on the same engine, an invariant broken there names it, a wrong
    token there is a bonus error, none is bookkeeping."""
    if first.check != "equivalence":
        return check_named(first.check).signature(first, None)
    add = next((op for op in reproducer["ops"] if op["op"] == "add" and op["id"] == first.request), None)
    alone = [] if add is None else replay(dict(reproducer, ops=[add, {"op": "drain"}]))
    seen = alone[0] if alone else None
    return alone_signature(first.request or 0, seen, seen is not None and seen.check == "equivalence")


def diagnose_engine(violations: list[Violation], reproducer: dict[str, Any]) -> Finding:
    """The diagnosis of an engine failure from its violations and the rules that gave them."""
    first = violations[0]
    return Finding(first, *engine_signature(first, reproducer), step=first.evidence.get("step"))


def replay(reproducer: dict[str, Any] | str | Path) -> list[Violation]:
    """Run a logged rule sequence again; returns the violations of the first failing rule ([] if none)."""
    if isinstance(reproducer, (str, Path)):
        text = Path(reproducer).read_text() if Path(str(reproducer)).exists() else str(reproducer)
        reproducer = json.loads(text)
    if reproducer.get("format") == ENVELOPE_FORMAT:  # a reproducer file: the rules are its subject and payload
        reproducer = {**reproducer["subject"], **reproducer["payload"]}
    session = engine_session(
        reproducer["engine"],
        int(reproducer["num_draft_tokens"]),
        reproducer["eos_token_id"],
        int(reproducer["pad_token_id"]),
        str(reproducer.get("model", "transparent")),  # written before engines ran on tiny real models
    )
    try:
        for op in reproducer["ops"]:
            if op["op"] == "add":
                accept = tuple(c == "1" for c in op["accept"])
                session.add(Request(int(op["id"]), tuple(op["prompt"]), int(op["max_new_tokens"]), accept))
            elif op["op"] == "abort":
                session.abort(int(op["id"]))
            elif op["op"] == "step":
                session.step()
            elif op["op"] == "drain":
                session.ops.append(op)
                session.drain()
    except EngineFailure as failure:
        return failure.violations
    finally:
        session.close()
    return []
