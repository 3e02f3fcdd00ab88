"""Real-model mode: audit a decoder on a real target/draft pair loaded from disk.

    specaudit audit --target PATH --draft PATH --device cuda --dtype float16 --prompts FILE \
        [--decoder MODULE:ATTR] [--check-rate 0.25] [--batch-size 8] [--max-new-tokens 128] \
        [--num-draft-tokens 4] [--out DIR]

The prompts (SpecBench-style JSONL with `turns`, or one prompt per line) are tokenized with the
target's tokenizer and cut into batches. Per batch:

  1. oracle:    batch-size-1 greedy decoding of every prompt with the target (`greedy_oracle`);
  2. baseline:  the decoder once on the un-instrumented models: its wall time gives tokens/s;
  3. audited:   the decoder again on the instrumented models; I1 is checked on every target
                call, I2 (the K/V comparison with a batch-size-1 run, the expensive part) only
                on a `--check-rate` share of the target calls, drawn by `make_sampler` from a
                `random.Random` seeded by (seed, batch): the same seed samples the same calls;
  4. verdict:   tie-aware equivalence with the oracle (`specaudit.checks.compare_row`), I1, I2,
                the first violated check and the paper's signature (`specaudit.diagnosis`).

Throughput is new tokens over the *un-instrumented* wall time (step 2). Instrumentation
overhead is reported in two parts, both relative to that time: recording (hooks and cache
snapshots: instrumented minus un-instrumented decoder time) and checking (I1 + I2 time).

With no GPU and no weights the same path runs on the tiny real architectures on the CPU:
`save_tiny_pair(DIR)` writes the tiny Llama target and draft with `save_pretrained`, plus a
128-token character tokenizer, so the mode loads them from disk exactly as real weights.

With `--out DIR` the per-batch results go to DIR/report.json, and a failing batch leaves two
reproducers under DIR/repro: the real case (`real-*.json`, the real token ids; it needs the
real models) and its transplant (`transplant-*.json`, see `specaudit.transplant`), which
`specaudit replay` runs on the CPU on the exact models.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Importing this module stays cheap (the CLI builds its parser on every call): torch,
# transformers and the harness modules that pull them in are imported where they are used,
# and the two classes that derive from them, `RealRun` (a `specaudit.runner.Run`) and
# `OnDevice` (a `torch.nn.Module`), are created on first access (`__getattr__` below).
if TYPE_CHECKING:
    import torch

    from specaudit.case import Case
    from specaudit.realmodel import RealRun  # created lazily, see `_classes`
    from specaudit.reference.oracle import OracleResult
    from specaudit.runner import Run

DTYPE_CHOICES = ("auto", "float64", "float32", "float16", "bfloat16")
DEFAULT_DECODER = "specaudit.reference.eqspec:EqSpec"
DEFAULT_CHECK_RATE = 0.25


class RealModelError(Exception):
    """Bad input for real-model mode (a path, a prompts file, a device); the message is one line."""


# ---------------------------------------------------------------------------------------
# Loading models, tokenizer and prompts


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def dtype_kwargs(dtype: torch.dtype | str) -> dict[str, Any]:
    """`dtype=` from transformers 4.56 on, `torch_dtype=` before (5.x warns on the old name)."""
    import transformers
    from packaging.version import Version

    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return {key: dtype}


def resolve_device(device: str) -> torch.device:
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise RealModelError(f"invalid device {device!r}: {_one_line(exc)}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RealModelError(f"device {device!r} is not available (torch.cuda.is_available() is False)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise RealModelError(f"device {device!r} is not available ({torch.cuda.device_count()} CUDA device(s))")
    if dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise RealModelError(f"device {device!r} is not available")
    return dev


@contextmanager
def _quiet_loading():
    """No weight-loading progress bars on stderr; the previous setting is restored."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _check_model_dir(role: str, path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise RealModelError(f"{role} model path {str(path)!r} does not exist")
    if not p.is_dir() or not (p / "config.json").is_file():
        raise RealModelError(f"{role} model path {str(path)!r} is not a Hugging Face model directory (no config.json)")
    return p


def load_model(role: str, path: str | Path, device: torch.device, dtype: str = "auto") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from specaudit.fixtures.pairs import DTYPES

    p = _check_model_dir(role, path)
    if dtype not in DTYPE_CHOICES:
        raise RealModelError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    torch_dtype: Any = "auto" if dtype == "auto" else DTYPES[dtype]
    try:
        with _quiet_loading():
            model = AutoModelForCausalLM.from_pretrained(str(p), local_files_only=True, **dtype_kwargs(torch_dtype))
    except Exception as exc:  # any loader failure is bad input, reported in one line
        raise RealModelError(f"cannot load the {role} model from {str(path)!r}: {_one_line(exc)}") from None
    model = model.to(device)
    model.requires_grad_(False)
    return model.eval()


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    p = _check_model_dir("target", path)
    try:
        with _quiet_loading():
            return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as exc:
        raise RealModelError(f"cannot load a tokenizer from the target path {str(path)!r}: {_one_line(exc)}") from None


def load_pair(
    target_path: str | Path, draft_path: str | Path, device: str = "cpu", dtype: str = "auto"
) -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    """(target, draft, tokenizer): both models from local directories, the tokenizer from the target's.

    `dtype` is "auto" (the checkpoint's) or a DTYPES key. Errors are `RealModelError`s with
    one line that names the path.
    """
    dev = resolve_device(device)
    target = load_model("target", target_path, dev, dtype)
    draft = load_model("draft", draft_path, dev, dtype)
    tokenizer = load_tokenizer(target_path)
    if target.dtype != draft.dtype:
        raise RealModelError(f"target and draft dtypes differ ({target.dtype} vs {draft.dtype}); pass --dtype")
    return target, draft, tokenizer


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: JSONL (SpecBench `turns`: the first turn; else `prompt` or `text`)
    when the first non-blank line starts with `{`, otherwise one prompt per non-blank line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise RealModelError(f"cannot read prompts file {str(path)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise RealModelError(f"prompts file {str(path)!r} is not UTF-8 text") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        raise RealModelError(f"prompts file {str(path)!r} holds no prompts")
    if not lines[0][1].lstrip().startswith("{"):
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RealModelError(f"{path}, line {n}: not a JSON object ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise RealModelError(f"{path}, line {n}: a JSON {type(obj).__name__}, but should be an object")
        if "turns" in obj:
            turns = obj["turns"]
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
                raise RealModelError(f'{path}, line {n}: "turns" should be a non-empty list of strings')
            prompts.append(turns[0])
        elif isinstance(obj.get("prompt"), str):
            prompts.append(obj["prompt"])
        elif isinstance(obj.get("text"), str):
            prompts.append(obj["text"])
        else:
            raise RealModelError(f'{path}, line {n}: no "turns", "prompt" or "text" string')
    return prompts


def special_ids(tokenizer: Any) -> tuple[int | None, int]:
    """(eos, pad): the tokenizer's; pad falls back to eos, then to 0."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = eos if eos is not None else 0
    return (None if eos is None else int(eos)), int(pad)


def tokenize(tokenizer: Any, prompts: Sequence[str]) -> list[tuple[int, ...]]:
    out = []
    for i, text in enumerate(prompts):
        ids = tuple(int(t) for t in tokenizer(text)["input_ids"])
        if not ids:
            raise RealModelError(f"prompt {i} ({text[:40]!r}) tokenizes to no tokens")
        out.append(ids)
    return out


# ---------------------------------------------------------------------------------------
# Tiny pair on disk (CPU tests and demos)


def tiny_tokenizer() -> Any:
    """A 128-token character tokenizer (0 <pad>, 1 <eos>, 2 <unk>, 3..127 characters 32..156)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from specaudit.fixtures import VOCAB_SIZE

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    vocab.update({chr(29 + i): i for i in range(3, VOCAB_SIZE)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def save_tiny_pair(directory: str | Path, arch: str = "llama", dtype: torch.dtype | None = None) -> tuple[Path, Path]:
    """Write the tiny `arch` target and draft (specaudit.fixtures.tiny) and a tokenizer under `directory`.

    Returns (target_dir, draft_dir); the tokenizer is saved with the target, as a real
    checkpoint ships it. Loading them gives the same weights as `build_tiny(arch, role, dtype=dtype)`
    (float64 by default).
    """
    import torch

    from specaudit.fixtures.tiny import build_tiny

    dtype = torch.float64 if dtype is None else dtype
    root = Path(directory)
    dirs = root / "target", root / "draft"
    for role, path in zip(("target", "draft"), dirs):
        build_tiny(arch, role, dtype=dtype).save_pretrained(str(path))
    tiny_tokenizer().save_pretrained(str(dirs[0]))
    return dirs


# ---------------------------------------------------------------------------------------
# Running batches


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


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_device(model: torch.nn.Module) -> torch.device:
    import torch

    dev = getattr(model, "device", None)
    if isinstance(dev, torch.device):
        return dev
    return next(model.parameters()).device


@functools.cache
def _classes() -> dict[str, type]:
    """`OnDevice` and `RealRun`, created once, on first use (they derive from torch and harness classes)."""
    import torch

    from specaudit.runner import Run

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
            from specaudit.compat import cache_keyword

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
        # the same decoder and models on another case (diagnosis re-runs a row at batch size 1)
        rerun: Callable[[Case], Run] | None = field(default=None, repr=False)

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

    for cls in (OnDevice, RealRun):
        cls.__qualname__ = cls.__name__
    return {"OnDevice": OnDevice, "RealRun": RealRun}


def __getattr__(name: str) -> Any:
    if name in ("OnDevice", "RealRun"):
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def checks_target(target: torch.nn.Module) -> torch.nn.Module:
    return target if model_device(target).type == "cpu" else _classes()["OnDevice"](target)


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
    from specaudit.case import Case

    return Case(
        tuple(tuple(p) for p in prompts),
        tuple(() for _ in prompts),
        num_draft_tokens,
        max_new_tokens,
        eos_token_id,
        pad_token_id,
        0,
        model if model.startswith("external:") else f"external:{model}",
        "external",
        dtype,
    )


def oracle_for(
    target: torch.nn.Module, case: Case, memo: dict[tuple[int, ...], OracleResult] | None = None
) -> tuple[list[OracleResult], float]:
    """Batch-size-1 greedy results for the case's prompts (memoized per prompt) and the seconds spent."""
    from specaudit.reference.oracle import greedy_oracle

    memo = {} if memo is None else memo
    device = model_device(target)
    spent = 0.0
    out = []
    for prompt in case.prompts:
        if prompt not in memo:
            _sync(device)
            t0 = time.perf_counter()
            memo[prompt] = greedy_oracle(
                target, prompt, max_new_tokens=case.max_new_tokens, eos_token_id=case.eos_token_id
            )
            _sync(device)
            spent += time.perf_counter() - t0
        out.append(memo[prompt])
    return out, spent


def _call(decoder: Any, target: Any, draft: Any, case: Case, device: torch.device, timeout_s: float) -> list[list[int]]:
    from specaudit.contract import call_decoder

    input_ids, attention_mask = case.batch()  # [B, T] each
    return call_decoder(
        decoder,
        target,
        draft,
        input_ids.to(device),
        attention_mask.to(device),
        num_draft_tokens=case.num_draft_tokens,
        max_new_tokens=case.max_new_tokens,
        eos_token_id=case.eos_token_id,
        pad_token_id=case.pad_token_id,
        timeout_s=timeout_s,
    )


def _timed_call(
    decoder_spec: str, factory: Any, target: Any, draft: Any, case: Case, timeout_s: float
) -> tuple[list[list[int]] | None, Any, float, Any]:
    """A fresh decoder on `case`, timed with the device synchronized: (outputs or None, the
    ContractError or None, seconds, the decoder)."""
    import torch

    from specaudit.contract import ContractError, instantiate

    device = model_device(target)
    decoder = instantiate(factory, decoder_spec)
    outputs, error = None, None
    _sync(device)
    start = time.perf_counter()
    try:
        with torch.no_grad():
            outputs = _call(decoder, target, draft, case, device, timeout_s)
    except ContractError as exc:
        error = exc
    _sync(device)
    return outputs, error, time.perf_counter() - start, decoder


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
) -> RealRun:
    """One batch: optional un-instrumented timing run, then the instrumented run."""

    from specaudit.fixtures.transparent import RequestScript
    from specaudit.instrument import instrument

    judge = checks_target(target)
    if oracle is None:
        oracle, oracle_seconds = oracle_for(judge, case)
    baseline_seconds, baseline_outputs = math.nan, None
    if baseline:  # a contract breach here is reported by the instrumented run below
        baseline_outputs, _, baseline_seconds, _ = _timed_call(decoder_spec, factory, target, draft, case, timeout_s)
    with instrument(target, draft, sample) as recording:
        outputs, error, seconds, decoder = _timed_call(decoder_spec, factory, target, draft, case, timeout_s)
    scripts = [RequestScript(p, o.tokens, ()) for p, o in zip(case.prompts, oracle)]

    def rerun(sub: Case) -> Run:
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
        )

    return _classes()["RealRun"](
        case=case,
        decoder=decoder_spec,
        outputs=outputs,
        error=error,
        oracle=list(oracle),
        scripts=scripts,
        recording=recording,
        target=judge,
        seconds=seconds,
        instance=decoder,
        batch=batch,
        sample_rate=sample_rate,
        baseline_seconds=baseline_seconds,
        baseline_outputs=baseline_outputs,
        oracle_seconds=oracle_seconds,
        rerun=rerun,
    )


def warm_up(
    decoder_spec: str,
    factory: Any,
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompt: tuple[int, ...],
    num_draft_tokens: int,
    eos: int | None,
    pad: int,
    timeout_s: float,
) -> None:
    """One short un-instrumented call, so one-time costs (kernel selection, allocator, lazy
    imports) do not land in the first batch's timing. Its output is not judged."""
    from specaudit.case import Case

    case = Case((prompt,), ((),), num_draft_tokens, 2, eos, pad, 0, "external:warm-up", "external", "float32")
    _timed_call(decoder_spec, factory, target, draft, case, timeout_s)  # a breach: the audited run reports it


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
) -> list[RealRun]:
    """Run `decoder_spec` on the prompts in batches of `batch_size`; one RealRun (a Run) per batch.

    The models must already be on `device` (default: the target's). Sampling of the I2
    snapshots is deterministic in `seed` (see `make_sampler`). With `baseline`, each batch
    first runs un-instrumented for its timing, after one short warm-up call.
    """
    import torch

    from specaudit.contract import load_decoder
    from specaudit.fixtures.pairs import DTYPES

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
    if baseline:
        warm_up(decoder_spec, factory, target, draft, tokens[0], num_draft_tokens, eos, pad, timeout_s)
    runs = []
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
            )
        )
    return runs


# ---------------------------------------------------------------------------------------
# Verdicts


def diagnose_real(run: Run) -> Any:
    """`specaudit.diagnosis.diagnose` for a run on external models: its batch-size-1 re-run of a
    diverging row goes through `run.rerun` (the same decoder and models, every call checked),
    so an invariant hidden by I2 sampling in the batch still names the signature."""
    from specaudit.diagnosis import diagnose

    return diagnose(run)


def audit_batch(run: RealRun) -> Any:
    """Check one batch: time I1 + I2 (the instrumentation's checks), then diagnose."""
    from specaudit.checks import check_i1, check_i2

    start = time.perf_counter()
    check_i1(run)
    if run.outputs is not None:
        check_i2(run)  # memoized: diagnose reuses the row views
    run.check_seconds = time.perf_counter() - start
    return diagnose_real(run)


@dataclass(frozen=True)
class OverheadRow:
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
    import torch

    from specaudit.checks import check_i1, check_i2
    from specaudit.contract import instantiate, load_decoder

    factory = load_decoder(decoder_spec)
    judge = checks_target(target)
    oracle, _ = oracle_for(judge, case)
    device = model_device(target)
    warm_up(decoder_spec, factory, target, draft, case.prompts[0], case.num_draft_tokens, case.eos_token_id,
            case.pad_token_id, 600.0)  # fmt: skip
    baseline: list[float] = []
    seconds: dict[float, list[float]] = {rate: [] for rate in rates}
    checks: dict[float, list[float]] = {rate: [] for rate in rates}
    counts: dict[float, tuple[int, int]] = {}
    for _ in range(repeats):
        decoder = instantiate(factory, decoder_spec)
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            _call(decoder, target, draft, case, device, 600.0)
        _sync(device)
        baseline.append(time.perf_counter() - start)
        for rate in rates:
            run = run_batch(
                decoder_spec, factory, case, target, draft, sample=make_sampler(seed, 0, rate), sample_rate=rate,
                baseline=False, oracle=oracle,
            )  # fmt: skip
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


# ---------------------------------------------------------------------------------------
# The command line


def _has_option(parser: argparse.ArgumentParser, option: str) -> bool:
    return option in parser._option_string_actions  # argparse keeps no public lookup


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Real-model options for `specaudit audit` (used when --target is given).

    Options the audit parser already has (--decoder, --seed, --quiet, --out) are reused, not
    added twice.
    """
    group = parser.add_argument_group("real-model mode (when --target is given)")
    group.add_argument("--target", metavar="PATH", help="target model directory (Hugging Face format, local)")
    group.add_argument("--draft", metavar="PATH", help="draft model directory (same tokenizer as the target)")
    group.add_argument("--device", default="cpu", help="torch device for both models (default: cpu)")
    group.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="model dtype (default: the checkpoint's)")
    group.add_argument("--prompts", metavar="FILE", help="JSONL with SpecBench-style `turns`, or one prompt per line")
    group.add_argument(
        "--check-rate",
        type=float,
        default=DEFAULT_CHECK_RATE,
        metavar="P",
        help=f"fraction of target calls whose K/V are checked for I2 (I1: every call; default {DEFAULT_CHECK_RATE})",
    )
    group.add_argument("--batch-size", type=int, default=8, help="prompts per batch (default 8)")
    group.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    group.add_argument("--num-draft-tokens", type=int, default=4, help="K, drafts per round (default 4)")
    group.add_argument("--max-prompts", type=int, default=None, metavar="N", help="use the first N prompts only")
    group.add_argument(
        "--timeout", type=float, default=600.0, metavar="S", help="seconds per decoder call (default 600)"
    )
    if not _has_option(parser, "--out"):
        group.add_argument(
            "--out", type=Path, default=None, metavar="DIR", help="write reproducers of failing batches here"
        )
    if not _has_option(parser, "--decoder"):
        group.add_argument("--decoder", action="append", default=[], metavar="MODULE:ATTR", help="decoder (repeatable)")
    if not _has_option(parser, "--seed"):
        group.add_argument("--seed", type=int, default=0, help="seed of the I2 call sampling")
    if not _has_option(parser, "--quiet"):
        group.add_argument("--quiet", action="store_true", help="no progress lines")


def _error(message: str) -> int:
    print(f"specaudit: error: {message}", file=sys.stderr)
    return 2


def _pct(x: float) -> str:
    return "n/a" if x != x else f"{x:+.0%}"


def _validate(args: argparse.Namespace) -> str | None:
    if not args.draft:
        return "--draft is required with --target"
    if not args.prompts:
        return "--prompts is required with --target"
    if not 0.0 <= args.check_rate <= 1.0:
        return f"--check-rate must be within [0, 1], got {args.check_rate}"
    for name in ("batch_size", "max_new_tokens", "num_draft_tokens"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    if args.max_prompts is not None and args.max_prompts < 1:
        return "--max-prompts must be at least 1"
    return None


def batch_line(run: RealRun, diagnosis: Any) -> str:
    status = "PASS" if diagnosis.passed else "FAIL"
    line = (
        f"  batch {run.batch}: {len(run.case.prompts)} rows  {status} ({diagnosis.verdict})  "
        f"exact {diagnosis.exact_match:.2f} partial {diagnosis.partial_match:.2f} ties {diagnosis.ties}  "
        f"{run.tokens_per_s:.1f} tok/s (oracle BS1 {run.oracle_tokens_per_s:.1f})  "
        f"I2 on {run.sampled_calls}/{len(run.recording.target_calls)} target calls  "
        f"overhead: recording {_pct(run.record_overhead)}, checks {_pct(run.check_overhead)}"
    )
    if not diagnosis.passed:
        from specaudit.violation import render

        line += f"\n    first violated check: {diagnosis.first_check}; "
        line += f"signature: {diagnosis.signature} ({diagnosis.reason})"

        line += "\n" + "\n".join("    " + s for s in render(list(diagnosis.violations), limit=4).splitlines())
    if run.baseline_outputs is not None and run.outputs is not None and run.baseline_outputs != run.outputs:
        line += "\n    note: the instrumented run's output differs from the un-instrumented run's (nondeterminism?)"
    return line


def write_reproducers(out: Path, run: RealRun, diagnosis: Any) -> tuple[list[str], list[str]]:
    """The real case and its CPU transplant as reproducer files under OUT/repro (the layout of
    `specaudit audit --out`); returns (report lines, paths written)."""
    from dataclasses import asdict

    from specaudit.diagnosis import diagnose
    from specaudit.reproducer import write_reproducer
    from specaudit.runner import run_case
    from specaudit.transplant import transplant

    label = run.decoder.replace(":", "-")
    evidence = [asdict(v) for v in diagnosis.violations[:20]]
    lines, paths = [], []
    real = write_reproducer(
        out / "repro",
        f"real-{label}-batch{run.batch}",
        {"case": run.case.to_json(), "decoder": run.decoder, "evidence": evidence},
    )
    lines.append(f"    reproducer (real models): {real}")
    paths.append(str(real))
    try:
        moved = transplant(run)
    except Exception as exc:  # a transplant that cannot be built must not hide the real verdict
        lines.append(f"    transplant: not built ({_one_line(exc)})")
        return lines, paths
    replay = diagnose(run_case(run.decoder, moved.case))
    outcome = f"FAIL ({replay.first_check}, {replay.signature})" if not replay.passed else "PASS (does not reproduce)"
    path = write_reproducer(
        out / "repro",
        f"transplant-{label}-batch{run.batch}",
        {"case": moved.case.to_json(), "decoder": run.decoder, "evidence": [asdict(v) for v in replay.violations[:20]]},
    )
    lines.append(f"    transplant on the CPU (transparent target, scripted draft): {outcome}: {path}")
    paths.append(str(path))
    return lines, paths


def _finite(x: float) -> float | None:
    return None if x != x or x in (math.inf, -math.inf) else x


def batch_report(run: RealRun, diagnosis: Any, reproducers: list[str]) -> dict[str, Any]:
    """One batch as JSON: the diagnosis plus throughput, sampling and overhead."""
    return {
        "decoder": run.decoder,
        "batch": run.batch,
        "diagnosis": diagnosis.to_json(),
        "outputs": run.outputs,
        "tokens_per_s": _finite(run.tokens_per_s),
        "oracle_tokens_per_s": _finite(run.oracle_tokens_per_s),
        "check_rate": run.sample_rate,
        "sampled_calls": run.sampled_calls,
        "target_calls": len(run.recording.target_calls),
        "decoder_seconds": _finite(run.baseline_seconds),
        "instrumented_seconds": run.seconds,
        "check_seconds": _finite(run.check_seconds),
        "record_overhead": _finite(run.record_overhead),
        "check_overhead": _finite(run.check_overhead),
        "reproducers": reproducers,
    }


def run_real_audit(args: argparse.Namespace) -> int:
    """`specaudit audit --target ...`: exit 0 when every batch passes, 1 on a failure, 2 for bad input."""
    from specaudit.contract import DecoderLoadError, load_decoder
    from specaudit.fixtures.pairs import DTYPES

    problem = _validate(args)
    if problem:
        return _error(problem)
    specs = list(args.decoder or []) or [DEFAULT_DECODER]
    try:
        factories = {spec: load_decoder(spec) for spec in specs}
        prompts = read_prompts(args.prompts)
        if args.max_prompts is not None:
            prompts = prompts[: args.max_prompts]
        target, draft, tokenizer = load_pair(args.target, args.draft, args.device, args.dtype)
        tokenize(tokenizer, prompts)  # bad prompts are input errors, before any decoding
    except (RealModelError, DecoderLoadError) as exc:
        return _error(str(exc))
    eos, pad = special_ids(tokenizer)
    dtype = next((n for n, d in DTYPES.items() if d == target.dtype), str(target.dtype))
    print(
        f"specaudit audit (real models): target {args.target}, draft {args.draft}, "
        f"device {args.device}, dtype {dtype}\n"
        f"  {len(prompts)} prompt(s) in batches of {args.batch_size}, K={args.num_draft_tokens}, "
        f"max_new_tokens={args.max_new_tokens}, eos={eos}, pad={pad}\n"
        f"  check rate {args.check_rate:g}: I1 on every target call, I2 (K/V against batch size 1) on a sampled "
        f"{args.check_rate:.0%} of target calls (seed {args.seed})",
        flush=True,
    )
    failed = 0
    report: list[dict[str, Any]] = []
    for spec in specs:
        try:
            runs = run_real(
                spec,
                target,
                draft,
                tokenizer,
                prompts,
                batch_size=args.batch_size,
                num_draft_tokens=args.num_draft_tokens,
                max_new_tokens=args.max_new_tokens,
                sample_rate=args.check_rate,
                seed=args.seed,
                model_name=str(args.target),
                timeout_s=args.timeout,
                factory=factories[spec],
            )
        except (RealModelError, DecoderLoadError) as exc:  # e.g. a factory returning no decoder
            return _error(str(exc))
        print(f"\n{spec}:", flush=True)
        diagnoses = []
        for run in runs:
            diagnosis = audit_batch(run)
            diagnoses.append(diagnosis)
            print(batch_line(run, diagnosis), flush=True)
            written: list[str] = []
            if not diagnosis.passed and args.out is not None:
                lines, written = write_reproducers(Path(args.out), run, diagnosis)
                for line in lines:
                    print(line, flush=True)
            report.append(batch_report(run, diagnosis, written))
        rows = sum(len(r.case.prompts) for r in runs)
        exact = sum(d.exact_match * len(r.case.prompts) for d, r in zip(diagnoses, runs)) / max(rows, 1)
        partial = sum(d.partial_match * len(r.case.prompts) for d, r in zip(diagnoses, runs)) / max(rows, 1)
        ties = sum(d.ties for d in diagnoses)
        passed = all(d.passed for d in diagnoses)
        tokens = sum(r.new_tokens for r in runs)
        base = sum(r.baseline_seconds for r in runs)
        inst = sum(r.seconds for r in runs)
        checks = sum(r.check_seconds for r in runs)
        oracle_tokens = sum(len(o.tokens) for r in runs for o in r.oracle)
        oracle_s = sum(r.oracle_seconds for r in runs)
        sampled = sum(r.sampled_calls for r in runs)
        calls = sum(len(r.recording.target_calls) for r in runs)
        first = next((d for d in diagnoses if not d.passed), None)
        verdicts = sorted({d.verdict for d in diagnoses})
        print(
            f"  overall: {'PASS' if passed else 'FAIL'} ({', '.join(verdicts)})  {rows} rows, exact match {exact:.2f}, "
            f"partial match {partial:.2f}, ties {ties}"
            + (f"; first violated check {first.first_check}, signature {first.signature}" if first else "")
            + f"\n  throughput: {tokens / base if base > 0 else math.nan:.1f} tok/s un-instrumented "
            f"(batch-size-1 oracle {oracle_tokens / oracle_s if oracle_s > 0 else math.nan:.1f} tok/s)"
            f"\n  check rate {args.check_rate:g} (I2 on {sampled}/{calls} target calls); instrumentation overhead: "
            f"recording {_pct(inst / base - 1 if base > 0 else math.nan)}, I1+I2 checks "
            f"{_pct(checks / base if base > 0 else math.nan)} of un-instrumented decoder time",
            flush=True,
        )
        failed += not passed
    print(f"\n{len(specs) - failed} passed, {failed} failed")
    if args.out is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        print(f"report: {out / 'report.json'}; reproducers under {out / 'repro'}")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specaudit-real", description="Audit a decoder on a real target/draft pair.")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m specaudit.realmodel --target ... --draft ... --prompts ...` (the same as `specaudit audit --target`)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0
    if not args.target:
        return _error("--target is required")
    return run_real_audit(args)


if __name__ == "__main__":
    sys.exit(main())
