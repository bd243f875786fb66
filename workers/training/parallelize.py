"""Apply tensor parallelism, activation checkpointing and FSDP2 to a model from outside, the way
torchtitan does: tensor parallelism first (`workers.training.tensor_parallel`: each block's heads
and MLP columns over the mesh's `tp` dimension), then the memory knobs, then FSDP over the rest.

Both model kinds expose their decoder blocks as `model.layers`. Each block becomes its own FSDP unit
(all-gathered just before it runs, freed after; its gradient reduce-scattered as soon as backward
leaves it) and the root unit holds the rest (embedding, final norm, head). Sharding is over the
whole mesh flattened (`Mesh.shard_mesh`), so each rank holds ≈ 1/W of the parameters, gradients and
AdamW state.

Gradients are *summed* (divide factor 1): every rank backpropagates its sum of weighted token
losses, and the trainer divides by the global token weight, as single-process training does.

Memory knobs (`train.activation_checkpointing`, `train.tiled_mlp`, `train.offload_activations`) are
applied here too, before FSDP, the same way for native and pretrained models (both have
`model.layers[i].mlp`):

- `full`: each block is recomputed in backward; a rank keeps one input per block
  (`checkpoint_wrapper`);
- `selective`: only each block's MLP is recomputed (attention, whose recompute would run the ring
  again, keeps its saved tensors); with a tiled MLP, the tiles already recompute it and nothing more
  is wrapped;
- tiled MLP (`workers.training.tiling`): each MLP runs over sequence tiles, forward and backward;
- offload (`workers.training.offload`): the kept block inputs go to pinned host memory until
  backward.

CUDA: bf16 parameters for compute, fp32 reductions; the sharded parameters (the optimizer's master
weights) stay fp32. Block inputs are not cast (`cast_forward_inputs=False`) so the fp32 RoPE tables
reach the blocks unrounded; the residual stream is bf16 because the gathered embedding is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.utils.checkpoint import checkpoint

from workers.config import MemoryKnobs, mlp_tiles
from workers.models import RingModel
from workers.training.mesh import Mesh
from workers.training.offload import BlockInputOffload, offload_block_inputs
from workers.training.tensor_parallel import TensorParallel, apply_tensor_parallel
from workers.training.tiling import tile_mlp


@dataclass(frozen=True)
class Parallelized:
    """What `parallelize` applied that the trainer needs again later."""

    offload: BlockInputOffload | None = None  # offloaded activations (for their byte count)
    tensor: TensorParallel | None = None  # tensor parallelism (partial gradients to finish)

    def finish_gradients(self) -> None:
        """After backward: what FSDP's reduce-scatter does not do (tensor-partial gradients)."""
        if self.tensor is not None:
            self.tensor.finish_gradients()


def mixed_precision(device: torch.device) -> MixedPrecisionPolicy:
    if device.type == "cuda":
        return MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    return MixedPrecisionPolicy(cast_forward_inputs=False)


def blocks_of(model: nn.Module) -> list[tuple[int | str, Any]]:
    """(key, block) of `model.layers`: a ModuleList (a whole model), or a ModuleDict keyed by the
    original layer index (a pipeline stage, `workers.training.pipeline`: its FQNs keep them)."""
    layers: Any = model.layers
    if isinstance(layers, nn.ModuleDict):
        return list(layers.items())
    return list(enumerate(layers))


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward (non-reentrant: composes with FSDP's
    hooks)."""
    layers: Any = model.layers
    for i, block in blocks_of(model):
        layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def apply_mlp_checkpointing(model: nn.Module) -> None:
    """Selective: recompute each block's MLP in backward (its forward patched, so names stay
    unchanged)."""
    for _, block in blocks_of(model):
        mlp: nn.Module = block.mlp
        inner = mlp.forward

        def forward(x: torch.Tensor, _inner: Callable[..., torch.Tensor] = inner) -> torch.Tensor:
            if not torch.is_grad_enabled():
                return _inner(x)
            out: torch.Tensor = checkpoint(_inner, x, use_reentrant=False)
            return out

        mlp.forward = forward


def apply_tiled_mlp(model: nn.Module, tiled_mlp: str | int, d_model: int) -> None:
    """Each block's MLP over `mlp_tiles(tiled_mlp, local tokens, d_model)` token tiles."""
    for _, block in blocks_of(model):
        tile_mlp(block.mlp, lambda tokens: mlp_tiles(tiled_mlp, tokens, d_model))


def apply_fsdp(model: nn.Module, mesh: Mesh, device: torch.device) -> None:
    """Shard per block, then the root; `features` (the chunked loss's entry) gathers like
    `forward`."""
    assert mesh.shard_mesh is not None
    policy = mixed_precision(device)
    for _, block in blocks_of(model):
        fully_shard(block, mesh=mesh.shard_mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh.shard_mesh, mp_policy=policy)
    if hasattr(model, "features"):  # a pipeline stage has only forward
        register_fsdp_forward_method(model, "features")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM


def parallelize(
    model: nn.Module,
    mesh: Mesh,
    device: torch.device,
    knobs: MemoryKnobs | None = None,
    *,
    tensor_parallel: bool = True,
) -> Parallelized:
    """Tensor parallelism first (plain modules in, DTensor-split projections out), then the memory
    knobs (inside each FSDP unit, so FSDP's gather/free hooks stay outside the recomputed region),
    then FSDP. Knobs this rank cannot run (`MemoryKnobs.problem`, the rule the spec checked at
    submission) raise ValueError. `tensor_parallel=False`: already applied (a pipeline splits the
    whole model before cutting it into stages, `workers.training.pipeline`)."""
    knobs = knobs or MemoryKnobs()
    problem = knobs.problem(cuda=device.type == "cuda")
    if problem:
        raise ValueError(f"{problem[1]} (this rank runs on {device.type})")
    mode, tiled_mlp = knobs.activation_checkpointing, knobs.tiled_mlp
    tensor = None
    if mesh.tp_mesh is not None and tensor_parallel:
        tensor = apply_tensor_parallel(model, mesh.tp_mesh, tiled_mlp=knobs.tiled)
    if knobs.tiled:
        apply_tiled_mlp(model, tiled_mlp, _hidden_size(model))
    if mode == "selective" and not knobs.tiled:
        apply_mlp_checkpointing(model)
    if mode == "full":
        apply_activation_checkpointing(model)
    blocks = model.layers
    if not isinstance(blocks, nn.ModuleList):
        blocks = nn.ModuleList(block for _, block in blocks_of(model))
    offload = offload_block_inputs(blocks, device) if knobs.offload_activations else None
    if mesh.shard_mesh is not None:
        apply_fsdp(model, mesh, device)
    return Parallelized(offload, tensor)


def _hidden_size(model: nn.Module) -> int:
    """d_model of any model kind: the LM head is [vocab, hidden] (`RingModel.output_weight`)."""
    d_model = getattr(model, "d_model", None)  # a pipeline stage may not hold the head
    if isinstance(d_model, int):
        return d_model
    if not isinstance(model, RingModel):
        raise TypeError(f"a tiled MLP needs a RingModel, not a {type(model).__name__}")
    return int(model.output_weight.shape[1])
