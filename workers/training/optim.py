"""AdamW with linear warmup + cosine decay (torch's `LambdaLR`), and gradient clipping (torch's `clip_grad_norm_`).

After the gradient all-reduce every rank holds the same full gradient of the global loss, so the
global norm is a purely local computation: no further communication is needed to clip.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from workers.config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """Decay matrices only; norms, biases and embeddings are not decayed."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "emb" in name else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # foreach=False: the plain per-parameter loop is deterministic and identical on every rank.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, foreach=False)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr for 0-based `step`: linear warmup to 1, then cosine down to cfg.min_lr_ratio."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_at(step: int, cfg: TrainConfig) -> float:
    return cfg.lr * lr_factor(step, cfg)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> LambdaLR:
    """Step k of training runs with lr_at(k); `scheduler.step()` after each optimizer step."""
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg))


@torch.no_grad()
def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Global L2 norm of the (already reduced) gradients, before clipping; clips in place if max_norm > 0."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    limit = max_norm if max_norm > 0 else math.inf
    return float(torch.nn.utils.clip_grad_norm_(grads, limit, foreach=False))
