"""Tensor parallelism applied from outside the model: each block's heads and MLP columns split over
the mesh's `tp` dimension (Megatron's layout, through DTensor's `parallelize_module`).

Attention is independent per head, so the ring composes with it unchanged: q/k/v projections are
column-wise (a tensor rank computes n_heads/T query heads and kv_heads/T K/V heads, and runs the
ring, or Ulysses x ring, over those), the output projection is row-wise (its all-reduce restores the
replicated residual stream); the MLP's gate and up projections are column-wise and its down
projection row-wise. Two all-reduces per block forward (and two in backward), nothing else. Norms,
the embedding and the LM head stay replicated over the tensor group (FSDP still shards them over
the other dimensions); their gradients are computed from the same replicated activations on every
tensor rank, so they agree without communication. The loss is not vocabulary-parallel: the chunked
loss already holds one chunk of logits at a time, so splitting the vocabulary would save little
memory for an all-reduce per chunk.

Plans (`plan_for`): the native model's is written here; a pretrained family's comes from its
transformers config (`base_model_tp_plan`, the plan transformers itself uses for `tp_plan="auto"`),
translated into DTensor styles. Its `replicated_with_grad_allreduce` entries (qwen3's per-head q/k
norms) are parameters that each tensor rank applies to its own heads only: their gradients are
partial sums, added over the tensor group after backward (`TensorParallel.finish_gradients`).
Any other style is refused by name.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

# The native model's plan, per block (`workers.models.llama.Block`).
NATIVE_PLAN: dict[str, str] = {
    "attn.wq": "colwise",
    "attn.wk": "colwise",
    "attn.wv": "colwise",
    "attn.wo": "rowwise",
    "mlp.w_gate": "colwise",
    "mlp.w_up": "colwise",
    "mlp.w_down": "rowwise",
}


class _SequentialCollectivesHint(logging.Filter):
    """Drop DTensor's hint that a two-dimensional gather or reduce runs as two collectives: with
    tensor parallelism it fires (once per process) on the scalar gradient norm and on the export's
    gathers, where one more small collective costs nothing; a training log is no place for it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("While redistributing from")


logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_SequentialCollectivesHint())

GRAD_SUM = "replicated_with_grad_allreduce"  # transformers' name: replicated, gradient summed
STYLES: dict[str, type[ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


@dataclass
class TensorParallel:
    """What `apply_tensor_parallel` did: the group, and the modules whose gradients are partial."""

    mesh: DeviceMesh
    grad_sum_modules: list[nn.Module] = field(default_factory=list)

    def finish_gradients(self) -> None:
        """Sum the partial gradients over the tensor group (collective over it; after backward)."""
        group = self.mesh.get_group()
        for module in self.grad_sum_modules:
            for p in module.parameters():
                if p.grad is not None:
                    grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    dist.all_reduce(grad, group=group)


def plan_for(model: nn.Module) -> dict[str, str]:
    """The per-block plan (block-relative module name -> style) of `model`'s kind."""
    config = getattr(model, "config", None)
    if getattr(model, "cfg", None) is not None or config is None:
        return dict(NATIVE_PLAN)
    base = getattr(config, "base_model_tp_plan", None) or {}
    plan = {}
    for pattern, style in base.items():
        if not pattern.startswith("layers.*."):
            raise ValueError(
                f"{config.model_type}: tensor-parallel plan entry {pattern!r} is outside the "
                "decoder blocks; parallel.tensor_size supports per-block plans only"
            )
        plan[pattern.removeprefix("layers.*.")] = style
    if not plan:
        raise ValueError(
            f"{config.model_type} has no tensor-parallel plan in transformers; "
            "use parallel.tensor_size: 1"
        )
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> TensorParallel:
    """Split every block of `model` over `tp_mesh` by its plan (before checkpointing and FSDP)."""
    plan = plan_for(model)
    tp = TensorParallel(tp_mesh)
    for block in model.layers:  # type: ignore[union-attr]
        styles: dict[str, ParallelStyle] = {}
        for name, _ in block.named_modules():
            for pattern, style in plan.items():
                if not name or not fnmatch.fnmatchcase(name, pattern):
                    continue
                if style == GRAD_SUM:
                    tp.grad_sum_modules.append(block.get_submodule(name))
                elif style in STYLES:
                    styles[name] = STYLES[style]()
                else:
                    raise ValueError(
                        f"tensor-parallel style {style!r} (for {pattern!r}) is not supported; "
                        f"supported: {sorted([*STYLES, GRAD_SUM])}"
                    )
        missing = [p for p in plan if plan[p] in STYLES and p not in styles]
        if missing:
            raise ValueError(f"tensor-parallel plan names modules the block lacks: {missing}")
        parallelize_module(block, tp_mesh, styles)
    return tp
