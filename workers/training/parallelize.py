"""Apply activation checkpointing and FSDP2 to a model from outside, the way torchtitan does.

Both model kinds expose their decoder blocks as `model.layers`. Each block becomes its own FSDP unit
(all-gathered just before it runs, freed after; its gradient reduce-scattered as soon as backward leaves
it) and the root unit holds the rest (embedding, final norm, head). Sharding is over the whole mesh
flattened (`Mesh.shard_mesh`), so each rank holds ≈ 1/W of the parameters, gradients and AdamW state.

Gradients are *summed* (divide factor 1): every rank backpropagates its sum of weighted token losses, and
the trainer divides by the global token weight, as single-process training does.

CUDA: bf16 parameters for compute, fp32 reductions; the sharded parameters (the optimizer's master
weights) stay fp32. Block inputs are not cast (`cast_forward_inputs=False`) so the fp32 RoPE tables reach
the blocks unrounded; the residual stream is bf16 because the gathered embedding is.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from workers.training.mesh import Mesh


def mixed_precision(device: torch.device) -> MixedPrecisionPolicy:
    if device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    return MixedPrecisionPolicy(cast_forward_inputs=False)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward (non-reentrant: composes with FSDP's hooks)."""
    layers: nn.ModuleList = model.layers  # type: ignore[assignment]
    for i, block in enumerate(layers):
        layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def apply_fsdp(model: nn.Module, mesh: Mesh, device: torch.device) -> None:
    """Shard per block, then the root; `features` (the chunked loss's entry) gathers like `forward`."""
    assert mesh.shard_mesh is not None
    policy = mixed_precision(device)
    for block in model.layers:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh.shard_mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh.shard_mesh, mp_policy=policy)
    register_fsdp_forward_method(model, "features")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM


def parallelize(model: nn.Module, mesh: Mesh, device: torch.device, *, activation_checkpointing: bool) -> None:
    """AC first (inside each FSDP unit, so FSDP's gather/free hooks stay outside the recomputed region)."""
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if mesh.shard_mesh is not None:
        apply_fsdp(model, mesh, device)
