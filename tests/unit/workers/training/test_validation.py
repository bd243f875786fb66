"""Held-out loss (`workers.training.validation`) against a numpy reference on hand-made batches.

The model here is a fixed lookup table (hidden state = a row per input token) times a fixed output
matrix, so every token's cross-entropy is known independently of the code under test (numpy
log-sum-exp in float64). The batches are packed by hand: documents that start inside a row (at row
position 50 and 130) so a token's position inside its document differs from its row position across
the bucket edges 64 and 128, loss weights other than one, and weight-0 tokens (a masked prompt and a
padded tail) whose labels are the least likely ones, so counting them would move every mean.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tests.support.trainutil import one_thread, tiny_spec
from workers.data.batch import Batch
from workers.training.mesh import Mesh
from workers.training.validation import bucket_edges, validation_loss

assert one_thread  # autouse fixture, imported to apply to this module

SEQ = 256
VOCAB = 13
DIM = 8
EDGES = [0, 64, 128, 256]  # written out by hand: [0, 64), [64, 128), then doubling up to SEQ
# per row: the document boundaries inside the row (a packed row holds several documents)
BATCH_DOCS = [
    [[0, 50, 200, 256], [0, 130, 256]],
    [[0, 256], [0, 10, 100, 256]],
]


class TableModel(torch.nn.Module):
    """Hidden state of a token = a fixed random row of `table`: its loss depends on the token pair
    only, never on a position, so only the bucketing can make a position matter."""

    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.table = torch.randn(VOCAB, DIM, generator=gen, dtype=torch.float64).float()
        self.output_weight = torch.nn.Parameter(
            (torch.randn(VOCAB, DIM, generator=gen, dtype=torch.float64) * 2).float()
        )
        self.seen_positions: list[torch.Tensor] = []

    def features(
        self, inputs: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        self.seen_positions.append(positions.clone())
        return self.table[inputs]

    def logits64(self) -> np.ndarray:
        """[input token, label] logits in float64: the reference's own matmul."""
        table = self.table.double().numpy()
        return table @ self.output_weight.detach().double().numpy().T


class HeldOut:
    """The held-out batches a `TokensSource` would hand out (same every call)."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches

    def validation_batches(self, batch_size: int, count: int) -> list[Batch]:
        return self.batches


def _doc_positions(bounds: list[int]) -> np.ndarray:
    return np.concatenate([np.arange(hi - lo) for lo, hi in itertools.pairwise(bounds)])


def _make_batch(rows: list[list[int]], logits: np.ndarray, gen: np.random.Generator) -> Batch:
    """Random tokens; weights in [0.5, 2] except weight 0 on every 7th token and on the last 20
    tokens of the second row (padding). Weight-0 tokens get the least likely label: a large loss."""
    inputs = gen.integers(0, VOCAB, size=(len(rows), SEQ))
    labels = gen.integers(0, VOCAB, size=(len(rows), SEQ))
    weights = gen.uniform(0.5, 2.0, size=(len(rows), SEQ))
    weights[:, ::7] = 0.0
    weights[1, -20:] = 0.0
    masked = weights == 0
    labels[masked] = logits[inputs[masked]].argmin(axis=1)
    cu = [0] + [r * SEQ + b for r, bounds in enumerate(rows) for b in bounds[1:]]
    return Batch(
        torch.from_numpy(inputs),
        torch.from_numpy(labels),
        torch.from_numpy(weights).float(),
        torch.arange(SEQ),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        doc_positions=torch.from_numpy(np.stack([_doc_positions(b) for b in rows])),
    )


def _reference(
    batches: list[Batch], logits: np.ndarray, *, by_row: bool = False, all_tokens: bool = False
) -> dict[str, float]:
    """Weighted mean cross-entropy overall and per bucket of in-document position, in numpy
    (`by_row` / `all_tokens`: the two wrong answers, to show this data tells them apart)."""
    loss_sum = np.zeros(len(EDGES) - 1)
    weight_sum = np.zeros(len(EDGES) - 1)
    for batch in batches:
        z = logits[batch.inputs.numpy()]  # [rows, SEQ, VOCAB]
        top = z.max(axis=-1)
        lse = top + np.log(np.exp(z - top[..., None]).sum(axis=-1))
        ce = lse - np.take_along_axis(z, batch.labels.numpy()[..., None], axis=-1)[..., 0]
        w = batch.weights.double().numpy()
        if all_tokens:
            w = np.where(w == 0, 1.0, w)
        assert batch.doc_positions is not None
        pos = np.broadcast_to(np.arange(SEQ), w.shape) if by_row else batch.doc_positions.numpy()
        bucket = np.searchsorted(EDGES, pos, side="right") - 1
        for b in range(len(EDGES) - 1):
            loss_sum[b] += (ce * w)[bucket == b].sum()
            weight_sum[b] += w[bucket == b].sum()
    out = {"val_loss": loss_sum.sum() / weight_sum.sum()}
    for b in range(len(EDGES) - 1):
        out[f"val_loss/pos={EDGES[b]}-{EDGES[b + 1]}"] = loss_sum[b] / weight_sum[b]
    return out


def test_bucket_edges_double_from_64_up_to_the_sequence_length() -> None:
    assert bucket_edges(256) == EDGES
    assert bucket_edges(64) == [0, 64]
    assert bucket_edges(1000) == [0, 64, 128, 256, 512, 1000]


def test_val_loss_and_every_bucket_match_numpy_on_packed_masked_batches() -> None:
    """Weight-0 tokens count nowhere; a token's bucket is its position inside its document."""
    model = TableModel(torch.Generator().manual_seed(11))
    logits = model.logits64()
    gen = np.random.default_rng(5)
    batches = [_make_batch(rows, logits, gen) for rows in BATCH_DOCS]
    spec = tiny_spec(data={"seq_len": SEQ}, train={"batch_size": 2})
    model.train()

    got = validation_loss(model, HeldOut(batches), spec, Mesh(), torch.device("cpu"))

    want = _reference(batches, logits)
    assert set(got) == set(want)  # val_loss and one value per bucket, no more
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=0), name
    assert model.training  # put back in training mode
    # RoPE positions restart in every document too
    for seen, batch in zip(model.seen_positions, batches, strict=True):
        assert batch.doc_positions is not None
        assert torch.equal(seen, batch.doc_positions)
    # the data tells the right answer from both wrong ones in every bucket (by far more than rel)
    for wrong in (
        _reference(batches, logits, by_row=True),
        _reference(batches, logits, all_tokens=True),
    ):
        for name in ("val_loss/pos=0-64", "val_loss/pos=64-128", "val_loss/pos=128-256"):
            assert abs(wrong[name] - want[name]) > 1e-2 * want[name], name
