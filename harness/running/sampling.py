"""Run a sampling decoder: one sampling case, several seeded runs, and the distribution oracle.

Each run is an ordinary decoder run (`running.runner.Run`) on the instrumented transparent target
and a mixture draft (`fixtures.sampling`), with the sampling keywords and a generator seeded
for that run. Its sampled tokens are its committed ones: each run's `oracle` is its own output,
so I1, I2 and the contract judge every forward of a sampled run exactly as in greedy mode.

The distribution oracle (`SampledRun.distribution`): for every sampled token, the exact target
distribution given that row's own prefix, teacher-forced at batch size 1 in float64 on the
target and processed by the case's settings (`contracts.sampling.target_distribution`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from specaudit.contracts.case import Case
from specaudit.contracts.decoder import load_decoder
from specaudit.contracts.sampling import SamplingCase, target_distribution
from specaudit.fixtures.pairs import target_model
from specaudit.fixtures.sampling import mixture_draft
from specaudit.models.compat import call_model
from specaudit.numerics.fit import pit_uniforms
from specaudit.reference.oracle import OracleResult
from specaudit.running.runner import Run, guarded_call, idle_limit, max_forwards
from specaudit.running.watchdog import Watchdog


@dataclass
class SampledRun:
    """Every run of one sampling case, and what the checks compute from them once."""

    case: SamplingCase
    decoder: str
    runs: list[Run]  # one per seed, in order; the first that broke the contract ends the list
    target: torch.nn.Module
    cached: dict[str, Any] = field(default_factory=dict, repr=False)  # check -> what it computed

    def distribution(self, run: int, row: int) -> torch.Tensor:
        """[n, V] float64: p of each of row `row`'s n sampled tokens in run `run`, given its own prefix."""
        key = ("p", run, row)
        if key not in self.cached:
            prompt = self.case.case.prompts[row]
            tokens = list(prompt) + list(self.runs[run].outputs[row])  # type: ignore[index]
            self.cached[key] = teacher_forced(self.target, tokens, len(prompt), self.case)
        return self.cached[key]

    def uniforms(self, run: int, row: int, n: int) -> torch.Tensor:
        """[n] the randomized PIT's uniforms for one row: seeded by the case, so a verdict replays."""
        return pit_uniforms(n, self.case.seed, run, row)


def teacher_forced(target: torch.nn.Module, tokens: list[int], prompt: int, case: SamplingCase) -> torch.Tensor:
    """[n, V] the target's processed distribution at each of the n = len(tokens) - prompt sampled positions."""
    n = len(tokens) - prompt
    if n <= 0:
        return torch.zeros(0, target.config.vocab_size, dtype=torch.float64)
    ids = torch.tensor([tokens[:-1]])  # [1, L - 1]: the last token is scored, never fed
    with torch.no_grad():
        logits, _ = call_model(target, ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None], DynamicCache())
    return target_distribution(logits[0, prompt - 1 :], case.sampling)  # [n, V]


def own_oracle(case: Case, outputs: list[list[int]] | None) -> list[OracleResult]:
    """Each row's sampled tokens as its committed ones (what I2 holds the cache to)."""
    rows = outputs or [[] for _ in case.prompts]
    stops = ["eos" if out and out[-1] == case.eos_token_id else "length" for out in rows]
    return [OracleResult(tuple(out), stop, ()) for out, stop in zip(rows, stops)]  # type: ignore[arg-type]


def run_sampling_case(decoder_spec: str, scase: SamplingCase, *, factory: Any = None) -> SampledRun:
    """`decoder_spec` on `scase`: its runs in order, stopping at the first contract break."""
    factory = factory or load_decoder(decoder_spec)
    case = scase.case
    target = target_model(case.model, case.dtype)
    runs: list[Run] = []
    for index in range(scase.runs):
        draft = mixture_draft(scase.disagree)
        generator = torch.Generator().manual_seed(scase.run_seed(index))
        watchdog = Watchdog(idle_limit(case), max_forwards=max_forwards(case))
        keywords = {**scase.sampling.keywords(), "generator": generator}
        guard = guarded_call(decoder_spec, factory, target, draft, case, watchdog, sampling=keywords)
        oracle = own_oracle(case, guard.outputs)
        run = Run(case, decoder_spec, guard.outputs, guard.error, oracle, [], guard.recording, target,
                  guard.seconds, guard.decoder, factory)  # fmt: skip
        runs.append(run)
        if guard.error is not None:
            break
    return SampledRun(scase, decoder_spec, runs, target)
