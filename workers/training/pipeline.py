"""Pipeline parallelism (`parallel.pipeline_size` P > 1) on `torch.distributed.pipelining`.

The native model's blocks are cut into stages (`workers.parallel_dims.stage_layers`: even, or
`parallel.pipeline_split`); stage s runs on pipeline rank s mod P (one stage per rank for 1f1b,
two for the interleaved schedules). Each stage is a `StageModule` holding the original block
objects under their original indices (a `ModuleDict` keyed "0", "1", ...), so its parameter names
are the whole model's (`layers.5.attn.wq.weight`), and a DCP checkpoint written with any pipeline
size loads with any other, or none. The first stage holds the embedding; the last holds the final
norm and the head, and returns the microbatch's *sum* of weighted token losses (the chunked loss,
`workers.training.loss`), so the schedule's loss is the identity and no logits cross a stage.

Inside a stage everything is as without a pipeline: FSDP2 over the stage's dp x ring x ulysses
slice of the mesh (`Mesh.shard_mesh`), ring/Ulysses attention on the slice's groups, the memory
knobs (`workers.training.parallelize`). The schedule (`Schedule1F1B`,
`ScheduleInterleaved1F1B`, `ScheduleInterleavedZeroBubble`) splits the replica's rows into
`train.microbatches` equal microbatches and sums their gradients (`scale_grads=False`); the trainer
then divides by the global token weight as always, so the step is the global token mean, the same
as one process.

`PipelineModel` is what the trainer holds as its model: this rank's stages' modules under the
whole model's names, for the optimizer, the gradient clip and checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from workers.config import JobSpec
from workers.data import Batch
from workers.models import SequenceParallel
from workers.models.llama import Transformer, rope_tables
from workers.parallel_dims import stage_layers, stage_rank
from workers.training.loss import linear_cross_entropy_sum
from workers.training.mesh import Mesh

if TYPE_CHECKING:
    from torch.distributed.pipelining.stage import _PipelineStageBase
from workers.training.parallelize import Parallelized, blocks_of, parallelize
from workers.training.tensor_parallel import _to_full, _to_piece, apply_tensor_parallel

WRAPPED = "_checkpoint_wrapped_module."


class StageModule(nn.Module):
    """One pipeline stage of the native model: `forward(tokens or hidden, positions, labels,
    weights)` -> the hidden states for the next stage, or (last stage) the loss sum."""

    def __init__(
        self,
        model: Transformer,
        layers: range,
        *,
        first: bool,
        last: bool,
        tp_mesh: DeviceMesh | None = None,
    ) -> None:
        super().__init__()
        self.cfg = model.cfg
        # tensor parallel: stages exchange the whole local sequence; inside, the residual stream
        # is a tensor rank's piece, as between the embedding and the final norm of a whole model
        self.tp_mesh = tp_mesh
        self.d_model = model.cfg.d_model
        self.sp: SequenceParallel | None = None
        self.tok_emb = model.tok_emb if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.norm = model.norm if last else None
        self.head = model.head if last else None

    @property
    def is_last(self) -> bool:
        return self.norm is not None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor,
        doc_starts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cu_seqlens = None
        if doc_starts is None:
            # positions arrive per row (the schedule splits every input by rows); rows are equal
            positions = positions[0]
        else:  # packed documents: per-row positions, boundaries from the rows' document starts
            rows, seq = doc_starts.shape
            starts = doc_starts.reshape(-1).nonzero().squeeze(1)
            cu_seqlens = torch.cat([starts, starts.new_tensor([rows * seq])]).to(torch.int32)
        cos, sin = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta)
        cuda = x.device.type == "cuda"
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
        with autocast:
            if self.tok_emb is not None:
                x = self.tok_emb(x)
            elif self.tp_mesh is not None:
                x = _to_piece(x, self.tp_mesh)
            for _, block in blocks_of(self):
                x = block(x, cos, sin, self.sp, cu_seqlens)
            if self.norm is None:
                return _to_full(x, self.tp_mesh) if self.tp_mesh is not None else x
            hidden = self.norm(x)
        head = self.head.weight if self.head is not None else None
        assert head is not None, "the last stage holds the head (tied embeddings are refused)"
        return linear_cross_entropy_sum(hidden, head, labels, weights)


class PipelineModel(nn.Module):
    """This rank's stages under the whole model's parameter names (shared modules, not copies):
    what the optimizer, the gradient clip and DCP see."""

    def __init__(self, stages: list[StageModule]) -> None:
        super().__init__()
        self.stage_modules = stages  # a plain list: not registered, so names stay the model's
        first = next((s.tok_emb for s in stages if s.tok_emb is not None), None)
        last = next((s for s in stages if s.is_last), None)
        self.tok_emb = first
        self.layers = nn.ModuleDict({k: b for s in stages for k, b in s.layers.items()})
        self.norm = last.norm if last is not None else None
        self.head = last.head if last is not None else None

    def set_sequence_parallel(self, sp: SequenceParallel | None) -> None:
        for stage in self.stage_modules:
            stage.sp = sp

    @property
    def sequence_parallel(self) -> SequenceParallel | None:
        """What the stages' attention runs on (all of this rank's stages share it)."""
        return self.stage_modules[0].sp


def stage_inputs(local: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    """The keyword inputs of every stage's forward for `local` ([rows, seq] of this rank's
    sequence shard): positions per row, labels, weights, and with packed documents each row's
    document starts (`cu_seqlens` has no row dimension for the schedule to split, so the
    microbatches rebuild their own from these)."""
    rows = local.inputs.shape[0]
    positions = local.positions.to(device).expand(rows, -1).contiguous()
    kwargs = {"positions": positions, "labels": local.labels, "weights": local.weights}
    if local.cu_seqlens is not None:
        assert local.doc_positions is not None
        cu = local.cu_seqlens.to(device, torch.int64)
        starts = torch.zeros(int(cu[-1]), dtype=torch.bool, device=device)
        starts[cu[:-1]] = True
        kwargs["doc_starts"] = starts.view(rows, -1)
        kwargs["positions"] = local.doc_positions
    return kwargs


def _identity_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage already returns the microbatch's loss sum."""
    return output


@dataclass
class Pipeline:
    """This rank's stages and the schedule that runs them."""

    model: PipelineModel
    whole: Transformer  # the skeleton the stages were cut from: its kind and config, for export
    stage_indices: list[int]
    num_stages: int
    microbatches: int
    schedule_name: str
    mesh: Mesh
    device: torch.device
    sum_gradients: bool = False  # stages without FSDP: sum gradients over the slice after a step
    parallelized: Parallelized = field(default_factory=Parallelized)  # TP gradients to finish
    _schedule: object = None
    _shape: tuple[int, ...] | None = None

    @property
    def holds_last(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    @property
    def holds_first(self) -> bool:
        return 0 in self.stage_indices

    def _build(self, rows: int, seq: int) -> None:
        """The stages and schedule for microbatches of [rows, seq] tokens: shapes are given, so
        nothing runs to infer them (a stage's forward is collective over its ring)."""
        cfg = self.model.stage_modules[0].cfg
        mb = rows // self.microbatches
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        tokens = torch.empty(mb, seq, dtype=torch.long, device="meta")
        hidden = torch.empty(mb, seq, cfg.d_model, dtype=dtype, device="meta", requires_grad=True)
        loss = torch.empty((), dtype=torch.float32, device="meta", requires_grad=True)
        # imported here, not at the top: torch.distributed.pipelining brings in torch._dynamo, ~0.7
        # CPU-s on every process that imports the trainer, pipeline or not
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
        )

        stages: list[_PipelineStageBase] = []
        for index, module in zip(self.stage_indices, self.model.stage_modules, strict=True):
            stages.append(
                PipelineStage(
                    module,
                    index,
                    self.num_stages,
                    self.device,
                    input_args=tokens if index == 0 else hidden,
                    output_args=loss if index == self.num_stages - 1 else hidden,
                    group=self.mesh.pp_group,
                )
            )
        kind: Callable[..., object]
        if self.schedule_name == "1f1b":
            self._schedule = Schedule1F1B(
                stages[0], self.microbatches, loss_fn=_identity_loss, scale_grads=False
            )
        else:
            kind = (
                ScheduleInterleaved1F1B
                if self.schedule_name == "interleaved_1f1b"
                else ScheduleInterleavedZeroBubble
            )
            self._schedule = kind(
                stages, self.microbatches, loss_fn=_identity_loss, scale_grads=False
            )
        self._shape = (rows, seq)

    def sum_stage_gradients(self) -> None:
        """Stages without FSDP (`sum_gradients`): sum each gradient over the stage's slice, as
        FSDP's reduce-scatter would (collective over the slice; nothing otherwise)."""
        if self.sum_gradients and self.mesh.shard_mesh is not None:
            group = self.mesh.shard_mesh.get_group()
            for param in self.model.parameters():
                if param.grad is not None and dist.get_world_size(group) > 1:
                    dist.all_reduce(param.grad, group=group)

    def step(self, local: Batch) -> torch.Tensor:
        """Forward and backward of every microbatch of `local` (this replica's rows, this rank's
        sequence shard); gradients are summed over microbatches, reduced over the stage's slice by
        FSDP. Returns this rank's loss sum (0 on ranks without the last stage)."""
        rows, seq = local.inputs.shape
        if self._shape != (rows, seq):  # first step, or a curriculum's other length
            self._build(rows, seq)
        kwargs = stage_inputs(local, self.device)
        losses: list[torch.Tensor] = []
        args = (local.inputs,) if self.holds_first else ()
        target = local.labels if self.holds_last else None
        self._schedule.step(  # type: ignore[attr-defined]
            *args, target=target, losses=losses, return_outputs=False, **kwargs
        )
        self.sum_stage_gradients()
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach().float() for loss in losses]).sum()


def build_pipeline(model: nn.Module, spec: JobSpec, mesh: Mesh, device: torch.device) -> Pipeline:
    """Cut the skeleton (`meta`) model into this rank's stages, parallelize each (memory knobs,
    FSDP over the stage's slice), allocate and fill their shards from the seed exactly as the
    whole model would be filled."""
    if not isinstance(model, Transformer):
        raise TypeError(f"pipeline parallel trains native models, not {type(model).__name__}")
    p = spec.parallel
    num_stages = p.pipeline_stages
    ranges = stage_layers(model.cfg.n_layers, num_stages, p.pipeline_split)
    # every parameter's name and full shape, in the order `init_weights` draws them
    order = [(name, param.shape) for name, param in model.named_parameters()]
    local = [s for s in range(num_stages) if stage_rank(s, p.pipeline_size) == mesh.pp_rank]
    # tensor parallel on the whole model first (its embedding and final-norm hooks included), so
    # every stage's blocks are split exactly as without a pipeline
    tensor = None
    if mesh.tp_mesh is not None:
        tensor = apply_tensor_parallel(model, mesh.tp_mesh, tiled_mlp=spec.train.knobs.tiled)
    modules = [
        StageModule(model, ranges[s], first=s == 0, last=s == num_stages - 1, tp_mesh=mesh.tp_mesh)
        for s in local
    ]
    # zero_bubble's deferred weight gradients (`stage_backward_weight`) are formed after FSDP has
    # resharded the stage, and land beside its sharded gradients: its stages stay whole (no FSDP)
    # and their gradients are summed over the stage's slice after the schedule instead
    fsdp = p.pipeline_schedule != "zero_bubble"
    for module in modules:
        parallelize(
            module,
            mesh if fsdp else replace(mesh, shard_mesh=None),
            device,
            spec.train.knobs,
            tensor_parallel=False,
        )
        module.to_empty(device=device)
    whole = PipelineModel(modules)
    _init_shards(whole, model, order, spec.train.seed)
    return Pipeline(
        whole,
        model,
        local,
        num_stages,
        spec.train.microbatches,
        p.pipeline_schedule,
        mesh,
        device,
        sum_gradients=not fsdp,
        parallelized=Parallelized(tensor=tensor),
    )


@torch.no_grad()
def _init_shards(
    whole: PipelineModel,
    model: Transformer,
    order: list[tuple[str, torch.Size]],
    seed: int,
) -> None:
    """Draw every parameter of the whole model from `seed` in `named_parameters` order (as
    `llama.init_shards` does) and keep this rank's shards of its stages' parameters: the stages
    start from the very model one process builds."""
    mine = {name.replace(WRAPPED, ""): p for name, p in whole.named_parameters()}
    generator = torch.Generator().manual_seed(seed)
    for name, shape in order:
        full = model.init_value(name, shape, generator)
        p = mine.get(name)
        if p is None:
            continue
        if isinstance(p, DTensor):
            shard = distribute_tensor(
                full.to(p.device), p.device_mesh, p.placements, src_data_rank=None
            )
            p.to_local().copy_(shard.to_local())
        else:
            p.copy_(full)


def full_state(model: PipelineModel, stage_size: int) -> dict[str, torch.Tensor]:
    """The whole model's weights (CPU, fp32) on global rank 0, gathered from every stage; an empty
    dict elsewhere. Collective over all ranks: each stage unshards its parameters over its slice,
    then one rank per stage (the slice's first) sends them to rank 0."""
    mine: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        whole = p.full_tensor() if isinstance(p, DTensor) else p
        mine[name.replace(WRAPPED, "")] = whole.detach().float().cpu()
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine if rank % stage_size == 0 else {}, gathered, dst=0)
    state: dict[str, torch.Tensor] = {}
    for part in gathered or []:
        state.update(part)
    return state
