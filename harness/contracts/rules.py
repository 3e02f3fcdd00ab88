"""Every rule each check can emit, by name: what a known-failures file may list.

Torch-free, because `specaudit.config.xfails` validates a file against it before anything heavy is
imported (the checks themselves import torch), and in the foundation layer, which cannot import
the registry. So the rules are written once, in each registry entry (`Check(..., rules=...)` in
`checks/registry.py`), and read here from that file's source: a set literal, or one of this
module's tables (the contract's rules, which the contract modules list, and the paged layout's,
in the order `checks.paged` judges them). The registry refuses to import while what is read here
differs from its entries (`checks.registry.validate`), and tests/contracts/test_rules.py fails when
a check emits a rule its entry does not list (it reads the rule literals of the check modules).
"""

from __future__ import annotations

import ast
from pathlib import Path

CONTRACT_RULES = frozenset(
    {
        # specaudit.contracts.decoder.RULES: the decoder contract
        "generate-returns",
        "returns-lists",
        "one-list-per-row",
        "max-new-tokens",
        "ends-at-eos",
        "inputs-unchanged",
        "models-unchanged",
        "unobserved-forward",
        "unsupported-input",
        # specaudit.contracts.engine.ENGINE_RULES: the engine contract
        "engine-builds",
        "add-request-returns",
        "step-returns",
        "step-result",
        "known-request",
        "aborted-silent",
        "finished-silent",
        "has-unfinished",
        "abort-returns",
        # specaudit.adapters.engine_blackbox.RULES: the black-box output contract
        "responds",
        "http-status",
        "json-response",
        "token-ids",
        "token-count",
        # specaudit.checks.stops: a stop string in the output (text and token ids)
        "stop-string",
        # specaudit.checks.stops: a usage count (generated tokens) against the outputs, every engine
        "usage-count",
    }
)

PAGED_RULES = (
    "query-spans",
    "live-request",
    "context-length",
    "query-positions",
    "query-tokens",
    "draft-count",
    "slot-mapping",
    "block-shared",
    "kv-provenance",
    "kv-overwritten",
    "greedy-commit",
    "kv-entry",
)
"""The paged layout's rules, in the order `specaudit.checks.paged` judges them."""

REGISTRY = Path(__file__).parent.parent / "checks" / "registry.py"


def rules_of(node: ast.expr) -> frozenset[str]:
    """An entry's `rules=`: a set literal, `frozenset(...)` of one, or a table of this module."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "frozenset":
        return rules_of(node.args[0])
    if isinstance(node, ast.Name) and node.id in ("CONTRACT_RULES", "PAGED_RULES"):
        return frozenset(globals()[node.id])
    try:
        return frozenset(ast.literal_eval(node))
    except ValueError:
        raise ValueError(
            f"checks/registry.py:{node.lineno}: write a check's rules= as a set literal, frozenset of one, "
            f"CONTRACT_RULES or PAGED_RULES (got {ast.unparse(node)}), so they are read without importing torch"
        ) from None


def registry_rules(source: str) -> dict[str, frozenset[str]]:
    """Check name -> its rules, from every `Check("name", ..., rules=...)` call, in source order."""
    entries = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Check":
            rules = next((k.value for k in node.keywords if k.arg == "rules"), None)
            if node.args and isinstance(node.args[0], ast.Constant) and rules is not None:
                entries.append((node.lineno, node.args[0].value, rules_of(rules)))
    return {name: rules for _, name, rules in sorted(entries)}


CHECK_RULES = registry_rules(REGISTRY.read_text(encoding="utf-8"))
"""Check name (in the registry's order) -> the rule names its violations carry."""

CHECK_NAMES = tuple(CHECK_RULES)
