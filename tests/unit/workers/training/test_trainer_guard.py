"""The trainer's step on packed documents: RoPE positions restart at 0 in every document.

RoPE is relative, so global positions instead of per-document ones change a loss only by rounding:
no loss comparison tells them apart. The positions the model is given are checked against ones
derived here from the batch's document boundaries (`cu_seqlens`) alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.support.trainutil import one_thread, tiny_spec

assert one_thread  # autouse fixture, imported to apply to this module

DOCS = [
    f"doc {i}: " + " ".join(f"w{(i * 3 + j) % 11}" for j in range(3 + 5 * (i % 4)))
    for i in range(30)
]


def _expected_positions(cu_seqlens: np.ndarray, rows: int, seq: int) -> np.ndarray:
    """Each token's offset from the start of its document (boundaries over the flattened rows)."""
    flat = np.arange(rows * seq)
    starts = cu_seqlens[np.searchsorted(cu_seqlens, flat, side="right") - 1]
    return (flat - starts).reshape(rows, seq)


def test_packed_documents_reach_the_model_with_positions_restarting_per_document(
    tmp_path: Path,
) -> None:
    from workers.training.trainer import Trainer

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    spec = tiny_spec(
        data={"kind": "text", "path": str(corpus), "seq_len": 96, "pack": "documents"},
        verify={"enabled": False},
    )
    t = Trainer(spec, checkpoint_dir=None, emit=lambda p: None)
    seen: dict[str, Any] = {}
    features = t.model.features

    def spy(tokens: torch.Tensor, positions: torch.Tensor, **kw: Any) -> torch.Tensor:
        seen["positions"], seen["cu_seqlens"] = positions, kw.get("cu_seqlens")
        return features(tokens, positions, **kw)

    t.model.features = spy  # type: ignore[method-assign]
    local = t.local_batch()
    loss_sum = t.forward_backward(local)
    assert local.cu_seqlens is not None
    cu = local.cu_seqlens.numpy()
    rows, seq = local.inputs.shape
    assert len(cu) - 1 >= 2 * rows  # several documents per row: positions must restart inside rows
    assert torch.equal(seen["cu_seqlens"], local.cu_seqlens)
    got = seen["positions"].numpy()
    np.testing.assert_array_equal(
        np.broadcast_to(got, (rows, seq)), _expected_positions(cu, rows, seq)
    )
    assert 0 < float(loss_sum) < float("inf")
