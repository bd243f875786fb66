"""`data.kind: tokens`: batches from a prepared dataset, the loss mask through the ring and the loss, val_loss.

Datasets here are prepared in-process (`prepare(..., inline=True)`: the same code each Ray task runs, without
starting Ray); `tests/unit/workers/data/test_prepare.py` runs the Ray pipeline itself.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.support.dist import run_distributed
from tests.support.trainutil import one_thread, series, source_of, tiny_spec, train
from tests.unit.workers.data.test_prepare import CHATS, GENERATION_TEMPLATE, write_tokenizer
from workers.data import TokensSource, open_dataset
from workers.data.prepare import prepare
from workers.data.tokens import affine, holdout_every
from workers.models import build_model

assert one_thread  # autouse fixture, imported to apply to this module

SEQ = 64


def text_dataset(tmp_path: Path, n: int = 40) -> Path:
    """n byte-level documents of varied lengths, some longer than SEQ."""
    src = tmp_path / "docs.jsonl"
    rows = [{"text": f"doc {i}: " + "abcdefghij"[i % 10] * (3 + (i * 37) % 150)} for i in range(n)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "text-ds"
    prepare(src, out, tokenizer="bytes", inline=True)
    return out


def chat_dataset(tmp_path: Path, n: int = 24) -> Path:
    tok = write_tokenizer(tmp_path / "tok", GENERATION_TEMPLATE)
    src = tmp_path / "chat.jsonl"
    src.write_text(
        "".join(json.dumps({"messages": CHATS[i % len(CHATS)]}) + "\n" for i in range(n))
    )
    out = tmp_path / "chat-ds"
    prepare(src, out, tokenizer=str(tok), fmt="chat", inline=True)
    return out


def epoch_documents(src: TokensSource) -> list[tuple[int, int]]:
    """Every (document, piece) that sequences of epoch 0 hold, in order."""
    cursor, seen = src._cursor(0), []
    while cursor.epoch == 0:
        pieces, cursor = src._advance(cursor)
        seen += pieces
    return seen


def test_documents_pack_visits_every_training_piece_once_and_holds_out_every_kth(
    tmp_path: Path,
) -> None:
    ds = open_dataset(text_dataset(tmp_path))
    src = TokensSource(ds, SEQ, seed=3, pack="documents", validation=0.1)
    k = holdout_every(0.1)
    held = {i for i in range(len(ds)) if i % k == k - 1}
    want = sorted(
        (i, p) for i in range(len(ds)) if i not in held for p in range(-(-ds.doc_length(i) // SEQ))
    )
    seen = epoch_documents(src)
    assert sorted(seen) == want and len(seen) == len(set(seen))
    assert [d for d, _ in seen] != sorted(d for d, _ in seen)  # permuted, not in file order

    batch = src.global_batch(0, 3)
    cu = batch.cu_seqlens.tolist()
    assert cu[0] == 0 and cu[-1] == 3 * SEQ and all(a < b for a, b in itertools.pairwise(cu))
    first_doc, first_piece = src._advance(src._cursor(0))[0][0]
    expect = ds[first_doc]["tokens"][first_piece * SEQ : (first_piece + 1) * SEQ]
    n = len(expect)
    np.testing.assert_array_equal(batch.inputs[0, :n].numpy(), expect)
    np.testing.assert_array_equal(batch.labels[0, : n - 1].numpy(), expect[1:])
    assert (
        batch.weights[0, : n - 1].eq(1).all() and batch.weights[0, n - 1] == 0
    )  # no label crosses a document
    assert batch.doc_positions[0, :n].tolist() == list(range(n))


def test_the_batch_of_a_step_is_the_same_fresh_resumed_or_in_sequence(tmp_path: Path) -> None:
    path = text_dataset(tmp_path)
    for pack in ("documents", "windows"):
        run = TokensSource(path, SEQ, seed=5, pack=pack, validation=0.05)
        batches = [run.global_batch(step, 4) for step in range(12)]  # past one epoch
        state = run.state_dict()
        fresh = TokensSource(path, SEQ, seed=5, pack=pack, validation=0.05)
        for step in (9, 3, 11):  # any step, from scratch
            torch.testing.assert_close(
                fresh.global_batch(step, 4).inputs, batches[step].inputs, rtol=0, atol=0
            )
        run.global_batch(12, 4)
        resumed = TokensSource(path, SEQ, seed=5, pack=pack, validation=0.05)
        resumed.load_state_dict(state)
        b = resumed.global_batch(12, 4)
        assert torch.equal(b.inputs, run.global_batch(12, 4).inputs) and torch.equal(
            b.weights, run.global_batch(12, 4).weights
        )
        other_seed = TokensSource(path, SEQ, seed=6, pack=pack, validation=0.05)
        assert not torch.equal(other_seed.global_batch(0, 4).inputs, batches[0].inputs)
        with pytest.raises(ValueError, match="changed since the checkpoint"):
            other_seed.load_state_dict(state)


def test_windows_are_the_training_stream_without_held_out_documents(tmp_path: Path) -> None:
    ds = open_dataset(text_dataset(tmp_path))
    src = TokensSource(ds, SEQ, seed=1, pack="windows", validation=0.1)
    k = holdout_every(0.1)
    stream = np.concatenate([ds[i]["tokens"] for i in range(len(ds)) if i % k != k - 1])
    assert src.n_windows == (len(stream) - 1) // SEQ
    a, b = affine(src.n_windows, 1, 0)
    order = [(a * g + b) % src.n_windows for g in range(src.n_windows)]
    assert sorted(order) == list(range(src.n_windows))  # one epoch: every window once
    for g, w in enumerate(order):
        inputs, labels, weights = src._window(g)
        np.testing.assert_array_equal(inputs.numpy(), stream[w * SEQ : w * SEQ + SEQ])
        np.testing.assert_array_equal(labels.numpy(), stream[w * SEQ + 1 : w * SEQ + SEQ + 1])
        assert weights.eq(1).all()
    for n in (1, 2, 7, 12, 97, 1000):
        for epoch in range(3):
            a, b = affine(n, 9, epoch)
            assert sorted((a * i + b) % n for i in range(n)) == list(range(n))


def test_chat_loss_mask_is_the_label_weight(tmp_path: Path) -> None:
    ds = open_dataset(chat_dataset(tmp_path))
    src = TokensSource(ds, 128, seed=0, pack="documents")
    batch = src.global_batch(0, 2)
    doc, piece = src._advance(src._cursor(0))[0][0]
    item = ds[doc]
    n = len(item["tokens"])
    assert piece == 0 and n < 128
    np.testing.assert_array_equal(
        batch.weights[0, : n - 1].numpy(), item["loss_mask"][1:].astype(np.float32)
    )
    assert 0 < batch.weights.sum() < (batch.labels != -1).sum()


def _first_loss_reference(spec_json: str) -> float:
    """The masked token mean of step 0's global batch on one unsharded model: the loss the trainer must report."""
    from workers.config import JobSpec

    spec = JobSpec.model_validate_json(spec_json)
    model = build_model(spec.model, spec.train.seed)
    batch = source_of(spec).global_batch(0, spec.train.batch_size)
    with torch.no_grad():
        logits = model(batch.inputs, batch.doc_positions, cu_seqlens=batch.cu_seqlens)
        losses = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="none")
    w = batch.weights.flatten()
    return float((losses * w).sum() / w.sum())


def _train_both(rank: int, world: int, ring: str, ref: str) -> list[dict]:
    return [train(rank, world, ring, None, 3)]


@pytest.mark.multiprocess
def test_masked_loss_and_val_loss_on_a_ring_equal_one_process(tmp_path: Path) -> None:
    path = chat_dataset(tmp_path, n=30)
    spec = tiny_spec(
        model={"vocab_size": 512},
        data={
            "kind": "tokens",
            "path": str(path),
            "seq_len": 128,
            "pack": "documents",
            "validation": 0.2,
        },
        eval={
            "enabled": True,
            "every_steps": 2,
            "depths": [0.5],
            "samples": 1,
            "context_lengths": [128],
        },
    )
    single = train(0, 1, spec.model_dump_json(), None, 3)
    loss = series(single["points"], "loss")
    assert loss[0] == pytest.approx(_first_loss_reference(spec.model_dump_json()), rel=1e-5)
    ring_spec = spec.model_copy(
        update={"parallel": spec.parallel.model_copy(update={"ring_size": 2})}
    )
    ring = run_distributed(_train_both, 2, ring_spec.model_dump_json(), "")[0][0]
    torch.testing.assert_close(
        torch.tensor(series(ring["points"], "loss")), torch.tensor(loss), rtol=1e-5, atol=0
    )
    names = {p["name"] for p in single["points"]}
    assert "val_loss" in names and any(n.startswith("val_loss/pos=0-64") for n in names)
    for name in sorted(n for n in names if n.startswith("val_loss")):
        torch.testing.assert_close(
            torch.tensor(series(ring["points"], name)),
            torch.tensor(series(single["points"], name)),
            rtol=1e-5,
            atol=0,
        )


def test_tokens_spec_fields_and_a_dataset_of_another_vocabulary(tmp_path: Path) -> None:
    from pydantic import ValidationError

    spec = tiny_spec(data={"kind": "tokens", "path": "/data/ds", "seq_len": 128})
    assert (
        spec.data.kind == "tokens" and spec.data.pack == "documents" and spec.data.validation == 0.0
    )
    for bad, field in (
        ({"validation": 0.9}, "validation"),
        ({"pack": "rows"}, "pack"),
        ({"text_field": "x"}, "text_field"),
    ):
        with pytest.raises(ValidationError) as e:
            tiny_spec(data={"kind": "tokens", "path": "/data/ds", "seq_len": 128, **bad})
        assert e.value.errors()[0]["loc"][-1] == field
    path = chat_dataset(tmp_path, n=4)  # a BPE of 320 ids
    small = tiny_spec(
        data={"kind": "tokens", "path": str(path), "seq_len": 128}
    )  # native vocabulary 256
    with pytest.raises(ValueError, match="more than the model's vocabulary"):
        source_of(small)
