"""Chunked cross-entropy: the weighted token-loss sum without ever holding fp32 logits for the whole
shard.

A rank's logits are [tokens, vocab] in fp32: 8.4 GB for 16k local tokens and a 128k vocabulary, more
than the rest of a step's activations together. Here the output projection and the loss run `chunk`
tokens at a time, and the gradients are formed in the same pass (softmax − one-hot is known as soon
as a chunk's log-sum-exp is): forward keeps only d(loss)/d(hidden) [tokens, d_model] and
d(loss)/d(weight) [vocab, d_model], so the peak of the loss is one chunk's logits whatever the
sequence length. Backward then only scales those by the incoming gradient (1 for
`loss_sum.backward()`, so the values are exact).

Precision: logits, log-sum-exp and their gradient in fp32 for any input dtype; the two gradient
matmuls run in the hidden states' dtype (bf16 on CUDA, like the head's own backward) and the weight
gradient is accumulated in fp32 across chunks.
"""

from __future__ import annotations

from typing import Any

import torch

DEFAULT_CHUNK_TOKENS = 4096


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        token_weights: torch.Tensor,
        chunk: int,
    ) -> torch.Tensor:
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        total = torch.zeros((), dtype=acc, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=acc, device=weight.device)
            if weight.requires_grad
            else None
        )
        w = weight.to(hidden.dtype)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk]
            y = labels[start : start + chunk]
            tw = token_weights[start : start + chunk].to(acc)
            logits = (h @ w.t()).to(acc)  # [c, V]: the only vocab-sized tensor, one chunk at a time
            lse = torch.logsumexp(logits, dim=-1)
            total += ((lse - logits.gather(1, y[:, None]).squeeze(1)) * tw).sum()
            if grad_hidden is None and grad_weight is None:
                continue
            g = logits.sub_(lse[:, None]).exp_()  # softmax, in place
            g.scatter_add_(1, y[:, None], torch.full_like(tw[:, None], -1.0))  # − one-hot
            g = g.mul_(tw[:, None]).to(hidden.dtype)
            if grad_hidden is not None:
                torch.mm(g, w, out=grad_hidden[start : start + chunk])
            if grad_weight is not None and h.dtype == acc:
                grad_weight.addmm_(g.t(), h)  # no [vocab, d_model] temporary per chunk
            elif grad_weight is not None:
                grad_weight += (g.t() @ h).to(acc)
        ctx.save_for_backward(
            grad_hidden if grad_hidden is not None else torch.empty(0),
            grad_weight.to(weight.dtype) if grad_weight is not None else torch.empty(0),
        )
        ctx.has_grad = (grad_hidden is not None, grad_weight is not None)
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        has_h, has_w = ctx.has_grad
        scale_h = grad_hidden * grad_out.to(grad_hidden.dtype) if has_h else None
        scale_w = grad_weight * grad_out.to(grad_weight.dtype) if has_w else None
        return scale_h, scale_w, None, None, None


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_weights: torch.Tensor,
    chunk: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """Σ token_weight · CE(hidden @ weightᵀ, label) over all tokens, an fp32 (fp64 for fp64) scalar,
    differentiable.

    hidden [..., d_model] (final hidden states), weight [vocab, d_model] (output head), labels and
    token_weights [...] (the leading shape of hidden). Equal to fp32 rounding to
    `(cross_entropy_per_token(F.linear(hidden, weight), labels) * token_weights).sum()`.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    with torch.autocast(hidden.device.type, enabled=False):  # dtypes are handled explicitly inside
        return _LinearCrossEntropySum.apply(
            hidden.reshape(-1, hidden.shape[-1]),
            weight,
            labels.reshape(-1),
            token_weights.reshape(-1),
            chunk,
        )


@torch.no_grad()
def token_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """Per-token cross-entropy [...] (fp32, no gradient), `chunk` tokens of logits at a time: for
    evals that need losses per position (validation by position bucket) without whole-shard
    logits."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    out = torch.empty(y.shape, dtype=torch.float32, device=hidden.device)
    w = weight.to(hidden.dtype)
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, flat.shape[0], chunk):
            logits = (flat[start : start + chunk] @ w.t()).float()
            target = logits.gather(1, y[start : start + chunk, None]).squeeze(1)
            out[start : start + chunk] = torch.logsumexp(logits, dim=-1) - target
    return out.reshape(labels.shape)
