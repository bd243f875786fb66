"""Model, mesh and evals: sharded forward/backward equals the full sequence; the mesh and eval bookkeeping."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.support.dist import run_distributed
from tests.support.trainutil import one_thread, tiny_spec
from workers.attention import shard_positions, shard_sequence, unshard_sequence
from workers.data import ByteTokenizer, PasskeySource, make_sample, sample_generator
from workers.models import SequenceParallel, build_model, cross_entropy_per_token
from workers.parallel_dims import ParallelDims
from workers.training.evals import EVAL_SALT, cell_name, passkey_accuracy
from workers.training.mesh import build_mesh
from workers.training.parallelize import apply_activation_checkpointing

assert one_thread  # autouse fixture, imported to apply to this module

CFG = tiny_spec(model={"tie_embeddings": True}).model  # d_model 32, 4 heads, 2 kv heads


def _batch(seq_len: int = 96):
    return PasskeySource(seq_len, 3, 0.4, 2.0, seed=1).global_batch(0, 2)


def test_model_structure_gqa_and_tied_head():
    model = build_model(CFG, seed=0)
    names = dict(model.named_parameters())
    assert "head.weight" not in names  # tied: the head is the embedding itself
    attn = model.layers[0].attn
    assert (
        attn.wq.out_features == 4 * 8 and attn.wk.out_features == attn.wv.out_features == 2 * 8
    )  # KV not repeated
    assert model.layers[0].mlp.w_gate.out_features == CFG.ffn_hidden
    untied = build_model(tiny_spec().model, seed=0)
    assert "head.weight" in dict(untied.named_parameters())
    b = _batch()
    logits = model(b.inputs, b.positions)
    assert logits.shape == (2, 96, 256) and logits.dtype == torch.float32
    assert torch.allclose(
        logits.logsumexp(-1), torch.full((2, 96), 256.0).log(), atol=0.5
    )  # near uniform at init


def test_rope_uses_the_given_positions():
    """Shifting all positions leaves attention unchanged (RoPE is relative); permuting them does not."""
    model = build_model(CFG, seed=0)
    with (
        torch.no_grad()
    ):  # sharpen attention: at init it is near uniform and positions barely matter
        for layer in model.layers:
            layer.attn.wq.weight.mul_(20)
            layer.attn.wk.weight.mul_(20)
    b = _batch()
    base = model(b.inputs, b.positions)
    torch.testing.assert_close(model(b.inputs, b.positions + 1000), base, rtol=1e-4, atol=1e-4)
    assert (model(b.inputs, b.positions.flip(0)) - base).abs().max() > 1e-1


def test_activation_checkpointing_gives_the_same_gradients():
    b = _batch()
    grads = []
    for ac in (False, True):
        model = build_model(CFG, seed=3)
        if ac:  # what `train.activation_checkpointing: full` applies to every model kind
            apply_activation_checkpointing(model)
        (
            cross_entropy_per_token(model(b.inputs, b.positions), b.labels) * b.weights
        ).sum().backward()
        # the wrapper's extra module level is not part of a parameter's name (nor of checkpoints)
        grads.append(
            {
                n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
                for n, p in model.named_parameters()
            }
        )
    for name, g in grads[0].items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7)


def _sharded_matches_full(rank: int, world: int) -> None:
    """On rings of `world` ranks, every layout: logits and all weight gradients equal the full sequence's."""
    b = _batch(96)
    full_model = build_model(CFG, seed=5)
    full = full_model(b.inputs, b.positions)
    (cross_entropy_per_token(full, b.labels) * b.weights).sum().backward()
    group = dist.new_group(list(range(world)))
    for layout in ("contiguous", "zigzag", "striped"):
        model = build_model(CFG, seed=5)
        model.set_sequence_parallel(SequenceParallel(group, layout))
        pos = shard_positions(96, layout, rank, world)
        x, y, w = (shard_sequence(t, 1, layout, group) for t in (b.inputs, b.labels, b.weights))
        logits = model(x, pos)
        # fp32, exact attention: only summation order differs → a few ulp
        torch.testing.assert_close(
            unshard_sequence(logits, 1, layout, group), full, rtol=1e-5, atol=1e-5
        )
        (cross_entropy_per_token(logits, y) * w).sum().backward()
        params = list(model.parameters())
        for p in params:  # what FSDP's reduce-scatter sums in training
            dist.all_reduce(p.grad)
        for (name, p), ref in zip(model.named_parameters(), full_model.parameters(), strict=True):
            torch.testing.assert_close(
                p.grad, ref.grad, rtol=1e-4, atol=1e-5, msg=f"{layout}: {name}"
            )


@pytest.mark.multiprocess
def test_sharded_model_matches_full_sequence_on_odd_ring():
    run_distributed(_sharded_matches_full, 3)


class _Oracle(nn.Module):
    """A perfect passkey reader: gathers the sequence over the ring, reads the needle, predicts every next byte.

    `corrupt=True`: gets the last key digit wrong whenever the key's first digit is odd.
    """

    def __init__(self, group: dist.ProcessGroup, layout: str, corrupt: bool) -> None:
        super().__init__()
        self.group, self.layout, self.corrupt = group, layout, corrupt
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        full = unshard_sequence(tokens, 1, self.layout, self.group)
        out = torch.zeros(*tokens.shape, 256)
        for row in range(full.shape[0]):
            key = re.search(r"The pass key is (\d+)\.", ByteTokenizer().decode(full[row])).group(1)
            last = int(key[-1])
            if self.corrupt and int(key[0]) % 2:
                last = (last + 1) % 10
            targets = torch.cat([full[row, 1:], torch.tensor([ord(str(last))])])
            out[row, torch.arange(tokens.shape[1]), targets[positions]] = 1.0
        return out


def _mesh_and_evals(rank: int, world: int) -> dict:
    mesh = build_mesh(ParallelDims(data_parallel=2, ring_size=2))
    assert (mesh.dp_index, mesh.ring_rank) == divmod(rank, 2)
    ring_peers = [None] * 2
    dist.all_gather_object(ring_peers, rank, group=mesh.ring_group)
    dp_peers = [None] * 2
    dist.all_gather_object(dp_peers, rank, group=mesh.dp_group)
    spec = tiny_spec(
        parallel={"ring_size": 2, "data_parallel": 2, "layout": "zigzag"},
        eval={"enabled": True, "context_lengths": [128, 192], "depths": [0.1, 0.9], "samples": 5},
    )
    results = {}
    for corrupt in (False, True):
        oracle = _Oracle(mesh.ring_group, "zigzag", corrupt)
        results[corrupt] = passkey_accuracy(oracle, spec, mesh, torch.device("cpu"))
    return {"ring": ring_peers, "dp": dp_peers, "acc": results}


@pytest.mark.multiprocess
def test_mesh_groups_and_passkey_eval_grid():
    out = run_distributed(_mesh_and_evals, 4)
    assert [o["ring"] for o in out] == [
        [0, 1],
        [0, 1],
        [2, 3],
        [2, 3],
    ]  # rings are contiguous in rank
    assert [o["dp"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    spec = tiny_spec(eval={"enabled": True, "samples": 5})
    expected = {}
    for length in (128, 192):
        for depth in (0.1, 0.9):
            keys = [
                make_sample(
                    length,
                    3,
                    depth,
                    sample_generator(spec.train.seed ^ EVAL_SALT, length, round(depth * 1e4), i),
                ).key
                for i in range(5)
            ]
            expected[cell_name(length, depth)] = sum(int(k[0]) % 2 == 0 for k in keys) / 5
    assert (
        0 < sum(expected.values()) / 4 < 1
    )  # the corrupted oracle is neither all right nor all wrong
    for o in out:  # every rank gets the same numbers
        # exact match only (answer-token accuracy is checked in tests/unit/workers/data/test_passkey.py)
        perfect, corrupted = (
            {k: v for k, v in o["acc"][c].items() if k.startswith("passkey_acc")} for c in (0, 1)
        )
        assert perfect == {"passkey_acc": 1.0, **{name: 1.0 for name in expected}}
        assert corrupted == {"passkey_acc": pytest.approx(sum(expected.values()) / 4), **expected}
