"""A pipeline stage on packed documents, in process: the schedule splits every input by rows, so
`stage_inputs` turns `cu_seqlens` into per-row document starts and each stage rebuilds the
boundaries from them. One stage holding the whole model must give the loss the whole model gives
on the same batch (`Trainer.forward_backward`'s path: features on the batch's `cu_seqlens` and
per-document positions, then the chunked loss)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.support.trainutil import one_thread, source_of, tiny_spec
from workers.models import build_model
from workers.training.loss import linear_cross_entropy_sum
from workers.training.pipeline import StageModule, stage_inputs

assert one_thread  # autouse fixture, imported to apply to this module

DOCS = [
    f"d{i}: " + " ".join(f"w{(i * 7 + j) % 13}" for j in range(1 + 2 * (i % 4))) for i in range(60)
]


def test_a_stage_on_packed_documents_gives_the_whole_models_loss(tmp_path: Path) -> None:
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    spec = tiny_spec(data={"kind": "text", "path": str(corpus), "seq_len": 96, "pack": "documents"})
    batch = source_of(spec).global_batch(0, 2)
    assert batch.cu_seqlens is not None and batch.doc_positions is not None
    cu = batch.cu_seqlens.tolist()
    rows, seq = batch.inputs.shape
    assert len(cu) - 1 > 2 * rows and cu[0] == 0 and cu[-1] == rows * seq

    kwargs = stage_inputs(batch, torch.device("cpu"))
    starts = kwargs["doc_starts"].reshape(-1).nonzero().squeeze(1).tolist()
    assert starts == cu[:-1]  # every document's first token, the first one included
    assert torch.equal(kwargs["positions"], batch.doc_positions)

    model = build_model(spec.model, seed=3)
    n = spec.model.n_layers
    stage = StageModule(model, range(n), first=True, last=True)
    with torch.no_grad():
        got = stage(batch.inputs, **kwargs)
        hidden = model.features(batch.inputs, batch.doc_positions, cu_seqlens=batch.cu_seqlens)
        want = linear_cross_entropy_sum(hidden, model.output_weight, batch.labels, batch.weights)
        # the same tokens as one document each row: a different loss (the comparison can fail)
        whole = model.features(batch.inputs, batch.positions)
        unpacked = linear_cross_entropy_sum(whole, model.output_weight, batch.labels, batch.weights)
    assert float(got) == float(want) or abs(float(got) / float(want) - 1) < 1e-6, (got, want)
    assert abs(float(unpacked) / float(want) - 1) > 1e-5, (unpacked, want)
