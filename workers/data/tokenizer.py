"""Byte-level tokenizer: token id = UTF-8 byte, vocab 256. Nothing to download, nothing unknown."""

from __future__ import annotations

import torch

VOCAB_SIZE = 256


class ByteTokenizer:
    """Text ↔ UTF-8 bytes. Decoding replaces invalid sequences (a model can emit any byte)."""

    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_tensor(self, text: str) -> torch.Tensor:
        return torch.tensor(self.encode(text), dtype=torch.long)

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")
