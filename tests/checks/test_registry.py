"""The check registry: one list read by the properties, the audit, the diagnosis and docs/checks.md.

Every check has exactly one property and one docs/checks.md row, fails on some planted or test
decoder (its negative control), maps that failure to a known signature, and says 'not
applicable' (never 'pass') where it cannot judge a run.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import specaudit.properties
from specaudit.checks.diagnosis import diagnose
from specaudit.checks.registry import (
    BATCH_ORDER,
    CHECK_ORDER,
    CHECKS,
    FAIL,
    NOT_APPLICABLE,
    PASS,
    SIGNATURES,
    all_violations,
    check_named,
    evaluate,
    i2_signature,
    markdown_table,
    outcome_of,
)
from specaudit.contracts.case import Case
from specaudit.contracts.violation import Violation
from specaudit.reference.planted.acceptance import BonusFromDraft
from specaudit.running.runner import run_case

ROOT = Path(__file__).resolve().parents[2]
ACCEPT, REJECT = (True,) * 40, (False,) * 40
RAGGED = Case(((1, 2, 3), (4, 5)), (ACCEPT, REJECT), 2, 5, None, 0)
ONE_ROW = Case(((1, 2, 3, 4),), (REJECT,), 3, 6, None, 0)
MUTANTS = "specaudit.reference.mutants"


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_registry_is_ordered_and_named_once() -> None:
    """CHECKS is in order, names are unique, check_named finds each and refuses unknown names."""
    assert len(set(CHECK_ORDER)) == len(CHECKS) and CHECK_ORDER[0] == "contract"
    assert all(check_named(c.name) is c for c in CHECKS)
    with pytest.raises(KeyError, match="no check named 'I3'"):
        check_named("I3")


# ---------------------------------------------------------------------------------------
# One property per check, one docs/checks.md row per check


def conformance_properties() -> list[tuple[str, Any]]:
    """(module.function, function) of every test function in the shipped suite."""
    found = []
    for module_info in pkgutil.iter_modules(specaudit.properties.__path__):
        module = importlib.import_module(f"specaudit.properties.{module_info.name}")
        for name, value in vars(module).items():
            if name.startswith("test_") and callable(value):
                found.append((f"{module_info.name}.{name}", value))
    return found


def test_every_check_has_exactly_one_property() -> None:
    """Each registry check of a batch run is claimed by exactly one batch property, and every batch
    property claims one (the engine property runs every check on each step of its state machine;
    the sampling property every sampling-decoder check on each drawn case; the paged layout is
    judged on vLLM traces, tests/adapters/test_vllm_observer.py)."""
    stepped = ("test_engines.", "test_sampling.")
    properties = [(name, test) for name, test in conformance_properties() if not name.startswith(stepped)]
    claimed = Counter(getattr(test, "specaudit_check", None) for _, test in properties)
    assert None not in claimed, [name for name, test in properties if not hasattr(test, "specaudit_check")]
    assert claimed == Counter(BATCH_ORDER), f"got properties for {dict(claimed)}, but should be one per {BATCH_ORDER}"
    for _, test in properties:
        statement = check_named(test.specaudit_check).statement
        assert test.__doc__ and statement[1:] in test.__doc__, f"{test.__name__} does not state its check"


def docs_section(title: str, page: str = "docs/checks.md") -> str:
    text = (ROOT / page).read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert match, f"{page} has no section '## {title}'"
    return match.group(1)


def test_docs_table_is_the_registry() -> None:
    """docs/checks.md's '## The checks' holds markdown_table() verbatim: one row per registry check."""
    section = docs_section("The checks")
    assert markdown_table() in section, "docs/checks.md's table of checks is stale: paste registry.markdown_table()"
    rows = [line for line in markdown_table().splitlines()[2:]]
    assert [re.match(r"\| `([^`]+)`", row).group(1) for row in rows] == list(CHECK_ORDER)  # type: ignore[union-attr]
    for signature in SIGNATURES:
        assert f"`{signature}`" in section, f"docs/checks.md does not explain the signature {signature}"


# ---------------------------------------------------------------------------------------
# Negative controls: every check fails on some planted or test decoder


def scheduling(name: str) -> tuple[str, Callable[[], Any]]:
    module = importlib.import_module("test_scheduling")
    return f"tests.checks.test_scheduling:{name}", getattr(module, name)


def grouped_control() -> tuple[str, Callable[[], Any]]:
    spec, cls = scheduling("ShiftingGroups")
    return spec, lambda: cls(8, 8, 2)


GROUPED = Case(tuple(tuple(range(i, i + 6)) for i in range(8)), (REJECT,) * 8, 3, 6, None, 0)
SORTED = Case(((1,), (2, 3), (4, 5, 6)), (ACCEPT, REJECT, ACCEPT), 2, 4, None, 0)

NEGATIVE_CONTROLS: dict[str, tuple[Callable[[], tuple[str, Any]], Case]] = {
    "contract": (lambda: (f"{MUTANTS}:max_new_tokens_overrun", None), RAGGED),
    "I1": (lambda: (f"{MUTANTS}:mask_not_updated_after_repad", None), ONE_ROW),
    "I2": (lambda: (f"{MUTANTS}:verify_position_off_by_one", None), ONE_ROW),
    "equivalence": (lambda: (f"{MUTANTS}:logits_shifted_by_one", None), ONE_ROW),
    "token-preservation": (lambda: (f"{MUTANTS}:acceptance_one_short", None), RAGGED),
    "liveness": (lambda: scheduling("OneAtATime"), RAGGED),
    "grouped-no-realignment": (grouped_control, GROUPED),
    "order-independence": (lambda: (f"{MUTANTS}:cache_rows_permuted", None), RAGGED),
}
"""Per check: (decoder spec and factory, a case it fails that check on): a fast fixed case for the batch checks.
The two whose control needs a particular pool (grouped rounds, another order) have it only here."""
POOL_CONTROLS = ("grouped-no-realignment", "order-independence")


def planted_controls() -> dict[str, list[str]]:
    """Check -> the planted bugs of every catalog whose record names it as the check that catches them
    (a catalog collects a planted class by its record: `reference.planted.planted`)."""
    from specaudit.reference import engine_mutants, mutants, sampling_mutants, transformers_cb_mutants, vllm_mutants

    named: list[tuple[str, str]] = [(cls.bug.first_check, name) for name, cls in mutants.CATALOG.items()]
    named += [(cls.bug.first_check, name) for name, cls in engine_mutants.ENGINE_CATALOG.items()]
    named += [(cls.bug.check, name) for name, cls in sampling_mutants.CATALOG.items()]
    vllm = (*vllm_mutants.MUTANTS, *vllm_mutants.SERVED_MUTANTS, *vllm_mutants.SAMPLING_MUTANTS)
    engines = (*vllm, *transformers_cb_mutants.MUTANTS)
    named += [(mutant.check, mutant.name) for mutant in engines]
    controls: dict[str, list[str]] = {}
    for check, name in named:
        controls.setdefault(check, []).append(name)
    return controls


def test_every_check_has_a_planted_control() -> None:
    """A check's negative control is a planted bug whose record names the check (its catalog's test
    shows it is caught so), derived, never listed: only the pool-order checks keep a fixed case here."""
    controls = planted_controls()
    missing = [c for c in CHECK_ORDER if not controls.get(c) and c not in POOL_CONTROLS]
    assert not missing, f"checks without a planted control naming them: {missing}"
    assert set(controls) <= set(CHECK_ORDER), sorted(set(controls) - set(CHECK_ORDER))
    assert set(POOL_CONTROLS) <= set(NEGATIVE_CONTROLS)


def test_every_planted_vllm_bug_is_a_control_of_its_check() -> None:
    """Every vLLM catalog (in process, served front end, sampling) is in the derivation: each bug that
    `vllm_mutants.BY_NAME` can plant is a control of the check its record names."""
    from specaudit.reference.vllm_mutants import BY_NAME

    controls = planted_controls()
    missing = sorted(name for name, mutant in BY_NAME.items() if name not in controls.get(mutant.check, []))
    assert not missing, f"planted vLLM bugs left out of the negative controls: {missing}"


def test_paged_rules_map_to_known_signatures() -> None:
    """Every paged rule names a signature: positions a position error, the bonus a bonus error,
    the slots and K/V read drift, the request bookkeeping bookkeeping."""
    from specaudit.checks.paged import RULES

    signatures = {rule: check_named("paged").signature(Violation("paged", rule, "x", "y"), None)[0] for rule in RULES}
    assert set(signatures.values()) <= set(SIGNATURES), signatures
    assert (signatures["query-positions"], signatures["greedy-commit"], signatures["slot-mapping"]) == (
        "position-id",
        "bonus",
        "kv-drift",
    ), signatures


@pytest.mark.parametrize("name", NEGATIVE_CONTROLS)
def test_negative_control_fails_its_check(name: str) -> None:
    """The control fails the check with evidence, its first violation maps to a known signature,
    and the reference decoders pass the same check on the same case."""
    make, case = NEGATIVE_CONTROLS[name]
    spec, factory = make()
    run = run_case(spec, case, factory=factory)
    outcome = outcome_of(name, run)
    assert outcome.status == FAIL and outcome.violations, f"{spec} passes {name} on {case!r}: {outcome}"
    assert {v.check for v in outcome.violations} == {name}
    signature, reason = check_named(name).signature(outcome.violations[0], run)
    assert signature in SIGNATURES and reason, (signature, reason)
    reference = "specaudit.reference.exspec:ExSpec" if name == "grouped-no-realignment" else None
    good = run_case(reference or "specaudit.reference.eqspec:EqSpec", case)
    assert outcome_of(name, good).status == PASS, f"the reference does not pass {name}: {outcome_of(name, good)}"


# ---------------------------------------------------------------------------------------
# Evaluation: order, short-circuit, not applicable


def test_contract_break_short_circuits() -> None:
    """After a contract break nothing else is judged: every other check is 'not applicable'."""
    run = run_case(f"{MUTANTS}:max_new_tokens_overrun", RAGGED)
    evaluation = evaluate(run)
    assert evaluation.statuses[0] == ("contract", FAIL)
    assert all(status == NOT_APPLICABLE for _, status in evaluation.statuses[1:]), evaluation.statuses
    assert all("contract" in o.why for o in evaluation.outcomes[1:])
    assert {v.check for v in all_violations(run)} == {"contract"}


def test_all_violations_are_ordered_by_check_then_call() -> None:
    run = run_case(f"{MUTANTS}:rejected_kv_attended", RAGGED)
    keys = [(CHECK_ORDER.index(v.check), v.call if v.call is not None else 1 << 30) for v in all_violations(run)]
    assert keys == sorted(keys) and len({k[0] for k in keys}) >= 2, keys


def test_not_applicable_is_never_a_pass() -> None:
    """Token preservation without the scripted draft and order independence of one row are
    reported as 'not applicable' with the reason, in the evaluation and the diagnosis."""
    run = run_case("specaudit.reference.eqspec:EqSpec", ONE_ROW)
    outcome = outcome_of("order-independence", run)
    assert (outcome.status, outcome.why) == (NOT_APPLICABLE, "needs a batch of >= 2 rows")
    document = diagnose(run).to_json()
    assert list(document["checks"]) == list(BATCH_ORDER)
    assert document["checks"]["order-independence"] == NOT_APPLICABLE
    assert document["not_applicable"]["order-independence"] == "needs a batch of >= 2 rows"
    assert "order-independence not applicable (needs a batch of >= 2 rows)" in diagnose(run).render()
    assert check_named("token-preservation").applies(run) is None
    unscripted = Case(((1, 2),), (REJECT,), 2, 3, None, 0, 0, "llama", "tiny", "float64")
    assert check_named("token-preservation").unmet(run_case("specaudit.reference.eqspec:EqSpec", unscripted))


# ---------------------------------------------------------------------------------------
# Signatures read fields, and the batch-size-1 re-run uses the user's decoder


def i2(rule: str, found: tuple[int, int], expected: tuple[int, int]) -> Violation:
    """An I2 violation whose text says nothing: the signature must come from the evidence."""
    evidence = {
        "found_token": found[0],
        "found_position": found[1],
        "expected_token": expected[0],
        "expected_position": expected[1],
    }
    return Violation("I2", rule, "-", "-", 1, 0, 2, 0, evidence)


@pytest.mark.parametrize(
    ("found", "expected", "signature"),
    [
        ((7, 1), (9, 2), "kv-drift"),  # an extra slot with a lower position among the row's own
        ((9, 3), (9, 2), "position-id"),  # the right token at the wrong position
        ((8, 2), (9, 2), "kv-drift"),  # another token at the right position
    ],
)
def test_i2_signature_reads_evidence(found: tuple[int, int], expected: tuple[int, int], signature: str) -> None:
    assert i2_signature(i2("attends-wrong-slot", found, expected))[0] == signature
    assert i2_signature(i2("position-ids", found, expected))[0] == "position-id"


class ConfiguredBonusBug(BonusFromDraft):
    """The bonus bug behind a constructor argument: `type(instance)()` cannot rebuild it."""

    def __init__(self, buggy: bool) -> None:
        self.buggy = buggy

    def accept(self, drafts: torch.Tensor, predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return (BonusFromDraft.accept if self.buggy else super(BonusFromDraft, self).accept)(drafts, predicted)


def test_single_row_rerun_uses_the_given_factory() -> None:
    """The diagnosis re-runs a diverging row alone with the decoder the user gave (a configured
    factory, under a spec that names nothing importable) and finds the bonus signature."""
    run = run_case("not.importable:Decoder", ONE_ROW, factory=lambda: ConfiguredBonusBug(buggy=True))
    diagnosis = diagnose(run)
    assert (diagnosis.first_check, diagnosis.signature) == ("equivalence", "bonus"), diagnosis.render()


def test_a_check_that_cannot_read_a_run_reports_it_instead_of_raising(monkeypatch: pytest.MonkeyPatch) -> None:
    """A check raising on a degenerate run is reported as not applicable, with the reason, never
    raised out of `evaluate` (the audit and the suite give a verdict, not a traceback)."""
    from specaudit.checks import registry
    from specaudit.contracts.case import Case
    from specaudit.running.runner import run_case

    def crash(run: object) -> list:
        raise IndexError("argmax(): Expected reduction dim 2 to have non-zero size")

    from dataclasses import replace

    i1 = registry.check_named("I1")
    crashing = replace(i1, implementations={**i1.implementations, registry.DECODER: crash})
    monkeypatch.setattr(registry, "CHECKS", tuple(crashing if c is i1 else c for c in registry.CHECKS))
    monkeypatch.setitem(registry._BY_NAME, "I1", crashing)
    run = run_case("specaudit.reference.eqspec:EqSpec", Case(((5,),), ((True,),), 1, 1, None, 0))
    outcome = {o.check: o for o in registry.evaluate(run).outcomes}["I1"]
    assert outcome.status == registry.NOT_APPLICABLE and "IndexError" in (outcome.why or ""), outcome
