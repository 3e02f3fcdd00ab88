"""Black-box engines: decoders that own their models (a serving engine), token prompts in, tokens out.

The harness cannot hook an engine's models, so I1, I2 and token preservation are out of
reach; what is left is the end-to-end property, *equivalence with the batch-size-1 greedy
oracle*, computed on a target the caller holds in process (the same weights the engine
serves). Verdicts are tie-aware as everywhere else (`specaudit.checks.compare_row`): a
divergence at a step whose oracle top-1/top-2 margin is within the dtype's tolerance is a
numerical tie, the comparison re-syncs onto the engine's token and goes on.

An engine is anything with

    generate(prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> list[list[int]]

returning per prompt, in order, the new tokens only, ending at the first EOS (included) or
at max_new_tokens. docs/vllm_example.md wraps a vLLM `LLM` this way; `DecoderEngine` wraps
any decoder of the decoder contract and is the in-process reference used by the tests.

The batch is judged by the registry's black-box checks (`evaluate(BLACK_BOX, ...)`: contract,
equivalence, liveness over a `running.record.Record`), as `engine_blackbox.judge_answers` judges
a staggered run. A failure's signature comes from re-running the diverging prompt alone:
`bonus` when it is wrong alone too, `batch-only` (the registry's signature for an output-level
subject, `checks.registry.SIGNATURES`) when it is right alone: a batch-dependent error that the
output level cannot place (a position, alignment or K/V error inside the engine).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from specaudit.checks import Equivalence, RowEquivalence
from specaudit.checks.outputs import OutputEvidence, compared
from specaudit.checks.registry import BLACK_BOX, evaluate
from specaudit.contracts.case import Case
from specaudit.contracts.decoder import ContractError, instantiate, load_decoder, validate_output
from specaudit.contracts.subjects import EVIDENCE_BLACK_BOX
from specaudit.contracts.violation import Violation, render
from specaudit.numerics.tolerance import DTYPES
from specaudit.reference.oracle import OracleResult, answer_oracles, greedy_oracle
from specaudit.running.record import Entry, Record


@runtime_checkable
class BlackBoxEngine(Protocol):
    """An engine that owns its models: token prompts in, new tokens out (greedy)."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> list[list[int]]: ...


def engine_name(engine: Any) -> str:
    return str(getattr(engine, "name", None) or type(engine).__name__)


def dtype_name(model: torch.nn.Module) -> str:
    """The DTYPES key of a model's floating dtype (float32 if it has none we know)."""
    dtype = getattr(model, "dtype", None)
    if dtype is None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return next((name for name, d in DTYPES.items() if d == dtype), "float32")


@dataclass(frozen=True)
class BlackBoxResult:
    """Equivalence of one black-box batch with the batch-size-1 oracle, with its evidence."""

    engine: str
    case: Case  # the batch as plain data (model "external:...", no acceptance schedule)
    outputs: tuple[tuple[int, ...], ...] | None  # None: the engine broke the output contract
    rows: tuple[RowEquivalence, ...]
    violations: tuple[Violation, ...]  # the registry's black-box checks: contract, equivalence, liveness
    signature: str | None  # for a failure: "bonus", "batch-only", "bookkeeping" or "contract"
    reason: str
    seconds: float  # engine wall time for the batch
    oracle_seconds: float  # batch-size-1 greedy target time for the same prompts

    @property
    def passed(self) -> bool:
        return not self.violations

    @property
    def summary(self) -> Equivalence:
        return Equivalence(self.rows)

    @property
    def exact_match(self) -> float:
        return self.summary.exact_match

    @property
    def partial_match(self) -> float:
        return self.summary.partial_match

    @property
    def ties(self) -> int:
        return self.summary.ties

    @property
    def verdict(self) -> str:
        return "contract broken" if self.outputs is None else self.summary.verdict

    @property
    def new_tokens(self) -> int:
        return sum(len(o) for o in self.outputs or ())

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")

    def render(self) -> str:
        lines = [f"{self.engine}: {'PASS' if self.passed else 'FAIL'} ({self.verdict}), black-box: equivalence only"]
        lines.append(
            f"  {len(self.case.prompts)} prompts, exact match {self.exact_match:.2f}, "
            f"partial match {self.partial_match:.2f}, ties {self.ties}, {self.tokens_per_s:.1f} tokens/s"
        )
        if not self.passed:
            lines.append(f"  signature: {self.signature} ({self.reason})")
            lines += ["  " + line for line in render(list(self.violations)).splitlines()]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "case": self.case.to_json(),
            "passed": self.passed,
            "verdict": self.verdict,
            "exact_match": self.exact_match,
            "partial_match": self.partial_match,
            "ties": self.ties,
            "signature": self.signature,
            "reason": self.reason,
            "outputs": None if self.outputs is None else [list(o) for o in self.outputs],
            "seconds": self.seconds,
            "oracle_seconds": self.oracle_seconds,
            "violations": [asdict(v) for v in self.violations],
        }


def _call_engine(engine: BlackBoxEngine, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> Any:
    try:
        return engine.generate([list(p) for p in prompts], max_new_tokens, eos)
    except Exception as exc:  # the engine's failure is evidence, not a crash of the audit
        raise ContractError("generate-returns", f"generate() raised {type(exc).__name__}: {exc}") from exc


def audit_blackbox(
    engine: BlackBoxEngine,
    target: torch.nn.Module,
    prompts: list[list[int]] | tuple[tuple[int, ...], ...],
    *,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    dtype: str | None = None,
    name: str | None = None,
    oracle: list[OracleResult] | None = None,
) -> BlackBoxResult:
    """Run `engine` on `prompts` once and judge its outputs against the batch-size-1 oracle.

    `target` is the engine's target model in process (same weights, same dtype); `dtype`
    (a DTYPES key) sets the tie tolerance and defaults to the target's. `oracle` may pass
    precomputed oracle results (one per prompt). Nothing is asserted: the result carries the
    verdict, the evidence and, for a failure, a signature ("bonus" when a diverging prompt
    diverges alone too, "batch-only" when it is right alone).
    """
    prompts_t = tuple(tuple(int(t) for t in p) for p in prompts)
    label = name or engine_name(engine)
    case = Case(
        prompts=prompts_t,
        accept=tuple(() for _ in prompts_t),
        num_draft_tokens=0,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        model=f"external:{label}",
        draft="blackbox",
        dtype=dtype or dtype_name(target),
    )
    outputs: list[list[int]] | None = None
    error: ContractError | None = None
    start = time.perf_counter()
    try:
        raw = _call_engine(engine, [list(p) for p in prompts_t], max_new_tokens, eos_token_id)
        seconds = time.perf_counter() - start
        outputs = validate_output(raw, len(prompts_t), max_new_tokens, eos_token_id)
    except ContractError as exc:
        seconds = time.perf_counter() - start
        error = exc
    start = time.perf_counter()
    if oracle is None:  # found by checking each output (one teacher-forced forward when it is right)
        answers = [tuple(o) for o in outputs] if outputs is not None else [() for _ in prompts_t]
        oracle = answer_oracles(
            target, [(p, a, max_new_tokens) for p, a in zip(prompts_t, answers)], eos_token_id, cut=True
        )
    oracle_seconds = time.perf_counter() - start
    evidence = batch_evidence(target, case, outputs, list(oracle), error)
    violations = evaluate(BLACK_BOX, evidence).violations
    rows = tuple(compared(evidence).values()) if outputs is not None else ()
    signature, reason = _signature(engine, case, rows, violations)
    return BlackBoxResult(
        label,
        case,
        None if outputs is None else tuple(tuple(o) for o in outputs),
        tuple(rows),
        tuple(violations),
        signature,
        reason,
        seconds,
        oracle_seconds,
    )


def batch_evidence(
    target: torch.nn.Module,
    case: Case,
    outputs: list[list[int]] | None,
    oracle: list[OracleResult],
    error: ContractError | None,
) -> OutputEvidence:
    """One batch as the registry's black-box evidence: each prompt a request of the record, its
    ties judged by the oracle's margin at the case's dtype and re-synced on the target."""
    eos = case.eos_token_id
    record = Record(case.model, EVIDENCE_BLACK_BOX, "calls", eos)
    for r, prompt in enumerate(case.prompts):
        tokens = list(outputs[r]) if outputs is not None else []
        record.admit(Entry(r, prompt, case.max_new_tokens, oracle[r], tokens, 0, 0))

    def oracle_from(prefix: tuple[int, ...], n: int) -> OracleResult:
        with torch.no_grad():
            return greedy_oracle(target, prefix, max_new_tokens=n, eos_token_id=eos)

    errors: dict[int | None, Violation] = {} if error is None else {None: error.violation()}
    return OutputEvidence(record, case.dtype, oracle_from, errors)


def _signature(
    engine: BlackBoxEngine, case: Case, rows: tuple[RowEquivalence, ...], violations: list[Violation]
) -> tuple[str | None, str]:
    if not violations:
        ties = sum(len(r.ties) for r in rows)
        return ("numerical-tie", f"{ties} divergence(s) at numerical ties only") if ties else (None, "")
    if violations[0].check == "contract":
        return "contract", violations[0].rule
    row = next(r for r in rows if not r.equivalent)
    if row.found[: len(row.reference)] == row.reference[: len(row.found)]:
        return "bookkeeping", f"row {row.row} stops at the wrong place ({row.found_stop} vs {row.expected_stop})"
    if len(case.prompts) == 1:
        return "bonus", "the wrong token appears at batch size 1"
    prompt = list(case.prompts[row.row])
    try:
        alone = validate_output(
            _call_engine(engine, [prompt], case.max_new_tokens, case.eos_token_id),
            1,
            case.max_new_tokens,
            case.eos_token_id,
        )[0]
    except ContractError:
        return "batch-only", "the prompt alone could not be re-run; the divergence shows in the batch"
    seen = tuple(alone) if row.complete else tuple(alone[: len(row.reference)])  # a cut oracle: up to its cut
    if seen != row.reference:
        return "bonus", "the wrong token appears even at batch size 1"
    return "batch-only", "right alone, wrong in the batch (alignment, position or KV error inside the engine)"


class DecoderEngine:
    """A decoder of the decoder contract with fixed models, seen as a black-box engine.

    The in-process reference for the black-box path: it left-pads the token prompts into one
    batch and calls `decoder.generate`. `decoder` is a decoder object or a `module:attr` spec.
    """

    def __init__(
        self,
        decoder: Any,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        *,
        num_draft_tokens: int = 4,
        pad_token_id: int = 0,
    ) -> None:
        if isinstance(decoder, str):
            decoder = instantiate(load_decoder(decoder), decoder)
        self.decoder = decoder
        self.target, self.draft = target, draft
        self.num_draft_tokens, self.pad_token_id = num_draft_tokens, pad_token_id
        self.name = f"engine({getattr(decoder, 'name', None) or type(decoder).__name__})"

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + list(p) for p in prompts])  # [B, T]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, T]
        device = getattr(self.target, "device", None)
        if device is not None:
            ids, mask = ids.to(device), mask.to(device)
        with torch.no_grad():
            return self.decoder.generate(
                self.target,
                self.draft,
                ids,
                mask,
                num_draft_tokens=self.num_draft_tokens,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos_token_id,
                pad_token_id=self.pad_token_id,
            )


__all__ = ["BlackBoxEngine", "BlackBoxResult", "DecoderEngine", "audit_blackbox", "dtype_name", "engine_name"]
