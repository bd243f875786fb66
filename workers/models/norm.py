"""RMSNorm as the native model and transformers' Llama/Mistral/Qwen norms compute it, with a
leaner backward; shared by every model kind."""

from __future__ import annotations

from typing import Any

import torch


class _RMSNorm(torch.autograd.Function):
    """y = (x·rsqrt(mean(x²) + eps)).to(x.dtype) · weight, normalised in fp32 even under bf16
    autocast.

    Autograd's own graph of these ops keeps the normalised x (one more activation per token) for
    the weight's gradient; this keeps x and the per-token rsqrt only and recomputes the rest in
    backward. The forward is the same ops in the same order, so its values are unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return (xf * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, rstd, weight = ctx.saved_tensors
        n = x.float() * rstd  # the normalised input, recomputed
        grad_weight = None
        if ctx.needs_input_grad[1]:
            normed = n.to(x.dtype).float()  # what the forward multiplied the weight by
            grad_weight = (grad.float() * normed).sum(tuple(range(grad.dim() - 1))).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = (grad * weight).float()  # d/d(normed), back through the cast
            grad_x = (rstd * (g - n * (g * n).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the native model and transformers' Llama/Mistral/Qwen norms compute it (see
    `_RMSNorm`)."""
    out: torch.Tensor = _RMSNorm.apply(x, weight, eps)
    return out
