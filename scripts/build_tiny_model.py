"""Build the tiny random Llama and byte-level BPE tokenizer the engine tests serve.

No model can be downloaded here, so the engine tests run vLLM on a model made
locally: a Llama with random weights (fixed seed) and a byte-level BPE
tokenizer trained on a fixed synthetic corpus, saved in the Hugging Face
layout vLLM loads (`config.json`, `model.safetensors`, `tokenizer.json`, ...).
Runs with .venv-engine's python (it needs `transformers` and `tokenizers`).
Deterministic: the same arguments give the same files; a directory already
built with the same arguments is left as it is.

    .venv-engine/bin/python scripts/build_tiny_model.py .engine-model
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

SEED = 1234
STAMP = "kvmesh-tiny-model.json"
# A chat template the gateway renders with the tokenizer (OpenAI roles, plain text).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]


def corpus(seed: int, lines: int = 4000) -> list[str]:
    """Synthetic English-like lines from seeded syllables (no data set is available)."""
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghklmnprstvwz" for b in ("a", "e", "i", "o", "u", "ai", "ou")]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(600)]
    words += ["the", "a", "of", "and", "to", "in", "is", "you", "that", "it", "user", "assistant"]
    out = []
    for _ in range(lines):
        n = rng.randint(4, 16)
        line = " ".join(rng.choices(words, k=n))
        out.append(line.capitalize() + rng.choice([".", "?", "!", ","]))
    return out


def build_tokenizer(out: Path, vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(SEED), trainer=trainer)
    bos, eos, pad = SPECIAL_TOKENS
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, model_max_length=4096
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return len(fast)


def build_model(out: Path, args: argparse.Namespace, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=(vocab + 63) // 64 * 64,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_len,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        torch_dtype=args.dtype,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    model.save_pretrained(out, safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = p.parse_args(argv)
    if args.hidden // args.heads < 32:
        p.error("head_dim (hidden / heads) must be >= 32: vLLM's CPU attention refuses less")
    want = {k: v for k, v in sorted(vars(args).items()) if k not in ("out", "force")}
    want["seed"] = SEED
    stamp = args.out / STAMP
    if not args.force and stamp.exists() and json.loads(stamp.read_text()) == want:
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"kvmesh: building the tiny engine model in {args.out}", file=sys.stderr)
    vocab = build_tokenizer(args.out, args.vocab)
    build_model(args.out, args, vocab)
    stamp.write_text(json.dumps(want, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
