"""Elastic jobs: on rank loss, keep training on the shape that can be placed now; grow back later.

`elastic: {enabled, min_world_size, grow}` on a job spec. The shapes a job may run on are its own
and the smaller ones `shapes` lists, largest first. The global batch of a step depends only on the
data spec, the seed and the step, and a checkpoint reshards onto any shape, so every shape trains
the same model on the same data: a resize changes where the work runs, never the math.

Who decides what:
- this module: which shapes exist (pure arithmetic on the spec): data parallelism shrinks before
  the sequence group (a smaller ring makes every rank hold a longer shard, the one thing that
  grows activation memory per token), and every shape obeys the spec's own rules (batch divisible
  by data_parallel, sequence length by the layout's chunks, heads by the tensor group);
- the control plane, at submission: whether the smallest allowed shape (at `min_world_size`) fits
  a device's memory (the planner's estimate), else 422 naming `elastic.min_world_size`;
- the job's driver, at run time: the largest shape whose bundles can be placed now
  (`workers.orchestration.elastic`), and, with `grow`, when to go back to the job's own shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from workers.config.base import MAX_WORLD, StrictModel
from workers.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from workers.config.spec import JobSpec


class ElasticConfig(StrictModel):
    enabled: bool = Field(
        False, description="on rank loss, continue on the largest shape that can be placed now"
    )
    min_world_size: int | None = Field(
        None,
        ge=1,
        le=MAX_WORLD,
        description="the fewest ranks the job may run on (default: the smallest shape it has)",
    )
    grow: bool = Field(
        True, description="return to the job's own shape once capacity for it is back"
    )


def shapes(spec: JobSpec) -> list[ParallelDims]:
    """The shapes `spec` may run on, its own first, then smaller worlds (largest first; among
    equal worlds the larger sequence group first), down to `elastic.min_world_size`. Ulysses,
    tensor and pipeline degrees stay the job's: they split heads and layers, which a lost node
    does not change; data parallelism and the ring shrink to any size the global batch and the
    sequence length still divide by (4 x 2 may become 3 x 2 when the batch is a multiple of 3)."""
    own = ParallelDims.of(spec.parallel)
    floor = spec.elastic.min_world_size or 1
    found: list[ParallelDims] = []
    for ring in range(own.ring_size, 0, -1):
        for dp in range(own.data_parallel, 0, -1):
            dims = ParallelDims(dp, ring, own.ulysses_size, own.tensor_size, own.pipeline_size)
            if dims.world_size < floor or spec.train.batch_size % dp:
                continue
            if spec.data.seq_len % dims.seq_divisor(spec.parallel.layout):
                continue
            found.append(dims)
    found.sort(key=lambda d: (-d.world_size, -d.seq_group_size))
    return found


def resized(spec: JobSpec, dims: ParallelDims) -> JobSpec:
    """`spec` on another shape: the same job (steps, data, seed, checkpoints), other degrees."""
    data = spec.model_dump(mode="json")
    data["parallel"] = {
        **data["parallel"],
        "data_parallel": dims.data_parallel,
        "ring_size": dims.ring_size,
    }
    return type(spec).model_validate(data)


def elastic_problem(spec: JobSpec) -> tuple[str, object, str] | None:
    """Why `spec.elastic` cannot work, as (field, value, message); None when it can."""
    e = spec.elastic
    if not e.enabled:
        return None
    if spec.parallel.ring_size < 1:  # ring_size auto: judged once resolved
        return None
    world = ParallelDims.of(spec.parallel).world_size
    if e.min_world_size is not None and e.min_world_size > world:
        return (
            "elastic.min_world_size",
            e.min_world_size,
            f"elastic.min_world_size ({e.min_world_size}) is larger than the job's world "
            f"({world} ranks)",
        )
    if spec.stages:
        return (
            "elastic.enabled",
            True,
            "elastic jobs cannot have stages yet: each stage already picks its own shape",
        )
    return None


def never_shrinks(spec: JobSpec) -> tuple[str, object, str] | None:
    """An elastic job with no smaller shape than its own, as (field, value, message). Judged at
    submission (`service.elastic`), not by the spec itself: a job already resized to its smallest
    shape is a valid spec."""
    e = spec.elastic
    if not e.enabled or spec.parallel.ring_size < 1 or len(shapes(spec)) >= 2:
        return None
    return (
        "elastic.min_world_size" if e.min_world_size else "elastic.enabled",
        e.min_world_size or True,
        f"no smaller shape than {ParallelDims.of(spec.parallel).describe()} exists at or above "
        f"{e.min_world_size or 1} rank(s) (train.batch_size must divide by the smaller "
        "data_parallel and data.seq_len by the smaller ring's chunks): the job could never "
        "shrink; lower elastic.min_world_size or turn elastic off",
    )
