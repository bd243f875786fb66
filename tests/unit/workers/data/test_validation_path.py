"""`data.validation` as a path: the held-out documents are another prepared dataset's, every
document of `data.path` trains, and a path that is not a prepared dataset (or one of another
tokenizer) is refused naming `data.validation`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.trainutil import one_thread
from tests.unit.workers.data.test_prepare import write_tokenizer
from workers.config import TokensData
from workers.data import TokensSource, open_dataset
from workers.data.prepare import prepare

assert one_thread  # autouse fixture, imported to apply to this module

SEQ = 64


def docs(tmp_path: Path, name: str, texts: list[str], tokenizer: str = "bytes") -> Path:
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / name
    prepare(src, out, tokenizer=tokenizer, inline=True)
    return out


def test_held_out_documents_come_from_the_validation_dataset(tmp_path: Path) -> None:
    train = docs(tmp_path, "train", [f"train {i} " + "t" * (5 + 7 * i) for i in range(12)])
    held = docs(tmp_path, "held", ["held-out A " + "v" * 90, "held-out B " + "w" * 20])
    src = TokensSource(train, SEQ, seed=0, validation=str(held))
    assert src.train.n == len(open_dataset(train)) == 12  # nothing of data.path is held out
    assert src.val.n == 2
    batches = src.validation_batches(batch_size=2, count=2)
    assert len(batches) == 2 and all(b.inputs.shape == (2, SEQ) for b in batches)
    seen = bytes(int(t) for b in batches for row in b.inputs for t in row if 0 < int(t) < 256)
    assert b"held-out A" in seen and b"held-out B" in seen and b"train" not in seen
    # the first held-out document (101 bytes) is cut into seq_len pieces; sequences start with it
    assert batches[0].inputs[0, :10].tolist() == list(b"held-out A")
    again = src.validation_batches(batch_size=2, count=2)  # the same every eval
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(batches, again, strict=True))
    # a share still holds out documents of data.path itself
    assert TokensSource(train, SEQ, seed=0, validation=0.25).val.n == 3


def test_a_validation_path_that_is_not_a_prepared_dataset_names_the_field(tmp_path: Path) -> None:
    train = docs(tmp_path, "train", [f"doc {i} " + "x" * 30 for i in range(6)])
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("not a dataset")
    for bad in (plain, tmp_path / "missing"):
        with pytest.raises(ValueError, match=r"^data\.validation: not a prepared dataset"):
            TokensSource(train, SEQ, seed=0, validation=str(bad))
    other = docs(
        tmp_path,
        "other",
        ["held " + "y" * 30],
        tokenizer=str(write_tokenizer(tmp_path / "tok", None)),
    )
    with pytest.raises(ValueError, match=r"^data\.validation .*another tokenizer than data\.path"):
        TokensSource(train, SEQ, seed=0, validation=str(other))


def test_the_spec_field_takes_a_share_or_a_path() -> None:
    assert TokensData(path="/d", validation=0.01).validation == 0.01
    assert TokensData(path="/d", validation="1e-2").validation == 0.01  # PyYAML's text for 1e-2
    assert TokensData(path="/d", validation="/data/held-out").validation == "/data/held-out"
    for bad, why in ((0.6, "between 0 and 0.5"), ("", "dataset directory"), (True, "share")):
        with pytest.raises(ValueError, match=why) as e:
            TokensData(path="/d", validation=bad)
        assert e.value.errors()[0]["loc"] == ("validation",)  # type: ignore[attr-defined]
