"""Run one case: oracle first, then the decoder under test on instrumented models."""

from __future__ import annotations

import functools
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from specaudit.contracts.case import Case
from specaudit.contracts.decoder import ContractError, instantiate, load_decoder
from specaudit.contracts.subjects import EVIDENCE_DECODER
from specaudit.fixtures.pairs import draft_model, target_model
from specaudit.fixtures.transparent import RequestScript
from specaudit.numerics.calibration import NoiseFloor, Witness, judge_divergence
from specaudit.reference.oracle import OracleResult, greedy_oracle, kv_rows, reference_kv, truncate
from specaudit.running.guard import ModelGuard, decoder_warnings
from specaudit.running.instrument import Recording, breach, every_call, instrument
from specaudit.running.record import Entry, Record
from specaudit.running.watchdog import Watchdog, call_decoder, still_running


@dataclass
class Derived:
    """What is computed from a run once and shared by the checks that read it: each check's
    slots (`cached`, keyed by the check's name; the slots each check fills are declared by its
    registry entry, `checks.registry.Check.caches`), each check's outcome, and the model runs some
    checks compare against, made by the run itself (`Run.again`, `Run.oracle_from`, `Run.entries`).
    Kept apart from the record, which nothing changes after the run."""

    cached: dict[str, dict[str, Any]] = field(default_factory=dict)  # check name -> slot -> value
    outcomes: dict[str, Any] = field(default_factory=dict)  # check name -> checks.registry.CheckOutcome
    reruns: dict[Case, Run] = field(default_factory=dict)  # another case on the same decoder and models
    continuations: dict[tuple[tuple[int, ...], int], OracleResult] = field(default_factory=dict)


@dataclass
class Run:
    """Everything the checks need about one decoder run; checks read it, never change it. The
    model runs a check needs beyond it (the case in another order, a row alone, the oracle from
    the decoder's own prefix, a batch-size-1 K/V reference) are the run's to make (`again`,
    `oracle_from`, `entries`), once each, kept in `derived`: no check runs a model itself
    (tests/test_layers.py holds them to it)."""

    case: Case
    decoder: str
    outputs: list[list[int]] | None  # None when the decoder broke the contract
    error: ContractError | None
    oracle: list[OracleResult]  # per row: the batch-size-1 greedy output, EOS and limit applied
    scripts: list[RequestScript]  # per row: EOS-blind continuation and accept pattern
    recording: Recording
    target: torch.nn.Module
    seconds: float
    instance: Any = None  # the decoder object, for its declared capabilities (e.g. max_wait_calls)
    factory: Any = None  # what the user gave (class, factory function, configured callable): re-run with this
    noise: NoiseFloor | None = None  # measured batched-arithmetic noise (real models); None: fixed tolerances
    rerun: Callable[[Case], Run] | None = field(default=None, repr=False)  # set where the models are not built in
    derived: Derived = field(default_factory=Derived, repr=False)

    def again(self, case: Case) -> Run:
        """The same decoder (the factory the user gave, not the class of its object) on `case`, on
        the same models: made once per case."""
        if case not in self.derived.reruns:
            if self.rerun is not None:
                self.derived.reruns[case] = self.rerun(case)
            else:
                factory = self.factory if self.factory is not None else load_decoder(self.decoder)
                self.derived.reruns[case] = run_case(self.decoder, case, factory=factory)
        return self.derived.reruns[case]

    def oracle_from(self, prefix: tuple[int, ...], max_new_tokens: int) -> OracleResult:
        """The batch-size-1 greedy oracle from `prefix` (the decoder's own tokens, re-synced at a tie)."""
        key = (prefix, max_new_tokens)
        if key not in self.derived.continuations:
            with torch.no_grad():
                result = greedy_oracle(self.target, prefix, max_new_tokens=max_new_tokens,
                                       eos_token_id=self.case.eos_token_id)  # fmt: skip
            self.derived.continuations[key] = result
        return self.derived.continuations[key]

    def score_divergence(self, prefix: tuple[int, ...], index: int, found: int, expected: int) -> Witness:
        """The measured noise floor's witness (the target in higher precision) on a divergence:
        logit(expected) - logit(found) scored on the shared prefix (real models only)."""
        assert self.noise is not None, "a divergence is scored against a measured noise floor"
        return judge_divergence(self.noise.witness or self.target, prefix, index, found, expected, self.noise)

    def entries(self, tokens: tuple[int, ...]) -> torch.Tensor:
        """[n, F] the target's batch-size-1 K/V of `tokens` at positions 0..n-1 (I2's reference)."""
        with torch.no_grad():
            return kv_rows(reference_kv(self.target, tokens, host=False))  # [n, F] on the model's device

    @functools.cached_property
    def record(self) -> Record:
        """The run as every subject's evidence (`running.record`): each case row a request, handed
        over when `generate` starts and returned when it ends."""
        calls = self.recording.target_calls
        record = Record(self.decoder, EVIDENCE_DECODER, "target calls", self.case.eos_token_id, calls)
        outputs = self.outputs or [[] for _ in self.case.prompts]
        for r, (prompt, tokens) in enumerate(zip(self.case.prompts, outputs)):
            record.admit(Entry(r, prompt, self.case.max_new_tokens, self.oracle[r], list(tokens), 0, len(calls)))
        return record

    @property
    def generated_tokens(self) -> int:
        return sum(map(len, self.outputs or []))

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def outside_models_share(self) -> float:
        """Share of the decoder's time spent outside target and draft forwards: realignment,
        acceptance and bookkeeping (the alignment overhead, as far as hooks can see)."""
        calls = self.recording.target_calls + self.recording.draft_calls
        inside = sum(c.seconds for c in calls)
        return max(0.0, 1.0 - inside / self.seconds) if self.seconds > 0 and calls else 0.0


def oracle_continuation(model: str, dtype: str, prompt: tuple[int, ...], horizon: int) -> OracleResult:
    """The EOS-blind greedy continuation, long enough for the draft to look past the limit.

    Computed in blocks of 16 tokens so shrinking K or max_new_tokens reuses it.
    """
    full, _ = _continuation(model, dtype, prompt, -(-horizon // 16) * 16)
    return OracleResult(full.tokens[:horizon], full.stop, full.margins[:horizon])


@functools.lru_cache(maxsize=4096)
def _continuation(model: str, dtype: str, prompt: tuple[int, ...], horizon: int) -> tuple[OracleResult, float]:
    """The continuation and the seconds its batch-size-1 greedy decoding took on this machine."""
    target = target_model(model, dtype)
    start = time.perf_counter()
    with torch.no_grad():
        result = greedy_oracle(target, prompt, max_new_tokens=horizon, eos_token_id=None)
    return result, time.perf_counter() - start


def oracle_outputs(case: Case) -> tuple[list[OracleResult], list[RequestScript]]:
    oracle, scripts = [], []
    for prompt, accept in zip(case.prompts, case.accept):
        cont = oracle_continuation(case.model, case.dtype, prompt, case.horizon)
        tokens, stop = truncate(cont.tokens, max_new_tokens=case.max_new_tokens, eos_token_id=case.eos_token_id)
        oracle.append(OracleResult(tokens, stop, cont.margins[: len(tokens)]))
        scripts.append(RequestScript(prompt, cont.tokens, accept))
    return oracle, scripts


# ---------------------------------------------------------------------------------------
# When a decoder run is a hang
#
# A limit in seconds that does not know the machine is a false alarm on a loaded runner, and a
# slow decoder (one without a cache, re-running whole rows every round) is not a hung one. So
# the watchdog (`specaudit.running.watchdog.Watchdog`) judges progress: a run is a hang when no forward
# of the target or draft completes for the idle limit
#
#     idle = max(IDLE_FLOOR_S, IDLE_MULTIPLE x t_ref)
#
# where t_ref is the measured wall time of the reference run of the same case on this machine
# (the batch-size-1 greedy oracle of its prompts, which every run computes first), or when it
# makes more target forwards than any decoder can need for the case,
#
#     max_forwards = B x (max_new_tokens + 2) x (K + 1)
#
# (every row alone, one token per round, each round verified one token per forward, plus a
# prefill): rows that never finish. A hang is therefore reported within `idle` of the last
# forward. An un-instrumented run (no progress to read) is bounded by `idle` as a whole.

IDLE_FLOOR_S = 20.0
IDLE_MULTIPLE = 10.0


def reference_seconds(case: Case) -> float:
    """t_ref: the oracle's measured batch-size-1 decoding time for the case's prompts."""
    horizon = -(-case.horizon // 16) * 16
    return sum(_continuation(case.model, case.dtype, prompt, horizon)[1] for prompt in set(case.prompts))


def idle_limit(case: Case) -> float:
    """The watchdog's idle limit for `case` (see the section comment)."""
    return max(IDLE_FLOOR_S, IDLE_MULTIPLE * reference_seconds(case))


# ---------------------------------------------------------------------------------------
# A decoder seen to hang
#
# Every run of a hanging decoder waits out the idle limit, and a search shrinking the hang runs
# it dozens of times (the suite's Hypothesis shrinker for up to its own five minutes). So once
# a run of a decoder spec is stopped for idleness, the runner remembers that the decoder hangs,
# and its later runs in this process (the replays and shrink candidates of that hang first of
# all) are watched with a short idle limit
#
#     short = min(idle, max(HANG_IDLE_FLOOR_S, HANG_GAP_MULTIPLE x longest gap))
#
# where the longest gap is the longest the decoder went without a forward completing in any of
# its runs that returned (measured at the watchdog's poll): a decoder that was once as slow
# between forwards as the short limit is not cut short. After HANG_RUNS hangs the suite's
# shared runs (`cached_run`) stop waiting on it at all: cases not run yet are rejected (not
# judged), so its shrinker ends on the smallest hang seen. A reproducer replayed in a fresh
# process waits the full idle limit again.

HANG_IDLE_FLOOR_S = 2.0
HANG_GAP_MULTIPLE = 4.0
HANG_RUNS = 6


@dataclass
class HangMemo:
    """What the runner knows of one decoder spec's hangs in this process."""

    hangs: int = 0  # runs stopped for idleness
    longest_gap: float = 0.0  # seconds without a completed forward, in a run that returned


_HANGS: dict[str, HangMemo] = {}


def is_hang(run: Run) -> bool:
    """A run the watchdog stopped because no forward completed for its idle limit."""
    return hang_error(run.error)


def hang_error(error: ContractError | None) -> bool:
    """The watchdog's 'generate-returns' for idleness (not a runaway, not a raise)."""
    return error is not None and error.rule == "generate-returns" and "timeout_s" in error.evidence


def hangs(decoder_spec: str) -> int:
    """How many runs of `decoder_spec` hung in this process."""
    memo = _HANGS.get(decoder_spec)
    return 0 if memo is None else memo.hangs


def hang_limit(decoder_spec: str, case: Case) -> float:
    """The idle limit for a run of `decoder_spec` on `case`: `idle_limit(case)`, or the short one
    once the decoder has hung (see the section comment)."""
    limit = idle_limit(case)
    memo = _HANGS.get(decoder_spec)
    if memo is None or memo.hangs == 0:
        return limit
    return min(limit, max(HANG_IDLE_FLOOR_S, HANG_GAP_MULTIPLE * memo.longest_gap))


def note_run(decoder_spec: str, error: ContractError | None, longest_gap: float) -> None:
    """Remember a hang of `decoder_spec`, or the longest forward gap of a run that returned."""
    memo = _HANGS.setdefault(decoder_spec, HangMemo())
    if hang_error(error):
        memo.hangs += 1
    elif error is None or error.rule != "generate-returns":
        memo.longest_gap = max(memo.longest_gap, longest_gap)


def max_forwards(case: Case) -> int:
    """More target forwards than this cannot come from a decoder whose rows finish."""
    return case.batch_size * (case.max_new_tokens + 2) * (case.num_draft_tokens + 1)


def run_case(
    decoder_spec: str,
    case: Case,
    *,
    factory: Any = None,
    timeout_s: float | None = None,
    instrumented: bool = True,
) -> Run:
    """Run `decoder_spec` (or an already loaded `factory`) on `case` and record everything.

    `timeout_s` overrides the watchdog's idle limit (`hang_limit`: `idle_limit(case)`, short once
    the decoder has hung). `instrumented=False`
    runs without hooks (an empty recording): the baseline for measuring the instrumentation's
    own overhead. A contract break (the decoder's own, an input the checks cannot judge, an
    unobserved target forward, a changed model) leaves `outputs` None and `error` set.
    """
    factory = factory or load_decoder(decoder_spec)
    oracle, scripts = oracle_outputs(case)
    target = target_model(case.model, case.dtype)
    draft = draft_model(case.model, case.draft, scripts, case.dtype)
    limit = timeout_s if timeout_s is not None else hang_limit(decoder_spec, case) if instrumented else idle_limit(case)
    guard = guarded_call(
        decoder_spec,
        factory,
        target,
        draft,
        case,
        Watchdog(limit, max_forwards=max_forwards(case)),
        instrumented,
    )
    if instrumented and timeout_s is None:  # a hang under a limit the caller chose says nothing of the idle limit
        note_run(decoder_spec, guard.error, guard.longest_gap)
    return Run(
        case,
        decoder_spec,
        guard.outputs,
        guard.error,
        oracle,
        scripts,
        guard.recording,
        target,
        guard.seconds,
        guard.decoder,
        factory,
    )


@dataclass
class Guarded:
    """One decoder call under the whole contract: what it returned or the rule it broke."""

    outputs: list[list[int]] | None
    error: ContractError | None
    recording: Recording
    seconds: float
    decoder: Any
    longest_gap: float = 0.0  # longest the call went without a forward completing, at the watchdog's poll


def guarded_call(
    spec: str,
    factory: Any,
    target: torch.nn.Module,
    draft: torch.nn.Module,
    case: Case,
    watchdog: Watchdog,
    instrumented: bool = True,
    sample: Callable[[int], bool] | None = None,
    device: torch.device | None = None,
    sampling: dict[str, Any] | None = None,
) -> Guarded:
    """A fresh decoder from `factory` on `case` under every contract rule, for every subject that
    runs a decoder (built-in and real models alike): the decoder's own rules and the watchdog,
    then, whether it failed or not, the side-effect guard (hooks left behind are removed, a
    changed built-in model is rebuilt) and, when instrumented, the observation rules
    ('unobserved-forward', 'unsupported-input'). `device` is synchronized around the timed call;
    `sampling` holds a sampling decoder's keywords (`running.sampling`). The warnings the run
    raises are shown once each, at the decoder's line (`guard.decoder_warnings`)."""
    owner = (spec, factory)  # the decoder, for `still_running`
    busy = still_running(owner)
    if busy is not None:
        error = ContractError(
            "generate-returns",
            f"no run: this decoder is still running since it timed out on {busy} (its thread has not returned)",
            evidence={"still_running": True},
        )
        return Guarded(None, error, Recording(), 0.0, None)
    decoder = instantiate(factory, spec)
    input_ids, attention_mask = case.batch()  # [B, T] each
    if device is not None:
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    guard = ModelGuard({"target": target, "draft": draft}, evict_models)
    outputs, error = None, None
    evidence = case.draft == "scripted"  # what the scripted draft proposed, for token preservation
    observed = instrument(target, draft, sample or every_call, draft_evidence=evidence)
    with observed if instrumented else nullcontext(Recording()) as recording:
        gaps = Gaps(recording)
        watch = gaps if instrumented else None  # un-instrumented: nothing to read
        watchdog = replace(watchdog, progress=watch, owner=owner, what=repr(case))
        synchronize(device)
        start = time.perf_counter()
        try:
            with torch.no_grad(), decoder_warnings():  # each warning once, at the decoder's line
                outputs = call_decoder(
                    decoder,
                    target,
                    draft,
                    input_ids,
                    attention_mask,
                    num_draft_tokens=case.num_draft_tokens,
                    max_new_tokens=case.max_new_tokens,
                    eos_token_id=case.eos_token_id,
                    pad_token_id=case.pad_token_id,
                    watchdog=watchdog,
                    sampling=sampling,
                )
        except ContractError as exc:
            error = exc
        synchronize(device)
        seconds = time.perf_counter() - start
    changed = guard.breach()  # always: it also repairs the models
    error = breach(recording) or error or changed  # an un-instrumented recording is empty: no breach
    return Guarded(None if error is not None else outputs, error, recording, seconds, decoder, gaps.longest)


def progress(recording: Recording) -> tuple[int, int]:
    """(target forwards, all forwards) completed so far: what the watchdog reads."""
    return recording.forwards, len(recording.target_calls) + len(recording.draft_calls)


class Gaps:
    """`progress` as the watchdog polls it, keeping the longest wait between two changes (or
    before the first): how slow between forwards the decoder has been (`hang_limit`)."""

    def __init__(self, recording: Recording) -> None:
        self.recording, self.seen = recording, (0, 0)
        self.last, self.longest = time.monotonic(), 0.0

    def __call__(self) -> tuple[int, int]:
        now, count = time.monotonic(), progress(self.recording)
        self.longest = max(self.longest, now - self.last)
        if count != self.seen:
            self.seen, self.last = count, now
        return count


def synchronize(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------
# Side effects on the shared models (`specaudit.running.guard`)


def evict_models() -> None:
    """Forget every cached built-in model and run built on one: a decoder changed a model."""
    target_model.cache_clear()
    tiny = sys.modules.get("specaudit.fixtures.tiny")
    if tiny is not None:  # built only when a tiny model was: no import here
        tiny.forget_built()
    _RUNS.clear()


_RUNS: OrderedDict[tuple[str, Case], Run] = OrderedDict()


def cached_run(decoder_spec: str, case: Case) -> Run:
    """The properties share runs: every check of one case costs one decoder run per process.
    Once the decoder has hung HANG_RUNS times, a case not run yet is rejected (Hypothesis's
    `reject`: not judged), so the suite's shrinker stops waiting on the hang."""
    key = (decoder_spec, case)
    if key in _RUNS:
        _RUNS.move_to_end(key)
        return _RUNS[key]
    if hangs(decoder_spec) >= HANG_RUNS:
        from hypothesis import reject

        reject()  # the hang is reported from the runs made; waiting on more of them finds nothing new
    run = run_case(decoder_spec, case)
    _RUNS[key] = run
    while len(_RUNS) > 64:
        _RUNS.popitem(last=False)
    return run
