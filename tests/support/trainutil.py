"""Helpers for the training tests: tiny specs and a picklable per-rank training function."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from workers.config import JobSpec
from workers.data import DataSource, build_source
from workers.models import tokenizer_for
from workers.protocol import MetricPoint
from workers.training.checkpoint import latest_step, read_weights


@pytest.fixture(autouse=True)
def one_thread():
    """In-process training on one thread: on 2 shared cores, more threads only oversubscribe (10-30× slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def source_of(spec: JobSpec) -> DataSource:
    """The job's data source as the trainer builds it: with its model kind's tokenizer."""
    return build_source(spec, tokenizer_for(spec))


def loss_of(weights: dict[str, torch.Tensor], spec: JobSpec, step: int) -> float:
    """float64 weighted token mean of `spec`'s batch for `step` on a model holding `weights`."""
    import torch.nn.functional as F

    from workers.models import build_model

    model = build_model(spec.model, 0).double()
    model.load_state_dict({k: v.double() for k, v in weights.items()})
    batch = source_of(spec).global_batch(step - 1, spec.train.batch_size)
    with torch.no_grad():
        logits = model(batch.inputs, batch.positions)
    ce = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="none")
    w = batch.weights.flatten().double()
    return float((ce * w).sum() / w.sum())


def tiny_spec(**over: Any) -> JobSpec:
    """A 2-layer, d_model 32, GQA (4 q heads, 2 kv heads) passkey job: big enough to be non-trivial."""
    base: dict[str, Any] = {
        "name": "tiny",
        "model": {
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "tie_embeddings": False,
        },
        "data": {"kind": "passkey", "seq_len": 192, "key_digits": 3, "answer_weight": 4.0},
        "parallel": {"ring_size": 1, "data_parallel": 1, "layout": "zigzag"},
        "train": {"steps": 6, "batch_size": 2, "lr": 3e-3, "warmup_steps": 2, "seed": 7},
        "checkpoint": {"every_steps": 0, "keep": 2},
        "eval": {"enabled": False},
    }
    for key, value in over.items():
        if key not in base:  # a section the tiny job leaves at its default (init_from, verify, ...)
            base[key] = value
            continue
        same_kind = isinstance(value, dict) and value.get("kind", base[key].get("kind")) == base[
            key
        ].get("kind")
        base[key] = (
            {**base[key], **value} if same_kind else value
        )  # another data kind replaces the whole section
    return JobSpec.model_validate(base)


def train(
    rank: int, world: int, spec_json: str, ckpt: str | None, max_steps: int | None
) -> dict[str, Any]:
    """Run `run_training` on this rank; return the metric points and the result (any rank)."""
    from workers.training.trainer import run_training

    points: list[MetricPoint] = []
    result = run_training(
        JobSpec.model_validate_json(spec_json),
        checkpoint_dir=ckpt,
        emit=points.append,
        max_steps=max_steps,
    )
    return {"points": [p.model_dump() for p in points], "result": result.__dict__}


def series(points: list[dict], name: str) -> list[float]:
    return [
        p["value"]
        for p in sorted((p for p in points if p["name"] == name), key=lambda p: p["step"])
    ]


def final_weights(ckpt: str | Path) -> dict[str, torch.Tensor]:
    step = latest_step(ckpt)
    assert step is not None, f"no checkpoint in {ckpt}"
    return read_weights(ckpt, step)
