"""The `model` section: the native decoder's config and the kind table (`MODEL_CONFIGS`) that
picks a config class by `model.kind`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeAlias, get_args

from pydantic import Field, model_validator

from workers.config.base import StrictModel, fail
from workers.config.pretrained import HFModelConfig

if TYPE_CHECKING:
    from workers.config.spec import JobSpec


class ModelConfig(StrictModel):
    """The built-in Llama-style decoder, trained from scratch (`model.kind: native`, the
    default)."""

    kind: Literal["native"] = "native"
    vocab_size: int = Field(256, ge=2, le=1 << 20, description="256 = byte-level tokenizer")
    d_model: int = Field(256, ge=8, le=65536)
    n_layers: int = Field(4, ge=1, le=512)
    n_heads: int = Field(8, ge=1, le=1024)
    n_kv_heads: int | None = Field(None, ge=1, le=1024, description="GQA: defaults to n_heads")
    ffn_mult: float = Field(
        4.0, gt=0, le=64, description="SwiGLU hidden = 2/3 · ffn_mult · d_model"
    )
    rope_theta: float = Field(10000.0, gt=1, le=1e9)
    norm_eps: float = Field(1e-5, gt=0, le=1e-1)
    tie_embeddings: bool = True

    shape_known: ClassVar[bool] = True  # the native model's sizes are the spec's own fields
    # what a rank's process holds for this kind beyond ringtrain's own runtime, on CPU (the planner)
    cpu_runtime_bytes: ClassVar[int] = 0
    # whether each RMSNorm keeps its normalised input for backward (the planner): the native norm
    # keeps x and its rsqrt only (`workers.models.llama._RMSNorm`)
    norm_keeps_normalized: ClassVar[bool] = False

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * self.ffn_mult * self.d_model / 3)
        return max(8, (hidden + 7) // 8 * 8)

    @model_validator(mode="after")
    def _heads(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            fail(
                "d_model",
                self.d_model,
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})",
            )
        if self.n_heads % self.kv_heads:
            fail(
                "n_kv_heads",
                self.n_kv_heads,
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})",
            )
        if self.head_dim % 2:
            fail(
                "d_model",
                self.d_model,
                f"head_dim = d_model / n_heads = {self.head_dim} must be even for RoPE",
            )
        return self

    def spec_problems(self, spec: JobSpec) -> list[tuple[str, Any, str]]:
        """What this kind refuses in the rest of `spec`, as (field path, value, message)."""
        if self.vocab_size < 256 and spec.data.kind in ("passkey", "text"):
            why = "the byte-level tokenizer needs model.vocab_size >= 256"
            return [("model.vocab_size", self.vocab_size, why)]
        return []

    def rope_context(self) -> int | None:
        """None: the native decoder's RoPE was never trained on a limited context (no warning)."""
        return None


ModelSection: TypeAlias = ModelConfig | HFModelConfig
"""A job's `model` section: one config class per model kind, told apart by its `kind` literal."""

MODEL_CONFIGS: dict[str, type[ModelSection]] = {
    get_args(cls.model_fields["kind"].annotation)[0]: cls for cls in get_args(ModelSection)
}
"""model.kind -> its config class: the torch-free half of the model registry, which the control
plane validates specs with (`workers.models.registry` holds the rest and checks it against this).
A new kind adds its config class to `ModelSection`; every kind's class has `kind: Literal[name]`,
`spec_problems(spec)` and `rope_context()`, plus the size properties the planner reads."""
