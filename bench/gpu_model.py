"""A realistic-size random Llama pair on disk, for the real-model audit where no checkpoint can travel.

    python bench/gpu_model.py OUT_DIR [--layers 12 --hidden 768 --heads 12 --kv-heads 4 --ffn 2048]
        [--draft-layers 4] [--init-std 0.05] [--seed 0] [--dtype float32] [--stats]

Writes OUT_DIR/target and OUT_DIR/draft as Hugging Face directories (`save_pretrained`), each
with the same offline character tokenizer, so `specaudit audit --target OUT_DIR/target --draft
OUT_DIR/draft` loads them exactly as it loads real weights. The draft is a layer-skip draft: the
target's first `--draft-layers` layers with its embedding, final norm and head
(`specaudit.models.pretrained.layer_skip`, as for the built-in smollm2 draft).

Weights are drawn from one explicit `torch.Generator` (no global RNG), in float32, and saved
in `--dtype` (the audit's `--dtype` casts on load). HF's initializer_range 0.02 at width 768
gives logits with a std of about 0.5 and top-1/top-2 margins that low precision flips; 0.05
(the default) gives a median greedy margin of about one logit and a draft that agrees with the
target on roughly half of the greedy tokens (`--stats` prints both; bench/README.md records
the figures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders
from tokenizers import models as tokenizer_models
from transformers import AutoTokenizer, DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "harness" / "data" / "prompts.jsonl"
SPECIALS = ("<pad>", "<eos>", "<unk>")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------------------------
# Tokenizer: one token per character, offline


def prompt_texts(path: Path) -> list[str]:
    """The prompts of a JSONL (`turns`/`prompt`/`text`) or plain file; [] if it does not exist."""
    if not path.is_file():
        return []
    texts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            obj = json.loads(line)
            turns = obj.get("turns")
            texts.append(turns[0] if isinstance(turns, list) and turns else obj.get("prompt") or obj.get("text") or "")
        else:
            texts.append(line)
    return texts


def char_vocab(texts: list[str], multiple: int = 64) -> dict[str, int]:
    """<pad> 0, <eos> 1, <unk> 2, then printable ASCII, newline, tab and every other character of
    `texts` (sorted), then reserved tokens up to a multiple of `multiple` (a GPU-friendly vocab)."""
    chars = {chr(c) for c in range(32, 127)} | {"\n", "\t"} | set("".join(texts))
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(chars):
        vocab[ch] = len(vocab)
    for i in range(-len(vocab) % multiple):
        vocab[f"<reserved_{i}>"] = len(vocab)
    return vocab


def char_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A character-level BPE (no merges) wrapped as a fast tokenizer, with eos and pad set."""
    tok = Tokenizer(tokenizer_models.BPE(vocab=char_vocab(texts), merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


# ---------------------------------------------------------------------------------------
# Model: a Llama config at a realistic width, seeded weights


def llama_config(args: argparse.Namespace, vocab_size: int, eos: int, pad: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions,
        initializer_range=args.init_std,
        tie_word_embeddings=False,
        use_cache=True,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        attn_implementation=args.attn,
    )


def weight_std(name: str, args: argparse.Namespace) -> float:
    """The init std of one weight: `--head-std` for the head, `--init-std` elsewhere, times
    `--later-layer-scale` on the residual-branch outputs of the layers the draft skips."""
    if name.startswith("lm_head."):
        return args.head_std
    parts = name.split(".")  # model.layers.<i>.self_attn.o_proj.weight
    later = len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= args.draft_layers
    if later and parts[-2] in ("o_proj", "down_proj"):
        return args.init_std * args.later_layer_scale
    return args.init_std


@torch.no_grad()
def seeded_init(model: torch.nn.Module, args: argparse.Namespace) -> None:
    """Every weight drawn from N(0, weight_std) by one explicit generator, in parameter order;
    norms 1. HF's own init uses the global RNG and changes between versions; this does not."""
    gen = torch.Generator().manual_seed(args.seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * weight_std(name, args))


def build_target(args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = llama_config(args, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    model = LlamaForCausalLM(config).float()
    seeded_init(model, args)
    return model.eval()


def write_pair(args: argparse.Namespace) -> tuple[Path, Path]:
    """OUT/target and OUT/draft (its first --draft-layers layers), each with the tokenizer."""
    from specaudit.models.pretrained import layer_skip

    out = Path(args.out)
    target_dir, draft_dir = out / "target", out / "draft"
    tokenizer = char_tokenizer(prompt_texts(Path(args.prompts)))
    model = build_target(args, tokenizer)
    with tempfile.TemporaryDirectory() as work:  # the draft is cut from the float32 weights
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        layer_skip(Path(work), draft_dir, args.draft_layers)
    if args.dtype != "float32":
        draft = LlamaForCausalLM.from_pretrained(str(draft_dir), dtype=DTYPES[args.dtype])
        draft.save_pretrained(str(draft_dir))
    model.to(DTYPES[args.dtype]).save_pretrained(str(target_dir))
    tokenizer.save_pretrained(str(target_dir))
    return target_dir, draft_dir


# ---------------------------------------------------------------------------------------
# Stats: how realistic the greedy margins and the draft's agreement are


@torch.no_grad()
def greedy(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Batch-size-1 greedy continuation with a cache: [1, L] -> [1, L + new_tokens]."""
    from specaudit.models.compat import cache_keyword

    cache = DynamicCache()
    logits = model(input_ids=ids, use_cache=True, **{cache_keyword(model): cache}).logits  # [1, L, V]
    for _ in range(new_tokens):
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        logits = model(input_ids=ids[:, -1:], use_cache=True, **{cache_keyword(model): cache}).logits  # [1, 1, V]
    return ids


@torch.no_grad()
def greedy_stats(target_dir: Path, draft_dir: Path, prompts: list[str], new_tokens: int) -> dict[str, Any]:
    """Float32, batch size 1, along the target's greedy continuation: the top-1/top-2 logit
    margin per step, how often the draft's argmax equals the target's, distinct tokens per row."""
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = LlamaForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    margins, agree, distinct = [], [], []
    for text in prompts:
        ids = torch.tensor([tokenizer(text)["input_ids"]])  # [1, L]
        n = ids.shape[1]
        ids = greedy(target, ids, new_tokens)  # [1, L + new]
        top = target(input_ids=ids, use_cache=False).logits[0, n - 1 : -1].topk(2, dim=-1).values  # [new, 2]
        margins += (top[:, 0] - top[:, 1]).tolist()
        drafted = draft(input_ids=ids, use_cache=False).logits[0, n - 1 : -1].argmax(-1)  # [new]
        agree += (drafted == ids[0, n:]).tolist()
        distinct.append(len(set(ids[0, n:].tolist())))
    ordered = sorted(margins)
    return {
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "margin_p10": ordered[len(ordered) // 10],
        "margin_p50": statistics.median(margins),
        "draft_agreement": sum(agree) / len(agree),
        "distinct_tokens_per_row": statistics.mean(distinct),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", metavar="OUT_DIR", help="writes OUT_DIR/target and OUT_DIR/draft")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4, help="GQA: key/value heads (default 4)")
    parser.add_argument("--ffn", type=int, default=2048, help="MLP width (default 2048)")
    parser.add_argument("--draft-layers", type=int, default=4, help="layers of the layer-skip draft (default 4)")
    parser.add_argument("--max-positions", type=int, default=4096)
    parser.add_argument("--init-std", type=float, default=0.05, help="std of every weight (default 0.05)")
    parser.add_argument("--head-std", type=float, default=0.15, help="std of the LM head (default 0.15)")
    parser.add_argument(
        "--later-layer-scale",
        type=float,
        default=0.5,
        help="factor on o_proj/down_proj of the layers the draft skips (default 0.5)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="saved dtype (default float32)")
    parser.add_argument("--attn", default="sdpa", help="attention implementation (default sdpa)")
    parser.add_argument("--prompts", default=str(PROMPTS), help="texts whose characters the vocabulary covers")
    parser.add_argument("--stats", action="store_true", help="print greedy margins and draft agreement (float32)")
    parser.add_argument("--stats-only", action="store_true", help="no build: --stats on the pair under OUT_DIR")
    parser.add_argument("--stats-prompts", type=int, default=4)
    parser.add_argument("--stats-tokens", type=int, default=32)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hf_logging.disable_progress_bar()  # one line per step in the check's log, no bars
    if args.stats_only:
        target_dir, draft_dir = Path(args.out) / "target", Path(args.out) / "draft"
    else:
        target_dir, draft_dir = write_pair(args)
        params = sum(p.numel() for p in LlamaForCausalLM.from_pretrained(str(target_dir)).parameters())
        print(
            f"gpu_model: target {target_dir} ({args.layers} layers, hidden {args.hidden}, {params / 1e6:.1f}M "
            f"params, init std {args.init_std:g}, head std {args.head_std:g}, later-layer scale "
            f"{args.later_layer_scale:g}, seed {args.seed}, saved {args.dtype}), draft {draft_dir} "
            f"(first {args.draft_layers} layers)",
            flush=True,
        )
    if args.stats or args.stats_only:
        texts = prompt_texts(Path(args.prompts))[: args.stats_prompts] or ["The quick brown fox"]
        stats = greedy_stats(target_dir, draft_dir, texts, args.stats_tokens)
        print("gpu_model stats: " + json.dumps({k: round(v, 3) for k, v in stats.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
