"""`transformers-cb` in `make audit`: transformers' continuous batching as a second paged engine.

Its items: each public entry point's fixed workload (must pass), a Hypothesis search over
drawn workloads and every entry point (must pass; a failure is shrunk to a minimal workload),
`generate_batch` sampling (`do_sample=True`) judged against the exact distribution (must pass),
and each planted bug of `specaudit.reference.transformers_cb_mutants` on its workload (must be
caught). Every run is judged by the registry's paged-engine checks
(`specaudit.adapters.transformers_cb.verdict_of`); each verdict is one report entry of kind "paged
engine", and every failure is written as a `transformers-cb` reproducer that `specaudit replay`
runs again. With --decoder or --engine the audit is of the user's own subjects: none of these.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specaudit.adapters.transformers_cb import (
    ENGINE,
    ENTRY_POINTS,
    KNOWN_DEFECTS,
    SMOKE,
    CbVerdict,
    mutant_workload,
    report_entry,
    run_workload,
    search,
    search_entry,
    verdict_of,
)
from specaudit.adapters.transformers_cb.reproducer import reproducer_of
from specaudit.adapters.transformers_cb.sampling import run_sampling, sampling_entry
from specaudit.artifacts.reproducer import Reproducer, save
from specaudit.artifacts.tables import entries_table
from specaudit.audits.subject import Item, SubjectDriver
from specaudit.audits.verdict import EntryVerdict, Progress, Verdict, Writer
from specaudit.checks.registry import check_named, decided
from specaudit.config.settings import AuditSettings, GateSettings
from specaudit.contracts import subjects
from specaudit.contracts.violation import Violation
from specaudit.reference.transformers_cb_mutants import BY_NAME, MUTANTS, planted
from specaudit.search.jobs import one_torch_thread

KIND = subjects.TRANSFORMERS_CB.name
"""The plan's kind of its items and verdicts (`contracts.subjects.TRANSFORMERS_CB`)."""
MODEL = "tiny-llama"  # the engine's own model (`adapters.transformers_cb.models`), not a built-in model's name
SEARCH_EXAMPLES = 30  # drawn workloads of the Hypothesis item, at most (about 20 s on two cores)
SMOKE_PREFIX, PLANTED_PREFIX, SEARCH_SPEC, SAMPLING_SPEC = "smoke:", "planted:", "hypothesis", "sampling"
CB_MODULE = "transformers.generation.continuous_batching"


def available() -> bool:
    """Whether the installed transformers has the continuous batching this adapter reads (tried
    on 5.19 and 5.24; 4.x has none, so an audit there has no `transformers-cb` rows)."""
    try:
        return importlib.util.find_spec(f"{CB_MODULE}.input_outputs") is not None
    except ModuleNotFoundError:
        return False


def audit_items(settings: AuditSettings) -> list[Item]:
    """With neither --decoder nor --engine: each entry point, the search, and every planted bug."""
    if settings.decoders or settings.engines or not available():
        return []
    smoke = [Item(SMOKE_PREFIX + name, MODEL, False, 1, settings.seed, kind=KIND) for name in ENTRY_POINTS]
    examples = min(settings.examples, SEARCH_EXAMPLES)
    hypothesis = Item(SEARCH_SPEC, MODEL, False, examples, settings.seed, kind=KIND)
    bugs = [Item(PLANTED_PREFIX + m.name, MODEL, True, 1, settings.seed, kind=KIND) for m in MUTANTS]
    sampling = Item(SAMPLING_SPEC, MODEL, False, 1, settings.seed, kind=KIND)
    return [*smoke, hypothesis, sampling, *bugs]


def gate_items(settings: GateSettings) -> list[Item]:
    """The gate judges the user's decoders and engines; transformers' own engine is not one."""
    return []


PAGED_LOGGER = "transformers.generation.continuous_batching"
"""transformers' paged API logs its set-up and threads at info and warning level ("Paged cache
initialized", "Manager thread is already running"): lines interleaved with the audit's progress
that say nothing about the verdict, which carries what the run exercised."""


@contextlib.contextmanager
def quiet_paged_api() -> Iterator[None]:
    """transformers' paged-API loggers at ERROR while a run lasts, restored after."""
    logger = logging.getLogger(PAGED_LOGGER)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def run_transformers_cb(item: Item, progress: Progress | None = None) -> Verdict:
    with one_torch_thread(), quiet_paged_api():  # one torch thread: the engine's and the oracle's, on two cores
        if item.spec == SEARCH_SPEC:
            return searched(item)
        if item.spec == SAMPLING_SPEC:
            return sampled(item)
        name = item.spec.removeprefix(PLANTED_PREFIX)
        if item.spec.startswith(PLANTED_PREFIX):
            with planted(BY_NAME[name]):
                verdict = verdict_of(run_workload(mutant_workload(BY_NAME[name].workload)))
            return judged(verdict, {"workload": BY_NAME[name].workload, "planted": name}, item)
        name = item.spec.removeprefix(SMOKE_PREFIX)
        return judged(verdict_of(run_workload(SMOKE[name])), {"workload": "smoke", "entry_point": name}, item)


def judged(verdict: CbVerdict, subject: dict[str, Any], item: Item) -> EntryVerdict:
    """One judged run as the audit's verdict: its entry (with the signature its first violation
    maps to), the evidence lines, and its reproducer when it failed."""
    entry = with_signature(report_entry(verdict, subject), verdict.first)
    name = f"{ENGINE}-{item.spec.replace(':', '-')}"
    lines = [f"  {verdict.render()}"]
    return EntryVerdict(KIND, entry, item.expect_failure, lines, writer(verdict, name), f"{item.spec} on llama")


def searched(item: Item) -> EntryVerdict:
    """The Hypothesis item: `item.examples` drawn workloads, a failure shrunk to a minimal one."""
    start = time.perf_counter()
    found = search(item.seed, item.examples)
    seconds = time.perf_counter() - start
    entry = search_entry(found, item.seed, seconds, {d.name: d.reproducer for d in KNOWN_DEFECTS})
    failing = found.failing
    label = f"{item.examples} drawn workloads on llama"
    if failing is None:
        return EntryVerdict(KIND, entry, False, label=label)
    entry = with_signature(entry, failing.first)
    lines = [f"  {failing.render()}"]
    return EntryVerdict(KIND, entry, False, lines, writer(failing, f"{ENGINE}-hypothesis"), label)


def sampled(item: Item) -> EntryVerdict:
    """The sampling item: `generate_batch` with do_sample, every token against the exact p (pooled fit)."""
    verdict = run_sampling(item.seed)
    lines = [f"  {verdict.verdict}"] + [f"  {v.render()}" for v in verdict.violations[:3]]
    return EntryVerdict(KIND, sampling_entry(verdict, item.seed), False, lines, label=f"{item.spec} on llama")


def with_signature(entry: dict[str, Any], first: Violation | None) -> dict[str, Any]:
    """The paper's signature of the first violation, as the registry maps it for this check (an
    output divergence, which a decoder's would re-run alone to decide, is left undecided)."""
    if first is None or first.check == "equivalence":
        return entry
    signature, _ = decided(check_named(first.check).signature(first, None), None)
    return {**entry, "signature": signature}


def writer(verdict: CbVerdict, name: str) -> Writer | None:
    """A failing verdict's reproducer writer: its envelope made here, so that the verdict crosses
    from a worker process as data (a picklable partial, no closure over the run)."""
    return None if verdict.passed else functools.partial(write_envelope, reproducer_of(verdict), name)


def write_envelope(reproducer: Reproducer, name: str, directory: Path, summary: str) -> list[Path]:
    return [save(Path(directory), name, reproducer)]


def table(verdicts: list[Any]) -> str:
    return entries_table(ENGINE, [v.report_entry() for v in verdicts], [v.details() for v in verdicts])


def headline(items: list[Item]) -> str:
    return f"{len(items)} {ENGINE} run(s), "


TRANSFORMERS_CB = SubjectDriver(
    KIND, audit_items, gate_items, lambda spec: None, run_transformers_cb, table, headline, 0.2
)
"""The audit's driver of transformers' continuous batching (`specaudit.audits.plan.SUBJECTS`)."""
