"""Tiled MLP (ALST): a block's MLP runs over sequence tiles, forward and backward.

An MLP is pointwise in the sequence, so running it tile by tile is the same function. Its
intermediates (SwiGLU's gate, up, activation and product: ~4·ffn_hidden floats per token, the
largest part of a block's working set) then exist for one tile at a time: the forward keeps only the
MLP's input, and the backward recomputes each tile with autograd on, back-propagates it and drops it
before the next one.

Applied from outside by patching the MLP instance's `forward` (`tile_mlp`), so parameter names,
state dicts, checkpoints and export are unchanged; it works on any module whose output has its
input's shape (the native `SwiGLU` and transformers' `LlamaMLP`/`Qwen2MLP`/... alike)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.amp import custom_bwd, custom_fwd
from torch.distributed._functional_collectives import AsyncCollectiveTensor

Forward = Callable[[torch.Tensor], torch.Tensor]


class _TiledMLP(torch.autograd.Function):
    """forward(x) = cat(mlp(tile) for tile in x's token tiles); saves x only. The parameters are
    explicit inputs (`flat`), so their gradients flow through autograd's usual accumulation (and
    FSDP's post-backward hooks); `params` is the same tuple, kept to name them in backward."""

    @staticmethod
    @custom_fwd(device_type="cuda")  # backward re-enters the forward's autocast state
    def forward(
        ctx: Any,
        forward: Forward,
        tiles: int,
        params: tuple[torch.Tensor, ...],
        x: torch.Tensor,
        *flat: torch.Tensor,
    ) -> torch.Tensor:
        ctx.forward, ctx.tiles, ctx.params = forward, tiles, params
        ctx.save_for_backward(x)
        rows = x.reshape(-1, x.shape[-1])
        out: torch.Tensor | None = None
        start = 0
        with torch.no_grad():
            for piece in rows.tensor_split(tiles, dim=0):
                y = forward(piece)
                if (
                    out is None
                ):  # the output's dtype is the MLP's (bf16 under autocast), not the input's
                    out = y.new_empty(rows.shape[0], y.shape[-1])
                out[start : start + piece.shape[0]] = y
                start += piece.shape[0]
        assert out is not None
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @custom_bwd(device_type="cuda")
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        wanted = ctx.needs_input_grad[4:]
        params = [p for p, need in zip(ctx.params, wanted, strict=True) if need]
        want_x = ctx.needs_input_grad[3]
        rows, grad_rows = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(rows) if want_x else None
        # The parameters' gradients are summed over the tiles in their own `.grad`, where autograd
        # adds each weight's tile gradient as soon as it exists: one transient weight gradient at a
        # time, where collecting a tile's gradients first would hold all of them next to the running
        # sums. Whatever `.grad` held before is put back, and the sums go out as this function's
        # gradients.
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        start = 0
        try:
            for piece, grad_piece in zip(
                rows.tensor_split(ctx.tiles), grad_rows.tensor_split(ctx.tiles), strict=True
            ):
                piece = piece.detach().requires_grad_(want_x)
                with torch.enable_grad():
                    y = ctx.forward(piece)
                if isinstance(y, AsyncCollectiveTensor):
                    # a tensor-parallel MLP ends in an all-reduce whose result the gradient does not
                    # read; a collective nobody waits for keeps its buffers until the process ends
                    y.wait()
                torch.autograd.backward(y, grad_piece, inputs=([piece] if want_x else []) + params)
                if grad_x is not None:
                    grad_x[start : start + piece.shape[0]] = piece.grad
                start += piece.shape[0]
            sums = [p.grad for p in params]
        finally:
            for p, before in zip(params, held, strict=True):
                p.grad = before
        found = iter(sums)
        per_param = [next(found) if need else None for need in wanted]
        return None, None, None, (grad_x.view_as(x) if grad_x is not None else None), *per_param


def _tiled_forward(module: nn.Module, inner: Forward, tiles: Callable[[int], int]) -> Forward:
    def forward(x: torch.Tensor) -> torch.Tensor:
        n = tiles(x.numel() // x.shape[-1])
        if n <= 1:
            return inner(x)
        params = tuple(module.parameters())
        out: torch.Tensor = _TiledMLP.apply(inner, n, params, x, *params)
        return out

    return forward


def tile_mlp(mlp: nn.Module, tiles: Callable[[int], int]) -> None:
    """Make `mlp` run over `tiles(local_tokens)` token tiles from now on (1: unchanged)."""
    inner: Forward = mlp.forward
    mlp.forward = _tiled_forward(mlp, inner, tiles)
