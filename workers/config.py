"""The job spec: one pydantic model, used by the trainer, the driver, the service and the API.

Kept free of torch/ray imports so the control plane can validate specs without loading them.
Cross-field rules raise errors located at the offending field (e.g. ``data.seq_len``) so that
the API can answer 422 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

Layout = Literal["zigzag", "striped", "contiguous"]

MAX_SEQ_LEN = 1 << 24  # 16M tokens: far beyond any ring we can place, still a sane upper bound
MAX_WORLD = 4096


class StrictModel(BaseModel):
    """Unknown fields are errors; floats must be finite; counts must be real integers.

    pydantic's lax mode would read `steps: true` as 1 and `steps: "10"` as 10; for sizes and counts that is a
    typo to report, not to guess. (Floats stay lax: PyYAML reads `3e-4` as text, and that should still work.)
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _integers_are_integers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                value = data.get(name)
                if field.annotation in (int, int | None) and isinstance(value, bool | str):
                    _fail(name, value, f"{name} must be an integer, got {type(value).__name__} {value!r}")
        return data


class ModelConfig(StrictModel):
    vocab_size: int = Field(256, ge=2, le=1 << 20, description="256 = byte-level tokenizer")
    d_model: int = Field(256, ge=8, le=65536)
    n_layers: int = Field(4, ge=1, le=512)
    n_heads: int = Field(8, ge=1, le=1024)
    n_kv_heads: int | None = Field(None, ge=1, le=1024, description="GQA: defaults to n_heads")
    ffn_mult: float = Field(4.0, gt=0, le=64, description="SwiGLU hidden = 2/3 · ffn_mult · d_model")
    rope_theta: float = Field(10000.0, gt=1, le=1e9)
    norm_eps: float = Field(1e-5, gt=0, le=1e-1)
    tie_embeddings: bool = True

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
            _fail("d_model", self.d_model, f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.kv_heads:
            _fail(
                "n_kv_heads",
                self.n_kv_heads,
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})",
            )
        if self.head_dim % 2:
            _fail("d_model", self.d_model, f"head_dim = d_model / n_heads = {self.head_dim} must be even for RoPE")
        return self


class PasskeyData(StrictModel):
    """Synthetic retrieval: a random key hidden at `depth` in filler text, asked for at the end."""

    kind: Literal["passkey"] = "passkey"
    seq_len: int = Field(4096, ge=64, le=MAX_SEQ_LEN)
    depth: float | None = Field(None, ge=0.0, le=1.0, description="where the key sits; None = random per sample")
    key_digits: int = Field(5, ge=1, le=20)
    answer_weight: float = Field(1.0, ge=0.0, le=1e4, description="extra loss weight on the answer tokens")


class TextData(StrictModel):
    """A local corpus (.txt, .jsonl, .parquet) packed into seq_len windows, byte-level tokens by default."""

    kind: Literal["text"] = "text"
    seq_len: int = Field(4096, ge=16, le=MAX_SEQ_LEN)
    path: str = Field(..., min_length=1, max_length=4096)
    text_field: str = Field("text", min_length=1, max_length=256, description="field read from .jsonl/.parquet")

    @field_validator("path", "text_field")
    @classmethod
    def _printable(cls, v: str) -> str:
        # a NUL or other control character is never part of a real file or field name, and os/pathlib
        # functions raise ValueError on NUL instead of answering
        if not v.isprintable():
            raise ValueError("must not contain control or other non-printable characters")
        return v


DataConfig = Annotated[PasskeyData | TextData, Field(discriminator="kind")]


class ParallelConfig(StrictModel):
    ring_size: int = Field(1, ge=1, le=MAX_WORLD)
    data_parallel: int = Field(1, ge=1, le=MAX_WORLD)
    layout: Layout = "zigzag"

    @property
    def world_size(self) -> int:
        return self.ring_size * self.data_parallel


class TrainConfig(StrictModel):
    steps: int = Field(100, ge=1, le=10_000_000)
    batch_size: int = Field(1, ge=1, le=65536, description="global sequences per step")
    lr: float = Field(3e-4, gt=0, le=10)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(0, ge=0, le=10_000_000)
    weight_decay: float = Field(0.1, ge=0, le=10)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, le=1e6, description="0 disables clipping")
    seed: int = Field(0, ge=0, le=2**63 - 1)
    activation_checkpointing: bool = False


class CheckpointConfig(StrictModel):
    every_steps: int = Field(50, ge=0, le=10_000_000, description="0 disables periodic checkpoints")
    keep: int = Field(3, ge=1, le=1000)


class EvalConfig(StrictModel):
    """Needle-in-a-haystack grid: passkey accuracy per (context length, depth)."""

    every_steps: int = Field(0, ge=0, le=10_000_000, description="0 = only after the last step")
    context_lengths: list[int] | None = Field(None, max_length=32, description="default: [data.seq_len]")
    depths: list[float] = Field(default_factory=lambda: [0.1, 0.5, 0.9], min_length=1, max_length=32)
    samples: int = Field(4, ge=1, le=1024, description="passkeys tried per grid cell")
    enabled: bool = True

    @field_validator("depths")
    @classmethod
    def _depths(cls, v: list[float]) -> list[float]:
        for d in v:
            if not 0.0 <= d <= 1.0:
                raise ValueError(f"every depth must lie in [0, 1], got {d}")
        return v


class ResourcesConfig(StrictModel):
    accelerator: Literal["auto", "cpu", "gpu"] = "auto"
    cpus_per_worker: float = Field(1.0, ge=1e-4, le=1024, description="≥ 0.0001: Ray's resource granularity")


class JobSpec(StrictModel):
    name: str = Field(..., min_length=1, max_length=128)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=PasskeyData)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    max_restarts: int = Field(2, ge=0, le=100)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        # isprintable() also refuses DEL, C1 controls (e.g. a terminal's CSI), bidi overrides and lone
        # surrogates, which `ord(c) < 32` let through into terminals, logs and the dashboard
        if not v.strip() or not v.isprintable():
            raise ValueError("name must be printable (no control characters) and not blank")
        return v

    @model_validator(mode="after")
    def _cross_fields(self) -> JobSpec:
        p = self.parallel
        need = seq_multiple(p.layout, p.ring_size)
        if self.data.seq_len % need:
            _fail(
                "data.seq_len",
                self.data.seq_len,
                f"data.seq_len ({self.data.seq_len}) must be divisible by {need} for the {p.layout} layout "
                f"with parallel.ring_size={p.ring_size}",
            )
        if self.train.batch_size % p.data_parallel:
            _fail(
                "train.batch_size",
                self.train.batch_size,
                f"train.batch_size ({self.train.batch_size}) is the global batch and must be divisible by "
                f"parallel.data_parallel ({p.data_parallel})",
            )
        if p.world_size > MAX_WORLD:
            _fail("parallel.ring_size", p.ring_size, f"ring_size × data_parallel must be ≤ {MAX_WORLD}")
        if self.train.warmup_steps > self.train.steps:
            _fail("train.warmup_steps", self.train.warmup_steps, "train.warmup_steps must be ≤ train.steps")
        if self.model.vocab_size < 256 and self.data.kind in ("passkey", "text"):
            _fail("model.vocab_size", self.model.vocab_size, "the byte-level tokenizer needs model.vocab_size ≥ 256")
        for i, length in enumerate(self.eval.context_lengths or []):
            if length < 64 or length > MAX_SEQ_LEN or length % need:
                _fail(
                    f"eval.context_lengths.{i}",
                    length,
                    f"eval context length {length} must be in [64, {MAX_SEQ_LEN}] and divisible by {need}",
                )
        if self.data.kind == "passkey" and self.data.seq_len < 16 * self.data.key_digits:
            _fail("data.seq_len", self.data.seq_len, "data.seq_len is too short to hide a passkey")
        return self

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    def eval_context_lengths(self) -> list[int]:
        return list(self.eval.context_lengths or [self.data.seq_len])


def seq_multiple(layout: str, ring_size: int) -> int:
    """The global sequence length must be a multiple of this for `layout` on a ring of `ring_size`."""
    return 2 * ring_size if layout == "zigzag" else ring_size


def _fail(path: str, value: Any, message: str) -> None:
    loc = tuple(int(p) if p.isdigit() else p for p in path.split("."))
    err = PydanticCustomError("spec_rule", message)
    raise ValidationError.from_exception_data("JobSpec", [InitErrorDetails(type=err, loc=loc, input=value)])


def load_spec(text: str) -> JobSpec:
    """Parse a YAML or JSON job spec (YAML is a superset of JSON). Aliases are refused: no YAML bombs."""
    import yaml

    class _NoAliasLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
            if self.check_event(yaml.AliasEvent):
                raise yaml.YAMLError("YAML aliases/anchors are not allowed in job specs")
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):  # type: ignore[no-untyped-def]
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, str) and key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}: each field may appear once", key_node.start_mark
                    )
                seen.add(key)
            return super().construct_mapping(node, deep)

    data = yaml.load(text, Loader=_NoAliasLoader)
    if not isinstance(data, dict):
        raise ValueError("a job spec must be a mapping (YAML or JSON object)")
    return JobSpec.model_validate(data)


__all__ = [
    "MAX_SEQ_LEN",
    "CheckpointConfig",
    "DataConfig",
    "EvalConfig",
    "JobSpec",
    "Layout",
    "ModelConfig",
    "ParallelConfig",
    "PasskeyData",
    "ResourcesConfig",
    "TextData",
    "TrainConfig",
    "load_spec",
    "seq_multiple",
]
