"""Ring attention details the multi-rank equivalence tests do not pin down, checked in one process.

- Input validation: each documented refusal names its reason (a dropped check would surface later as
  a kernel's RuntimeError, or not at all).
- The forward ring, emulated in process (`_fold_ring` over a fake exchange that hands each rank the
  next K/V of the ring), in bf16: partial results must merge in fp32, not in the inputs' dtype. The
  multi-rank tests run fp32/fp64 only, where the accumulation dtype cannot show.
- Per-row packed documents where the first row is one whole document: its block covers every query
  but only some batch rows, which must not be taken for the dense first block of every row.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.attention_cases import reference_doc_attention
from workers.attention import ring_attention, shard_positions
from workers.attention.plan import Documents
from workers.attention.ring import _fold_ring, _steps, documents


class _FakeRing:
    """The exchange of rank `rank`: after step s it holds the K/V of rank (rank - s - 1) mod W."""

    def __init__(self, kvs: list[torch.Tensor], rank: int) -> None:
        self.kvs, self.rank, self.step = kvs, rank, 0

    def send_recv(self, send: torch.Tensor) -> None:
        """Nothing to post: every rank's K/V is already in this process."""

    def wait(self) -> torch.Tensor:
        self.step += 1
        return self.kvs[(self.rank - self.step) % len(self.kvs)]


def _emulated_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, world: int, layout: str):  # type: ignore[no-untyped-def]
    """Causal ring forward of every rank, in process; the shards' outputs put back in global order."""
    s, scale = q.shape[1], q.shape[-1] ** -0.5
    pos = [shard_positions(s, layout, r, world) for r in range(world)]
    kvs = [torch.stack([k[:, p], v[:, p]]) for p in pos]
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(world):
        qr = q[:, pos[r]]
        steps = _steps(qr, True, layout, r, world, scale, None)
        o, _ = _fold_ring(qr, kvs[r], steps, _FakeRing(kvs, r), world, True)
        out[:, pos[r]] = o.double()
    return out


def _causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Float64 causal softmax attention (one K/V head per query head)."""
    s, d = q.shape[1], q.shape[-1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * d**-0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.double())


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_bf16_ring_merges_in_fp32(layout: str) -> None:
    """bf16 on a ring of 4 (emulated): the merged output is within bf16 rounding of float64 attention
    over the same (bf16) inputs. Sharp logits make the log-sum-exps large (~50), where bf16 keeps
    only ~0.25: merging in bf16 weights the partial results wrongly, ~4x the error of merging in
    fp32 and then rounding once (measured: 5e-4..1.1e-3 in fp32, 3.5e-3..7.3e-3 in bf16)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 32, 2, 8, generator=g) for _ in range(3))
    q, k, v = (q * 20).bfloat16(), k.bfloat16(), v.bfloat16()
    out = _emulated_ring(q, k, v, 4, layout)
    ref = _causal_reference(q, k, v)
    err = float((out - ref).norm() / ref.norm())
    assert err <= 2e-3, f"{layout}: bf16 ring vs float64 relative error {err:.2e}"


def test_emulated_fp64_ring_is_exact() -> None:
    """The emulation itself is faithful: in float64 every layout equals the reference to rounding."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 12, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    ref = _causal_reference(q, k, v)
    for layout in ("contiguous", "zigzag", "striped"):
        out = _emulated_ring(q, k, v, 3, layout)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_first_row_one_whole_document() -> None:
    """Row 0 is one document, row 1 two (flattened-batch cu_seqlens): row 0's only block covers every
    query of its row alone, and row 1 must still get its own attention."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 8, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 8, 11, 16], dtype=torch.int32)
    for causal in (True, False):
        out = ring_attention(q, k, v, causal=causal, layout="contiguous", cu_seqlens=cu)
        ref = reference_doc_attention(q, k, v, causal, cu)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_rows_sharing_documents_form_one_group() -> None:
    """Rows 0 and 1 hold the same documents, row 2 others: two groups, rows [0, 2) and [2, 3), each
    with its row-relative boundaries from 0 to S; and every row is attended."""
    cu = torch.tensor([0, 3, 8, 11, 16, 24], dtype=torch.int32)
    assert documents(cu, 3, 8) == Documents(((0, 2, (0, 3, 8)), (2, 3, (0, 8))))
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(3, 8, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    out = ring_attention(q, k, v, layout="contiguous", cu_seqlens=cu)
    torch.testing.assert_close(
        out, reference_doc_attention(q, k, v, True, cu), rtol=1e-12, atol=1e-12
    )


def _qkv(shape: tuple[int, ...] = (1, 8, 2, 4)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(*shape, generator=g) for _ in range(3)]


def test_empty_shard_is_refused() -> None:
    q, k, v = _qkv((1, 0, 2, 4))
    with pytest.raises(ValueError, match="seq_local must be at least 1"):
        ring_attention(q, k, v, layout="contiguous")


def test_value_dtype_must_match() -> None:
    """q and k agree, v does not: refused, not promoted."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="share one dtype"):
        ring_attention(q, k, v.double(), layout="contiguous")


def test_value_device_must_match() -> None:
    q, k, _ = _qkv()
    v = torch.empty(k.shape, device="meta")
    with pytest.raises(ValueError, match="one device"):
        ring_attention(q, k, v, layout="contiguous")


def test_head_dim_must_match() -> None:
    """Only head_dim differs between q and k/v."""
    q, _, _ = _qkv((1, 8, 2, 4))
    k, v, _ = _qkv((1, 8, 2, 6))
    with pytest.raises(ValueError, match="must agree in batch, seq_local and head_dim"):
        ring_attention(q, k, v, layout="contiguous")


def test_cu_seqlens_needs_two_entries() -> None:
    with pytest.raises(ValueError, match="at least 2 entries"):
        documents(torch.tensor([0], dtype=torch.int32), 1, 8)
