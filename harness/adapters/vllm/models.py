"""The served models of `specaudit audit-vllm`: a config-built tiny Llama with a WordLevel
tokenizer (built here, nothing downloaded) and its layer-skip draft, and SmolLM2 with its draft
(`specaudit.models.pretrained`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from specaudit.config.settings import VLLM_MODEL_NAMES
from specaudit.contracts.errors import UsageError

TINY = {"vocab": 512, "hidden": 128, "heads": 2, "kv_heads": 1, "ffn": 256, "layers": 2, "positions": 512}
"""head_dim 64: vLLM's CPU attention supports it, and GQA (2 heads over 1 KV head) is exercised."""
TINY_RANGE = 0.4
"""Weight std: HF's 0.02 gives near-uniform logits, so greedy argmaxes would be near-ties."""
TINY_LATER_SCALE = 0.5
"""Factor on the output projections after layer 0, so the layer-0 draft agrees often, not always."""
TINY_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")


def tiny_tokenizer(out: Path, vocab: int) -> None:
    """A WordLevel tokenizer over `vocab` ids (`w4` ... plus four specials), saved as a fast HF tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {tok: i for i, tok in enumerate(TINY_SPECIALS)} | {f"w{i}": i for i in range(len(TINY_SPECIALS), vocab)}
    core = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(out)


def tiny_llama(out: Path, seed: int = 0) -> None:
    """A seeded random-weight Llama (float32) with its tokenizer, saved with `save_pretrained`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = TINY
    config = LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], max_position_embeddings=s["positions"],
        initializer_range=TINY_RANGE, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(TINY_LATER_SCALE)
            layer.mlp.down_proj.weight.mul_(TINY_LATER_SCALE)
    model.save_pretrained(out)
    tiny_tokenizer(out, s["vocab"])


def model_directories(name: str, root: Path, say: Callable[[str], None]) -> tuple[Path, Path]:
    """(target, draft) directories of a served model, built on first use."""
    from specaudit.models.pretrained import built, layer_skip, resolve

    def tell(text: str) -> None:  # pretrained's lines carry the prefix already
        say(text.removeprefix("specaudit: "))

    if name == "smollm2":
        return resolve("smollm2", say=tell), resolve("smollm2-draft", say=tell)
    if name != "tiny":
        raise UsageError(f"unknown served model {name!r}; choose from {', '.join(VLLM_MODEL_NAMES)}")
    target = built(root / "tiny-llama", tiny_llama, tell)
    return target, built(root / "tiny-llama-draft", lambda out: layer_skip(target, out, 1), tell)
