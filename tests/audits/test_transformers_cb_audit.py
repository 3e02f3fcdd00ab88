"""`transformers-cb` in `make audit` (`specaudit.audits.transformers_cb`): its items, a planted
bug's verdict as a paged-engine report entry whose reproducer replays, a passing run's none."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from specaudit.adapters.transformers_cb import mutant_workload, read_workload, replay_workload
from specaudit.audits import transformers_cb
from specaudit.audits.plan import SUBJECTS, driver
from specaudit.audits.subject import Item
from specaudit.audits.transformers_cb import MODEL, audit_items, run_transformers_cb
from specaudit.checks.registry import PAGED
from specaudit.commands.replay import replay
from specaudit.config.settings import AuditSettings
from specaudit.reference.transformers_cb_mutants import BY_NAME, MUTANTS, planted
from tests.adapters.test_transformers_cb import needs_cb


@needs_cb
def test_the_default_audit_runs_every_entry_point_the_search_and_every_planted_bug() -> None:
    items = audit_items(AuditSettings(examples=100))
    assert [i.spec for i in items if not i.expect_failure] == [
        "smoke:generate_batch",
        "smoke:manager",
        "smoke:generate",
        "hypothesis",
        "sampling",
    ]
    assert [i.spec for i in items if i.expect_failure] == [f"planted:{m.name}" for m in MUTANTS]
    assert next(i for i in items if i.spec == "hypothesis").examples == 30  # at most SEARCH_EXAMPLES
    assert driver("transformers-cb") in SUBJECTS
    assert audit_items(AuditSettings(decoders=("specaudit.reference.eqspec:EqSpec",))) == []


def test_without_continuous_batching_the_audit_has_no_transformers_cb_items(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 4.x (CI's oldest smoke) has no continuous batching: no items, no crash."""
    monkeypatch.setattr(transformers_cb, "CB_MODULE", "transformers.no_such_module")
    assert not transformers_cb.available() and audit_items(AuditSettings()) == []


@needs_cb
def test_a_planted_bug_is_caught_as_a_paged_engine_entry_whose_reproducer_replays(tmp_path: Path) -> None:
    """The entry is of the registry's paged-engine subject with the bug's check, rule and the
    signature the registry maps it to; its reproducer replays to the same rule with the bug in
    place, and passes without it (the file holds the workload)."""
    mutant = BY_NAME["write-over-previous-page"]
    verdict = run_transformers_cb(Item(f"planted:{mutant.name}", MODEL, True, 1, 0, kind="transformers-cb"))
    entry = verdict.report_entry()
    assert entry["kind"] == PAGED == "paged engine" and entry["passed"] is False and entry["as_expected"]
    assert (entry["first"]["check"], entry["first"]["rule"]) == (mutant.check, mutant.rule), entry["first"]
    assert entry["signature"] == "kv-drift", entry["signature"]
    verdict = pickle.loads(pickle.dumps(verdict))  # as a worker process sends it back to the audit
    [path] = verdict.write_reproducers(tmp_path, "summary")
    written = json.loads(path.read_text())
    assert (written["kind"], written["payload"]["engine"]) == ("paged-engine", "transformers-cb"), written["kind"]
    assert read_workload(path) == mutant_workload(mutant.workload)
    with planted(mutant):
        again = replay(path)  # `specaudit replay FILE`
    first = again.verdict.first
    assert not again.passed and (first.check, first.rule) == (mutant.check, mutant.rule), again.render()
    assert again.to_json()["violations"][0]["rule"] == mutant.rule
    assert replay(path).passed and replay_workload(path).passed


@needs_cb
def test_a_passing_run_writes_no_reproducer(tmp_path: Path) -> None:
    verdict = run_transformers_cb(Item("smoke:generate_batch", MODEL, False, 1, 0, kind="transformers-cb"))
    assert verdict.passed and verdict.as_expected and verdict.report_entry()["kind"] == PAGED
    assert verdict.status() == "transformers-cb smoke:generate_batch on llama: PASS", verdict.status()
    assert verdict.write_reproducers(tmp_path, "summary") == [] and list(tmp_path.iterdir()) == []
