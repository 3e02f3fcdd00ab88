"""A transformers CB run judged: `checks.registry.evaluate(PAGED, PagedRun(...))`.

Every paged rule on every forward (kv-entry against a batch-size-1 run's K/V), then each
request's output contract (length, stop, one answer per prompt without raising), equivalence
with the batch-size-1 greedy oracle and liveness: the same checks, through the same registry
entry, as vLLM's white box, so neither engine has judging code of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specaudit.adapters.transformers_cb.driver import CbRun
from specaudit.adapters.transformers_cb.models import oracle_model
from specaudit.adapters.transformers_cb.workload import ENGINE
from specaudit.checks.registry import PAGED, Evaluation, evaluate
from specaudit.contracts.subjects import EVIDENCE_PAGED
from specaudit.contracts.violation import Violation
from specaudit.reference.oracle import OracleResult, answer_oracles, greedy_oracle, reference_kv
from specaudit.running.paged import PagedRun
from specaudit.running.record import Entry, Record


@dataclass(frozen=True)
class CbVerdict:
    """A run judged by every check of the paged-engine subject."""

    run: CbRun
    evaluation: Evaluation
    judge_seconds: float

    @property
    def passed(self) -> bool:
        return self.evaluation.passed

    @property
    def violations(self) -> list[Violation]:
        return self.evaluation.violations

    @property
    def first(self) -> Violation | None:
        return self.violations[0] if self.violations else None

    def render(self) -> str:
        w, head = self.run.workload, f"{ENGINE} [{self.run.workload.entry}]"
        first = self.first.render() if self.first is not None else "a check failed without a violation"
        status = "PASS" if self.passed else f"FAIL: {first}"
        return (
            f"{head}: {status}; {len(w.requests)} requests, {len(self.run.trace.calls)} forwards, "
            f"engine {self.run.seconds:.2f} s, judge {self.judge_seconds:.2f} s"
        )


def kv_reference(target: torch.nn.Module, layers: Sequence[int]) -> Callable[[tuple[int, ...]], torch.Tensor]:
    """tokens -> [n, L', 2, kv_heads, head_dim]: a batch-size-1 run's K/V (after RoPE) in `layers`,
    what kv-entry compares each written entry with."""

    def entries(tokens: tuple[int, ...]) -> torch.Tensor:
        per_layer = reference_kv(target, tokens)  # per layer (K, V) [H, n, D]
        picked = [torch.stack(per_layer[i], dim=0).permute(2, 0, 1, 3) for i in layers]  # [n, 2, H, D]
        return torch.stack(picked, dim=1)

    return entries


def output_record(run: CbRun, target: torch.nn.Module) -> Record:
    """Each request's answer against its batch-size-1 greedy oracle, as the record every subject keeps
    (steps: admitted at its arrival, retired when its last incarnation left)."""
    w, trace = run.workload, run.trace
    eos = w.eos_token_id
    wanted = [(r.prompt, run.answers.get(r.id) or (), r.max_new_tokens) for r in w.requests]
    with torch.no_grad():
        oracles = answer_oracles(target, wanted, eos, cut=True)
    record = Record(f"{ENGINE}:{w.entry}", EVIDENCE_PAGED, "steps", eos)
    for i, (r, oracle) in enumerate(zip(w.requests, oracles)):
        incarnations = trace.incarnations_of(r.id)
        retired = max((trace.left.get(t, 0) for t in incarnations), default=None)
        aborted = any(t in trace.aborted for t in incarnations)
        tokens = list(run.answers.get(r.id) or ())
        record.admit(Entry(i, r.prompt, r.max_new_tokens, oracle, tokens, r.arrival, retired, aborted))
    return record


def transport_errors(run: CbRun) -> dict[int | None, Violation]:
    """The entry point's own breaks (it raised, or gave no result): contract violations by request."""
    wanted = "one sequence of new tokens per prompt, returned without raising"
    return {
        i: Violation("contract", "generate-returns", f"{r.id}: {run.errors[r.id]}", wanted, request=i)
        for i, r in enumerate(run.workload.requests)
        if r.id in run.errors
    }


def verdict_of(run: CbRun, target: torch.nn.Module | None = None, reference: bool = True) -> CbVerdict:
    """`evaluate(PAGED, PagedRun(...))`: every paged rule on every forward (kv-entry against a
    batch-size-1 run unless `reference` is off), then each request's output contract,
    equivalence and liveness. `target` is the oracle's model (the shared tiny Llama by default)."""
    start = time.perf_counter()
    target = oracle_model(run.workload.seed) if target is None else target
    kv = kv_reference(target, run.trace.kv_layers) if reference and run.trace.kv_layers else None
    oracle = oracle_from(target, run.workload.eos_token_id)
    evidence = PagedRun(run.trace, output_record(run, target), kv, "float32", oracle, transport_errors(run))
    evaluation = evaluate(PAGED, evidence)
    return CbVerdict(run, evaluation, time.perf_counter() - start)


def oracle_from(target: torch.nn.Module, eos: int | None) -> Callable[[tuple[int, ...], int], OracleResult]:
    """(prefix, n) -> the batch-size-1 greedy continuation: what equivalence re-syncs on after a tie."""

    def continue_from(prefix: tuple[int, ...], n: int) -> OracleResult:
        with torch.no_grad():
            return greedy_oracle(target, prefix, max_new_tokens=n, eos_token_id=eos)

    return continue_from
