"""Ring attention equals float64 single-process attention: outputs and gradients, every layout."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from tests.support.attention_cases import (
    gradcheck_ring,
    make_inputs,
    reference_attention,
    ring_vs_reference,
    subgroup_ring,
)
from tests.support.dist import run_distributed
from workers.attention import attention_backend, kernels, ring_attention, shard_positions
from workers.attention.merge import merge_
from workers.attention.plan import block_for_step

LAYOUTS = ["contiguous", "zigzag", "striped"]
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _cases(world: int) -> list[dict]:
    cases = []
    seed = 1000 * world
    for layout, causal, dtype in itertools.product(
        LAYOUTS, [True, False], [torch.float64, torch.float32]
    ):
        seed += 1
        # GQA (8 query heads over 2 KV heads), odd head dim, batch 2
        cases.append(
            dict(
                seed=seed,
                b=2,
                s=8 * world,
                h=8,
                hk=2,
                d=13,
                dtype=dtype,
                layout=layout,
                causal=causal,
            )
        )
    for layout in LAYOUTS:  # MQA, longer sequence, logits scaled ×100 (stable merge), plain MHA
        cases.append(
            dict(
                seed=seed + 1,
                b=1,
                s=24 * world,
                h=4,
                hk=1,
                d=16,
                dtype=torch.float64,
                layout=layout,
                causal=True,
            )
        )
        cases.append(
            dict(
                seed=seed + 2,
                b=1,
                s=8 * world,
                h=2,
                hk=2,
                d=8,
                dtype=torch.float64,
                layout=layout,
                causal=True,
                logit_scale=100.0,
            )
        )
        cases.append(
            dict(
                seed=seed + 3,
                b=1,
                s=8 * world,
                h=2,
                hk=2,
                d=8,
                dtype=torch.float32,
                layout=layout,
                causal=True,
                logit_scale=100.0,
            )
        )
    return cases


def _check(results: list[dict]) -> None:
    """Ring error vs float64 must be within the contract's tolerance. Logits scaled ×100 make the softmax
    gradient ill-conditioned: there fp32 single-process attention itself misses 1e-5, so the bar for those
    gradients is "no worse than single-process attention in the same dtype" (2× its error)."""
    for res in results:
        case = res["case"]
        assert res["finite"], case
        assert res["out_dtype"] == str(case["dtype"]) and set(res["grad_dtypes"]) == {
            str(case["dtype"])
        }
        for what, err, floor in zip(
            ["out", "dq", "dk", "dv"], res["errors"], res["single_errors"], strict=True
        ):
            assert err <= max(TOL[case["dtype"]], 2 * floor), f"{what} rel err {err:.2e} for {case}"
        if case.get("logit_scale", 1.0) == 1.0:
            assert max(res["errors"]) <= TOL[case["dtype"]], res


def test_world_size_one_equals_plain_attention() -> None:
    """Without torch.distributed initialized, ring attention is plain attention."""
    _check(ring_vs_reference(0, 1, _cases(1)))


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_matches_reference(world: int) -> None:
    results = run_distributed(ring_vs_reference, world, _cases(world))
    for per_rank in results:
        _check(per_rank)


@pytest.mark.multiprocess
def test_ring_in_kv_head_chunks_that_are_not_a_power_of_two() -> None:
    """6 and 3 K/V heads on a ring of 2: the forward and backward run in K/V-head chunks (3 of them
    for both), which must cover every head once. A chunk count that does not divide the heads (4 for
    6) leaves heads uncomputed; the float64 single-process reference sees them all."""
    cases = [
        dict(
            seed=61, b=1, s=16, h=12, hk=6, d=8, dtype=torch.float64, layout="zigzag", causal=True
        ),
        dict(
            seed=62, b=2, s=16, h=6, hk=3, d=5, dtype=torch.float64, layout="striped", causal=False
        ),
    ]
    for per_rank in run_distributed(ring_vs_reference, 2, cases):
        _check(per_rank)


@pytest.mark.multiprocess
def test_gradcheck_through_the_ring() -> None:
    assert all(run_distributed(gradcheck_ring, 3, LAYOUTS))


@pytest.mark.multiprocess
def test_independent_rings_in_one_world() -> None:
    """Subgroups: ring peers are translated to global ranks; two rings never mix."""
    for errors in run_distributed(subgroup_ring, 4):
        assert max(errors) <= 1e-12, errors


def test_large_logit_gap_merge_is_stable() -> None:
    """lse values 1e4 apart: the naive log(1 + exp(.)) form overflows, ours must not."""
    out = torch.tensor([[[[1.0, 2.0]]]], dtype=torch.float32)  # [B=1, S=1, H=1, D=2]
    lse = torch.tensor([[[1e4]]])
    merge_(out, lse, torch.tensor([[[[5.0, 7.0]]]]), torch.tensor([[[-1e4]]]))
    assert torch.equal(out, torch.tensor([[[[1.0, 2.0]]]])) and lse.item() == 1e4
    out2 = torch.tensor([[[[1.0, 2.0]]]])
    lse2 = torch.tensor([[[0.0]]])
    merge_(out2, lse2, torch.tensor([[[[3.0, 6.0]]]]), torch.tensor([[[0.0]]]))  # equal weights
    assert (
        torch.allclose(out2, torch.tensor([[[[2.0, 4.0]]]])) and abs(lse2.item() - 0.6931472) < 1e-6
    )


def test_rows_with_only_one_visible_key() -> None:
    """Causal first row sees only itself (all-but-one masked) and strongly peaked logits stay exact."""
    q, k, v, _ = make_inputs(3, 2, 16, 4, 2, 8, torch.float64, logit_scale=50.0)
    out = ring_attention(q, k, v, causal=True, layout="striped")
    ref = reference_attention(q, k, v, True)
    assert torch.allclose(out[:, 0], v[:, 0].repeat_interleave(2, dim=1), atol=1e-12)
    assert (out - ref).abs().max().item() < 1e-12


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_causal_work_is_balanced(world: int, layout: str) -> None:
    """Zigzag and striped give every rank (nearly) the same visible work; contiguous does not."""
    n = 64

    def work(lay: str, rank: int) -> float:
        blocks = (block_for_step(lay, True, rank, (rank - s) % world, n) for s in range(world))
        return sum(b.cost() for b in blocks if b is not None)

    loads = [work(layout, r) for r in range(world)]
    assert max(loads) / (sum(loads) / world) <= 1.05, loads
    contiguous = [work("contiguous", r) for r in range(world)]
    assert max(contiguous) / (sum(contiguous) / world) > 1.3
    # the visible work summed over ranks is exactly the causal triangle of the global sequence
    s = n * world
    assert sum(loads) == s * (s + 1) / 2


def test_positions_partition_the_sequence() -> None:
    for layout, world in itertools.product(LAYOUTS, [1, 2, 3, 4]):
        s = 12 * world
        pos = torch.cat([shard_positions(s, layout, r, world) for r in range(world)])
        assert torch.equal(pos.sort().values, torch.arange(s))
    assert shard_positions(16, "zigzag", 1, 4).tolist() == [2, 3, 12, 13]
    assert shard_positions(8, "striped", 1, 4).tolist() == [1, 5]


@pytest.mark.parametrize(
    ("shapes", "dtype2", "message"),
    [
        (((1, 8, 4, 8), (1, 8, 3, 8)), None, "multiple of key/value heads"),
        (((1, 8, 4, 8), (1, 6, 2, 8)), None, "must agree"),
        (((1, 8, 4), (1, 8, 4)), None, "must be \\[batch"),
        (((1, 7, 4, 8), (1, 7, 4, 8)), None, "zigzag"),
        (((1, 8, 4, 8), (1, 8, 4, 8)), torch.float64, "one dtype"),
    ],
)
def test_invalid_input_raises_value_error(shapes, dtype2, message) -> None:  # type: ignore[no-untyped-def]
    q = torch.randn(*shapes[0])
    k = torch.randn(*shapes[1], dtype=dtype2 or torch.float32)
    with pytest.raises(ValueError, match=message):
        ring_attention(q, k, k.clone(), layout="zigzag")


def test_bad_layout_and_length() -> None:
    with pytest.raises(ValueError, match="layout"):
        shard_positions(16, "spiral", 0, 2)
    with pytest.raises(ValueError, match="not divisible by 8"):
        shard_positions(12, "zigzag", 0, 4)


def test_backend_is_queryable() -> None:
    assert attention_backend("cpu", torch.float32) == "torch_cpu_flash"


def _count_calls(monkeypatch: pytest.MonkeyPatch, cls: type, calls: Counter) -> None:
    for method in ("forward", "backward"):
        real = getattr(cls, method)

        def counted(self, *a, _real=real, _key=f"{cls.__name__}.{method}", **kw):  # type: ignore[no-untyped-def]
            calls[_key] += 1
            return _real(self, *a, **kw)

        monkeypatch.setattr(cls, method, counted)


@pytest.mark.parametrize("backend", ["torch_math", "torch_cpu_flash"])
def test_math_backend_matches_cpu_flash(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """Both CPU-runnable kernels, each forced through RINGTRAIN_ATTN_BACKEND and checked to be the one ring
    attention actually ran (forward and backward, the other never called), equal the float64 reference to 1e-12.
    torch_math is the device-independent fallback (fp32 on CUDA), so it must be exact too."""
    monkeypatch.setenv("RINGTRAIN_ATTN_BACKEND", backend)
    assert attention_backend("cpu", torch.float64) == backend
    calls: Counter = Counter()
    for cls in (kernels.TorchMath, kernels.TorchCpuFlash):
        _count_calls(monkeypatch, cls, calls)
    q, k, v, dout = make_inputs(5, 2, 16, 6, 3, 8, torch.float64)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(qr, kr, vr, causal=True)
    out.backward(dout)
    cls_name = {"torch_math": "TorchMath", "torch_cpu_flash": "TorchCpuFlash"}[backend]
    assert calls == {f"{cls_name}.forward": 1, f"{cls_name}.backward": 1}, calls
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k, v))
    ref = reference_attention(q2, k2, v2, True)
    ref.backward(dout)
    # A run once reported one element off by 1.58e-9 here (then bounded at 1e-8). Not reproduced since: 300
    # in-process repetitions (both kernels, 1-2 threads, conftest imported) and 27 pytest runs (20 of this test
    # with its neighbours, 7 of the whole file, one after test_api) stayed at or below 1.8e-15. If it comes
    # back, the message names the tensor, the element and both values.
    for what, a, b in [
        ("out", out, ref),
        ("dq", qr.grad, q2.grad),
        ("dk", kr.grad, k2.grad),
        ("dv", vr.grad, v2.grad),
    ]:
        diff = (a - b).abs()
        worst = int(diff.argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
        assert diff.max().item() < 1e-12, (
            f"{backend} {what}{list(idx)}: {a.flatten()[worst].item()!r} vs float64 reference "
            f"{b.flatten()[worst].item()!r} (|diff| {diff.max().item():.3e}, {torch.get_num_threads()} threads)"
        )


@pytest.mark.gpu
def test_cuda_block_kernels_match_reference() -> None:
    q, k, v, dout = (t.cuda() for t in make_inputs(9, 1, 256, 8, 2, 64, torch.bfloat16))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(qr, kr, vr, causal=True)
    out.backward(dout)
    ref = reference_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), True)
    assert ((out.double().cpu() - ref).norm() / ref.norm()).item() < 2e-2
