"""The audit's and the gate's tables, rendered from report entries (`specaudit.artifacts.report.entry`).

One table per subject kind: a row per entry (its subject, figures, verdict, first broken check,
signature and what it exercised), the legends, then under it each entry's known failures and
the evidence its verdict renders of an unexpected failure (`details`: text only the verdict
can write, such as a minimal case's rendered violations; None or [] when there is none). A
report.json read back renders the same rows (`Coverage.from_json` gives the coverage column).
"""

from __future__ import annotations

import json
import statistics
import textwrap
from collections.abc import Sequence
from typing import Any

from specaudit.checks.coverage import Coverage

Entry = dict[str, Any]
"""One report entry: the shared verdict fields, then its kind's figures."""

COVERAGE_LEGEND = (
    "coverage = rounds (target calls after the prefill) in which rows accepted different numbers of drafts / "
    "all rounds, largest batch B, draft lengths K, highest position id, rows finished early, prompts holding "
    "the pad id, EOS stops (specaudit.checks.coverage)"
)
EFFICIENCY_LEGEND = (
    "EFFICIENCY = output and invariants right, but verified drafts thrown away or rejected ones kept "
    "(token preservation: a cost, not fatal unless --strict-efficiency)"
)
RAGGED_EVENT = "admission into a batch with ragged acceptance"
"""The engine event whose share of runs the engine table shows (`ragged`)."""


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def coverage_of(e: Entry) -> Coverage:
    return Coverage.from_json(e.get("coverage") or {"level": "none"})


def verdict_word(passed: bool, coverage: Coverage, level: str = "pass") -> str:
    """PASS, FAIL, EFFICIENCY (only findings of cost: output and invariants right), or a pass that
    exercised little, with why: "PASS (no ragged round)"."""
    if not passed:
        return "FAIL"
    if level == "efficiency":
        return "EFFICIENCY"
    return f"PASS ({coverage.flags[0]})" if coverage.flags else "PASS"


def entry_word(e: Entry) -> str:
    """An entry's verdict word (`verdict_word`) from its passed, coverage and level."""
    return verdict_word(e["passed"], coverage_of(e), e.get("level", "pass"))


def known_line(e: Entry) -> list[str]:
    """The known failures an entry met (--xfails), one line, or none."""
    known = e.get("known_failures") or []
    if not known:
        return []
    subject = e["subject"]
    met = ", ".join(f"{k['check']} {k['rule']}" for k in known)
    return [f"{subject[e['kind']]} on {subject['model']}: known failures met: {met}"]


# ---------------------------------------------------------------------------------------
# Decoders on the built-in models


def decoder_table(entries: list[Entry], details: Sequence[list[str] | None], timing_basis: dict[str, int]) -> str:
    """The forensic table (the paper's Table 2, with a diagnosis in every row), then what each
    verdict exercised and each check's status per decoder x model, each a table of its own so that
    no line outgrows `WIDTH`. `timing_basis`: the least a run must do to be timed for the
    instrumentation overhead (the audit's)."""
    words = [entry_word(e) for e in entries]
    wasteful = any(f.get("level") == "efficiency" for e in entries for f in [e, *(e.get("failures") or [])])
    w = max([9 if not wasteful else 10, *map(len, words)])
    n = name_width(entries)
    header = (
        f"{'decoder':<{n}} {'model':<11} {'cases':>7} {'exact':>6} {'partial':>7} {'tok/s':>7} {'align%':>6}  "
        f"{'verdict':<{w}} {'first check':<18} {'signature':<17} {'expected':<8}"
    )
    lines = [header, "-" * len(header)]
    for e, word in zip(entries, words):
        lines.append(decoder_row(e, word, w, n))
        failures = e.get("failures") or []
        lines += [more_failure_line(e, i, len(failures), w, n) for i in range(1, len(failures))]
    lines.append(overhead_line(entries, timing_basis))
    lines.append(
        "cases = cases run (returned/run when some raised or hung: exact and partial match are over the returned "
        "ones' rows); align% = share of decoder time outside model forwards (realignment, acceptance, bookkeeping)"
    )
    lines += [EFFICIENCY_LEGEND] if wasteful else []
    lines += ["", *coverage_table(entries), COVERAGE_LEGEND]
    lines += ["", *check_table(entries)]
    for e, more in zip(entries, details):
        lines += known_line(e)
        lines += more or []
    return "\n".join(wrapped for line in lines for wrapped in fit(line))


WIDTH = 200
"""The widest line a table writes: longer text (a legend, a minimal case's evidence) is wrapped."""


def fit(line: str, width: int = WIDTH) -> list[str]:
    """`line`, wrapped at `width` with its continuation indented 4 past its own indent."""
    if len(line) <= width:
        return [line]
    indent = " " * (len(line) - len(line.lstrip()) + 4)
    return textwrap.wrap(line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def coverage_table(entries: list[Entry]) -> list[str]:
    """What each verdict exercised (`Coverage.summary`), per decoder x model."""
    n = name_width(entries)
    header = f"{'coverage':<{n}} {'model':<11} what the runs exercised"
    rows = [f"{short_name(e['subject']['decoder']):<{n}} {e['subject']['model']:<11} {coverage_of(e).summary()}"
            for e in entries]  # fmt: skip
    return [header, "-" * len(header), *rows]


SHORTENED = "specaudit.reference."
"""Left out of the decoder column (the references and planted bugs: `mutants:pads_attended`), so that
the table's rows keep one width whatever the planted bugs' names."""


def short_name(spec: str) -> str:
    """A decoder's name in the tables: its spec, without `SHORTENED`."""
    return spec.removeprefix(SHORTENED)


def name_width(entries: list[Entry]) -> int:
    """The decoder column's width: 44, or the longest name shown."""
    return max([44, *(len(short_name(e["subject"]["decoder"])) for e in entries)])


def decoder_row(e: Entry, word: str, width: int, name: int = 44) -> str:
    subject, share = e["subject"], e["outside_models_share"]
    return (
        f"{short_name(subject['decoder']):<{name}} {subject['model']:<11} {cases_cell(e):>7} "
        f"{fmt(e['exact_match'], '.2f'):>6} "
        f"{fmt(e['partial_match'], '.2f'):>7} {fmt(e['tokens_per_second'], '.0f'):>7} "
        f"{fmt(None if share is None else 100 * share, '.0f'):>6}  "
        f"{word:<{width}} {(e['first'] or {}).get('check') or '':<18} "
        f"{e['signature'] or '':<17} {'yes' if e['as_expected'] else 'NO'}"
    )


def cases_cell(e: Entry) -> str:
    """The cases run, as "measured/run" when some raised or hung: exact and partial match are
    over the cases that returned outputs only."""
    measured = e.get("measured_cases", e["cases"])
    return str(e["cases"]) if measured == e["cases"] else f"{measured}/{e['cases']}"


def more_failure_line(e: Entry, index: int, count: int, width: int, name: int = 44) -> str:
    """A row under an entry's for its `index`-th distinct failure: its first check, rule and signature."""
    failure = e["failures"][index]
    first = failure.get("first") or {}
    label = f"  + failure {index + 1} of {count}"
    check = (failure.get("diagnosis") or {}).get("first_check") or first.get("check") or ""
    rule = f" ({first['rule']})" if first.get("rule") is not None else ""
    return (
        f"{label:<{name}} {e['subject']['model']:<11} {'':>7} {'':>6} {'':>7} {'':>7} {'':>6}  "
        f"{'EFFICIENCY' if failure.get('level') == 'efficiency' else 'FAIL':<{width}} "
        + (f"{check + rule:<18} {failure.get('signature') or '':<17}").rstrip()
    )


def overhead_line(entries: list[Entry], timing_basis: dict[str, int]) -> str:
    """The median overhead over the entries timed on a long enough run, or why there is none."""
    timed = [e["instrumentation_overhead"] for e in entries if e.get("instrumentation_overhead") is not None]
    least = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in timing_basis.items())
    if not timed:
        return f"instrumentation overhead: n/a (run too short: no run of at least {least} to time)"
    median = statistics.median(timed)
    return (
        f"instrumentation overhead (hooked vs plain run of one case each): median {100 * median:.0f}% "
        f"over {len(timed)} of {len(entries)} verdicts (timed on runs of at least {least})"
    )


def check_table(entries: list[Entry]) -> list[str]:
    """Each check's status over the runs, per decoder x model (FAIL in capitals)."""
    checks = list(dict.fromkeys(c for e in entries for c in e["checks"]))
    widths = [max(len(c), 5) for c in checks]
    n = name_width(entries)
    header = f"{'checks':<{n}} {'model':<11} " + " ".join(f"{c:<{w}}" for c, w in zip(checks, widths))
    lines = [header, "-" * len(header)]
    for e in entries:
        cells = []
        for c, w in zip(checks, widths):
            status = e["checks"].get(c, "n/a")
            cells.append(f"{'FAIL' if status == 'fail' else status:<{w}}")
        name = short_name(e["subject"]["decoder"])
        lines.append(f"{name:<{n}} {e['subject']['model']:<11} " + " ".join(cells).rstrip())
    return lines


# ---------------------------------------------------------------------------------------
# Engines through the engine state machine


def engine_word(e: Entry) -> str:
    return "XFAIL" if e.get("known_failures") else verdict_word(e["passed"], coverage_of(e))


def engine_row(e: Entry, width: int, verdict_width: int = 7) -> str:
    subject, first = e["subject"], e["first"] or {}
    ragged = e["events"].get(RAGGED_EVENT)
    return (
        f"{short_name(subject['engine']):<{width}} {subject['model']:<11} {e['runs']:>5} {e['seconds']:>6.1f} "
        f"{fmt(ragged, '.2f'):>6}  {engine_word(e):<{verdict_width}} {first.get('check') or '':<12} "
        f"{first.get('rule') or '':<18} {e['signature'] or '':<17} {fmt(e['minimized_rules'], 'd'):>5}  "
        f"{'yes' if e['as_expected'] else 'NO'}"
    )


def engine_table(entries: list[Entry], details: Sequence[list[str] | None]) -> str:
    """Engines: runs, time, share of runs with an admission into a ragged batch, the verdict,
    the first broken check, rule and signature, and the length of the minimized rule sequence."""
    width = max([28, *(len(short_name(e["subject"]["engine"])) for e in entries)])
    w = max([7, *(len(engine_word(e)) for e in entries)])
    header = (
        f"{'engine (state machine)':<{width}} {'model':<11} {'runs':>5} {'sec':>6} {'ragged':>6}  "
        f"{'verdict':<{w}} {'first check':<12} {'rule':<18} {'signature':<17} {'rules':>5}  expected"
    )
    lines = [header, "-" * len(header), *(engine_row(e, width, w) for e in entries)]
    lines.append(
        "ragged = share of runs with an admission into a batch with ragged acceptance; "
        "rules = length of the minimized failing rule sequence"
    )
    coverage = f"{'coverage':<{width}} {'model':<11} what the runs exercised"
    lines += ["", coverage, "-" * len(coverage)]
    lines += [f"{short_name(e['subject']['engine']):<{width}} {e['subject']['model']:<11} {coverage_of(e).summary()}"
              for e in entries]  # fmt: skip
    lines.append(COVERAGE_LEGEND + "; arrivals while others ran, aborts, duplicate prompts, rows reused")
    for e, more in zip(entries, details):
        lines += known_line(e) or (more or [])
    return "\n".join(wrapped for line in lines for wrapped in fit(line))


def rules_block(e: Entry, rendered: str) -> list[str]:
    """An engine's minimal failing rule sequence under the table: its length, its violations
    (`rendered`, the verdict's own rendering of all of them) and the reproducer's rules."""
    subject, reproducer = e["subject"], e.get("reproducer") or {}
    rules = len(reproducer.get("ops", []))
    head = f"{subject['engine']} on {subject['model']}: minimal failing rule sequence ({rules} rules)"
    return [
        "",
        head,
        *("  " + line for line in rendered.splitlines()),
        "  reproducer: " + json.dumps(e.get("reproducer")),
    ]


# ---------------------------------------------------------------------------------------
# Any kind: the shared verdict fields alone (a paged engine's, a black box's configurations)


def entries_table(title: str, entries: list[Entry], details: Sequence[list[str] | None]) -> str:
    """One row per entry from the shared verdict fields only (subject, verdict, first check, rule,
    signature, whether it was expected, coverage): the table of a kind with no figures of its own
    in the table yet. `title` heads the subject column."""
    names = [", ".join(f"{v}" for v in e["subject"].values()) for e in entries]
    width = max([len(title), *map(len, names)])
    words = [verdict_word(e["passed"], coverage_of(e)) for e in entries]
    w = max([7, *map(len, words)])
    header = f"{title:<{width}}  {'verdict':<{w}} {'first check':<18} {'rule':<24} {'signature':<17} {'expected':<8}"
    header += "  coverage"
    lines = [header, "-" * len(header)]
    for e, name, word in zip(entries, names, words):
        first, expected = e["first"] or {}, e.get("as_expected")
        lines.append(
            f"{name:<{width}}  {word:<{w}} {first.get('check') or '':<18} {first.get('rule') or '':<24} "
            f"{e['signature'] or '':<17} {'-' if expected is None else 'yes' if expected else 'NO':<8}  "
            f"{coverage_of(e).summary()}"
        )
    for more in details:
        lines += more or []
    return "\n".join(lines)


def sampling_entries_table(entries: list[Entry], details: Sequence[list[str] | None]) -> str:
    """A sampling decoder's verdicts: cases and tokens pooled, the smallest shift the best-sampled
    case detects (at the stated false-alarm rate), and a failure's check, rule and role."""
    names = [e["subject"].get("sampling decoder", "?").rsplit(":", 1)[-1] for e in entries]
    width = max([16, *map(len, names)])
    header = (
        f"{'sampling decoder':<{width}}  {'verdict':<7} {'cases':>5} {'tokens':>6} {'shift':>6}  {'first check':<16} "
        f"{'rule':<16} {'role':<6} {'signature':<11} {'expected':<8}  coverage"
    )
    lines = [header, "-" * len(header)]
    for e, name in zip(entries, names):
        first, expected, failures = e["first"] or {}, e.get("as_expected"), e.get("failures") or [{}]
        best = e.get("best_case") or {}
        shift = f"{best['shift']:.3f}" if best.get("shift") not in (None, float("inf")) else "-"
        lines.append(
            f"{name:<{width}}  {verdict_word(e['passed'], coverage_of(e)):<7} {e.get('cases', 0):>5} "
            f"{(e.get('tokens') or {}).get('all', 0):>6} {shift:>6}  {first.get('check') or '':<16} "
            f"{first.get('rule') or '':<16} {failures[0].get('role') or '':<6} {e['signature'] or '':<11} "
            f"{'-' if expected is None else 'yes' if expected else 'NO':<8}  {coverage_of(e).summary()}"
        )
    lines.append(
        "shift: the smallest rank-ordered total-variation shift the best-sampled case detects with probability "
        "0.95, at a false-alarm probability of 1e-06 per case (docs/sampling.md)"
    )
    for more in details:
        lines += more or []
    return "\n".join(lines)


__all__ = [
    "COVERAGE_LEGEND",
    "decoder_table",
    "engine_table",
    "entries_table",
    "rules_block",
    "sampling_entries_table",
    "verdict_word",
]
