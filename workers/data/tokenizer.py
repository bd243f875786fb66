"""Tokenizers: one small interface, byte-level for native models, the model's own for pretrained
ones.

Everything that turns text into training tokens or scores generated tokens (text corpora, passkey
prompts and answers, evals) gets its tokenizer from the caller, which asks the model kind
(`workers.models.tokenizer_for(spec)`), so a pretrained model always sees the ids its embedding was
trained on. The data layer never looks up a model kind itself.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

VOCAB_SIZE = 256


@runtime_checkable
class Tokenizer(Protocol):
    """What training and evaluation need from a tokenizer.

    `encode` never adds special tokens (BOS/EOS are the caller's decision); `eos_id` separates
    documents in a packed corpus; `vocab_size` is the number of ids `encode` can return (≤ the
    model's vocabulary).
    """

    vocab_size: int
    eos_id: int | None
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str: ...

    def encode_tensor(self, text: str) -> torch.Tensor: ...


class ByteTokenizer:
    """Text ↔ UTF-8 bytes (id = byte). Decoding replaces invalid sequences (a model can emit any
    byte).

    NUL (id 0) is the document separator, as in corpora prepared with the bytes tokenizer
    (`workers.data.prepare` closes every document with it).
    """

    vocab_size = VOCAB_SIZE
    eos_id: int | None = 0
    bos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_tensor(self, text: str) -> torch.Tensor:
        return torch.tensor(self.encode(text), dtype=torch.long)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer read from a local model directory
    (tokenizer.json / tokenizer_config.json).

    Loaded through `transformers.AutoTokenizer` so the directory's own settings (special tokens,
    added tokens, normalisers) apply exactly as they will after export; nothing is downloaded.
    """

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        self.path = str(path)
        self._tok: Any = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        self.vocab_size: int = len(self._tok)
        self.eos_id: int | None = self._tok.eos_token_id
        self.bos_id: int | None = self._tok.bos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_tensor(self, text: str) -> torch.Tensor:
        return torch.tensor(self.encode(text), dtype=torch.long)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def save_pretrained(self, out_dir: str | Path) -> None:
        """Write the tokenizer files next to an exported model."""
        self._tok.save_pretrained(str(out_dir))


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map, used by `tokenizers`' ByteLevel pre-tokenizer."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def save_byte_tokenizer(out_dir: str | Path) -> None:
    """Write a Hugging Face tokenizer whose ids are UTF-8 bytes (ByteTokenizer's), for exported
    native models.

    Byte-level BPE with the 256 byte symbols as vocabulary (id = byte) and no merges, no regex
    split, no special tokens: `AutoTokenizer` encodes any text to exactly
    `ByteTokenizer().encode(text)`.
    """
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=raw).save_pretrained(str(out_dir))


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str) -> HFTokenizer:
    """A model directory's tokenizer, loaded once per process (data, evals and export share it)."""
    return HFTokenizer(path)


__all__ = [
    "VOCAB_SIZE",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "save_byte_tokenizer",
]
