"""The oracle: single-sequence, batch-size-1 greedy decoding with the target.

Everything a batch decoder produces is judged against this. No padding, no batch, no
speculation: positions 0..n-1 passed explicitly, one token appended per step.

With `keep_kv` the oracle also keeps its own final cache (prompt and every generated token,
the last one fed once more) on the CPU, flattened one row per slot (`kv_rows`). I2 slices it
as the batch-size-1 reference K/V of any row whose tokens are a prefix of the oracle's, so
a row that matches the oracle costs no second batch-size-1 run.

`answer_oracle` is the same oracle made as fast as the engine it judges: given the engine's
answer, one teacher-forced forward proves every token whose argmax it reproduces by a clear
margin, and only past the first doubt does it decode step by step. With `cut` it stops at the
first divergence from the answer (greedy's own token there included): all a verdict needs, so a
wrong answer costs no more than a right one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import DynamicCache

from specaudit.models.compat import cache_layers, call_model, last_logits

StopReason = Literal["eos", "length"]
OracleStop = Literal["eos", "length", "cut"]
"""How an oracle's tokens end: EOS, the token limit, or cut at the first divergence from an answer."""


@dataclass(frozen=True)
class OracleResult:
    tokens: tuple[int, ...]
    stop: OracleStop
    margins: tuple[float, ...]
    """Top-1 minus top-2 logit at each generated step: how close each argmax was to a tie."""
    kv: torch.Tensor | None = field(default=None, compare=False, repr=False, hash=False)
    """With `keep_kv`: the K/V of prompt + tokens, [n, F] (`kv_rows`), on the CPU, in the model's dtype."""

    @property
    def complete(self) -> bool:
        """False when cut at the first divergence from an answer (`answer_oracle(cut=True)`): the
        tokens are the proven prefix plus greedy's own token there, not the whole continuation."""
        return self.stop != "cut"


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def top_margin(logits: torch.Tensor) -> float:
    top = logits.double().topk(2).values  # [2]
    return float(top[0] - top[1])


def kv_rows(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One row per slot: per-layer (K, V) [H, n, D] (or [1, H, n, D]) as [n, F], F = layers x 2 x H x D,
    ordered K0, V0, K1, V1, ... (what I2 compares slot by slot)."""
    flat = []
    for k, v in layers:
        for x in (k, v):
            x = x[0] if x.dim() == 4 else x  # [H, n, D]
            flat.append(x.transpose(0, 1).reshape(x.shape[1], -1))  # [n, H * D]
    return torch.cat(flat, dim=1)


@torch.no_grad()
def greedy_oracle(
    target: torch.nn.Module,
    prompt: tuple[int, ...],
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
    keep_kv: bool = False,
) -> OracleResult:
    """Greedy continuation of one prompt, stopping after EOS (included) or max_new_tokens.

    `keep_kv`: feed the last token once more and keep the final cache as `OracleResult.kv`."""
    device = model_device(target)
    ids = torch.tensor([prompt], device=device)  # [1, L]
    positions = torch.arange(len(prompt), device=device)[None]
    logits, cache = call_model(target, ids, torch.ones_like(ids), positions, DynamicCache())
    tokens: list[int] = []
    margins: list[float] = []
    while True:
        last = logits[0, -1]  # [V]
        token = int(last.argmax())
        tokens.append(token)
        margins.append(top_margin(last))
        stop = stop_reason(tokens, max_new_tokens, eos_token_id)
        if stop is not None and not keep_kv:
            return OracleResult(tuple(tokens), stop, tuple(margins))
        length = len(prompt) + len(tokens)
        mask = torch.ones(1, length, dtype=torch.long, device=device)
        step = torch.tensor([[token]], device=device)
        logits, cache = call_model(target, step, mask, torch.tensor([[length - 1]], device=device), cache)
        if stop is not None:
            kv = kv_rows([(k[:1, :, :length], v[:1, :, :length]) for k, v in cache_layers(cache)])  # [n, F]
            return OracleResult(tuple(tokens), stop, tuple(margins), kv.detach().to("cpu", copy=True))


PROOF_MARGIN = {torch.float64: 1e-7, torch.float32: 1e-2, torch.float16: 0.25, torch.bfloat16: 0.5}
"""Top-1/top-2 margin above which a teacher-forced argmax stands for the step-by-step one: far
beyond the gap between a prefill's and a decode step's arithmetic (a tie is judged at 1e-4 in float32)."""


def stop_reason(tokens: list[int], max_new_tokens: int, eos_token_id: int | None) -> StopReason | None:
    if tokens and tokens[-1] == eos_token_id:
        return "eos"
    return "length" if len(tokens) >= max_new_tokens else None


@torch.no_grad()
def proven_prefix(
    target: torch.nn.Module, context: tuple[int, ...], answer: tuple[int, ...], margin: float
) -> tuple[list[int], list[float]]:
    """The longest prefix of `answer` that greedy decoding after `context` provably produces.

    One forward over context + answer[:-1] at batch size 1: the logits at position L-1+i score
    answer[i] given answer[:i] (the LM head runs on those n positions only). Greedy agrees at i
    when argmax == answer[i]; the proof holds while the top-1/top-2 gap exceeds `margin` (past
    that, noise could flip it)."""
    if not answer:
        return [], []
    ids = torch.tensor([context + answer[:-1]], device=model_device(target))  # [1, L + n - 1]
    scored = last_logits(target, ids, len(answer))[0].double()  # [n, V]: position L-1+i scores answer[i]
    top = scored.topk(2, dim=-1)
    gaps = (top.values[:, 0] - top.values[:, 1]).tolist()
    picks = top.indices[:, 0].tolist()
    proven = 0
    while proven < len(answer) and picks[proven] == answer[proven] and gaps[proven] > margin:
        proven += 1
    return list(answer[:proven]), gaps[:proven]


def answer_oracle(
    target: torch.nn.Module,
    prompt: tuple[int, ...],
    answer: tuple[int, ...],
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
    cut: bool = False,
) -> OracleResult:
    """`greedy_oracle`'s result, found by checking `answer` rather than decoding blind.

    The answer's prefix is proven teacher-forced; at the first doubt (a near-tie or a
    disagreement) one greedy step decides; while it agrees with the answer proof resumes after
    it, and once it leaves the answer the rest is decoded step by step. A right answer costs
    one forward instead of one per token.

    `cut`: stop where greedy leaves the answer (or the answer ends), keeping greedy's token and
    margin there (a tie can still be judged and re-synced), with stop "cut" unless greedy itself
    stopped there. The verdict needs only that first divergence, not the continuation past it."""
    margin = PROOF_MARGIN.get(next(target.parameters()).dtype, PROOF_MARGIN[torch.float32])
    tokens: list[int] = []
    margins: list[float] = []

    def decode(budget: int) -> OracleResult:
        found = greedy_oracle(target, prompt + tuple(tokens), max_new_tokens=budget, eos_token_id=eos_token_id)
        tokens.extend(found.tokens)
        margins.extend(found.margins)
        return found

    while stop_reason(tokens, max_new_tokens, eos_token_id) is None:
        proven, gaps = proven_prefix(target, prompt + tuple(tokens), answer[len(tokens) : max_new_tokens], margin)
        kept, _ = truncate(tuple(proven), max_new_tokens=len(proven), eos_token_id=eos_token_id)  # through EOS
        tokens.extend(kept)
        margins.extend(gaps[: len(kept)])
        if stop_reason(tokens, max_new_tokens, eos_token_id) is not None:
            break
        if len(tokens) < len(answer):  # the first doubt: one greedy step decides
            agrees = decode(1).tokens[0] == answer[len(tokens) - 1]
            if agrees or stop_reason(tokens, max_new_tokens, eos_token_id) is not None:
                continue
        elif cut:  # past the answer: greedy's next token is the divergence
            decode(1)
        if not cut:
            decode(max_new_tokens - len(tokens))  # past or off the answer: the rest blind
        break
    stop = stop_reason(tokens, max_new_tokens, eos_token_id)
    assert cut or stop is not None, "the oracle stops at EOS or the token limit"
    return OracleResult(tuple(tokens), stop or "cut", tuple(margins))


def answer_oracles(
    target: torch.nn.Module,
    wanted: Sequence[tuple[tuple[int, ...], tuple[int, ...], int]],
    eos_token_id: int | None,
    *,
    cut: bool = False,
) -> list[OracleResult]:
    """`answer_oracle` for each (prompt, answer, max_new_tokens), each distinct one found once
    (`cut`: each stops at its first divergence from the answer)."""
    memo: dict[tuple[tuple[int, ...], tuple[int, ...], int], OracleResult] = {}
    for key in wanted:
        if key not in memo:
            prompt, answer, limit = key
            memo[key] = answer_oracle(target, prompt, answer, max_new_tokens=limit, eos_token_id=eos_token_id, cut=cut)
    return [memo[key] for key in wanted]


def truncate(
    continuation: tuple[int, ...], *, max_new_tokens: int, eos_token_id: int | None
) -> tuple[tuple[int, ...], StopReason]:
    """The oracle's output from a longer EOS-blind continuation: same tokens, same stop."""
    out = continuation[:max_new_tokens]
    if eos_token_id is not None and eos_token_id in out:
        return out[: out.index(eos_token_id) + 1], "eos"
    return out, "length"


@torch.no_grad()
def reference_kv(
    target: torch.nn.Module, tokens: tuple[int, ...], *, host: bool = True
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) [H, n, D] of a batch-size-1 run over `tokens` at positions 0..n-1: copied to
    the host (the paged white boxes compare there), or with `host=False` kept on the model's device
    for I2, which compares where the snapshots are (`checks.kv`)."""
    device = model_device(target)
    ids = torch.tensor([tokens], device=device)  # [1, n]
    positions = torch.arange(len(tokens), device=device)[None]
    _, cache = call_model(target, ids, torch.ones_like(ids), positions, DynamicCache())
    where = "cpu" if host else device
    return [(k[0].detach().to(where, copy=True), v[0].detach().to(where, copy=True)) for k, v in cache_layers(cache)]
