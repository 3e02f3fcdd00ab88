"""`specaudit audit` on the built-in models: every subject kind's plan, run, tables and outputs.

The plan is each `SubjectDriver`'s items (`specaudit.audits.plan.SUBJECTS`: decoders on the
built-in models, engines through the state machine), run on worker processes; each verdict
(`specaudit.audits.verdict.Verdict`) gives its report entry, its table row and its reproducers.
Exit 0 when every verdict is as expected (a planted bug caught, everything else passing), 1 otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specaudit.artifacts.report import write_report
from specaudit.audits.decoders import left_out
from specaudit.audits.plan import SUBJECTS, Item, forget_report, run_items, shard_items, shard_record, tables
from specaudit.audits.verdict import Verdict
from specaudit.config.settings import AuditSettings
from specaudit.config.shards import Shard
from specaudit.contracts.errors import UsageError

SUMMARY = "shrunk by specaudit audit"
"""What the regression tests the audit writes say of their case."""


def audit_items(settings: AuditSettings) -> list[Item]:
    """Every kind's items, in `SUBJECTS` order."""
    return [item for d in SUBJECTS for item in d.audit_plan(settings)]


def headline(settings: AuditSettings, items: list[Item]) -> str:
    """What the audit is about to run, and the planted bugs it leaves out."""
    kinds = "".join(d.headline(mine) for d in SUBJECTS if (mine := [i for i in items if i.kind == d.kind]))
    missing = left_out(settings)
    return f"specaudit audit: {kinds}up to {settings.examples} cases each, seed {settings.seed}" + (
        f"\n  planted bugs left out (they show only on models not asked for): {', '.join(missing)}" if missing else ""
    )


def shard_line(shard: Shard | None, items: list[Item], plan: list[Item]) -> str:
    """The headline's shard words: which shard, and how many of the plan's cells it runs."""
    return "" if shard is None else f"\n  shard {shard}: {len(items)} of the plan's {len(plan)} cells"


def write_outputs(directory: Path, verdicts: list[Verdict], **extra: Any) -> None:
    """DIR/report.json (an entry per verdict, in plan order; `extra` in its envelope: a shard's
    record and exit status) and, per failure, its reproducer and regression test under DIR/repro."""
    write_report(directory, "audit", [v.report_entry() for v in verdicts], **extra)
    for v in verdicts:
        v.write_reproducers(directory / "repro", SUMMARY)


def run_audit(settings: AuditSettings) -> int:
    """`specaudit audit`: exit 0 when every verdict is as expected, 1 otherwise."""
    plan = audit_items(settings)
    items = shard_items(plan, settings.shard)
    if settings.shard is not None and settings.out is not None:
        forget_report(settings.out)
    for d in SUBJECTS:
        for spec in dict.fromkeys(item.spec for item in items if item.kind == d.kind):
            d.load(spec)  # an unloadable subject is a usage error before anything runs
    print(headline(settings, items) + shard_line(settings.shard, items, plan), flush=True)
    verdicts = run_items(items, settings)
    for v in verdicts:
        v.mark_known(settings.xfails)
    if verdicts:
        print(tables(verdicts))
    wrong = [v for v in verdicts if not v.as_expected]
    if settings.out is not None:
        shard = settings.shard
        extra = {} if shard is None else {"shard": shard_record(plan, shard), "exit": int(bool(wrong))}
        try:
            write_outputs(settings.out, verdicts, **extra)
        except OSError as exc:
            raise UsageError(f"cannot write to --out {settings.out}: {exc.strerror or exc}") from None
        print(f"report: {settings.out / 'report.json'}; reproducers under {settings.out / 'repro'}")
    print(f"\n{len(verdicts) - len(wrong)} as expected, {len(wrong)} not")
    for line in settings.xfails.unused_lines():  # stale or too narrow entries: told, not fatal
        print(line)
    return 1 if wrong else 0
