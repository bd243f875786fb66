"""AdamW with linear warmup + cosine decay, and gradient clipping.

After the gradient all-reduce every rank holds the same full gradient of the global loss, so the
global norm is a purely local computation — no further communication needed to clip.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from workers.config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """Decay matrices only; norms, biases and embeddings are not decayed."""
    decay, no_decay = [], []
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


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for 0-based `step`: linear warmup to cfg.lr, then cosine to cfg.lr · min_lr_ratio."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Scheduler:
    """Sets each group's lr from `lr_at`; its whole state is the step counter."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> None:
        self.optimizer, self.cfg, self.step_count = optimizer, cfg, 0

    def apply(self) -> float:
        lr = lr_at(self.step_count, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def step(self) -> None:
        self.step_count += 1

    def state_dict(self) -> dict:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])


@torch.no_grad()
def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Global L2 norm of the (already reduced) gradients, before clipping; clips in place if max_norm > 0."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
    return float(norm)
