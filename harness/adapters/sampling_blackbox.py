"""Lossless in distribution at the output level: an engine that owns its models, sampling.

Greedy output cannot see a wrong sampler, so a sampling engine is judged against the target's
exact distribution (`contracts.sampling.target_distribution`, HF order: temperature, top-k,
top-p). Each prompt is sent `per_prompt` times with distinct per-request seeds; every returned
token is scored against p given its own request's prefix, teacher-forced at batch size 1 in
float64 on the weights the engine serves; the tokens of all requests are pooled into one
goodness-of-fit verdict (`checks.distribution.output_tokens`, `judge_tokens`) whose false-alarm
probability is fixed in advance (`numerics.fit.ALPHA`) and stated with its power.

Numerics. The engine computes in float32, the oracle in float64: the logits differ by far less
than `SUPPORT_MARGIN`, but a token at a top-k or top-p boundary can be kept by one and dropped by
the other. A token the float64 p gives probability 0 is therefore impossible only when no
perturbation of the logits within +-SUPPORT_MARGIN keeps it (`within_noise`: the perturbation
most in its favour lowers every logit above it and raises it and every logit below it). A token
within the noise is scored against that perturbed distribution instead (`boundary` counts them);
a token beyond it stays at p = 0 and is an `impossible-token`.

Level of evidence: OUTPUT ONLY, as the greedy black box (`adapters.engine_blackbox`): no forward is
observed, so the tokens carry no role (accepted draft, resample, bonus) and the verdict is the
pooled fit.
"""

from __future__ import annotations

import copy
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from specaudit.adapters.engine_blackbox import Request, load_target, seeded_arrivals
from specaudit.adapters.transports import CompletionsClient, send_staggered
from specaudit.checks.distribution import SampledToken, fits_of, judge_tokens, output_tokens
from specaudit.contracts.sampling import Sampling, target_distribution
from specaudit.contracts.violation import Violation
from specaudit.models.compat import call_model
from specaudit.numerics.fit import POWER, Fit
from specaudit.search.jobs import one_torch_thread

SAMPLING = Sampling(temperature=1.0, top_k=20, top_p=0.95)
"""The served audit's settings: temperature 1 keeps the tiny Llama's structure (its top token
holds 0.35-0.75 of the mass), and top-k and top-p both cut, so both boundaries are exercised."""
PER_PROMPT = 16
"""Requests per prompt, each with its own seed: repeated draws of one distribution."""
SUPPORT_MARGIN = 1e-2
"""Logit noise allowed at a top-k/top-p boundary: the float32 proof margin of the greedy black box
(`reference.oracle.PROOF_MARGIN`), 70-100 times the gap measured between vLLM's served float32
log-probabilities and the float64 oracle's (tiny Llama 1.4e-4, SmolLM2-135M 1.0e-4)."""
IN_FLIGHT = 64
"""Requests the client keeps open at once (the server queues them and runs its own batch)."""
FLAT_TOP = 0.2
"""Below this mean top-1 probability the sampled distributions are nearly flat: a fit there sees little."""
EVIDENCE = (
    "output level only: each sampled token against the target's exact float64 distribution given its own "
    "request's prefix, pooled into one goodness-of-fit test; no forward observed, so no roles and no diagnosis"
)


@dataclass(frozen=True)
class Sample:
    """One sampling request and what came back: its tokens, or the contract break standing for them."""

    request: Request
    prompt_index: int
    seed: int
    tokens: tuple[int, ...] | None = None
    error: Violation | None = None

    def to_json(self) -> dict[str, Any]:
        r = self.request
        return {"id": r.id, "prompt": self.prompt_index, "seed": self.seed, "max_new_tokens": r.max_new_tokens,
                "arrival": r.arrival, "tokens": None if self.tokens is None else list(self.tokens),
                "error": None if self.error is None else self.error.rule}  # fmt: skip


def sampling_requests(
    prompts: Sequence[Sequence[int]], per_prompt: int, max_new_tokens: int, seed: int, spread_s: float
) -> list[tuple[Request, int, int]]:
    """(request, prompt index, request seed) for every draw: prompts interleaved, seeded arrivals."""
    n, k = len(prompts) * per_prompt, len(prompts)
    arrivals = seeded_arrivals(n, seed, spread_s)
    return [
        (Request(i, tuple(prompts[i % k]), max_new_tokens, arrivals[i]), i % k, request_seed(seed, i)) for i in range(n)
    ]


def request_seed(seed: int, index: int) -> int:
    """The engine's `seed` of one request: distinct per request, reproducible from the audit's seed."""
    return zlib.crc32(f"sample:{seed}:{index}".encode()) & 0x7FFFFFFF


class SamplingClient(CompletionsClient):
    """POST /v1/completions sampling: the settings and each request's own `seed`; no stop token, so
    every request runs to `max_tokens` (ignore_eos) and each of its tokens is a draw."""

    def __init__(self, url: str, sampling: Sampling, seeds: dict[int, int], **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.sampling, self.seeds = sampling, seeds

    def body(self, request: Request, eos_token_id: int | None) -> dict[str, Any]:
        body = super().body(request, None)
        body["temperature"] = self.sampling.temperature
        if self.sampling.top_k:
            body["top_k"] = self.sampling.top_k
        if self.sampling.top_p is not None:
            body["top_p"] = self.sampling.top_p
        return {**body, "seed": self.seeds[request.id]}


# ---------------------------------------------------------------------------------------
# The oracle and the boundary tolerance


@torch.no_grad()
def prompt_cache(target: torch.nn.Module, prompt: Sequence[int]) -> Any:
    """The target's cache over prompt[:-1] at batch size 1 (None for a one-token prompt), shared by
    every request of the prompt: each continues from a copy of it."""
    if len(prompt) < 2:
        return None
    ids = torch.tensor([list(prompt[:-1])])  # [1, P - 1]
    _, cache = call_model(target, ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None], DynamicCache())
    return cache


@torch.no_grad()
def exact_logits(target: torch.nn.Module, prompt: Sequence[int], tokens: Sequence[int], cache: Any) -> torch.Tensor:
    """[n, V] float64 logits before each of the n tokens: prompt[-1] + tokens[:-1] fed after a copy of
    the prompt's cache (`prompt_cache`), batch size 1; the last token is scored, never fed."""
    past = len(prompt) - 1
    ids = torch.tensor([[prompt[-1], *tokens[:-1]]])  # [1, n]
    mask = torch.ones(1, past + ids.shape[1], dtype=torch.long)
    positions = torch.arange(past, past + ids.shape[1])[None]
    logits, _ = call_model(target, ids, mask, positions, copy.deepcopy(cache) if cache is not None else DynamicCache())
    return logits[0].double()  # [n, V]


def favouring(logits: torch.Tensor, token: int, margin: float) -> torch.Tensor:
    """[V] the logits moved by at most `margin` each, as far as possible in `token`'s favour."""
    above = logits > logits[token]
    return torch.where(above, logits - margin, logits + margin)


def within_noise(logits: torch.Tensor, token: int, sampling: Sampling, margin: float = SUPPORT_MARGIN) -> bool:
    """Whether some perturbation of the logits [V] within +-margin keeps `token` after top-k and top-p."""
    return bool(target_distribution(favouring(logits, token, margin), sampling)[token] > 0)


def tolerant_distribution(
    logits: torch.Tensor, tokens: Sequence[int], sampling: Sampling, margin: float = SUPPORT_MARGIN
) -> tuple[torch.Tensor, list[int]]:
    """(p [n, V], indices scored against a perturbed p): the exact p, except where a token p drops
    is kept within the noise; there, the distribution of the logits perturbed in its favour."""
    p = target_distribution(logits, sampling)  # [n, V]
    index = torch.tensor(list(tokens))
    dropped = (p.gather(1, index[:, None])[:, 0] == 0).nonzero().flatten().tolist()
    boundary = [i for i in dropped if within_noise(logits[i], int(index[i]), sampling, margin)]
    for i in boundary:
        p[i] = target_distribution(favouring(logits[i], int(index[i]), margin), sampling)
    return p, boundary


# ---------------------------------------------------------------------------------------
# The verdict


@dataclass
class SamplingVerdict:
    """The pooled fit of every request's tokens and what stands against it."""

    label: str
    sampling: Sampling
    samples: list[Sample]
    violations: list[Violation]
    fit: Fit
    boundary: list[tuple[int, int]]  # (request, index) scored within the noise of a boundary
    mean_top: float  # the mean top-1 probability of p over the sampled positions
    engine_s: float = 0.0
    oracle_s: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.violations

    @property
    def tokens(self) -> int:
        return self.fit.n

    @property
    def flat(self) -> bool:
        return self.mean_top < FLAT_TOP

    @property
    def verdict(self) -> str:
        f = self.fit
        figures = (f"KS {f.distance:.3f} against {f.bound:.3f} over {f.n} tokens of {len(self.samples)} requests; "
                   f"a shift >= {f.shift:.3f} detected with probability {POWER:.0%}")  # fmt: skip
        if self.passed:
            return f"lossless in distribution ({figures})"
        first = self.violations[0]
        return f"FAIL {first.check}/{first.rule}: {first.found} ({figures})"

    def to_json(self) -> dict[str, Any]:
        f = self.fit
        return {
            "passed": self.passed,
            "verdict": self.verdict,
            "label": self.label,
            "sampling": self.sampling.keywords(),
            "requests": len(self.samples),
            "tokens": f.n,
            "fit": {**asdict(f), "p_bound": f.p_bound},
            "boundary": len(self.boundary),
            "support_margin": SUPPORT_MARGIN,
            "mean_top": self.mean_top,
            "flat": self.flat,
            "engine_s": self.engine_s,
            "oracle_s": self.oracle_s,
            "violations": [asdict(v) for v in self.violations[:8]],
            "samples": [sample.to_json() for sample in self.samples],
            "evidence": EVIDENCE,
        }


def judge_samples(
    label: str, target: torch.nn.Module, samples: Sequence[Sample], sampling: Sampling, seed: int
) -> SamplingVerdict:
    """Each answered request's tokens against its exact p (boundary-tolerant), pooled; contract
    breaks (no answer, too few tokens) first."""
    start = time.perf_counter()
    scored: list[Scored] = []
    cache: tuple[int, Any] | None = None  # (prompt index, its cache): requests are scored prompt by prompt
    with one_torch_thread():  # batch-size-1 forwards: more threads only contend
        for s in sorted(samples, key=lambda s: (s.prompt_index, s.request.id)):
            if s.error is None and s.tokens:
                if cache is None or cache[0] != s.prompt_index:
                    cache = (s.prompt_index, prompt_cache(target, s.request.prompt))
                scored.append(score(target, s, cache[1], sampling, seed))
    tokens = [t for one in scored for t in one.tokens]
    violations = [s.error for s in samples if s.error is not None] + judge_tokens(tokens)
    tops = [top for one in scored for top in one.tops]
    boundary = [where for one in scored for where in one.boundary]
    mean_top = sum(tops) / len(tops) if tops else 0.0
    verdict = SamplingVerdict(label, sampling, list(samples), violations, fits_of(tokens)["all"], boundary, mean_top)
    verdict.oracle_s = time.perf_counter() - start
    return verdict


@dataclass(frozen=True)
class Scored:
    """One request's tokens scored: their PIT values, p's top-1 probability at each, the boundary ones."""

    tokens: list[SampledToken]
    tops: list[float]
    boundary: list[tuple[int, int]]  # (request, index)


def score(target: torch.nn.Module, sample: Sample, cache: Any, sampling: Sampling, seed: int) -> Scored:
    """One request's tokens against p given its prompt's cache; its PIT uniforms seeded by the request."""
    assert sample.tokens is not None
    rid = sample.request.id
    logits = exact_logits(target, sample.request.prompt, sample.tokens, cache)  # [n, V]
    p, near = tolerant_distribution(logits, sample.tokens, sampling)
    found = output_tokens([(list(sample.tokens), p)], request_seed(seed, rid))  # seeded per request
    return Scored([replace(t, row=rid) for t in found], p.max(dim=-1).values.tolist(), [(rid, i) for i in near])


# ---------------------------------------------------------------------------------------
# A server


def audit_sampling_server(
    url: str,
    target: torch.nn.Module | str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    sampling: Sampling = SAMPLING,
    per_prompt: int = PER_PROMPT,
    max_new_tokens: int = 16,
    seed: int = 0,
    spread_s: float = 0.5,
    model: str | None = None,
    timeout_s: float = 300.0,
    say: Callable[[str], None] | None = None,
) -> SamplingVerdict:
    """`per_prompt` seeded requests per prompt to an OpenAI-compatible server (token-id prompts,
    `return_token_ids`), at staggered arrivals, judged against the float64 target in process."""
    planned = sampling_requests(prompts, per_prompt, max_new_tokens, seed, spread_s)
    seeds = {r.id: s for r, _, s in planned}
    client = SamplingClient(url, sampling, seeds, model=model, timeout_s=timeout_s)
    if say is not None:
        say(f"sampling: {len(planned)} requests ({per_prompt} per prompt, {sampling!r}) to {client.url}")
    start = time.perf_counter()
    answers = send_staggered([r for r, _, _ in planned], lambda r: client.complete(r, None), max_workers=IN_FLIGHT)
    engine_s = time.perf_counter() - start
    samples = [Sample(r, p, s, answers[r.id].tokens, answers[r.id].error) for r, p, s in planned]
    verdict = judge_samples(f"server {client.url}", load_target(target, "float64"), samples, sampling, seed)
    verdict.engine_s = engine_s
    if say is not None:
        say(f"sampling: {verdict.verdict}")
    return verdict
