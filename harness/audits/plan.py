"""The plan of an audit (or a gate): its items, one list of subject drivers, and the worker pool.

Every item is one independent search: a subject (a decoder, an engine, ...) on a model, with
its budgets. What each kind of subject needs is one `SubjectDriver` in `SUBJECTS`: which items
the audit and the gate plan for it, how to load its spec (an unloadable one is a usage error
before anything runs), how to run one item to a `Verdict`, how its table is rendered, and what
an item costs. The audit and the gate read `SUBJECTS` and nothing else of a kind.

Adding a subject kind (a paged engine such as transformers' continuous batching: a driver in
`specaudit.adapters` that returns report entries) is its row in `specaudit.contracts.subjects.KINDS`
(the one table of subject kinds; a driver whose kind is no row's name fails when it is made)
naming its `SubjectDriver` (`driver`), which `SUBJECTS` here then holds: its plan functions
(items with `Item.kind` set to its row's name), its `run` returning
a `Verdict` (`specaudit.audits.verdict`; a driver that returns report entries wraps each in an
`EntryVerdict`), and its table (`specaudit.artifacts.tables.entries_table` renders any kind's
entries). The worker pool, the progress lines, the tables' order, report.json and the
reproducers follow from the protocol; the gate judges decoders and engines only so far
(`specaudit.audits.gate.held_to_gate`), so a new kind's `gate_plan` returns [] until it is taught there.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any, Protocol

from specaudit.audits.decoders import (
    PLANTED_BUG_EXAMPLES,
    PLANTED_SHRINK_BUDGET,
    audit_model,
    audit_plan,
    format_table,
)
from specaudit.audits.engines import PLANTED_ENGINE_EXAMPLES, audit_engine, engine_plan, format_engine_table
from specaudit.audits.subject import Item, SubjectDriver
from specaudit.audits.verdict import Progress, Verdict
from specaudit.config.settings import AuditSettings, GateSettings
from specaudit.config.shards import Shard, cell_ids
from specaudit.config.xfails import KnownFailures
from specaudit.contracts import subjects
from specaudit.contracts.decoder import load_decoder
from specaudit.contracts.engine import load_engine
from specaudit.contracts.errors import UsageError
from specaudit.search.driver import SHRINK_BUDGET
from specaudit.search.jobs import default_jobs, run_all

# ---------------------------------------------------------------------------------------
# Decoders


def decoder_items(settings: AuditSettings) -> list[Item]:
    """The decoder plan, each item with its search budgets (a planted bug's: a bound, and a
    smaller shrink budget)."""
    items = []
    for spec, expect_failure, model in audit_plan(settings):
        budget = max(settings.examples, PLANTED_BUG_EXAMPLES) if expect_failure else settings.examples
        shrink = PLANTED_SHRINK_BUDGET if expect_failure else SHRINK_BUDGET
        items.append(
            Item(
                spec,
                model,
                expect_failure,
                budget,
                settings.seed,
                known=settings.xfails,
                shrink_budget=shrink,
                strict_efficiency=settings.strict_efficiency,
            )
        )
    return items


def gate_decoder_items(settings: GateSettings) -> list[Item]:
    """Every decoder x model, past the known failures, with the search's own shrink budget."""
    return [
        Item(
            spec,
            model,
            False,
            settings.examples,
            settings.seed,
            known=settings.xfails,
            strict_efficiency=settings.strict_efficiency,
        )
        for spec in settings.decoders
        for model in settings.models
    ]


def run_decoder(item: Item, progress: Progress | None) -> Verdict:
    return audit_model(
        item.spec,
        item.model,
        item.examples,
        item.seed,
        progress=progress,
        expect_failure=item.expect_failure,
        known=item.known,
        shrink_budget=item.shrink_budget,
        strict_efficiency=item.strict_efficiency,
    )


def decoder_headline(items: list[Item]) -> str:
    return f"{len(items)} decoder/model pairs ({len({item.spec for item in items})} decoders), "


DECODERS = SubjectDriver(
    subjects.DECODER.name, decoder_items, gate_decoder_items, load_decoder, run_decoder, format_table, decoder_headline
)


# ---------------------------------------------------------------------------------------
# Engines through the state machine

ENGINE_KIND = subjects.ENGINE.name


def engine_items(settings: AuditSettings) -> list[Item]:
    items = []
    for spec, expect_failure, model in engine_plan(settings):
        budget = max(settings.examples, PLANTED_ENGINE_EXAMPLES) if expect_failure else settings.examples
        items.append(Item(spec, model, expect_failure, budget, settings.seed, kind=ENGINE_KIND))
    return items


def gate_engine_items(settings: GateSettings) -> list[Item]:
    """Every engine x model through the state machine (Hypothesis shrinking on)."""
    return [
        Item(spec, model, False, settings.examples, settings.seed, kind=ENGINE_KIND)
        for spec in settings.engines
        for model in settings.models
    ]


def run_engine(item: Item, progress: Progress | None) -> Verdict:
    """Planted engine bugs skip Hypothesis's shrinking (seconds each) and are shrunk by `minimize_ops` alone."""
    shrink = not item.expect_failure
    return audit_engine(
        item.spec, item.examples, item.seed, expect_failure=item.expect_failure, shrink=shrink, model=item.model
    )


def engine_headline(items: list[Item]) -> str:
    return f"{len(items)} engine(s) through the engine state machine, "


ENGINES = SubjectDriver(
    ENGINE_KIND, engine_items, gate_engine_items, load_engine, run_engine, format_engine_table, engine_headline, 0.1
)


def drivers() -> list[SubjectDriver]:
    """The driver each row of `contracts.subjects.KINDS` names (`driver`), in table order; a driver
    of another kind than its row's is an import error."""
    found = []
    for kind in subjects.KINDS:
        if kind.driver is not None:
            made = subjects.resolve(kind.driver)
            if made.kind != kind.name:
                raise ValueError(
                    f"contracts.subjects row {kind.name!r} names {kind.driver}, a driver of kind {made.kind!r}"
                )
            found.append(made)
    return found


SUBJECTS: list[SubjectDriver] = drivers()
"""Every subject kind the audit and the gate run, in plan (and table) order: the drivers the rows
of the one table name (see the module docstring)."""


def driver(kind: str) -> SubjectDriver:
    return next(d for d in SUBJECTS if d.kind == kind)


# ---------------------------------------------------------------------------------------
# Shards: the cells of a plan one job runs (`--shard i/n`, `specaudit.config.shards`)


def plan_cells(items: list[Item]) -> list[str]:
    """Each item's cell name, in plan order."""
    return cell_ids([(item.kind, item.spec, item.model) for item in items])


def shard_items(items: list[Item], shard: Shard | None) -> list[Item]:
    """The items of `shard` (all of them without one), in plan order."""
    if shard is None:
        return items
    return [item for item, cell in zip(items, plan_cells(items)) if shard.holds(cell)]


def shard_record(items: list[Item], shard: Shard) -> dict[str, Any]:
    """What a shard's report.json says of itself, so that `specaudit merge` can tell a missing,
    foreign or incomplete shard: which shard, the whole plan's cells, and its own cells (one per
    report entry, in the entries' order)."""
    plan = plan_cells(items)
    mine = [cell for cell in plan if shard.holds(cell)]
    return {"index": shard.index, "count": shard.count, "plan": plan, "cells": mine, "digest": plan_digest(items)}


def forget_report(directory: Path) -> None:
    """Remove an earlier run's DIR/report.json before a shard starts: the report is written last,
    so a shard killed midway leaves none, and `specaudit merge` cannot take a stale one for it."""
    try:
        (directory / "report.json").unlink(missing_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot write to --out {directory}: {exc.strerror or exc}") from None


def plan_digest(items: list[Item]) -> str:
    """A fingerprint of what every cell runs (subject, model, budgets, seed), so that shards run with
    different --examples or --seed are not merged as one plan."""
    fields = [(i.kind, i.spec, i.model, i.expect_failure, i.examples, i.seed, i.shrink_budget) for i in items]
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------
# The run: every item, in worker processes, the results in plan order


def run_item(item: Item, progress: Progress | None = None) -> tuple[Verdict, list[int]]:
    """One item's verdict and the known-failure entries it matched (a worker's copy of them)."""
    return driver(item.kind).run(item, progress), sorted(item.known.used)


MODEL_COST = {"transparent": 1.0}
"""Rough cost of an item by model, so that the slow ones start first and no worker is left with
a long one at the end: the tiny real models cost about 5x the transparent one, an engine about a
tenth of a decoder (bench/results/audit_time.md). Only the start order depends on it."""


def item_cost(item: Item) -> float:
    return MODEL_COST.get(item.model, 5.0) * driver(item.kind).cost


class Runs(Protocol):
    """What `run_items` reads of a command's settings (the audit's, the gate's)."""

    jobs: int | None  # worker processes; None: one per available core
    quiet: bool
    ray: bool  # Ray tasks instead of worker processes (`specaudit.fleet.ray_sweep`)
    xfails: KnownFailures  # the entries the workers matched are marked used in it


def run_items(items: list[Item], settings: Runs) -> list[Verdict]:
    """Every item on `settings.jobs` workers; progress lines as each finishes, results in plan order."""
    progress = {
        d.kind: Progress(sum(item.kind == d.kind for item in items), enabled=not settings.quiet) for d in SUBJECTS
    }

    def on_done(index: int, result: tuple[Verdict, list[int]]) -> None:
        verdict, used = result
        settings.xfails.mark_used(used)
        progress[verdict.kind].finish_item(verdict)

    if settings.ray:  # one Ray task per item, on a cluster or a local Ray; the same results in plan order
        from specaudit.fleet.ray_sweep import run_all_ray

        return [verdict for verdict, _ in run_all_ray(run_item, items, on_done, first=item_cost)]
    jobs = settings.jobs or default_jobs()
    fn = run_item if jobs > 1 else functools.partial(run_in_process, progress=progress)
    return [verdict for verdict, _ in run_all(fn, items, jobs, on_done, first=item_cost)]


def run_in_process(item: Item, progress: dict[str, Progress]) -> tuple[Verdict, list[int]]:
    """`run_item` with its kind's progress bar (one process: the bar can follow the search)."""
    return run_item(item, progress[item.kind])


def by_kind(verdicts: list[Verdict]) -> list[tuple[SubjectDriver, list[Verdict]]]:
    """The verdicts grouped by subject kind, in `SUBJECTS` order, kinds with none left out."""
    groups = [(d, [v for v in verdicts if v.kind == d.kind]) for d in SUBJECTS]
    return [(d, group) for d, group in groups if group]


def tables(verdicts: list[Verdict]) -> str:
    """Each kind's table, in `SUBJECTS` order, a blank line between two."""
    return "\n\n".join(d.table(group) for d, group in by_kind(verdicts))
