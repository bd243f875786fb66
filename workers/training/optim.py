"""AdamW with linear warmup + cosine decay (torch's `LambdaLR`), gradient clipping, and
`state_bytes`.

Under FSDP every parameter, gradient and AdamW moment is a DTensor shard; the optimizer steps on the
local shards (fp32 master weights). The global gradient norm is the norm of all shards: torch's
`get_total_norm` returns it as a partial DTensor and `full_tensor()` sums it over the mesh. With
tensor parallelism the gradients live on two meshes (the split projections on shard x tp, the rest
on the shard mesh alone), which one `get_total_norm` cannot mix: the norm is taken per mesh and the
per-mesh norms combined.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
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
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, foreach=False
    )


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr for 0-based `step`: linear warmup to 1, then cosine down to
    cfg.min_lr_ratio."""
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
def clip_grad_norm(
    params: list[nn.Parameter], max_norm: float, across: dist.ProcessGroup | None = None
) -> float:
    """Global L2 norm of the (already reduced) gradients, before clipping; clips in place if
    max_norm > 0. `across`: ranks holding *other* parameters (the pipeline's stages), whose squared
    norms add to this one's (collective over that group)."""
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad and across is None:
        return 0.0
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in with_grad:
        assert p.grad is not None
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        by_mesh.setdefault(key, []).append(p.grad)
    norms = []
    for grads in by_mesh.values():  # the same order on every rank: parameter order
        norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=False)
        # collective: the norm over every rank's shards
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:  # a pipeline rank without gradients still joins the sum below
        norms.append(torch.zeros(()))
    total = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
    if across is not None:
        square = total.detach().float() ** 2
        dist.all_reduce(square, group=across)
        total = square.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total, foreach=False)
    return float(total)


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def state_bytes(params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters + gradients + optimizer state this rank holds (its shards, under
    FSDP)."""
    total = sum(
        _local_bytes(p) + (_local_bytes(p.grad) if p.grad is not None else 0) for p in params
    )
    for state in optimizer.state.values():
        total += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total
