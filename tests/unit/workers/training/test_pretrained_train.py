"""A pretrained model trains through the torchrun entry and comes back out as a transformers directory.

A tiny Qwen2 checkpoint (tied head, q/k/v biases) with its BPE tokenizer trains 3 steps on a text corpus
on a ring of 2 with a RoPE override; the first loss equals the loss computed directly on one process
(model's tokenizer, transformers model), and `<checkpoint dir>/model/` read back with AutoModelForCausalLM /
AutoTokenizer gives the trained model's logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.support.hf_fixtures import CORPUS, write_checkpoint
from tests.support.trainutil import source_of
from tests.unit.workers.training.test_train_entry import _torchrun
from workers.config import JobSpec

STEPS = 3


def _spec(model_dir: Path, corpus: Path) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "hf-tiny",
            "model": {
                "kind": "hf",
                "path": str(model_dir),
                "rope_scaling": {"rope_type": "yarn", "factor": 2.0},
            },
            "data": {"kind": "text", "path": str(corpus), "seq_len": 64},
            "parallel": {"ring_size": 2, "layout": "zigzag"},
            "train": {"steps": STEPS, "batch_size": 2, "lr": 1e-3, "seed": 3},
            "checkpoint": {"every_steps": 0, "keep": 1},
            "eval": {"enabled": False},
        }
    )


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torchrun_trains_and_exports_a_pretrained_model(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.models import load_pretrained, model_for, tokenizer_for
    from workers.training.checkpoint import latest_step, load_checkpoint

    src = write_checkpoint(tmp_path / "qwen", "qwen2", tie_word_embeddings=True)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    spec = _spec(src, corpus)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(spec.model_dump_json())
    jsonl, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"

    _torchrun(2, str(spec_file), "--metrics-jsonl", str(jsonl), "--checkpoint-dir", str(ckpt))

    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    losses = [
        r["value"]
        for r in sorted((r for r in rows if r["name"] == "loss"), key=lambda r: r["step"])
    ]
    assert len(losses) == STEPS

    # step 1's loss, computed here on one process: the model's own tokens, transformers' own model
    batch = source_of(spec).global_batch(0, spec.train.batch_size)
    assert int(batch.inputs.max()) > 255  # BPE ids, not bytes
    assert tokenizer_for(spec).decode(batch.inputs[0, :20]) in CORPUS
    with torch.no_grad():
        logits = model_for(spec)(batch.inputs, batch.positions)
    expected = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()).item()
    assert losses[0] == pytest.approx(expected, rel=1e-4)

    # the export: the trained weights (= the final checkpoint), read back by transformers
    trained = load_pretrained(src, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    load_checkpoint(ckpt, latest_step(ckpt), trained)
    exported = AutoModelForCausalLM.from_pretrained(
        ckpt / "model", attn_implementation="eager"
    ).eval()
    tok = AutoTokenizer.from_pretrained(ckpt / "model")
    ids = torch.tensor([tok.encode(CORPUS[:400], add_special_tokens=False)[:64]])
    with torch.no_grad():
        ours, theirs = trained.eval()(ids, torch.arange(64)), exported(ids).logits
        source = load_pretrained(src, rope_scaling={"rope_type": "yarn", "factor": 2.0})(
            ids, torch.arange(64)
        )
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5 * float(ours.abs().max()))
    assert (source - ours).abs().max() > 1e-3  # it trained
    assert exported.config.rope_parameters["rope_type"] == "yarn"
