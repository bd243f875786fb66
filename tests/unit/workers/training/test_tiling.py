"""The tiled MLP on its own: the same function and gradients as the untiled MLP, gradients that add up
across backward calls as autograd's do, and a backward that holds one transient weight gradient at a
time next to the running sums (`LiveTensors`)."""

from __future__ import annotations

import torch
from torch import nn

from workers.config import ModelConfig
from workers.models.llama import SwiGLU
from workers.training.memory import LiveTensors
from workers.training.tiling import tile_mlp

D, FFN_MULT, TOKENS = (
    64,
    16,
    96,
)  # wide MLP, few tokens: the weights dominate what the backward holds


def _mlp(tiles: int) -> nn.Module:
    torch.manual_seed(3)
    mlp = SwiGLU(ModelConfig(d_model=D, n_layers=1, n_heads=4, ffn_mult=FFN_MULT, vocab_size=32))
    if tiles > 1:
        tile_mlp(mlp, lambda tokens: tiles)
    return mlp


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return torch.randn(1, TOKENS, D, generator=gen), torch.randn(1, TOKENS, D, generator=gen)


def test_tiles_give_the_untiled_values_and_gradients_and_accumulate_like_autograd() -> None:
    x, grad = _inputs()
    plain, tiled = _mlp(1), _mlp(5)  # 5 tiles of 19-20 tokens: uneven on purpose
    for p, q in zip(plain.parameters(), tiled.parameters(), strict=True):
        assert torch.equal(p, q)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [plain(xs[0]), tiled(xs[1])]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-6)
    for out in outs:
        out.backward(grad)
    # the input's gradient is assembled tile by tile in the backward: every tile's rows in their place
    assert xs[1].grad is not None and float(xs[1].grad.abs().min()) > 0
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-5, atol=5e-6)
    for xi in xs:
        xi.grad = None  # only the parameters' .grad accumulate from here
    # a second backward adds to the .grad the first one left (gradient accumulation over micro-batches)
    for mlp in (plain, tiled):
        xi = (2 * x).requires_grad_()
        mlp(xi).backward(grad)
    assert all(float(p.grad.abs().max()) > 0 for p in tiled.parameters())
    for p, q in zip(plain.parameters(), tiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=5e-6)  # tile order


def test_backward_holds_one_transient_weight_gradient_beside_the_sums() -> None:
    x, grad = _inputs()
    mlp = _mlp(4)  # 24 tokens per tile
    weight = (
        mlp.w_gate.weight.numel() * 4
    )  # bytes of one of the three (equal-sized) weight matrices
    xi = x.clone().requires_grad_()
    out = mlp(xi)
    tracker = LiveTensors(exclude=mlp.parameters())
    with tracker:
        out.backward(grad)
    # the three sums (3) and one tile's new weight gradient (1), one tile's intermediates and the input's
    # gradient: 6.3 measured; collecting each tile's gradients before adding them held 9.9
    units = tracker.peak / weight
    assert 4.0 <= units <= 7.0, f"{units:.2f} weight matrices live"
