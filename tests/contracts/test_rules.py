"""`specaudit.contracts.rules`, the torch-free table a known-failures file is validated against, names every
rule a check can emit: a rule missing there would make a correct entry a usage error.

The rules come from two places: the contract rule tables (`RULES` dicts) and the string literals
the check modules pass where a violation is made (`Violation(check, rule, ...)`, `Fault(rule)`,
`ContractError(rule)`, a local `bad(rule, ...)` helper, `rule = "a" if ... else "b"`). The scan
reads the source, so it is instant and needs no planted bug to fire.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import specaudit
from specaudit.adapters.engine_blackbox import RULES as BLACKBOX_RULES
from specaudit.checks.registry import CHECK_ORDER
from specaudit.contracts.decoder import RULES as CONTRACT_RULES
from specaudit.contracts.engine import ENGINE_RULES
from specaudit.contracts.rules import CHECK_NAMES, CHECK_RULES, registry_rules

HARNESS = Path(specaudit.__file__).parent
EMITTERS = {"Fault": "I2", "ContractError": "contract", "engine_error": "contract", "contract_violation": "contract"}
"""Callables whose first argument is a rule of a fixed check."""
LOCAL_EMITTERS = {
    ("checks/i1.py", "bad"): "I1",
    ("checks/rows.py", "slot_fault"): "I2",
    ("checks/engine.py", "fault_at"): "I2",
    ("checks/paged.py", "bad"): "paged",
}
RULE_VARIABLES = {"checks/i1.py": "I1", "checks/rows.py": "I2", "checks/engine.py": "I2"}
"""Modules whose `rule = ...` assignments hold rules of one check."""


def literals(node: ast.expr) -> list[str]:
    """The strings an expression can be: a literal, or either branch of `a if c else b`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return literals(node.body) + literals(node.orelse)
    return []


def callee(node: ast.Call) -> str | None:
    if isinstance(node.func, ast.Name):
        return node.func.id
    return node.func.attr if isinstance(node.func, ast.Attribute) else None


def emitted_in(tree: ast.AST, module: str) -> Iterator[tuple[str, str, str]]:
    """(check, rule, file:line) for every rule literal that one module emits."""
    for node in ast.walk(tree):
        where = f"{module}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Call) and node.args:
            name = callee(node)
            if name == "Violation" and len(node.args) >= 2:
                yield from ((c, r, where) for c in literals(node.args[0]) for r in literals(node.args[1]))
            check = EMITTERS.get(name or "") or LOCAL_EMITTERS.get((module, name or ""))
            if check is not None:
                yield from ((check, r, where) for r in literals(node.args[0]))
        if isinstance(node, ast.Assign) and module in RULE_VARIABLES:
            if any(isinstance(t, ast.Name) and t.id == "rule" for t in node.targets):
                yield from ((RULE_VARIABLES[module], r, where) for r in literals(node.value))


def emitted() -> list[tuple[str, str, str]]:
    found = []
    for path in sorted(HARNESS.rglob("*.py")):
        module = path.relative_to(HARNESS).as_posix()
        found += emitted_in(ast.parse(path.read_text(encoding="utf-8")), module)
    return found


def test_the_table_has_the_registry_checks_in_order() -> None:
    assert CHECK_NAMES == CHECK_ORDER


def test_every_contract_rule_table_is_listed() -> None:
    """The decoder contract, the engine contract and the black-box output contract."""
    for table in (CONTRACT_RULES, ENGINE_RULES, BLACKBOX_RULES):
        assert set(table) <= CHECK_RULES["contract"], sorted(set(table) - CHECK_RULES["contract"])


def test_every_rule_a_check_module_emits_is_listed() -> None:
    missing = [f"{where}: {check} {rule}" for check, rule, where in emitted() if rule not in CHECK_RULES.get(check, ())]
    assert not missing, "rules emitted but missing from specaudit.contracts.rules.CHECK_RULES:\n" + "\n".join(missing)


def test_every_listed_rule_is_emitted_somewhere() -> None:
    """The reverse: no stale name in the table (and the scan above sees every check's rules)."""
    seen = {(check, rule) for check, rule, _ in emitted()}
    seen |= {("contract", rule) for table in (CONTRACT_RULES, ENGINE_RULES, BLACKBOX_RULES) for rule in table}
    listed = {(check, rule) for check, rules in CHECK_RULES.items() for rule in rules}
    assert listed <= seen, sorted(listed - seen)


def test_the_rules_are_read_from_the_registry_entries_without_importing_it() -> None:
    """A check's rules are written once, in its entry; the torch-free table reads them from the source,
    and says where an entry wrote them in a form it cannot read."""
    source = 'Check(\n    "I9",\n    rules=frozenset({"a", "b"}),\n)\n'
    source += 'Check("I8", rules=CONTRACT_RULES)\nCheck("I7", rules={"c"})\n'
    table = registry_rules(source)
    assert list(table) == ["I9", "I8", "I7"] and table["I9"] == {"a", "b"} and table["I7"] == {"c"}
    assert table["I8"] == CHECK_RULES["contract"]
    with pytest.raises(ValueError, match=r"registry.py:1: write a check's rules= as a set literal"):
        registry_rules('Check("I9", rules=SOME_RULES)')
