"""Export round trip: what `save_pretrained` writes, transformers' Auto classes read back with the same logits.

Native models come back as `LlamaForCausalLM` with a byte-level tokenizer that encodes like ByteTokenizer;
pretrained models as their own family with their own tokenizer. Weights are changed after loading (as
training would) so a round trip that silently re-read the source checkpoint would fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.hf_fixtures import write_checkpoint
from workers.config import ModelConfig
from workers.data.tokenizer import ByteTokenizer, HFTokenizer
from workers.models import build_model, load_pretrained, save_pretrained

TEXT = "The pass key is 48213. Ünïcödé → ok\x00next document 🙂"


def _read_back(out: Path) -> tuple[torch.nn.Module, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32
    )
    return model.eval(), AutoTokenizer.from_pretrained(out)


@pytest.mark.parametrize("tied", [True, False])
def test_native_exports_as_llama_with_byte_tokenizer(tmp_path: Path, tied: bool) -> None:
    cfg = ModelConfig(
        d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, tie_embeddings=tied, rope_theta=5000.0
    )
    model = build_model(cfg, seed=1).eval()
    with torch.no_grad():  # norm gains away from 1, so a dropped or misplaced norm weight shows
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.mul_(5.0)
    out = save_pretrained(model, tmp_path / "model", max_position_embeddings=4096)
    hf, tok = _read_back(out)
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.max_position_embeddings == 4096

    ids = tok.encode(TEXT, add_special_tokens=False)
    assert ids == ByteTokenizer().encode(TEXT)
    assert tok.decode(ids) == TEXT
    tokens = torch.tensor([ids, ids[::-1]])
    with torch.no_grad():
        ours = model(tokens, torch.arange(tokens.shape[1]))
        theirs = hf(tokens).logits
    assert ours.std() > 0.5
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5 * float(ours.abs().max()))
    assert hf.config.tie_word_embeddings == tied


def test_pretrained_round_trip(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", "qwen2", tie_word_embeddings=True)
    model = load_pretrained(src, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with torch.no_grad():  # "training": every weight moves
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    out = save_pretrained(model.eval(), tmp_path / "model")
    hf, tok = _read_back(out)
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    assert (
        hf.config.rope_parameters["rope_type"] == "yarn"
    )  # the extended context is part of the export

    source_tok = HFTokenizer(src)
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert ids == source_tok.encode(TEXT) and tok.eos_token_id == source_tok.eos_id
    tokens = torch.tensor([ids[:32], ids[-32:]])
    with torch.no_grad():
        ours = model(tokens, torch.arange(32))
        theirs = hf(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5 * float(ours.abs().max()))
    before = load_pretrained(src)(tokens, torch.arange(32))
    assert (
        before - ours
    ).abs().max() > 1e-2  # the export holds the trained weights, not the source's


def test_a_crash_while_an_older_export_is_replaced_leaves_no_half_export(
    tmp_path: Path, monkeypatch
) -> None:
    """Re-exporting replaces the older model; a process killed while deleting it must leave either the old or the
    new export at `out`, never a directory missing some of its files."""
    import shutil

    import workers.models.export as export

    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=2)
    out = save_pretrained(build_model(cfg, seed=1), tmp_path / "model")
    first = sorted(p.name for p in out.iterdir())
    real_rmtree = shutil.rmtree

    def killed_midway(
        path, ignore_errors=False
    ):  # deletes the weights of the older export, then the process dies
        if (
            Path(path).exists()
            and (Path(path) / "model.safetensors").exists()
            and "partial" not in Path(path).name
        ):
            (Path(path) / "model.safetensors").unlink()
            raise SystemExit("killed while deleting")
        return real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(export.shutil, "rmtree", killed_midway)
    with pytest.raises(SystemExit):
        save_pretrained(build_model(cfg, seed=2), out)
    monkeypatch.undo()
    assert (
        sorted(p.name for p in out.iterdir()) == first
    )  # whole (the new one: renamed in before the old was deleted)
    hf, _ = _read_back(out)
    new = build_model(cfg, seed=2)
    assert torch.equal(hf.model.embed_tokens.weight, new.tok_emb.weight)
