"""Real-model mode, running: a decoder on a real target/draft pair, batch by batch, with sampled I2.

Per batch of prompts (token ids, cut by `run_real`):

  1. oracle:    batch-size-1 greedy decoding of every prompt with the target (`oracle_for`),
                keeping its final cache on the CPU: I2's batch-size-1 reference K/V for every
                row that matches the oracle, so only diverged rows cost another forward;
  2. baseline:  the decoder once on the un-instrumented models: its wall time gives tokens/s;
  3. audited:   the decoder again on the instrumented models; I1 is checked on every target
                call, I2 (the K/V comparison with the batch-size-1 entries, judged against the
                measured noise floor when `noise` is given) only on a sampled share of the
                target calls, drawn by `make_sampler` from a `random.Random` seeded by
                (seed, batch): the same seed samples the same calls;
  4. verdict:   `audit_batch`: I1 + I2 timed, then `specaudit.checks.diagnosis.diagnose` (tie-aware
                equivalence, the first violated check and the paper's signature). A diverging
                row is re-run alone through `RealRun.rerun`, on the same decoder and models
                with every call checked, so an invariant hidden by sampling still shows.

Throughput is new tokens over the *un-instrumented* wall time (step 2). Instrumentation
overhead is reported in two parts, both relative to that time: recording (hooks and cache
snapshots: instrumented minus un-instrumented decoder time) and checking (I1 + I2 time).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specaudit.checks import check_i1, check_i2
from specaudit.checks.diagnosis import Diagnosis, diagnose
from specaudit.config.settings import DEFAULT_CHECK_RATE
from specaudit.contracts.case import Case
from specaudit.contracts.decoder import load_decoder
from specaudit.fixtures.transparent import RequestScript
from specaudit.models.compat import cache_keyword
from specaudit.models.loading import RealModelError, special_ids, tokenize
from specaudit.numerics.calibration import NoiseFloor
from specaudit.numerics.tolerance import DTYPES
from specaudit.reference.oracle import OracleResult, greedy_oracle
from specaudit.running.runner import Run, guarded_call, synchronize
from specaudit.running.watchdog import Watchdog

# ---------------------------------------------------------------------------------------
# Sampling and devices


def make_sampler(seed: int, batch: int, rate: float) -> Callable[[int], bool]:
    """Which target calls keep a snapshot for I2, asked in call order 0, 1, 2, ...

    Jittered systematic sampling: the calls are cut into consecutive blocks of about 1/rate
    calls (block k holds calls ceil(k / rate) .. ceil((k + 1) / rate) - 1) and one call is
    drawn uniformly in each block. So a run of n calls samples rate * n of them give or take
    one (plain coin flips can sample none of 20 calls at rate 0.25), and the random place in
    each block avoids aliasing with a decoder's periodic call pattern. Deterministic in
    (seed, batch): the draws come from a private `random.Random`; no global randomness is touched.
    """
    if rate <= 0.0:
        return lambda index: False
    if rate >= 1.0:
        return lambda index: True
    rng = random.Random(int(seed) * 1_000_003 + int(batch))
    block = {"k": 0, "end": 0, "chosen": -1}

    def sample(index: int) -> bool:
        while block["end"] <= index:
            start, block["k"] = block["end"], block["k"] + 1
            block["end"] = math.ceil(block["k"] / rate)
            block["chosen"] = start + int(rng.random() * (block["end"] - start))
        return index == block["chosen"]

    return sample


def model_device(model: torch.nn.Module) -> torch.device:
    dev = getattr(model, "device", None)
    if isinstance(dev, torch.device):
        return dev
    return next(model.parameters()).device


class OnDevice(torch.nn.Module):
    """The target as the checks call it: CPU-built inputs (oracle, reference K/V) moved to the
    model's device. Not instrumented; the decoder gets the model itself."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        past_key_values: Any = None,
        use_cache: bool = True,
        **kwargs: Any,
    ) -> Any:
        dev = self.device
        moved = {
            name: value.to(dev) if isinstance(value, torch.Tensor) else value
            for name, value in (
                ("input_ids", input_ids),
                ("attention_mask", attention_mask),
                ("position_ids", position_ids),
            )
            if value is not None
        }
        return self.model(
            **moved,
            use_cache=use_cache,
            **{cache_keyword(self.model): cache if cache is not None else past_key_values},
            **kwargs,
        )


@dataclass
class RealRun(Run):
    """A Run on external models, plus what real-model mode measures around it."""

    batch: int = 0
    sample_rate: float = 1.0
    baseline_seconds: float = math.nan  # the decoder on un-instrumented models
    baseline_outputs: list[list[int]] | None = None
    oracle_seconds: float = 0.0  # batch-size-1 greedy decoding of this batch's prompts
    check_seconds: float = math.nan  # I1 + I2, filled in by `audit_batch`

    @property
    def new_tokens(self) -> int:
        return sum(len(o) for o in self.outputs or ())

    @property
    def tokens_per_s(self) -> float:
        t = self.baseline_seconds if self.baseline_seconds == self.baseline_seconds else self.seconds
        return self.new_tokens / t if t > 0 else math.nan

    @property
    def oracle_tokens_per_s(self) -> float:
        n = sum(len(o.tokens) for o in self.oracle)
        return n / self.oracle_seconds if self.oracle_seconds > 0 else math.nan

    @property
    def sampled_calls(self) -> int:
        return sum(1 for c in self.recording.target_calls if c.sampled)

    @property
    def record_overhead(self) -> float:
        """Instrumented over un-instrumented decoder time, minus 1."""
        return self.seconds / self.baseline_seconds - 1 if self.baseline_seconds > 0 else math.nan

    @property
    def check_overhead(self) -> float:
        """I1 + I2 time over un-instrumented decoder time."""
        return self.check_seconds / self.baseline_seconds if self.baseline_seconds > 0 else math.nan


# ---------------------------------------------------------------------------------------
# Running batches


def checks_target(target: torch.nn.Module) -> torch.nn.Module:
    return target if model_device(target).type == "cpu" else OnDevice(target)


def model_label(path_or_model: Any) -> str:
    if isinstance(path_or_model, (str, Path)):
        return str(path_or_model)
    name = getattr(getattr(path_or_model, "config", None), "_name_or_path", None)
    return str(name or type(path_or_model).__name__)


def real_case(
    prompts: Sequence[tuple[int, ...]],
    *,
    num_draft_tokens: int,
    max_new_tokens: int,
    eos_token_id: int | None,
    pad_token_id: int,
    model: str,
    dtype: str,
) -> Case:
    """A case on external models: `model` is "external:<name>" (never a built-in name), the
    draft "external", no acceptance schedule (the real draft decides)."""
    return Case(
        prompts=tuple(tuple(p) for p in prompts),
        accept=tuple(() for _ in prompts),
        num_draft_tokens=num_draft_tokens,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        model=model if model.startswith("external:") else f"external:{model}",
        draft="external",
        dtype=dtype,
    )


def oracle_for(
    target: torch.nn.Module,
    case: Case,
    memo: dict[tuple[int, ...], OracleResult] | None = None,
    *,
    keep_kv: bool = True,
) -> tuple[list[OracleResult], float]:
    """Batch-size-1 greedy results for the case's prompts (memoized per prompt) and the seconds spent.

    `keep_kv`: each result keeps the oracle's final cache (`OracleResult.kv`), which I2 slices as
    its reference K/V; False leaves I2 a batch-size-1 forward per row sequence (the old path)."""
    memo = {} if memo is None else memo
    device = model_device(target)
    spent = 0.0
    out = []
    for prompt in case.prompts:
        if prompt not in memo or (keep_kv and memo[prompt].kv is None):
            synchronize(device)
            t0 = time.perf_counter()
            memo[prompt] = greedy_oracle(
                target, prompt, max_new_tokens=case.max_new_tokens, eos_token_id=case.eos_token_id, keep_kv=keep_kv
            )
            synchronize(device)
            spent += time.perf_counter() - t0
        out.append(memo[prompt])
    return out, spent


def timed_call(
    decoder_spec: str, factory: Any, target: Any, draft: Any, case: Case, timeout_s: float
) -> tuple[list[list[int]] | None, Any, float, Any]:
    """A fresh decoder on `case` on the un-instrumented models, timed with the device
    synchronized, under the same contract guard as every run: (outputs or None, the
    ContractError or None, seconds, the decoder)."""
    guard = guarded_call(
        decoder_spec, factory, target, draft, case, Watchdog(timeout_s), False, device=model_device(target)
    )
    return guard.outputs, guard.error, guard.seconds, guard.decoder


def run_batch(
    decoder_spec: str,
    factory: Any,
    case: Case,
    target: torch.nn.Module,
    draft: torch.nn.Module,
    *,
    sample: Callable[[int], bool],
    sample_rate: float,
    batch: int = 0,
    baseline: bool = True,
    oracle: list[OracleResult] | None = None,
    oracle_seconds: float = 0.0,
    timeout_s: float = 600.0,
    noise: NoiseFloor | None = None,
) -> RealRun:
    """One batch: optional un-instrumented timing run, then the instrumented run. `noise`: the
    measured noise floor of the target (model, dtype, device) that I2 judges K/V against; None
    keeps the dtype's fixed tolerances."""
    judge = checks_target(target)
    if oracle is None:
        oracle, oracle_seconds = oracle_for(judge, case)
    baseline_seconds, baseline_outputs = math.nan, None
    if baseline:  # a contract breach here is reported by the instrumented run below
        baseline_outputs, _, baseline_seconds, _ = timed_call(decoder_spec, factory, target, draft, case, timeout_s)
    guard = guarded_call(
        decoder_spec,
        factory,
        target,
        draft,
        case,
        Watchdog(timeout_s),
        sample=sample,
        device=model_device(target),
    )
    scripts = [RequestScript(p, o.tokens, ()) for p, o in zip(case.prompts, oracle)]

    run = RealRun(
        case=case,
        decoder=decoder_spec,
        outputs=guard.outputs,
        error=guard.error,
        oracle=list(oracle),
        scripts=scripts,
        recording=guard.recording,
        target=judge,
        seconds=guard.seconds,
        instance=guard.decoder,
        batch=batch,
        sample_rate=sample_rate,
        baseline_seconds=baseline_seconds,
        baseline_outputs=baseline_outputs,
        oracle_seconds=oracle_seconds,
        noise=noise,
    )

    def rerun(sub: Case) -> Run:
        """The same decoder and models on `sub`, every call checked, judged against the run's noise
        floor as it is when the re-run happens (a floor set on the run later still applies)."""
        return run_batch(
            decoder_spec,
            factory,
            sub,
            target,
            draft,
            sample=lambda i: True,
            sample_rate=1.0,
            baseline=False,
            timeout_s=timeout_s,
            noise=run.noise,
        )

    run.rerun = rerun
    return run


def warm_up(
    decoder_spec: str, factory: Any, target: torch.nn.Module, draft: torch.nn.Module, case: Case, timeout_s: float
) -> None:
    """One short un-instrumented call on the case's first prompt, so one-time costs (kernel
    selection, allocator, lazy imports) do not land in the first batch's timing. Its output
    is not judged; a contract breach shows again in the audited run."""
    short = replace(case, prompts=case.prompts[:1], accept=case.accept[:1], max_new_tokens=min(2, case.max_new_tokens))
    timed_call(decoder_spec, factory, target, draft, short, timeout_s)


def run_real(
    decoder_spec: str,
    target: torch.nn.Module,
    draft: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    batch_size: int = 8,
    num_draft_tokens: int = 4,
    max_new_tokens: int = 64,
    sample_rate: float = DEFAULT_CHECK_RATE,
    seed: int = 0,
    device: str | torch.device | None = None,
    model_name: str | None = None,
    baseline: bool = True,
    timeout_s: float = 600.0,
    factory: Any = None,
    noise: NoiseFloor | None = None,
) -> list[RealRun]:
    """Run `decoder_spec` on the prompts in batches of `batch_size`; one RealRun (a Run) per batch.

    The models must already be on `device` (default: the target's). Sampling of the I2
    snapshots is deterministic in `seed` (see `make_sampler`). With `baseline`, each batch
    first runs un-instrumented for its timing, after one short warm-up call. `noise` is the
    target's measured noise floor (`specaudit.numerics.calibration`), passed to every batch's I2.
    """
    if batch_size < 1:
        raise RealModelError("--batch-size must be at least 1")
    if not 0.0 <= sample_rate <= 1.0:
        raise RealModelError(f"--check-rate must be within [0, 1], got {sample_rate}")
    if device is not None and torch.device(device) != model_device(target):
        target, draft = target.to(device), draft.to(device)
    factory = factory or load_decoder(decoder_spec)
    tokens = tokenize(tokenizer, prompts)
    eos, pad = special_ids(tokenizer)
    dtype = next((name for name, d in DTYPES.items() if d == target.dtype), None)
    if dtype is None:
        raise RealModelError(f"unsupported model dtype {target.dtype}; use one of {', '.join(DTYPES)}")
    name = model_name or model_label(target)
    memo: dict[tuple[int, ...], OracleResult] = {}
    runs: list[RealRun] = []
    for batch, start in enumerate(range(0, len(tokens), batch_size)):
        case = real_case(
            tokens[start : start + batch_size],
            num_draft_tokens=num_draft_tokens,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            model=name,
            dtype=dtype,
        )
        if baseline and batch == 0:
            warm_up(decoder_spec, factory, target, draft, case, timeout_s)
        oracle, oracle_seconds = oracle_for(checks_target(target), case, memo)
        runs.append(
            run_batch(
                decoder_spec,
                factory,
                case,
                target,
                draft,
                sample=make_sampler(seed, batch, sample_rate),
                sample_rate=sample_rate,
                batch=batch,
                baseline=baseline,
                oracle=oracle,
                oracle_seconds=oracle_seconds,
                timeout_s=timeout_s,
                noise=noise,
            )
        )
    return runs


def audit_batch(run: RealRun) -> Diagnosis:
    """Check one batch: time I1 + I2 (the instrumentation's checks), then diagnose. A diverging
    row's batch-size-1 re-run goes through `run.rerun` (the same decoder and models, every
    call checked), so an invariant hidden by I2 sampling in the batch still names the signature."""
    start = time.perf_counter()
    check_i1(run)
    if run.outputs is not None:
        check_i2(run)  # memoized: diagnose reuses the row views
    run.check_seconds = time.perf_counter() - start
    return diagnose(run)
