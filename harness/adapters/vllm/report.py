"""The report of `specaudit audit-vllm`: per served model and configuration, the black box's
verdict and figures, the white box's, and the server's speculative counters; rendered as
Markdown and written with the report envelope (`artifacts.report`), an entry per level."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from specaudit.adapters.sampling_blackbox import EVIDENCE as SAMPLING_EVIDENCE
from specaudit.adapters.sampling_blackbox import SAMPLING, SUPPORT_MARGIN
from specaudit.adapters.vllm.lifecycle import SERVER_ARGS
from specaudit.adapters.vllm.metrics import SpecCounts
from specaudit.adapters.vllm.server import sampling_size, workaround_env
from specaudit.artifacts.report import entry, write_report
from specaudit.config.settings import VllmAuditSettings
from specaudit.contracts.subjects import VLLM_BLACK_BOX, VLLM_WHITE_BOX
from specaudit.numerics.fit import ALPHA
from specaudit.reference.vllm_mutants import BY_NAME, WORKAROUNDS, WORKAROUNDS_ENV

WHITEBOX_EVIDENCE = "every target forward's paged layout and every request's outputs, in process, on drawn workloads"
WHITEBOX_NOTE = ("White box: workloads Hypothesis drew through an in-process engine (drawn), preemptions vLLM made, "
                 "accepted over drafted tokens, and the share of verify steps with two or more drafting requests in "
                 "which they accepted different counts (ragged).")  # fmt: skip
NOTHING_ACCEPTED = "nothing was accepted: a run in which nothing was accepted proves little"
SAMPLING_NOTE = ("Sampling: seeded requests per prompt at the settings in the header, every token scored against the "
                 "target's exact float64 distribution given its own request's prefix, pooled into one KS test (its "
                 "distance against the bound of the stated false-alarm probability); acceptance: the server's during "
                 "those requests.")  # fmt: skip
IN_FLIGHT = ("In flight: requests sent and not yet answered, seen at the client (overlapped: in flight with another; "
             "peak: the most at once); the server runs at most `--max-num-seqs` 8 of them together.")  # fmt: skip


@dataclass(frozen=True)
class ConfigurationOutcome:
    """One served model x configuration: the black-box verdict (`passed`, `verdict`) and the
    server's speculative counters, and the white box's result (`adapters.vllm.whitebox`, as JSON;
    None: not run)."""

    model: str
    configuration: str
    speculative: dict[str, Any] | None
    passed: bool
    verdict: str
    requests: int = 0
    overlapped: int = 0
    peak_in_flight: int = 0
    exact_match: float = 0.0
    partial_match: float = 0.0
    counts: SpecCounts = field(default_factory=SpecCounts)
    startup_s: float = 0.0
    engine_s: float = 0.0
    oracle_s: float = 0.0
    wall_s: float = 0.0
    error: str = ""
    coverage: dict[str, Any] | None = None  # the black-box audit's (`checks.coverage`); None: it never ran
    stop_strings: int = 0  # black-box requests that carried a stop string (`engine_blackbox.with_stops`)
    ended_at_stop: int = 0  # of those, the ones that ended short of max_tokens (at the stop string)
    whitebox: dict[str, Any] | None = None  # `WhiteBoxResult.to_json()`; None: the white box did not run
    sampling: dict[str, Any] | None = None  # the sampling black box's summary (`sampling_summary`); None: not run

    @property
    def whitebox_passed(self) -> bool | None:
        return None if self.whitebox is None else bool(self.whitebox.get("passed"))

    @property
    def sampling_passed(self) -> bool | None:
        return None if self.sampling is None else bool(self.sampling.get("passed"))

    @property
    def all_passed(self) -> bool:
        """Both levels: the black box (greedy, and sampling where it ran), and the white box where it ran."""
        return self.passed and self.whitebox_passed is not False and self.sampling_passed is not False

    @property
    def nothing_accepted(self) -> bool:
        return self.speculative is not None and self.counts.accepted <= 0

    @property
    def sampling_preemptions(self) -> float:
        """The server's preemptions during the sampling black box (0: it did not run)."""
        return float(((self.sampling or {}).get("counts") or {}).get("preemptions", 0.0))

    @property
    def unexercised(self) -> list[str]:
        """The server's features (`server.server_block`, prefix caching) its requests, greedy or
        sampled, never reached, by its own counters: a pass there says nothing of them."""
        out = ["a preemption"] if self.counts.preemptions + self.sampling_preemptions <= 0 else []
        return out + (["a prefix-cache hit"] if self.counts.prefix_hits <= 0 else [])

    @property
    def warnings(self) -> list[str]:
        out = [NOTHING_ACCEPTED] if self.nothing_accepted else []
        if self.speculative is None and self.counts.drafted > 0:
            out.append(f"the control drafted {self.counts.drafted:g} tokens: speculation was on")
        if not self.error:
            out += [f"flagged: the black box's requests never reached {feature}" for feature in self.unexercised]
        out += [f"sampling: {w}" for w in (self.sampling or {}).get("warnings", [])]
        return out + [f"white box: {w}" for w in (self.whitebox or {}).get("warnings", [])]

    def to_json(self) -> dict[str, Any]:
        """The black box's entry (the white box has an entry of its own)."""
        counts = asdict(self.counts) | {"acceptance": self.counts.acceptance}
        skip = ("counts", "whitebox", "sampling")
        data = {k: v for k, v in asdict(self).items() if k not in skip}
        return data | {"counts": counts, "warnings": self.warnings}


def peak_in_flight(spans: Sequence[tuple[float, float]]) -> int:
    """The most requests in flight at one instant (a request answered as another is sent counts as overlapping)."""
    events = sorted([(s, 0) for s, _ in spans] + [(e, 1) for _, e in spans])
    now = peak = 0
    for _, kind in events:
        now += 1 if kind == 0 else -1
        peak = max(peak, now)
    return peak


def from_report(report: dict[str, Any]) -> dict[str, Any]:
    """The figures of a black-box report entry that the vLLM report shows."""
    rows = report.get("requests", [])
    spans = [(r["start"], r["end"]) for r in rows if r.get("start") is not None and r.get("end") is not None]
    return {
        "passed": bool(report["passed"]),
        "verdict": str(report["verdict"]),
        "requests": len(rows),
        "overlapped": sum(bool(r.get("overlapped")) for r in rows),
        "peak_in_flight": peak_in_flight(spans),
        "exact_match": float(report["exact_match"]),
        "partial_match": float(report["partial_match"]),
        "engine_s": float(report["seconds"]),
        "oracle_s": float(report["oracle_seconds"]),
        "coverage": report.get("coverage"),
        **stop_figures(rows),
    }


def stop_figures(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    """How many requests carried a stop string, and how many of them came back short of `max_tokens`."""
    stopped = [r for r in rows if r.get("stop") is not None]
    short = [r for r in stopped if len(r.get("tokens") or ()) < int(r.get("max_new_tokens") or 0)]
    return {"stop_strings": len(stopped), "ended_at_stop": len(short)}


def render_markdown(outcomes: Sequence[ConfigurationOutcome], header: str = "") -> str:
    """The report: one table row per configuration, then each warning and error, then the level of evidence."""
    from specaudit.adapters.engine_blackbox import EVIDENCE

    lines = ["# specaudit audit-vllm", ""] + ([header, ""] if header else [])
    lines += [
        "| model | configuration | black box | exact | partial | in flight (overlapped / peak) | drafted | accepted "
        "| acceptance | preempted (greedy / sampling) | startup s | engine s | oracle s | sampling | tokens "
        "| KS / bound | acceptance | s "
        "| white box | drawn | preempted | drafts verified | acceptance | ragged | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        rate = "-" if o.counts.acceptance is None else f"{o.counts.acceptance:.2f}"
        verdict = "PASS" if o.passed else "FAIL"
        lines.append(
            f"| {o.model} | {o.configuration} | {verdict} | {o.exact_match:.2f} | {o.partial_match:.2f} | "
            f"{o.overlapped} of {o.requests} / {o.peak_in_flight} | {o.counts.drafted:g} | {o.counts.accepted:g} | "
            f"{rate} | {o.counts.preemptions:g} / {o.sampling_preemptions:g} | {o.startup_s:.1f} | "
            f"{o.engine_s:.1f} | {o.oracle_s:.1f} | "
            f"{sampling_cells(o.sampling)} | {whitebox_cells(o.whitebox)} |"
        )
    lines += ["", IN_FLIGHT, "", SAMPLING_NOTE, "", WHITEBOX_NOTE] + notes_of(outcomes)
    lines += [""] + [f"Worked around, `{n}`: {WORKAROUNDS[n].description}." for n in worked_around()]
    passed = sum(o.all_passed for o in outcomes)
    evidence = f"black box {EVIDENCE}; sampling {SAMPLING_EVIDENCE}; white box {WHITEBOX_EVIDENCE}"
    lines += ["", f"{passed} of {len(outcomes)} configurations passed (both levels).", "",
              f"Level of evidence: {evidence}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def notes_of(outcomes: Sequence[ConfigurationOutcome]) -> list[str]:
    """Each warning, failing verdict and error, per configuration."""
    notes = [f"- **{o.model} / {o.configuration}**: {w}" for o in outcomes for w in o.warnings]
    for o in outcomes:  # what the white box's draws exercised (`whitebox.Features`)
        if o.whitebox and o.whitebox.get("features"):
            counts = ", ".join(f"{n} {feature}" for feature, n in o.whitebox["features"].items())
            notes.append(f"- **{o.model} / {o.configuration}** white box coverage: {counts}")
    notes += [f"- **{o.model} / {o.configuration}** black box stop strings: {o.stop_strings} requests carried one, "
              f"{o.ended_at_stop} ended short of max_tokens" for o in outcomes if o.stop_strings]  # fmt: skip
    notes += [f"- **{o.model} / {o.configuration}**: {o.verdict}" for o in outcomes if not o.passed and not o.error]
    notes += [f"- **{o.model} / {o.configuration}** ERROR: {o.error.splitlines()[0]}" for o in outcomes if o.error]
    for o in outcomes:
        if o.sampling_passed is False and o.sampling is not None:
            notes.append(f"- **{o.model} / {o.configuration}** sampling FAIL: {o.sampling.get('verdict')}")
        if o.whitebox_passed is False:
            first = (o.whitebox.get("violations") or [{}])[0] if o.whitebox else {}
            where = o.whitebox.get("reproducer") or o.whitebox.get("error", "") if o.whitebox else ""
            notes.append(f"- **{o.model} / {o.configuration}** white box FAIL: {first.get('check')}/"
                         f"{first.get('rule')} {first.get('found', '')} ({where})")  # fmt: skip
    return [""] + notes if notes else []


def sampling_cells(sampling: dict[str, Any] | None) -> str:
    """verdict | sampled tokens | KS distance / its bound | accepted over drafted tokens | seconds."""
    if sampling is None:
        return "- | - | - | - | -"
    fit, counts = sampling.get("fit", {}), sampling.get("counts", {})
    rate = counts.get("acceptance")
    verdict = "PASS" if sampling.get("passed") else "FAIL"
    ks = f"{fit['distance']:.3f} / {fit['bound']:.3f}" if fit.get("bound") not in (None, float("inf")) else "-"
    return (f"{verdict} | {sampling.get('tokens', 0)} | {ks} | {'-' if rate is None else f'{rate:.2f}'} | "
            f"{sampling.get('engine_s', 0) + sampling.get('oracle_s', 0):.0f}")  # fmt: skip


def whitebox_cells(whitebox: dict[str, Any] | None) -> str:
    """verdict | workloads drawn | preemptions | drafts per verifying query (least-most) | acceptance |
    ragged share | seconds."""
    if whitebox is None:
        return "- | - | - | - | - | - | -"
    a = whitebox.get("acceptance", {})

    def show(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lengths = sorted(int(n) for n in a.get("lengths", {}))
    verified = f"{lengths[0]}-{lengths[-1]}" if lengths else "-"
    verdict = "PASS" if whitebox.get("passed") else "FAIL"
    return (f"{verdict} | {whitebox.get('examples', 0)} | {whitebox.get('preemptions', 0)} | {verified} | "
            f"{show(a.get('rate'))} | {show(a.get('ragged_share'))} | {whitebox.get('seconds', 0):.0f}")  # fmt: skip


def sampling_header(settings: VllmAuditSettings) -> str:
    """What the sampling black box sent per configuration, and the vLLM defects worked around meanwhile."""
    sizes = ", ".join(
        f"{m} {p} prompts x {r}" for m in settings.models for p, r in [sampling_size(settings.requests, m)]
    )
    names = ", ".join(f"`{n}`" for n in worked_around()) or "none"
    return (f"Sampling black box: seeded requests of {settings.max_new_tokens} tokens ({sizes}) "
            f"at {SAMPLING!r}, false alarm <= {ALPHA:g} per verdict, a token outside top-k/top-p impossible "
            f"beyond a logit margin of {SUPPORT_MARGIN:g}. vLLM defects worked around in every server: {names} "
            f"(below; `{WORKAROUNDS_ENV}=` serves vLLM as shipped).")  # fmt: skip


def planted_expectation(name: str) -> str:
    """What a planted bug should fail: both levels, or (a bug only sampling shows) the sampling verdicts."""
    if BY_NAME[name].check == "distribution":
        return "a negative control only sampling sees: the speculative configurations' sampling verdicts should fail"
    return "a negative control: both levels should fail"


def worked_around() -> list[str]:
    return [n.strip() for n in workaround_env()[WORKAROUNDS_ENV].split(",") if n.strip() in WORKAROUNDS]


def write_reports(
    settings: VllmAuditSettings, outcomes: Sequence[ConfigurationOutcome], wall_s: float, version: str
) -> str:
    header = (f"vLLM {version} (`{' '.join(SERVER_ARGS)}`); black box: {settings.requests} requests of up to "
              f"{settings.max_new_tokens} tokens per configuration, arrivals over {settings.spread:g} s, seed "
              f"{settings.seed}; white box: up to {settings.whitebox_examples} drawn workloads within "
              f"{settings.whitebox_minutes:g} min per configuration; total wall time {wall_s:.0f} s. "
              f"{sampling_header(settings)}")  # fmt: skip
    if settings.plant:
        header += f" Planted in every server and white box: `{settings.plant}` ({planted_expectation(settings.plant)})."
    text = render_markdown(outcomes, header)
    settings.out.mkdir(parents=True, exist_ok=True)
    (settings.out / "report.md").write_text(text)
    entries = []
    for o in outcomes:
        where = {"model": o.model, "configuration": o.configuration}
        entries.append(entry(VLLM_BLACK_BOX.report, where | {"level": "black box"}, o.passed, None, None, o.to_json()))
        if o.sampling is not None:
            entries.append(entry(VLLM_BLACK_BOX.report, where | {"level": "black box, sampling"},
                                 bool(o.sampling_passed), None, None, o.sampling))  # fmt: skip
        if o.whitebox is not None:
            entries.append(
                entry(
                    VLLM_WHITE_BOX.report,
                    where | {"level": "white box"},
                    bool(o.whitebox_passed),
                    None,
                    None,
                    o.whitebox,
                )
            )
    write_report(settings.out, "audit-vllm", entries, wall_s=wall_s, vllm=version, settings=asdict(settings))
    return text
