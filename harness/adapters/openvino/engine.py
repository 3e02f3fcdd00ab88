"""The step API of OpenVINO GenAI's `ContinuousBatchingPipeline` as a step-wise engine.

`add_request`, `step`, `has_unfinished` and `abort` of the engine contract
(`contracts.engine`) over the pipeline's `add_request`, `step`, `has_non_finished_requests` and
the request handle's `cancel`. Each step's emissions are also kept (`steps`): tokens emitted per
request per step are the per-step evidence acceptance and raggedness are computed from. Per
request it also keeps what the API reports besides the ids: the last finish reason, the handle's
generated-token count (`usage`) and the text the wrapper detokenizes (`text`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

F32_HINTS = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
"""Exact on this CPU; its defaults (bf16, u8) differ from the float64 oracle even without speculation."""


@dataclass(frozen=True)
class EngineOptions:
    """One configuration of the pipeline: the scheduler's settings and the speculation."""

    method: str = "none"  # "none", "draft" (a draft model) or "lookup" (prompt lookup)
    k: int = 3  # num_assistant_tokens
    max_num_batched_tokens: int = 256
    dynamic_split_fuse: bool = True
    prefix_caching: bool = False
    max_num_seqs: int = 8
    num_kv_blocks: int = 64
    hints: tuple[tuple[str, str], ...] = tuple(F32_HINTS.items())
    stop_strings: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "hints": dict(self.hints), "stop_strings": list(self.stop_strings)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineOptions:
        """`to_json`'s inverse (a reproducer's options); keys it does not know are refused by the constructor."""
        hints = tuple((str(k), str(v)) for k, v in (data.get("hints") or F32_HINTS).items())
        return cls(**{**data, "hints": hints, "stop_strings": tuple(data.get("stop_strings") or ())})


@dataclass
class StepLog:
    """Per step, the tokens each request emitted in it (requests that emitted nothing are absent)."""

    emitted: list[dict[int, int]] = field(default_factory=list)

    def ragged_share(self) -> float:
        """Share of steps with two or more requests emitting that emitted different numbers of tokens."""
        busy = [e for e in self.emitted if len(e) >= 2]
        return sum(len(set(e.values())) > 1 for e in busy) / max(len(busy), 1)

    def acceptance(self, k_of: dict[int, int], first_step: dict[int, int]) -> float | None:
        """Accepted drafts over drafted ones: each verify step of a request emits accepted + 1 tokens
        out of K drafts (its first emission, the prefill's token, is no verify step)."""
        drafted = accepted = 0
        for index, e in enumerate(self.emitted):
            for rid, n in e.items():
                if first_step.get(rid) == index:
                    n -= 1
                    if n <= 0:
                        continue
                drafted += k_of[rid]
                accepted += min(n - 1, k_of[rid])
        return None if drafted == 0 else accepted / drafted


def scheduler_config(options: EngineOptions) -> Any:
    import openvino_genai as ov_genai

    config = ov_genai.SchedulerConfig()
    config.max_num_batched_tokens = options.max_num_batched_tokens
    config.dynamic_split_fuse = options.dynamic_split_fuse
    config.enable_prefix_caching = options.prefix_caching
    config.max_num_seqs = options.max_num_seqs
    config.num_kv_blocks = options.num_kv_blocks
    return config


def build_pipeline(target: Path, draft: Path | None, options: EngineOptions) -> Any:
    """The pipeline on the CPU with the options' hints, its draft model or prompt lookup."""
    import openvino_genai as ov_genai

    properties: dict[str, Any] = dict(options.hints)
    if options.method == "draft":
        assert draft is not None, "a draft-model configuration needs the draft's directory"
        properties["draft_model"] = ov_genai.draft_model(str(draft), "CPU", **dict(options.hints))
    elif options.method == "lookup":
        properties["prompt_lookup"] = True
    return ov_genai.ContinuousBatchingPipeline(str(target), scheduler_config(options), "CPU", properties)


class OpenVinoEngine:
    """The engine contract over a built pipeline (greedy; an EOS id, a stop string set, K from the options)."""

    def __init__(self, pipeline: Any, options: EngineOptions, eos_token_id: int | None) -> None:
        self.pipeline, self.options, self.eos = pipeline, options, eos_token_id
        self.handles: dict[int, Any] = {}
        self.log = StepLog()
        self.first_step: dict[int, int] = {}
        self.k_of: dict[int, int] = {}
        self.tokens: dict[int, list[int]] = {}
        self.finish: dict[int, str] = {}  # "stop" or "length": the last finish reason other than NONE
        self.tokenizer: Any = None
        self.sampling: Any = None  # a `contracts.sampling.Sampling`: requests sample (`rng_seed` from `seeds`)
        self.seeds: dict[int, int] = {}

    def generation_config(self, max_new_tokens: int, k: int, stop: str | None = None, include: bool = False) -> Any:
        """`stop`: this request's stop string (the options' set when None), `include`: include_stop_str_in_output."""
        import openvino_genai as ov_genai

        config = ov_genai.GenerationConfig()
        config.max_new_tokens = max_new_tokens
        config.do_sample = False
        if self.eos is not None:
            config.eos_token_id = self.eos
            config.stop_token_ids = {self.eos}
        else:
            config.ignore_eos = True
        stops = {stop} if stop is not None else set(self.options.stop_strings)
        if stops:
            config.stop_strings = stops
            config.include_stop_str_in_output = include
        if self.options.method in ("draft", "lookup"):
            config.num_assistant_tokens = k
        if self.options.method == "lookup":
            config.max_ngram_size = 3
        return config

    def add_request(
        self, request_id: int, prompt_ids: Sequence[int], max_new_tokens: int, k: int | None = None,
        stop: str | None = None, include: bool = False,
    ) -> None:  # fmt: skip
        """`k`: this request's num_assistant_tokens (the options' K by default), so a batch mixes draft
        counts; `stop`, `include`: its stop string and include_stop_str_in_output."""
        import numpy as np
        import openvino as ov

        self.k_of[request_id] = k or self.options.k
        ids = ov.Tensor(np.asarray([list(prompt_ids)], dtype=np.int64))
        config = self.generation_config(max_new_tokens, self.k_of[request_id], stop, include)
        if self.sampling is not None:  # 0 and 1.0: top-k and top-p off
            sampling = self.sampling
            config.do_sample, config.rng_seed, config.temperature = True, self.seeds[request_id], sampling.temperature
            config.top_k = sampling.top_k or 0
            config.top_p = 1.0 if sampling.top_p is None else sampling.top_p
        self.handles[request_id] = self.pipeline.add_request(request_id, ids, config)

    def step(self) -> dict[int, list[int]]:
        self.pipeline.step()
        out: dict[int, list[int]] = {}
        for rid, handle in self.handles.items():
            if handle.can_read():
                for output in handle.read().values():
                    out.setdefault(rid, []).extend(int(t) for t in output.generated_ids)
                    reason = output.finish_reason.name.lower()
                    if reason != "none":
                        self.finish[rid] = reason
        out = {rid: tokens for rid, tokens in out.items() if tokens}
        for rid, tokens in out.items():
            self.tokens.setdefault(rid, []).extend(tokens)
        for rid in out:
            self.first_step.setdefault(rid, len(self.log.emitted))
        self.log.emitted.append({rid: len(tokens) for rid, tokens in out.items()})
        return out

    def has_unfinished(self) -> bool:
        return bool(self.pipeline.has_non_finished_requests())

    def abort(self, request_id: int) -> None:
        handle = self.handles.get(request_id)
        if handle is not None:
            handle.cancel()

    def acceptance(self) -> float | None:
        return None if self.options.method == "none" else self.log.acceptance(self.k_of, self.first_step)

    def finished(self, request_id: int) -> bool:
        """The handle's status is no longer RUNNING (finished, stopped, cancelled or ignored)."""
        import openvino_genai as ov_genai

        handle = self.handles.get(request_id)
        return handle is not None and handle.get_status() != ov_genai.GenerationStatus.RUNNING

    def usage(self, request_id: int) -> int | None:
        """The handle's count of generated tokens (its perf metrics'); None where it reports none: an
        unknown request, or one whose generation never completed (the pipeline raised part-way)."""
        handle = self.handles.get(request_id)
        try:
            return None if handle is None else int(handle.get_perf_metrics().get_num_generated_tokens())
        except RuntimeError:  # "Perf metrics are not available until generation has completed"
            return None

    def decode(self, ids: Sequence[int]) -> str:
        """The pipeline's own tokenizer's text of `ids`."""
        if self.tokenizer is None:
            self.tokenizer = self.pipeline.get_tokenizer()
        return str(self.tokenizer.decode(list(ids)))

    def text(self, request_id: int) -> str:
        """The text of the ids the request emitted (the step API returns ids only; a user decodes them)."""
        return self.decode(self.tokens.get(request_id, []))
