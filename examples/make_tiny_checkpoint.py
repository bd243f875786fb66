"""Write a tiny random Hugging Face checkpoint + a BPE tokenizer trained on a local corpus, for trying
`model: {kind: hf}` offline (nothing is downloaded).

    python examples/make_tiny_checkpoint.py /tmp/ringtrain-tiny-qwen2 --family qwen2 --corpus examples/corpus.txt

The directory is what a real model directory holds (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json); `examples/pretrained.yaml` trains it with a yarn RoPE extension.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def train_tokenizer(corpus: Path, vocab_size: int) -> object:
    """A byte-level BPE (GPT-2/Qwen style) trained on the corpus, with an end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([str(corpus)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out", type=Path)
    ap.add_argument("--family", choices=FAMILIES, default="qwen2")
    ap.add_argument("--corpus", type=Path, default=Path(__file__).parent / "corpus.txt")
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument(
        "--max-position-embeddings", type=int, default=512, help="the 'pretraining' context"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = train_tokenizer(args.corpus, args.vocab_size)
    config = AutoConfig.for_model(
        args.family,
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=args.family in ("qwen2", "qwen3"),
        eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)  # type: ignore[attr-defined]
    n = sum(p.numel() for p in model.parameters())
    print(
        f"wrote a random {args.family} model ({n / 1e6:.2f} M parameters, vocab {len(tokenizer)}) to {args.out}"
    )  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
