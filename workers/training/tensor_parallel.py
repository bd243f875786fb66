"""Tensor parallelism applied from outside the model: each block's heads and MLP columns split over
the mesh's `tp` dimension (Megatron's layout, through DTensor's `parallelize_module`).

Attention is independent per head, so the ring composes with it unchanged: q/k/v projections are
column-wise (a tensor rank computes n_heads/T query heads and kv_heads/T K/V heads, and runs the
ring, or Ulysses x ring, over those), the output projection is row-wise; the MLP's gate and up
projections are column-wise and its down projection row-wise.

Between those, the residual stream is split along the sequence over the tensor group (Megatron's
sequence parallelism): a rank holds 1/T of its local tokens' hidden states, norms run on that piece
(`SequenceParallel`, their weights replicated and their gradients summed by DTensor), and the
attention and MLP gather the whole local sequence before their column-wise projections; the row-wise
ones reduce-scatter back to pieces. Per block that is an all-gather and a reduce-scatter each for
attention and MLP (the bytes of one all-reduce each), and what full activation checkpointing keeps
per block, its input, is 1/T as large: on long contexts that input is the floor of memory per token.
The embedding's output is sliced into the pieces and the final norm's input gathered back, so the
loss (chunked, so the vocabulary is not split either: one chunk of logits at a time), the
evaluations and the embedding and head see the whole local sequence on every tensor rank, and their
gradients agree without communication (the trainer counts a tensor group's tokens once).

Plans (`plan_for`) are each model kind's (`ModelKind.tp_plan` in `workers/models/registry.py`): the
native model's is `NATIVE_PLAN` (`models/llama.py`); a pretrained family's comes from its
transformers config (`base_model_tp_plan`, the plan transformers itself uses for `tp_plan="auto"`,
read in `models/hf.py`), translated here into DTensor styles. Its `replicated_with_grad_allreduce`
entries (qwen3's per-head q/k norms) are parameters that each tensor rank applies to its own heads
only: their gradients are partial sums, added over the tensor group after backward
(`TensorParallel.finish_gradients`). Any other style is refused by name.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from workers.models import RingModel, kind_of


class _SequentialCollectivesHint(logging.Filter):
    """Drop DTensor's hint that a two-dimensional gather or reduce runs as two collectives: with
    tensor parallelism it fires (once per process) on the scalar gradient norm and on the export's
    gathers, where one more small collective costs nothing; a training log is no place for it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("While redistributing from")


logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_SequentialCollectivesHint())

GRAD_SUM = "replicated_with_grad_allreduce"  # transformers' name: replicated, gradient summed


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
    return dict(kind_of(model).tp_plan(model))


def _to_full(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """A tensor rank's piece of the local sequence (plain, or a DTensor sharded on it) -> the whole
    local sequence on every tensor rank (all-gather; backward: each rank keeps its piece's
    gradient)."""
    piece = (
        x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
    )
    return piece.redistribute(mesh, [Replicate()]).to_local()


def _to_piece(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The whole local sequence, the same on every tensor rank -> this rank's piece (a slice;
    backward: the pieces' gradients all-gathered)."""
    whole = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return whole.redistribute(mesh, [Shard(1)]).to_local()


def _gather_first_input(mesh: DeviceMesh) -> Callable[..., Any]:
    """Forward pre-hook: the module's hidden states (first positional argument, or transformers'
    `hidden_states` keyword) gathered to the whole local sequence."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (_to_full(args[0], mesh), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": _to_full(kwargs["hidden_states"], mesh)}

    return hook


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, *, tiled_mlp: bool = False
) -> TensorParallel:
    """Split every block of `model` over `tp_mesh` by its plan, with the residual stream split
    over the tensor group along the sequence (before checkpointing and FSDP).

    Per block: the norms run on a rank's piece of the local sequence (`SequenceParallel`), the
    attention and the MLP gather it first (`_gather_first_input`), their column-wise projections
    work on the whole local sequence for a rank's heads and columns, and the row-wise ones
    reduce-scatter back to pieces. A tiled MLP runs its tiles over the whole sequence, so its
    down projection all-reduces and the MLP's output is sliced to the piece instead. Around the
    blocks, the embedding's output is sliced into pieces and the final norm's input gathered, so
    the loss and the evaluations see the whole local sequence as without tensor parallelism."""
    if not isinstance(model, RingModel):
        raise TypeError(f"tensor parallelism needs a RingModel, not a {type(model).__name__}")
    plan = plan_for(model)
    tp = TensorParallel(tp_mesh)
    for block in model.layers:  # type: ignore[union-attr]
        styles: dict[str, ParallelStyle] = {}
        parents: set[str] = set()
        for name, _ in block.named_modules():
            for pattern, style in plan.items():
                if not name or not fnmatch.fnmatchcase(name, pattern):
                    continue
                parent = name.rpartition(".")[0]
                if style == GRAD_SUM:
                    tp.grad_sum_modules.append(block.get_submodule(name))
                elif style == "colwise":
                    styles[name] = ColwiseParallel()
                    parents.add(parent)
                elif style == "rowwise":
                    whole = tiled_mlp and parent == "mlp"  # tiles are rows of the whole sequence
                    styles[name] = (
                        RowwiseParallel() if whole else RowwiseParallel(output_layouts=Shard(1))
                    )
                    parents.add(parent)
                else:
                    raise ValueError(
                        f"tensor-parallel style {style!r} (for {pattern!r}) is not supported; "
                        f"supported: {sorted(['colwise', 'rowwise', GRAD_SUM])}"
                    )
        missing = [p for p in plan if plan[p] != GRAD_SUM and p not in styles]
        if missing:
            raise ValueError(f"tensor-parallel plan names modules the block lacks: {missing}")
        for name, child in block.named_children():
            if _is_norm(child):
                styles[name] = SequenceParallel()
        parallelize_module(block, tp_mesh, styles)
        for parent in sorted(parents):
            block.get_submodule(parent).register_forward_pre_hook(
                _gather_first_input(tp_mesh), with_kwargs=True
            )
        if tiled_mlp and "mlp" in parents:
            block.get_submodule("mlp").register_forward_hook(
                lambda module, args, out: _to_piece(out, tp_mesh)
            )
    embedding, final_norm = model.sequence_ends()
    embedding.register_forward_hook(lambda module, args, out: _to_piece(out, tp_mesh))
    final_norm.register_forward_pre_hook(
        lambda module, args: (_to_full(args[0], tp_mesh), *args[1:])
    )
    return tp
