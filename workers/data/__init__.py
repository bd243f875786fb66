"""Training data: byte tokenizer, passkey synthetic task, local text corpora, prepared datasets.

`build_source(spec, tokenizer)` returns an object with `global_batch(step, batch_size) -> Batch`
whose result depends only on the data spec, the seed and the step — never on how ranks are laid
out. The tokenizer is the model kind's (`workers.models.tokenizer_for`), handed in by the caller.
"""

from __future__ import annotations

from workers.config import JobSpec
from workers.data.batch import Batch, from_windows, take_shard
from workers.data.cache import CachedTextSource, cached_dataset
from workers.data.dataset import DatasetError, PreparedDataset, open_dataset
from workers.data.passkey import PasskeySample, PasskeySource, make_sample, sample_generator
from workers.data.prepare import BYTES
from workers.data.tokenizer import VOCAB_SIZE, ByteTokenizer, HFTokenizer, Tokenizer
from workers.data.tokens import TokensSource

DataSource = PasskeySource | TokensSource | CachedTextSource


def build_source(spec: JobSpec, tokenizer: Tokenizer) -> DataSource:
    d, seed = spec.data, spec.train.seed
    if d.kind == "passkey":
        stages = [(s.steps, s.seq_len) for s in d.curriculum]
        return PasskeySource(
            d.seq_len, d.key_digits, d.depth, d.answer_weight, seed, tokenizer, stages
        )
    if d.kind == "tokens":
        vocab = spec.model.vocab_size if spec.model.kind == "native" else None
        return TokensSource(d.path, d.seq_len, seed, d.pack, d.validation, vocab_size=vocab)
    # kind: text: prepared once into the cache (workers/data/cache.py), then read like kind: tokens
    return CachedTextSource(
        d.path,
        d.seq_len,
        seed,
        d.pack,
        d.text_field,
        tokenizer=tokenizer.path if isinstance(tokenizer, HFTokenizer) else BYTES,
        vocab_size=spec.model.vocab_size if spec.model.kind == "native" else None,
    )


__all__ = [
    "VOCAB_SIZE",
    "Batch",
    "ByteTokenizer",
    "CachedTextSource",
    "DataSource",
    "DatasetError",
    "PasskeySample",
    "PasskeySource",
    "PreparedDataset",
    "Tokenizer",
    "TokensSource",
    "build_source",
    "cached_dataset",
    "from_windows",
    "make_sample",
    "open_dataset",
    "sample_generator",
    "take_shard",
]
