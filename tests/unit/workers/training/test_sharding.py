"""Sharded training state pieces: the chunked loss, and meta-device models materialised shard by shard.

References are independent of the code under test: float64 logits through `F.cross_entropy` for the
loss, `build_model` (the unsharded native init) and `load_pretrained` (transformers' own loading) for
the materialised shards, gathered whole again by torch's `get_model_state_dict`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from tests.support.dist import run_distributed
from tests.support.hf_fixtures import write_checkpoint
from tests.support.trainutil import one_thread, tiny_spec
from workers.config import MemoryKnobs
from workers.models import build_model, load_pretrained
from workers.parallel_dims import ParallelDims
from workers.training.loss import linear_cross_entropy_sum
from workers.training.materialize import materialize, skeleton
from workers.training.mesh import build_mesh
from workers.training.parallelize import parallelize

assert one_thread  # autouse fixture, imported to apply to this module


def _problem(
    dtype: torch.dtype, n: int = 37, d: int = 16, vocab: int = 301
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, n, d, generator=g, dtype=dtype)
    weight = torch.randn(vocab, d, generator=g, dtype=dtype)
    labels = torch.randint(0, vocab, (2, n), generator=g)
    weights = torch.rand(2, n, generator=g, dtype=torch.float32) * (
        torch.rand(2, n, generator=g) > 0.3
    )
    return hidden, weight, labels, weights


def _reference(hidden, weight, labels, weights):
    """float64 logits, torch's cross-entropy: value and gradients."""
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    loss = (
        F.cross_entropy(F.linear(h, w).flatten(0, 1), labels.flatten(), reduction="none")
        * weights.flatten()
    ).sum()
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 5, 37, 74, 1000])
def test_chunked_loss_equals_full_logits(chunk):
    hidden, weight, labels, weights = _problem(torch.float32)
    ref, ref_h, ref_w = _reference(hidden, weight, labels, weights)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy_sum(h, w, labels, weights, chunk=chunk)
    (3.0 * loss).backward()  # the incoming gradient scales both results
    assert loss.dtype == torch.float32 and float(ref) > 10
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=0)
    for got, want in (
        (h.grad, 3 * ref_h),
        (w.grad, 3 * ref_w),
    ):  # fp32: relative to the gradient's scale
        torch.testing.assert_close(
            got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max())
        )


def test_chunked_loss_never_keeps_vocab_sized_tensors():
    """Only d(loss)/d(hidden) and d(loss)/d(weight) stay for backward: nothing [tokens, vocab]-sized."""
    hidden, weight, labels, weights = _problem(torch.float32, n=200, vocab=1000)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    saved: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.shape) or t, lambda t: t
    ):
        loss = linear_cross_entropy_sum(h, w, labels, weights, chunk=64)
    assert sorted(saved) == [torch.Size([400, 16]), torch.Size([1000, 16])]
    full = F.linear(h, w)  # what an unchunked loss would keep: [2, 200, 1000]
    assert max(s.numel() for s in saved) * 25 <= full.numel()
    loss.backward()


def test_chunked_loss_in_bf16_stays_close():
    """bf16 inputs (the CUDA path): bf16 matmuls, fp32 log-sum-exp and softmax, fp32 weight-gradient sum."""
    hidden, weight, labels, weights = _problem(torch.bfloat16)
    ref, ref_h, ref_w = _reference(hidden, weight, labels, weights)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy_sum(h, w, labels, weights, chunk=8)
    loss.backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(
        loss.double(), ref, rtol=1e-3, atol=0
    )  # the bf16 matmul rounds logits, as autocast
    torch.testing.assert_close(h.grad.double(), ref_h, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad.double(), ref_w, rtol=2e-2, atol=2e-2)


def _materialised(rank: int, world: int, hf_dir: str) -> dict[str, float]:
    """Max |difference| between each sharded, materialised model gathered whole and its unsharded reference."""
    out = {}
    mesh = build_mesh(ParallelDims(ring_size=world))
    native = tiny_spec(model={"tie_embeddings": True}, parallel={"ring_size": world})
    hf = tiny_spec(model={"kind": "hf", "path": hf_dir}, parallel={"ring_size": world})
    references = {
        "native": build_model(native.model, native.train.seed).state_dict(),
        "hf": load_pretrained(hf_dir).state_dict(),
    }
    for kind, spec in (("native", native), ("hf", hf)):
        model = skeleton(spec)
        assert all(p.is_meta for p in model.parameters())
        parallelize(model, mesh, torch.device("cpu"), MemoryKnobs("full"))
        materialize(model, spec, torch.device("cpu"))
        local = sum(p.to_local().numel() for p in model.parameters())
        assert (
            local < sum(p.numel() for p in model.parameters()) / world * 1.1
        )  # only this rank's shards
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        ref = references[kind]
        assert {k for k in full if k in ref} == {k for k in ref if "inv_freq" not in k}, kind
        out[kind] = max(float((full[k] - ref[k]).abs().max()) for k in full)
    return out


@pytest.mark.multiprocess
def test_meta_init_gives_the_unsharded_model_on_any_world(tmp_path):
    """Native init from the seed, and pretrained weights read shard-wise, equal the unsharded model bit for bit."""
    hf_dir = write_checkpoint(tmp_path / "llama", "llama", tie_word_embeddings=False)
    for world in (2, 3):
        for rank_result in run_distributed(_materialised, world, str(hf_dir)):
            assert rank_result == {"native": 0.0, "hf": 0.0}, (world, rank_result)


def test_planner_memory_follows_the_sharded_arithmetic():
    from service.planner import LOSS_CHUNK_TOKENS, memory_estimate
    from workers.training.loss import DEFAULT_CHUNK_TOKENS

    assert LOSS_CHUNK_TOKENS == DEFAULT_CHUNK_TOKENS
    big = {"d_model": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 2}
    one, four = (
        memory_estimate(tiny_spec(model=big, data={"seq_len": 8192}, parallel={"ring_size": w}))
        for w in (1, 4)
    )
    state = ("params", "grads", "adamw")
    assert sum(one["bytes"][k] for k in state) == 16 * one["param_count"]
    assert sum(four["bytes"][k] for k in state) == 16 * one["param_count"] // 4
    assert (
        four["bytes"]["activations"] * 4 == one["bytes"]["activations"]
    )  # a quarter of the tokens
    assert four["total_bytes"] < one["total_bytes"] / 2


@pytest.mark.parametrize(
    ("d_model", "n_heads", "n_kv_heads", "seq"), [(128, 8, 2, 1024), (96, 6, 6, 768)]
)
def test_planner_activations_are_what_autograd_saves(
    d_model: int, n_heads: int, n_kv_heads: int, seq: int
) -> None:
    """The planner's activation term (no checkpointing) against the bytes autograd actually keeps for the backward
    of the native model (every saved tensor's storage, counted once, parameters excluded): within 1 %."""
    from service.planner import memory_estimate

    spec = tiny_spec(
        model={"d_model": d_model, "n_layers": 3, "n_heads": n_heads, "n_kv_heads": n_kv_heads},
        data={"seq_len": seq},
    )
    model = build_model(spec.model, seed=0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        if x.untyped_storage().data_ptr() not in params:
            kept[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model.features(torch.randint(0, 256, (spec.train.batch_size, seq)), torch.arange(seq))
    estimate = memory_estimate(spec)["bytes"]["activations"]
    assert abs(estimate / sum(kept.values()) - 1) < 0.01, (estimate, sum(kept.values()))
