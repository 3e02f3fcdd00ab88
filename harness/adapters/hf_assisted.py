"""Hugging Face assisted generation as a decoder under the decoder contract.

`HFAssisted` runs `target.generate(..., assistant_model=draft, do_sample=False)` one row at a
time: each row's left padding is stripped and the row is generated at batch size 1, which is
the only batch size HF's assisted generation supports. The harness instruments the models
it hands over, so every target and draft forward HF makes is recorded and I1/I2 and
equivalence apply as for any batch decoder.

  per row b:   x_b = input_ids[b][attention_mask[b] == 1]            # [1, L_b], no padding
               y_b = target.generate(x_b, assistant_model=draft)      # greedy, K drafts a round
               out_b = y_b[L_b:] cut after the first EOS, at most max_new_tokens

K is fixed: HF reads the number of drafts per round from the *assistant's* generation config
(`num_assistant_tokens`), adapts it by default (`num_assistant_tokens_schedule="heuristic"`,
stored back into the assistant's config) and stops drafting early below a confidence
threshold. For the duration of one `generate` the draft's generation config is swapped for a
copy with K drafts, the "constant" schedule and no confidence threshold, and restored after,
so a shared draft model is left as it was found.

Models: any HF causal LM pair sharing a vocabulary: the tiny Llama/Qwen3/GPT-2 fixtures, and
the transparent target with the scripted draft (Hugging Face `generate` drives them as it drives Llama),
where token preservation applies too.

Observed with transformers 5.24 (an HF behaviour the audit shows, not an adapter choice): after
the first round HF calls the assistant's `generate` without an attention mask, so the assistant
infers one from `pad_token_id` and masks out every real token equal to the pad id. The output
stays right (the target verifies), acceptance drops; on the transparent pair token
preservation reports it when a prompt or generated token equals the pad id.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class UnsupportedModelError(ValueError):
    """The models cannot run HF assisted generation (the message says which and why)."""


@contextmanager
def fixed_assistant_config(draft: torch.nn.Module, num_draft_tokens: int) -> Iterator[None]:
    """Swap the draft's generation config for one that drafts exactly K tokens a round; restore it after."""
    original = getattr(draft, "generation_config", None)
    config = copy.deepcopy(original)
    if config is None:
        from transformers import GenerationConfig

        config = GenerationConfig()
    config.num_assistant_tokens = int(num_draft_tokens)
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0  # 0: no ConfidenceCriteria, no threshold adaptation
    draft.generation_config = config
    try:
        yield
    finally:
        draft.generation_config = original


def cut(tokens: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """The contract's row: at most max_new_tokens, ending at the first EOS (included)."""
    tokens = list(tokens[:max_new_tokens])
    if eos_token_id is not None and eos_token_id in tokens:
        tokens = tokens[: tokens.index(eos_token_id) + 1]
    return tokens


def check_supported(target: torch.nn.Module, draft: torch.nn.Module) -> None:
    for role, model in (("target", target), ("draft", draft)):
        if not callable(getattr(model, "generate", None)):
            raise UnsupportedModelError(f"the {role} {type(model).__name__} has no generate() method")
    if target is not draft and getattr(target.config, "vocab_size", None) != getattr(draft.config, "vocab_size", None):
        raise UnsupportedModelError(
            f"target and draft vocabularies differ ({target.config.vocab_size} vs {draft.config.vocab_size}); "
            "HFAssisted audits same-tokenizer assisted generation only"
        )


class HFAssisted:
    """Hugging Face assisted generation, greedy, batch size 1 per row (see the module docstring)."""

    name = "hf-assisted"

    def __init__(self, generate_kwargs: dict[str, Any] | None = None) -> None:
        self.generate_kwargs = dict(generate_kwargs or {})  # extra generate() arguments, passed through

    @torch.no_grad()
    def generate(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        num_draft_tokens: int,
        max_new_tokens: int,
        eos_token_id: int | None,
        pad_token_id: int,
    ) -> list[list[int]]:
        check_supported(target, draft)
        out: list[list[int]] = []
        with fixed_assistant_config(draft, num_draft_tokens):
            for row in range(input_ids.shape[0]):
                out.append(
                    self.generate_row(
                        target, draft, input_ids[row], attention_mask[row], max_new_tokens, eos_token_id, pad_token_id
                    )
                )
        return out

    def generate_row(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        ids: torch.Tensor,
        mask: torch.Tensor,
        max_new_tokens: int,
        eos_token_id: int | None,
        pad_token_id: int,
    ) -> list[int]:
        prompt = ids[mask.bool()][None]  # [1, L]: left padding stripped
        # An explicit all-ones mask: the prompt may hold the pad id as a real token, and HF
        # would otherwise infer a mask from pad_token_id and hide it.
        generated = target.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            assistant_model=draft,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            **self.generate_kwargs,
        )  # [1, L + n]
        return cut([int(t) for t in generated[0, prompt.shape[1] :].tolist()], max_new_tokens, eos_token_id)


__all__ = ["HFAssisted", "UnsupportedModelError", "fixed_assistant_config", "cut", "check_supported"]
