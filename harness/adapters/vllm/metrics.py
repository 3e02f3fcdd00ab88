"""A vLLM server's /metrics (Prometheus text): the speculative-decoding, preemption and prefix-cache
counters read before and after each audit."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass

SPEC_METRICS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "drafted": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
    "preemptions": "vllm:num_preemptions_total",
    "prefix_hits": "vllm:prefix_cache_hits_total",
}
"""The /metrics counters read before and after each audit (summed over their labels)."""


SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")
"""A Prometheus text sample: `name{labels} value [timestamp]`."""


def parse_metrics(text: str) -> dict[str, float]:
    """Each sample's value summed by metric name over its labels (comments and unparsable lines skipped)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = SAMPLE.match(line.strip())
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        totals[match.group(1)] = totals.get(match.group(1), 0.0) + value
    return totals


@dataclass(frozen=True)
class SpecCounts:
    """Counters of one server: drafting rounds, draft tokens proposed, accepted; requests preempted;
    prompt tokens the prefix cache served."""

    drafts: float = 0.0
    drafted: float = 0.0
    accepted: float = 0.0
    preemptions: float = 0.0
    prefix_hits: float = 0.0

    @classmethod
    def from_metrics(cls, metrics: dict[str, float]) -> SpecCounts:
        return cls(**{key: metrics.get(name, 0.0) for key, name in SPEC_METRICS.items()})

    def __sub__(self, other: SpecCounts) -> SpecCounts:
        return SpecCounts(**{key: getattr(self, key) - getattr(other, key) for key in SPEC_METRICS})

    @property
    def acceptance(self) -> float | None:
        return None if self.drafted <= 0 else self.accepted / self.drafted


def fetch_counts(url: str, timeout_s: float = 10.0) -> SpecCounts:
    with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as response:
        return SpecCounts.from_metrics(parse_metrics(response.read().decode(errors="replace")))
