"""A pretrained (Hugging Face) model as a real Ray job: driver, two rank actors, FSDP, ring attention, export.

The same path a user's `kind: hf` job takes (launcher → driver → actors), ending in `<checkpoint dir>/<job>/model/`,
which transformers itself loads back with the model's own tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.test_orchestration import Harness, harness, losses, tiny_spec  # noqa: F401  (fixture)
from tests.support.hf_fixtures import CORPUS, write_checkpoint

pytestmark = pytest.mark.ray


def test_pretrained_job_trains_on_ray_and_exports(harness: Harness, tmp_path: Path) -> None:  # noqa: F811
    model_dir, corpus = tmp_path / "qwen2", tmp_path / "corpus.txt"
    write_checkpoint(model_dir, "qwen2", tie_word_embeddings=True)
    corpus.write_text(CORPUS)
    spec = tiny_spec(
        model={"kind": "hf", "path": str(model_dir)},
        data={"kind": "text", "path": str(corpus), "seq_len": 64},
        parallel={"ring_size": 2, "layout": "striped"},
        train={"steps": 6, "lr": 1e-3},
        checkpoint={"every_steps": 3},
    )
    sid = harness.submit("hf1", spec)
    final = harness.finish("hf1", sid, timeout_s=300)
    job = harness.receiver.jobs["hf1"]
    assert final["state"] == "SUCCEEDED", (
        [s["reason"] for s in job.states],
        [x["line"] for x in job.logs][-20:],
    )
    assert sorted(losses(job)) == list(range(1, 7))
    loss = [p["value"] for p in sorted(job.points, key=lambda p: p["step"]) if p["name"] == "loss"]
    assert all(0 < v < 20 for v in loss), loss

    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf1" / "model"
    tok = AutoTokenizer.from_pretrained(out)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    trained = {k: v for k, v in reloaded.state_dict().items()}
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    moved = max(float((trained[k] - original[k]).abs().max()) for k in original)
    assert moved > 1e-4, (
        moved
    )  # the exported weights are the trained ones, not the checkpoint we started from
    ids = tok("the ring passes keys and values", return_tensors="pt").input_ids
    assert ids.shape[1] > 1 and int(ids.max()) < reloaded.config.vocab_size
    assert torch.isfinite(reloaded(ids).logits).all()
