"""Tokenizers (workers/data/tokenizer.py): the byte tokenizer's decoding of what a model may emit,
and the exported byte-level tokenizer on every byte value valid UTF-8 can hold (the export test
checks one sentence), against Python's own UTF-8 codec."""

from __future__ import annotations

from pathlib import Path

import torch

from workers.data.tokenizer import ByteTokenizer, save_byte_tokenizer

# every code point up to U+07FF, then samples of the 3- and 4-byte ranges: every byte value a UTF-8
# text can contain
TEXT = "".join(chr(c) for c in range(1, 0x800)) + "\u0800\u3042\uffee\U00010000\U0010fffd"


def test_byte_decoding_replaces_what_is_not_utf8() -> None:
    tok = ByteTokenizer()
    assert tok.decode([72, 0xFF, 105]) == "H\ufffdi"
    assert tok.decode(torch.tensor([0xE2, 0x86, 0x92, 0x21])) == "→!"
    assert tok.encode_tensor("é").tolist() == [0xC3, 0xA9]
    assert tok.encode_tensor("é").dtype == torch.long


def test_the_exported_byte_tokenizer_encodes_every_byte_as_itself(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    save_byte_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert ids == list(TEXT.encode("utf-8"))
    assert len(set(ids)) > 190
    assert tok.decode(ids) == TEXT


def test_the_exported_vocabulary_is_gpt2s_byte_alphabet_in_byte_order(tmp_path: Path) -> None:
    """Id b is GPT-2's printable stand-in for byte b (transformers' own table), bytes that no
    valid UTF-8 text holds (0xC0, 0xC1, 0xF5..0xFF) included."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    save_byte_tokenizer(tmp_path)
    tok = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    table = bytes_to_unicode()
    assert tok.convert_ids_to_tokens(list(range(256))) == [table[b] for b in range(256)]
