"""Pass-Q decoding on its own: new queries against K/V caches sharded over 1, 2 and 3 ranks equal
float64 attention over the gathered keys, with GQA, slots a rank does not count (`keep`), and a
rank that holds no counted key at all."""

from __future__ import annotations

import pytest
import torch

from tests.support.dist import run_distributed
from workers.attention.decode import pass_q_attention

B, H, HK, D, S, NEW = 2, 6, 3, 16, 23, 2


def _case() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, NEW, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, S, HK, D, generator=g, dtype=torch.float64) * 2
    v = torch.randn(B, S, HK, D, generator=g, dtype=torch.float64)
    counted = torch.rand(S, generator=g) > 0.3  # slots that are real tokens
    return q, k, v, counted


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    k, v = k[:, keep].repeat_interleave(H // HK, 2), v[:, keep].repeat_interleave(H // HK, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * D**-0.5
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def _ranks(rank: int, world: int, dtype: str) -> list:
    q, k, v, counted = _case()
    # rank r holds every world-th slot from r (any split works: the partials are disjoint);
    # the last rank's slots are all left uncounted, so it contributes an empty partial
    mine = torch.arange(rank, S, world)
    keep = counted[mine] & torch.tensor(rank != world - 1 or world == 1)
    t = getattr(torch, dtype)
    out = pass_q_attention(q.to(t), k[:, mine].to(t), v[:, mine].to(t), keep=keep)
    return (
        out.double().tolist()
    )  # by value: a tensor crosses the queue as a handle to shared memory


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_one_rank_equals_attention_over_the_kept_keys(dtype: str) -> None:
    q, k, v, counted = _case()
    got = torch.tensor(_ranks(0, 1, dtype), dtype=torch.float64)
    tol = 1e-12 if dtype == "float64" else 1e-5
    torch.testing.assert_close(got, _reference(q, k, v, counted), rtol=tol, atol=tol)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_caches_merge_to_attention_over_every_counted_key(world: int) -> None:
    q, k, v, counted = _case()
    everywhere = torch.zeros(S, dtype=torch.bool)
    for r in range(world - 1):
        everywhere[r::world] = True
    expected = _reference(q, k, v, counted & everywhere)
    for got in run_distributed(_ranks, world, "float64"):
        torch.testing.assert_close(
            torch.tensor(got, dtype=torch.float64), expected, rtol=1e-12, atol=1e-12
        )


def test_bad_shapes_are_refused() -> None:
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="not a multiple"):
        pass_q_attention(q, torch.randn(1, 5, 3, 8), torch.randn(1, 5, 3, 8))
    with pytest.raises(ValueError, match="pass_q_attention"):
        pass_q_attention(q, torch.randn(1, 5, 2, 8), torch.randn(1, 4, 2, 8))
