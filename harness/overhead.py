"""Real-model mode, overhead: what the instrumentation costs at each I2 sampling rate.

`measure_overhead` times the decoder un-instrumented and instrumented at each rate, plus the
I1 + I2 checks, on one case; a GPU gate picks its `--check-rate` from these numbers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specaudit.case import Case
from specaudit.checks import check_i1, check_i2
from specaudit.contract import load_decoder
from specaudit.realmodel import checks_target, make_sampler, oracle_for, run_batch, timed_call, warm_up

TIMEOUT_S = 600.0


@dataclass(frozen=True)
class OverheadRow:
    """One sampling rate's cost, each part relative to the un-instrumented decoder time."""

    rate: float
    sampled_calls: int
    target_calls: int
    baseline_seconds: float  # un-instrumented decoder, median of the repeats
    instrumented_seconds: float  # instrumented decoder, median
    check_seconds: float  # I1 + I2, median

    @property
    def record_overhead(self) -> float:
        return self.instrumented_seconds / self.baseline_seconds - 1

    @property
    def check_overhead(self) -> float:
        return self.check_seconds / self.baseline_seconds

    def render(self) -> str:
        return (
            f"rate {self.rate:.2f}: I2 on {self.sampled_calls}/{self.target_calls} target calls, "
            f"decoder {self.baseline_seconds * 1e3:.1f} ms un-instrumented, {self.instrumented_seconds * 1e3:.1f} ms "
            f"instrumented ({self.record_overhead:+.0%}), I1+I2 checks {self.check_seconds * 1e3:.1f} ms "
            f"({self.check_overhead:+.0%}), total {self.record_overhead + self.check_overhead:+.0%}"
        )


def measure_overhead(
    decoder_spec: str,
    target: torch.nn.Module,
    draft: torch.nn.Module,
    case: Case,
    *,
    rates: Sequence[float] = (1.0, 0.25, 0.0),
    repeats: int = 3,
    seed: int = 0,
) -> list[OverheadRow]:
    """Decoder wall time un-instrumented vs instrumented at each sampling rate, plus I1 + I2 time.

    After one warm-up call, each repeat runs the un-instrumented decoder and then every rate
    in turn (interleaved, so drifting machine load hits all of them alike); medians are kept.
    """
    factory = load_decoder(decoder_spec)
    judge = checks_target(target)
    oracle, _ = oracle_for(judge, case)
    warm_up(decoder_spec, factory, target, draft, case, TIMEOUT_S)
    baseline: list[float] = []
    seconds: dict[float, list[float]] = {rate: [] for rate in rates}
    checks: dict[float, list[float]] = {rate: [] for rate in rates}
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
            )
            start = time.perf_counter()
            check_i1(run)
            check_i2(run)
            checks[rate].append(time.perf_counter() - start)
            seconds[rate].append(run.seconds)
            counts[rate] = (run.sampled_calls, len(run.recording.target_calls))
    base = statistics.median(baseline)
    return [
        OverheadRow(rate, *counts[rate], base, statistics.median(seconds[rate]), statistics.median(checks[rate]))
        for rate in rates
    ]
