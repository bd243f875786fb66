"""Tiny pretrained checkpoints written with transformers itself (nothing is downloaded).

Weights are re-drawn with a large spread (and non-zero biases, norm gains away from 1) so that
attention is far from uniform and every parameter matters: equivalence tests on freshly initialised
HF models (zero biases, unit norms, 0.02 weights) would pass for many wrong implementations.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

CORPUS = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    "The pass key is 48213. Remember it. What is the pass key? 0123456789 "
) * 20

BASE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


@functools.lru_cache(maxsize=1)
def bpe_tokenizer_json() -> str:
    """A small byte-level BPE trained on CORPUS (serialised; each checkpoint gets its own copy)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CORPUS], trainer)
    return tok.to_str()


def write_checkpoint(
    out_dir: Path, family: str, *, seed: int = 0, std: float = 0.15, **config: Any
) -> Path:
    """Save a random `family` model (config = BASE | config) and the BPE tokenizer to `out_dir`."""
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(bpe_tokenizer_json()), eos_token="<|endoftext|>"
    )
    cfg = AutoConfig.for_model(family, **{**BASE, "vocab_size": len(tok), **config})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir
