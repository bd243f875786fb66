"""Rules across sections that the planner also asks directly: the sequence-length divisor, heads
per tensor or Ulysses rank, RoPE coverage."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.config.models import ModelSection
    from workers.config.spec import JobSpec


def rope_coverage_warning(spec: JobSpec) -> str | None:
    """A `plan` warning when training/eval contexts exceed what the pretrained model's RoPE settings
    cover."""
    covered = spec.model.rope_context()
    longest = max([spec.data.seq_len, *spec.eval_context_lengths()])
    if covered is None or longest <= covered:
        return None
    return (
        f"contexts up to {longest} tokens exceed the {covered} "
        "that the model's RoPE settings cover; "
        "set model.rope_scaling (e.g. {rope_type: yarn, factor: ...}) to extend the context"
    )


def tensor_heads_problem(model: ModelSection, tensor_size: int) -> str | None:
    """Why this model cannot be split over a tensor-parallel group of `tensor_size`, or None.

    Each tensor rank holds n_heads/T query heads, kv_heads/T K/V heads (never repeated: a K/V head
    lives on exactly one tensor rank) and ffn_hidden/T MLP columns."""
    t = tensor_size
    if t == 1:
        return None
    for field, size in (
        ("model.n_heads", model.n_heads),
        ("model.n_kv_heads", model.kv_heads),
        ("the MLP's hidden size", model.ffn_hidden),
    ):
        if size % t:
            return f"{field} ({size}) must be divisible by parallel.tensor_size ({t})"
    return None


def ulysses_heads_problem(
    model: ModelSection, ulysses_size: int, tensor_size: int = 1
) -> str | None:
    """Why a tensor rank's heads cannot be split over a Ulysses group (`workers.attention.ulysses`'
    GQA rule), or None. With tensor parallelism the Ulysses group splits each tensor rank's
    share."""
    t, u = tensor_size, ulysses_size
    h, kv = model.n_heads // t, model.kv_heads // t
    if u == 1:
        return None
    of = f" per tensor rank (tensor_size {t})" if t > 1 else ""
    if h % u:
        return f"model.n_heads ({h}{of}) must be divisible by parallel.ulysses_size ({u})"
    if kv % u and u % kv:
        return (
            f"model.n_kv_heads ({kv}{of}) and parallel.ulysses_size ({u}) must divide one another: "
            "each Ulysses rank holds kv_heads/ulysses_size K/V heads, or one repeated head when "
            "ulysses_size > kv_heads"
        )
    return None


def pipeline_problem(spec: JobSpec) -> tuple[str, object, str] | None:
    """The first reason this job cannot run its pipeline (`parallel.pipeline_size` > 1), as
    (field path, value, message), or None.

    Microbatches split each replica's rows evenly (a stage's buffers are sized once, from the
    first microbatch); every stage holds at least one layer; the split is even unless
    `parallel.pipeline_split` gives the layers per stage, or `auto` (the planner's balance by its
    memory estimate, resolved at submission). What the pipeline does not carry yet is refused by
    name rather than run wrong: tied embeddings (the head would live on two stages), pretrained
    models, and evals (they run the whole model on every rank). The per-job check runs: each
    stage's ranks check their own stage (`workers.training.verify.StagePlan`)."""
    p, t = spec.parallel, spec.train
    m = t.microbatches
    if p.pipeline_size == 1:
        if m > 1:
            return (
                "train.microbatches",
                m,
                f"train.microbatches ({m}) splits the batch for pipeline parallel: set "
                "parallel.pipeline_size > 1, or leave train.microbatches at 1",
            )
        if p.pipeline_split is not None:
            return (
                "parallel.pipeline_split",
                p.pipeline_split,
                "parallel.pipeline_split needs parallel.pipeline_size > 1",
            )
        return None
    size = p.pipeline_size
    if m < size:
        return (
            "train.microbatches",
            m,
            f"train.microbatches ({m}) must be >= parallel.pipeline_size ({size}): "
            "fewer microbatches than stages leave stages idle for the whole step",
        )
    if t.batch_size % (p.data_parallel * m):
        return (
            "train.microbatches",
            m,
            f"train.batch_size ({t.batch_size}) must split into parallel.data_parallel "
            f"({p.data_parallel}) x train.microbatches ({m}) equal microbatches",
        )
    rounds = max(1, m // size)
    if p.pipeline_schedule != "1f1b" and m % rounds:
        return (
            "train.microbatches",
            m,
            f"parallel.pipeline_schedule {p.pipeline_schedule} runs microbatches in rounds of "
            f"parallel.pipeline_size ({size}): train.microbatches ({m}) must be a multiple of "
            f"{rounds}",
        )
    if spec.model.kind != "native":
        return (
            "parallel.pipeline_size",
            size,
            "parallel.pipeline_size > 1 trains native models only (model.kind: native)",
        )
    stages = p.pipeline_stages
    n_layers: int = spec.model.n_layers
    if n_layers < stages:
        return (
            "parallel.pipeline_size",
            size,
            f"the model is too small for the pipeline: model.n_layers ({n_layers}) < {stages} "
            f"stages (parallel.pipeline_size {size} x {p.virtual_stages} per rank for "
            f"{p.pipeline_schedule}); every stage needs a layer",
        )
    if p.pipeline_split == "auto":
        pass  # the planner balances any n_layers >= stages (`service.planner.balanced_split`)
    elif p.pipeline_split is not None:
        split = p.pipeline_split
        if len(split) != stages:
            return (
                "parallel.pipeline_split",
                split,
                f"parallel.pipeline_split has {len(split)} entries; the pipeline has {stages} "
                f"stages (parallel.pipeline_size {size} x {p.virtual_stages} per rank)",
            )
        if sum(split) != n_layers:
            return (
                "parallel.pipeline_split",
                split,
                f"parallel.pipeline_split sums to {sum(split)}, not model.n_layers ({n_layers})",
            )
    elif n_layers % stages:
        return (
            "parallel.pipeline_split",
            None,
            f"model.n_layers ({n_layers}) is not divisible by the {stages} pipeline stages: "
            "give parallel.pipeline_split (layers per stage), or change parallel.pipeline_size",
        )
    refused: list[tuple[str, object, bool, str]] = [
        (
            "model.tie_embeddings",
            True,
            bool(getattr(spec.model, "tie_embeddings", False)),
            "set model.tie_embeddings: false (the head would live on two stages)",
        ),
        (
            "eval.enabled",
            True,
            spec.eval.enabled,
            "evals run the whole model on every rank: set eval.enabled: false",
        ),
    ]
    for path, value, bad, why in refused:
        if bad:
            return (path, value, f"with parallel.pipeline_size {size}: {why}")
    return None
