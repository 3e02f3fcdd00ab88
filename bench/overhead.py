"""What the instrumentation costs on a real model at each I2 sampling rate (bench/overhead_real.py).

`measure_overhead` times the decoder un-instrumented and instrumented at each rate, plus the
I1 + I2 checks, on one case; a GPU gate picks its `--check-rate` from these numbers. I2's
batch-size-1 reference K/V comes either from the oracle's own kept cache ("oracle", the
default) or from a batch-size-1 forward per row sequence ("rerun", the path before the oracle
kept its cache); both are checked on the same instrumented run, so they compare side by side.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from specaudit.adapters.realmodel import (
    RealRun,
    checks_target,
    make_sampler,
    oracle_for,
    run_batch,
    timed_call,
    warm_up,
)
from specaudit.checks import check_i1, check_i2
from specaudit.contracts.case import Case
from specaudit.contracts.decoder import load_decoder
from specaudit.numerics.calibration import NoiseFloor
from specaudit.running.runner import Derived

TIMEOUT_S = 600.0
REFERENCES = ("oracle", "rerun")


@dataclass(frozen=True)
class OverheadRow:
    """One sampling rate's cost, each part relative to the un-instrumented decoder time."""

    rate: float
    sampled_calls: int
    target_calls: int
    baseline_seconds: float  # un-instrumented decoder, median of the repeats
    instrumented_seconds: float  # instrumented decoder, median
    check_seconds: float  # I1 + I2, median
    reference: str = "oracle"  # where I2's batch-size-1 K/V came from (see REFERENCES)

    @property
    def record_overhead(self) -> float:
        return self.instrumented_seconds / self.baseline_seconds - 1

    @property
    def check_overhead(self) -> float:
        return self.check_seconds / self.baseline_seconds

    @property
    def total_overhead(self) -> float:
        return self.record_overhead + self.check_overhead

    def render(self) -> str:
        return (
            f"rate {self.rate:.2f}: I2 on {self.sampled_calls}/{self.target_calls} target calls "
            f"({self.reference} reference), decoder {self.baseline_seconds * 1e3:.1f} ms un-instrumented, "
            f"{self.instrumented_seconds * 1e3:.1f} ms instrumented ({self.record_overhead:+.0%}), I1+I2 checks "
            f"{self.check_seconds * 1e3:.1f} ms ({self.check_overhead:+.0%}), total {self.total_overhead:+.0%}"
        )


def without_kept_kv(run: RealRun) -> RealRun:
    """The same run as the old reference path sees it: no kept oracle cache, nothing memoized."""
    return replace(run, oracle=[replace(o, kv=None) for o in run.oracle], derived=Derived())


def timed_checks(run: RealRun) -> float:
    start = time.perf_counter()
    check_i1(run)
    check_i2(run)
    return time.perf_counter() - start


def measure_overhead(
    decoder_spec: str,
    target: torch.nn.Module,
    draft: torch.nn.Module,
    case: Case,
    *,
    rates: Sequence[float] = (1.0, 0.25, 0.0),
    repeats: int = 3,
    seed: int = 0,
    references: Sequence[str] = ("oracle",),
    noise: NoiseFloor | None = None,
) -> list[OverheadRow]:
    """Decoder wall time un-instrumented vs instrumented at each sampling rate, plus I1 + I2 time
    with each reference path in `references` (one row per rate and reference).

    After one warm-up call, each repeat runs the un-instrumented decoder and then every rate
    in turn (interleaved, so drifting machine load hits all of them alike), checking each
    instrumented run once per reference path; medians are kept.
    """
    unknown = set(references) - set(REFERENCES)
    if unknown:
        raise ValueError(f"unknown I2 reference path(s) {sorted(unknown)}; use {', '.join(REFERENCES)}")
    factory = load_decoder(decoder_spec)
    judge = checks_target(target)
    oracle, _ = oracle_for(judge, case)
    warm_up(decoder_spec, factory, target, draft, case, TIMEOUT_S)
    baseline: list[float] = []
    seconds: dict[float, list[float]] = {rate: [] for rate in rates}
    checks: dict[tuple[float, str], list[float]] = {(rate, ref): [] for rate in rates for ref in references}
    counts: dict[float, tuple[int, int]] = {}
    for _ in range(repeats):
        baseline.append(timed_call(decoder_spec, factory, target, draft, case, TIMEOUT_S)[2])
        for rate in rates:
            sample = make_sampler(seed, 0, rate)
            run = run_batch(
                decoder_spec,
                factory,
                case,
                target,
                draft,
                sample=sample,
                sample_rate=rate,
                baseline=False,
                oracle=oracle,
                noise=noise,
            )
            for ref in references:
                checks[(rate, ref)].append(timed_checks(run if ref == "oracle" else without_kept_kv(run)))
            seconds[rate].append(run.seconds)
            counts[rate] = (run.sampled_calls, len(run.recording.target_calls))
    base = statistics.median(baseline)
    return [
        OverheadRow(
            rate, *counts[rate], base, statistics.median(seconds[rate]), statistics.median(checks[(rate, ref)]), ref
        )
        for rate in rates
        for ref in references
    ]
