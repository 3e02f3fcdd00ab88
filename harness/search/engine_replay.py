"""Engine rule sequences run again: a session judged by `EngineJudge`, `EngineRules` replayed
(`replay_rules`), and a failure's diagnosis, whose signature for a wrong token replays the request
alone (the engine analogue of `Run.again`, made here so that checks run no model).

Dicts in any form engine rules were written in are read on entry (`EngineRules.from_json`): the
regression tests specaudit wrote call `replay(dict)`, and so may callers not yet moved over.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specaudit.checks.diagnosis import Finding
from specaudit.checks.engine import EngineFailure, EngineJudge
from specaudit.checks.registry import alone_signature, check_named
from specaudit.contracts.engine_rules import Drain, EngineRules, as_rules
from specaudit.contracts.violation import Violation
from specaudit.running.engine_session import EngineSession


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


RulesLike = EngineRules | Mapping[str, Any]
"""Rules, or a dict in any form they were written in (read on entry with `EngineRules.from_json`)."""


def engine_signature(first: Violation, rules: RulesLike) -> tuple[str, str]:
    """The registry's signature of an engine's first violation. Every check but equivalence maps
    from the violation's fields; a wrong token is judged as a decoder's is (`alone_signature`):
    the request re-run alone on the same engine, an invariant broken there names it, a wrong
    token there is a bonus error, none is bookkeeping."""
    if first.check != "equivalence":
        return check_named(first.check).signature(first, None)
    rules = as_rules(rules)
    add = rules.added(first.request)
    alone = [] if add is None else replay_rules(rules.with_ops([add, Drain()]))
    seen = alone[0] if alone else None
    return alone_signature(first.request or 0, seen, seen is not None and seen.check == "equivalence")


def diagnose_engine(violations: list[Violation], rules: RulesLike) -> Finding:
    """The diagnosis of an engine failure from its violations and the rules that gave them."""
    first = violations[0]
    return Finding(first, *engine_signature(first, rules), step=first.evidence.get("step"))


def read_rules(rules: RulesLike | str | Path) -> EngineRules:
    """Rules as they are, or read from a dict, a JSON text or a file holding either (any form
    `EngineRules.from_json` reads, the reproducer envelope included)."""
    if isinstance(rules, str) and rules.lstrip().startswith("{"):  # JSON text, never a file name
        rules = json.loads(rules)
    elif isinstance(rules, (str, Path)):
        rules = json.loads(Path(rules).read_text())
    return EngineRules.from_json(rules)


def replay_rules(rules: RulesLike | str | Path) -> list[Violation]:
    """Run an engine rule sequence again; returns the violations of the first failing rule ([] if none)."""
    rules = read_rules(rules)
    session = engine_session(rules.engine, rules.num_draft_tokens, rules.eos_token_id, rules.pad_token_id, rules.model)
    try:
        for op in rules.ops:
            session.apply(op)
    except EngineFailure as failure:
        return failure.violations
    finally:
        session.close()
    return []


replay = replay_rules
"""The public name (`specaudit.replay_engine`) and the one every engine regression test specaudit
wrote imports; `replay_rules` says which replay this is (`specaudit.commands.replay.replay` runs
any reproducer)."""
