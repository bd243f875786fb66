"""`TokensSource` (pack: documents) guards the fast tier lacked.

A source keeps a cursor at every epoch start it met, and a lookup of an earlier sequence scans
forward from the nearest one (`_cursor`): the epoch-start cursor must name the sequence that really
starts the epoch, or every sequence looked up from it shifts by one. The expected sequences here are
the reference next-fit packing (`test_next_fit.reference`) of each epoch's pieces in visit order,
read straight from the dataset.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.unit.workers.data.test_next_fit import reference
from tests.unit.workers.data.test_tokens_data import SEQ, text_dataset
from workers.data import TokensSource, open_dataset


def _expected_inputs(src: TokensSource, epochs: int) -> list[np.ndarray]:
    """Inputs of every training sequence of the first `epochs` epochs, by the reference packing."""
    ds, out = src.ds, []
    for epoch in range(epochs):
        pieces = []
        for j in range(src.train.n):
            doc = src._train_doc(epoch, j)
            n = ds.doc_length(doc)
            pieces += [((doc, p), min(SEQ, n - p * SEQ)) for p in range(-(-n // SEQ))]
        for group in reference([n for _, n in pieces], SEQ):
            row = np.concatenate(
                [
                    ds[doc]["tokens"][p * SEQ : (p + 1) * SEQ]
                    for (doc, p), _ in (pieces[i] for i in group)
                ]
            )
            out.append(np.pad(row, (0, SEQ - len(row)), constant_values=src.pad_id))
    return out


def test_a_lookup_back_into_a_later_epoch_starts_at_its_real_first_sequence(
    tmp_path: Path,
) -> None:
    """After running into epoch 2, the sequences of epoch 1 looked up again (from the epoch-1
    cursor) are the reference's, not shifted by one."""
    ds = open_dataset(text_dataset(tmp_path, n=12))
    src = TokensSource(ds, SEQ, seed=4, pack="documents")
    want = _expected_inputs(src, 3)
    per_epoch = len(_expected_inputs(src, 1))
    assert per_epoch > 3 and len(want) > 2 * per_epoch
    far = len(want) - 1  # the last sequence of epoch 2
    assert np.array_equal(src.sequence(far)[0].numpy(), want[far])
    for g in (per_epoch + 2, per_epoch, per_epoch + 1, 2 * per_epoch - 1):
        src.sequence(far)  # the last cursor is past g again: g comes from an epoch-start cursor
        inputs = src.sequence(g)[0]
        assert inputs.dtype == torch.int64
        np.testing.assert_array_equal(inputs.numpy(), want[g], err_msg=f"sequence {g}")


def test_windows_of_a_stream_whose_length_is_a_multiple_of_seq_len(tmp_path: Path) -> None:
    """A stream of exactly 3 · SEQ tokens holds 2 windows of SEQ + 1 tokens (stride SEQ), not 3:
    a third would run past the end. Every window of an epoch is a full one of the stream."""
    from workers.data.prepare import prepare

    src = tmp_path / "docs.jsonl"
    # bytes tokenizer: each document is its text plus one EOS (id 0): 4 x 48 = 192 = 3 x 64
    src.write_text("".join(f'{{"text": "{c * 47}"}}\n' for c in "abcd"))
    prepare(src, tmp_path / "ds", tokenizer="bytes", inline=True)
    ds = open_dataset(tmp_path / "ds")
    assert ds.num_tokens == 3 * SEQ
    stream = np.concatenate([ds[i]["tokens"] for i in range(len(ds))])
    windows = TokensSource(ds, SEQ, seed=2, pack="windows")
    assert windows.n_windows == 2
    starts = set()
    for g in range(2 * windows.n_windows):  # two epochs
        batch = windows.global_batch(g, 1)
        assert batch.inputs.shape == (1, SEQ) and batch.labels.shape == (1, SEQ)
        inputs = batch.inputs[0].numpy()
        start = next(s for s in (0, SEQ) if np.array_equal(stream[s : s + SEQ], inputs))
        np.testing.assert_array_equal(batch.labels[0].numpy(), stream[start + 1 : start + SEQ + 1])
        starts.add(start)
    assert starts == {0, SEQ}


def hand_dataset(root: Path, docs: list[tuple[np.ndarray, np.ndarray]]) -> Path:
    """A chat-format prepared dataset written by hand (one shard): no tokenizer, no prepare."""
    import json

    shards = root / "shards"
    shards.mkdir(parents=True)
    tokens = np.concatenate([t for t, _ in docs]).astype(np.uint8)
    mask = np.concatenate([m for _, m in docs]).astype(bool)
    offsets = np.cumsum([0] + [len(t) for t, _ in docs]).astype(np.int64)
    np.save(shards / "k-00000.tokens.npy", tokens)
    np.save(shards / "k-00000.offsets.npy", offsets)
    np.save(shards / "k-00000.mask.npy", mask)
    shard = {"name": "k-00000", "documents": len(docs), "tokens": len(tokens)}
    manifest = {
        "id": "hand",
        "format_version": 1,
        "format": "chat",
        "tokenizer": {"kind": "bytes", "sha256": "x", "vocab_size": 256, "eos_id": 0},
        "files": [{"shards": [shard]}],
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def test_window_weights_are_the_mask_of_the_next_token(tmp_path: Path) -> None:
    """pack: windows over a masked (chat) dataset: the weight of label i is the loss mask of token
    i + 1, as for packed documents. Tokens are distinct, so each window's start is its first id."""
    seq = 16
    stream = np.arange(1, 201)  # 200 distinct ids, 5 documents of 40
    mask = (np.arange(200) * 7) % 3 == 0
    docs = [(stream[i : i + 40], mask[i : i + 40]) for i in range(0, 200, 40)]
    src = TokensSource(hand_dataset(tmp_path / "ds", docs), seq, seed=1, pack="windows")
    assert src.n_windows == (200 - 1) // seq
    for g in range(src.n_windows):
        inputs, labels, weights = src._window(g)
        start = int(inputs[0]) - 1
        assert start % seq == 0
        np.testing.assert_array_equal(inputs.numpy(), stream[start : start + seq])
        np.testing.assert_array_equal(labels.numpy(), stream[start + 1 : start + seq + 1])
        np.testing.assert_array_equal(weights.numpy(), mask[start + 1 : start + seq + 1])


def test_a_resume_mid_document_continues_at_the_saved_piece(tmp_path: Path) -> None:
    """A checkpoint whose cursor sits inside a long document (piece > 0) resumes at that piece:
    the next sequences are the reference's."""
    ds = open_dataset(text_dataset(tmp_path, n=12))
    want = _expected_inputs(TokensSource(ds, SEQ, seed=4, pack="documents"), 2)
    run = TokensSource(ds, SEQ, seed=4, pack="documents")
    resumed_mid = 0
    for g in range(len(want) - 2):
        run.global_batch(g, 1)
        state = run.state_dict()
        if state["cursor"][3] == 0:
            continue
        resumed_mid += 1
        fresh = TokensSource(ds, SEQ, seed=4, pack="documents")
        fresh.load_state_dict(state)
        for step in (g + 1, g + 2):
            np.testing.assert_array_equal(
                fresh.global_batch(step, 1).inputs[0].numpy(), want[step], err_msg=f"{g}->{step}"
            )
    assert resumed_mid >= 2


def test_held_out_pieces_have_their_own_length_when_packed(tmp_path: Path) -> None:
    """validation_batches packs held-out pieces by their real lengths: the 4-token tail of a
    20-token document and the next 8-token document share a sequence (4 + 8 <= 16)."""
    seq = 16
    train = (np.arange(1, 31), np.ones(30, dtype=bool))
    long_doc = (np.arange(101, 121), np.ones(20, dtype=bool))
    short_doc = (np.arange(151, 159), np.ones(8, dtype=bool))
    # validation 0.5: every 2nd document (index 1, 3) is held out
    docs = [train, long_doc, train, short_doc]
    src = TokensSource(hand_dataset(tmp_path / "ds", docs), seq, seed=0, validation=0.5)
    first, second = src.validation_batches(1, 2)
    assert first.cu_seqlens.tolist() == [0, 16]
    assert first.inputs[0].tolist() == list(range(101, 117))
    assert second.cu_seqlens.tolist() == [0, 4, 12, 16]
    assert second.inputs[0].tolist() == [117, 118, 119, 120, *range(151, 159), 0, 0, 0, 0]
    assert second.weights[0].tolist() == [1, 1, 1, 0] + [1] * 7 + [0] * 5
