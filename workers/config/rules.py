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
