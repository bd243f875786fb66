"""`init_from`: start a job from another job's (or a directory's) checkpoint, on its own shape.

`state: weights` loads the model only (a fresh optimizer and schedule, step 1: a new run from
those weights, e.g. a context extension with another length and RoPE scaling); `state: full`
also loads the optimizer, the learning-rate schedule and the data position and continues the
step count (the source run, resumed into a new job with its own shape and data). Either way the
checkpoint's shards load onto the new job's parallel shape (DCP reshards).

At submission the control plane resolves `job` (one the caller may read) to its checkpoint
directory and `step` (default: the latest complete one) and checks the two models can share
weights (`architecture_problem`), so the stored spec names a directory and a step, and the
ranks never look a job up.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from workers.config.base import StrictModel
from workers.config.models import ModelConfig, ModelSection

# what must be equal for weights to carry over; RoPE (theta, scaling, max positions) may change
NATIVE_ARCHITECTURE = ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_mult", "vocab_size")


class InitFrom(StrictModel):
    job: str | None = Field(None, min_length=1, max_length=64, description="a job you may read")
    checkpoint: str | None = Field(
        None, min_length=1, max_length=4096, description="a checkpoint root (step-N dirs inside)"
    )
    step: int | None = Field(None, ge=1, description="default: the latest complete checkpoint")
    state: Literal["weights", "full"] = "weights"

    @model_validator(mode="after")
    def _one_source(self) -> InitFrom:
        if self.job is None and self.checkpoint is None:
            raise ValueError("init_from needs a job or a checkpoint directory")
        return self


def architecture_problem(source: ModelSection, target: ModelSection) -> str | None:
    """Why `target` cannot start from `source`'s weights, or None."""
    if source.kind != target.kind:
        return f"the source model is kind {source.kind}, this job's is {target.kind}"
    if isinstance(source, ModelConfig) and isinstance(target, ModelConfig):
        differ = [
            f"{name} {getattr(source, name)} -> {getattr(target, name)}"
            for name in NATIVE_ARCHITECTURE
            if getattr(source, name) != getattr(target, name)
        ]
        if source.tie_embeddings != target.tie_embeddings:
            differ.append(f"tie_embeddings {source.tie_embeddings} -> {target.tie_embeddings}")
        if differ:
            return "the models differ in " + ", ".join(differ)
        return None
    return _pretrained_problem(source, target)


def _pretrained_problem(source: Any, target: Any) -> str | None:
    """Pretrained models: the architecture fields of their config.json files must agree."""
    from workers.config.pretrained import read_config_json

    keys = (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "tie_word_embeddings",
    )
    try:
        a, b = read_config_json(source.path), read_config_json(target.path)
    except Exception as e:  # the source's directory may be gone: say so, do not guess
        return f"cannot compare the models' config.json files ({e})"
    differ = [f"{k} {a.get(k)} -> {b.get(k)}" for k in keys if a.get(k) != b.get(k)]
    return "the models differ in " + ", ".join(differ) if differ else None
