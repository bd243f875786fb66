"""The job spec: one pydantic model, used by the trainer, the driver, the service and the API.

Kept free of torch/ray imports so the control plane can validate specs without loading them.
Cross-field rules raise errors located at the offending field (e.g. ``data.seq_len``) so that
the API can answer 422 naming it.
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Annotated, Any, ClassVar, Literal, TypeAlias, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from workers.parallel_dims import ParallelDims

Layout = Literal["zigzag", "striped", "contiguous"]

MAX_SEQ_LEN = 1 << 24  # 16M tokens: far beyond any ring we can place, still a sane upper bound
MAX_WORLD = 4096
MAX_MLP_TILES = 4096  # train.tiled_mlp: a tile count beyond this is a typo


class StrictModel(BaseModel):
    """Unknown fields are errors; floats must be finite; counts must be real integers.

    pydantic's lax mode would read `steps: true` as 1 and `steps: "10"` as 10; for sizes and counts that is a
    typo to report, not to guess. (Floats stay lax: PyYAML reads `3e-4` as text, and that should still work.)
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)
    auto_fields: ClassVar[frozenset[str]] = frozenset()  # integer fields that also accept "auto"

    @model_validator(mode="before")
    @classmethod
    def _integers_are_integers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                value = data.get(name)
                if name in cls.auto_fields and value == "auto":
                    continue
                if field.annotation in (int, int | None) and isinstance(value, bool | str):
                    _fail(
                        name,
                        value,
                        f"{name} must be an integer, got {type(value).__name__} {value!r}",
                    )
        return data


class ModelConfig(StrictModel):
    """The built-in Llama-style decoder, trained from scratch (`model.kind: native`, the default)."""

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
            _fail(
                "d_model",
                self.d_model,
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})",
            )
        if self.n_heads % self.kv_heads:
            _fail(
                "n_kv_heads",
                self.n_kv_heads,
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})",
            )
        if self.head_dim % 2:
            _fail(
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


class CurriculumStage(StrictModel):
    """Train `steps` steps on contexts of `seq_len` tokens (a curriculum stage, before data.seq_len)."""

    steps: int = Field(..., ge=1, le=10_000_000)
    seq_len: int = Field(..., ge=64, le=MAX_SEQ_LEN)


class PasskeyData(StrictModel):
    """Synthetic retrieval: a random key hidden at `depth` in filler text, asked for at the end."""

    kind: Literal["passkey"] = "passkey"
    seq_len: int = Field(4096, ge=64, le=MAX_SEQ_LEN)
    depth: float | None = Field(
        None, ge=0.0, le=1.0, description="where the key sits; None = random per sample"
    )
    key_digits: int = Field(5, ge=1, le=20)
    answer_weight: float = Field(
        1.0, ge=0.0, le=1e4, description="extra loss weight on the answer tokens"
    )
    curriculum: list[CurriculumStage] = Field(
        default_factory=list,
        max_length=32,
        description="shorter contexts first: stages trained in order, then data.seq_len for the remaining steps",
    )


class TextData(StrictModel):
    """A local corpus (.txt, .jsonl, .parquet) packed into seq_len windows, byte-level tokens by default."""

    kind: Literal["text"] = "text"
    seq_len: int = Field(4096, ge=16, le=MAX_SEQ_LEN)
    path: str = Field(..., min_length=1, max_length=4096)
    text_field: str = Field(
        "text", min_length=1, max_length=256, description="field read from .jsonl/.parquet"
    )
    pack: Literal["windows", "documents"] = Field(
        "windows",
        description="windows: the corpus as one token stream cut into seq_len windows; documents: whole documents "
        "packed into each sequence, positions restarting per document, no attention across documents",
    )

    @field_validator("path", "text_field")
    @classmethod
    def _printable(cls, v: str) -> str:
        # a NUL or other control character is never part of a real file or field name, and os/pathlib
        # functions raise ValueError on NUL instead of answering
        if not v.isprintable():
            raise ValueError("must not contain control or other non-printable characters")
        return v


class TokensData(StrictModel):
    """A prepared dataset directory (`ringtrain data prepare`): token shards read through memory maps."""

    kind: Literal["tokens"] = "tokens"
    seq_len: int = Field(4096, ge=16, le=MAX_SEQ_LEN)
    path: str = Field(
        ..., min_length=1, max_length=4096, description="the directory `data prepare --out` wrote"
    )
    pack: Literal["documents", "windows"] = Field(
        "documents",
        description="documents: whole documents packed into each sequence, positions restarting per document, no "
        "attention across documents; windows: the documents as one stream cut into seq_len windows",
    )
    validation: float | str = Field(
        0.0,
        description="share of documents of `path` held out for val_loss at every eval (0 to 0.5; "
        "0: none), or a prepared dataset directory of held-out documents (same tokenizer)",
    )

    @field_validator("path")
    @classmethod
    def _printable(cls, v: str) -> str:
        if not v.isprintable():
            raise ValueError("must not contain control or other non-printable characters")
        return v

    @field_validator("validation", mode="before")
    @classmethod
    def _share_or_path(cls, v: object) -> object:
        if isinstance(v, bool):
            raise ValueError("must be a share of documents (0 to 0.5) or a dataset directory")
        if isinstance(v, str):
            text = v
            try:  # PyYAML reads 1e-2 as text: a number is a share, not a path
                v = float(text)
            except ValueError:
                if not text or len(text) > 4096 or not text.isprintable():
                    raise ValueError(
                        "a dataset directory: 1 to 4096 printable characters"
                    ) from None
                return text
        if isinstance(v, int | float) and not 0.0 <= v <= 0.5:
            raise ValueError("a share of documents must be between 0 and 0.5")
        return v


DataConfig = Annotated[PasskeyData | TextData | TokensData, Field(discriminator="kind")]


AUTO_RING = 0
"""`parallel.ring_size: auto` until it is resolved (`service.planner.fit`, at submission): the
smallest ring whose memory estimate fits the devices. A stored job never holds it."""


class ParallelConfig(StrictModel):
    ring_size: Annotated[
        int,
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "integer", "minimum": 1, "maximum": MAX_WORLD},
                    {"const": "auto"},
                ]
            }
        ),
    ] = Field(
        1,
        ge=AUTO_RING,
        le=MAX_WORLD,
        description="ranks of the ring, or auto: the smallest that fits the devices' memory "
        "(resolved at submission, with the memory knobs)",
    )
    data_parallel: int = Field(1, ge=1, le=MAX_WORLD)
    layout: Layout = "zigzag"
    ulysses_size: int = Field(
        1,
        ge=1,
        le=MAX_WORLD,
        description="Ulysses x ring: ranks of one node that trade sequence for heads by all-to-all "
        "around the ring",
    )
    tensor_size: int = Field(
        1,
        ge=1,
        le=MAX_WORLD,
        description="tensor parallel: ranks of one node that split every block's heads and MLP "
        "columns; each runs the ring over its own heads",
    )

    auto_fields: ClassVar[frozenset[str]] = frozenset({"ring_size"})

    @field_validator("ring_size", mode="before")
    @classmethod
    def _ring_auto(cls, v: Any) -> Any:
        """ "auto" is kept as AUTO_RING (an int, so every reader of a resolved spec stays typed)."""
        if v == "auto":
            return AUTO_RING
        if isinstance(v, int) and not isinstance(v, bool) and v == AUTO_RING:
            raise ValueError("ring_size must be >= 1 or auto")
        return v

    @field_serializer("ring_size")
    def _ring_dump(self, v: int) -> int | str:
        return "auto" if v == AUTO_RING else v

    @property
    def ring_auto(self) -> bool:
        return self.ring_size == AUTO_RING

    @property
    def world_size(self) -> int:
        return ParallelDims.of(self).world_size


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
    activation_checkpointing: Literal["none", "selective", "full"] = Field(
        "none",
        description="recompute in backward: none, selective (each MLP), full (each block); true = full",
    )
    tiled_mlp: Literal["off", "auto"] | int = Field(
        "off",
        description="run each MLP over N sequence tiles (auto: N from the local length); off = 1 tile",
    )
    offload_activations: bool = Field(
        False, description="CUDA: checkpointed block inputs in pinned host memory until backward"
    )

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _checkpointing_bool(cls, v: Any) -> Any:
        """Older specs said true/false: they mean full/none."""
        if isinstance(v, bool):
            return "full" if v else "none"
        return v

    @field_validator("tiled_mlp", mode="before")
    @classmethod
    def _tiles(cls, v: Any) -> Any:
        if isinstance(v, bool) or (isinstance(v, int) and not 1 <= v <= MAX_MLP_TILES):
            raise ValueError(
                f"tiled_mlp must be off, auto or a tile count in [1, {MAX_MLP_TILES}], got {v!r}"
            )
        return v


def mlp_tiles(tiled_mlp: str | int, local_tokens: int, d_model: int) -> int:
    """Sequence tiles per MLP call for `train.tiled_mlp` (1: untiled). `auto` keeps each tile at about d_model
    tokens, so a tile's intermediates (~4·ffn_hidden per token) stay near one layer's d_model² weights (ALST's
    rule); never more tiles than tokens."""
    if tiled_mlp == "off":
        return 1
    n = math.ceil(local_tokens / max(d_model, 1)) if tiled_mlp == "auto" else int(tiled_mlp)
    return max(1, min(n, local_tokens))


class CheckpointConfig(StrictModel):
    every_steps: int = Field(50, ge=0, le=10_000_000, description="0 disables periodic checkpoints")
    keep: int = Field(3, ge=1, le=1000)


class EvalConfig(StrictModel):
    """Needle-in-a-haystack grid: passkey accuracy per (context length, depth)."""

    every_steps: int = Field(0, ge=0, le=10_000_000, description="0 = only after the last step")
    context_lengths: list[int] | None = Field(
        None, max_length=32, description="default: [data.seq_len]"
    )
    depths: list[float] = Field(
        default_factory=lambda: [0.1, 0.5, 0.9], min_length=1, max_length=32
    )
    samples: int = Field(4, ge=1, le=1024, description="passkeys tried per grid cell")
    enabled: bool = True

    @field_validator("depths")
    @classmethod
    def _depths(cls, v: list[float]) -> list[float]:
        for d in v:
            if not 0.0 <= d <= 1.0:
                raise ValueError(f"every depth must lie in [0, 1], got {d}")
        return v


class VerifyConfig(StrictModel):
    """The check every job runs before step 1: its distributed forward/backward against a
    one-rank reference (`workers.training.verify`)."""

    enabled: bool = True
    tokens: int = Field(
        256,
        ge=16,
        le=8192,
        description="tokens in the random check sequence (at most data.seq_len, fit to the layout)",
    )


class ResourcesConfig(StrictModel):
    accelerator: Literal["auto", "cpu", "gpu"] = "auto"
    cpus_per_worker: float = Field(
        1.0, ge=1e-4, le=1024, description=">= 0.0001: Ray's resource granularity"
    )


PRETRAINED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")
SKIP_FILE_CHECKS = {
    "check_files": False
}  # validation context for specs re-read after submission (see HFModelConfig)


class RopeScaling(StrictModel):
    """A RoPE scaling override (transformers' `rope_parameters` keys) for extending a pretrained model's context."""

    rope_type: Literal["linear", "dynamic", "yarn", "llama3"]
    factor: float = Field(..., ge=1.0, le=1024.0)
    original_max_position_embeddings: int | None = Field(
        None, ge=16, le=MAX_SEQ_LEN, description="the pretraining context; default: config.json's"
    )
    low_freq_factor: float | None = Field(None, gt=0, le=1e4, description="llama3")
    high_freq_factor: float | None = Field(None, gt=0, le=1e4, description="llama3")
    beta_fast: float | None = Field(None, gt=0, le=1e4, description="yarn")
    beta_slow: float | None = Field(None, gt=0, le=1e4, description="yarn")
    attention_factor: float | None = Field(None, gt=0, le=1e4, description="yarn")
    mscale: float | None = Field(None, gt=0, le=1e4, description="yarn")
    mscale_all_dim: float | None = Field(None, ge=0, le=1e4, description="yarn")
    truncate: bool | None = Field(None, description="yarn")

    @model_validator(mode="after")
    def _type_fields(self) -> RopeScaling:
        if self.rope_type == "llama3":
            for name in ("low_freq_factor", "high_freq_factor"):
                if getattr(self, name) is None:
                    _fail(name, None, f"rope_type llama3 needs {name}")
            if self.high_freq_factor <= self.low_freq_factor:  # type: ignore[operator]
                _fail(
                    "high_freq_factor",
                    self.high_freq_factor,
                    "high_freq_factor must exceed low_freq_factor",
                )
        yarn_only = (
            "beta_fast",
            "beta_slow",
            "attention_factor",
            "mscale",
            "mscale_all_dim",
            "truncate",
        )
        for name in yarn_only if self.rope_type != "yarn" else ():
            if getattr(self, name) is not None:
                _fail(name, getattr(self, name), f"{name} applies to rope_type yarn only")
        return self


class HFModelConfig(StrictModel):
    """A pretrained Hugging Face causal LM from a local directory (`config.json`, `*.safetensors`, tokenizer).

    Validation reads `config.json` (only that) and refuses what ringtrain cannot train exactly. The
    architecture properties (`d_model`, `n_layers`, ...) mirror the native `ModelConfig`'s, read from
    `config.json`, so planners and reports need no second code path. Pass `context=SKIP_FILE_CHECKS` to
    re-read a spec that was validated at submission (the directory may live only on the cluster).
    """

    kind: Literal["hf"]
    path: str = Field(..., min_length=1, max_length=4096, description="local model directory")
    rope_scaling: RopeScaling | None = Field(
        None, description="overrides config.json's RoPE scaling"
    )
    rope_theta: float | None = Field(
        None, gt=1, le=1e12, description="overrides config.json's rope_theta"
    )
    max_position_embeddings: int | None = Field(
        None, ge=16, le=MAX_SEQ_LEN, description="overrides config.json's"
    )

    # transformers' modules (measured on CPU, in the same processes as the planner's runtime term)
    cpu_runtime_bytes: ClassVar[int] = 70 * 10**6
    norm_keeps_normalized: ClassVar[bool] = (
        False  # its RMSNorms run through `rms_norm` (models/hf.py)
    )

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: str) -> str:
        from pathlib import Path

        if not v.isprintable():
            raise ValueError("must not contain control or other non-printable characters")
        try:  # one meaning wherever the spec travels: resolved where it was submitted
            return str(Path(v).expanduser().resolve())
        except (OSError, RuntimeError, ValueError) as e:
            raise ValueError(f"cannot be resolved: {e}") from e

    @model_validator(mode="after")
    def _readable(self, info: Any) -> HFModelConfig:
        if (info.context or {}).get("check_files", True):
            try:
                check_pretrained_dir(self.path)
                arch = self.hf_config
            except ValueError as e:
                _fail("path", self.path, str(e))
            if arch.get("attention_dropout", 0.0):
                _fail(
                    "path", self.path, "attention_dropout must be 0 (ring attention has no dropout)"
                )
        return self

    @property
    def shape_known(self) -> bool:
        """Whether config.json was read (it is not under SKIP_FILE_CHECKS): the size properties need it."""
        return "hf_config" in self.__dict__

    @cached_property
    def hf_config(self) -> dict[str, Any]:
        """config.json with the spec's overrides applied, RoPE in transformers' `rope_parameters` form (read once)."""
        return pretrained_config(self.path, **self.overrides())

    def overrides(self) -> dict[str, Any]:
        """The spec's RoPE overrides as `pretrained_config` / `load_pretrained` keyword arguments."""
        return {
            "rope_scaling": self.rope_scaling.model_dump(exclude_none=True)
            if self.rope_scaling
            else None,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
        }

    @property
    def model_type(self) -> str:
        return str(self.hf_config["model_type"])

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def d_model(self) -> int:
        return int(self.hf_config["hidden_size"])

    @property
    def n_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def n_heads(self) -> int:
        return int(self.hf_config["num_attention_heads"])

    @property
    def kv_heads(self) -> int:
        c = self.hf_config
        return int(c.get("num_key_value_heads") or c["num_attention_heads"])

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])

    @property
    def ffn_hidden(self) -> int:
        return int(self.hf_config["intermediate_size"])

    @property
    def tie_embeddings(self) -> bool:
        return bool(self.hf_config.get("tie_word_embeddings", False))

    def spec_problems(self, spec: JobSpec) -> list[tuple[str, Any, str]]:
        """What the ring cannot compute exactly for this model in `spec`: a sliding window shorter
        than the contexts, heads a Ulysses group cannot split. Needs config.json (else: nothing)."""
        if not self.shape_known:
            return []
        problems: list[tuple[str, Any, str]] = []
        window = self.sliding_window()
        longest = max([spec.data.seq_len, *spec.eval_context_lengths()])
        if window is not None and window < longest:
            problems.append(
                (
                    "data.seq_len",
                    spec.data.seq_len,
                    f"the model's sliding_window ({window}) is shorter than the {longest}-token "
                    "contexts; ring attention computes full causal attention, so this model cannot "
                    "be trained exactly at this length",
                )
            )
        ulysses = getattr(spec.parallel, "ulysses_size", 1)
        if self.n_heads % ulysses:
            problems.append(
                (
                    "parallel.ulysses_size",
                    ulysses,
                    f"the model's num_attention_heads ({self.n_heads}) must be divisible by "
                    f"parallel.ulysses_size ({ulysses})",
                )
            )
        return problems

    def rope_context(self) -> int:
        """Tokens the RoPE settings cover: max_position_embeddings, or factor × the pretraining context."""
        c = self.hf_config
        rp = c["rope_parameters"]
        if rp.get("rope_type", "default") in ROPE_TYPES:
            original = int(
                rp.get("original_max_position_embeddings") or c["max_position_embeddings"]
            )
            return max(int(c["max_position_embeddings"]), int(rp["factor"] * original))
        return int(c["max_position_embeddings"])

    def sliding_window(self) -> int | None:
        """The sliding attention window some layers use, or None (ring attention is full causal attention)."""
        c = self.hf_config
        window = c.get("sliding_window")
        if not window:
            return None
        if c["model_type"] == "mistral":
            return int(window)
        layer_types = c.get("layer_types") or (
            ["sliding_attention"] * c["num_hidden_layers"]
            if c.get("use_sliding_window")
            and c.get("max_window_layers", 0) < c["num_hidden_layers"]
            else []
        )
        return int(window) if "sliding_attention" in layer_types else None


ModelSection: TypeAlias = ModelConfig | HFModelConfig
"""A job's `model` section: one config class per model kind, told apart by its `kind` literal."""

MODEL_CONFIGS: dict[str, type[ModelSection]] = {
    get_args(cls.model_fields["kind"].annotation)[0]: cls for cls in get_args(ModelSection)
}
"""model.kind -> its config class: the torch-free half of the model registry, which the control
plane validates specs with (`workers.models.registry` holds the rest and checks it against this).
A new kind adds its config class to `ModelSection`; every kind's class has `kind: Literal[name]`,
`spec_problems(spec)` and `rope_context()`, plus the size properties the planner reads."""


def read_config_json(path: str) -> dict[str, Any]:
    """A model directory's config.json as a dict; ValueError naming what is wrong (for `model.path`)."""
    import json
    from pathlib import Path

    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ValueError(f"{path} has no config.json") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} cannot be read as JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{file} is not a JSON object")
    model_type = raw.get("model_type")
    if model_type not in PRETRAINED_FAMILIES:
        raise ValueError(
            f"model_type {model_type!r} in {file} is not supported; "
            f"supported families: {', '.join(PRETRAINED_FAMILIES)}"
        )
    for key in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
    ):
        if not isinstance(raw.get(key), int) or isinstance(raw.get(key), bool) or raw[key] < 1:
            raise ValueError(f"{file}: {key} must be a positive integer, got {raw.get(key)!r}")
    heads, kv = (
        raw["num_attention_heads"],
        raw.get("num_key_value_heads") or raw["num_attention_heads"],
    )
    if not isinstance(kv, int) or heads % kv:
        raise ValueError(
            f"{file}: num_attention_heads ({heads}) must be divisible by num_key_value_heads ({kv})"
        )
    rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rp.get("rope_type", rp.get("type", "default")) if isinstance(rp, dict) else None
    if rope_type not in ("default", *ROPE_TYPES):
        raise ValueError(
            f"{file}: RoPE type {rope_type!r} is not supported (default, {', '.join(ROPE_TYPES)})"
        )
    return raw


def check_pretrained_dir(path: str) -> None:
    """The directory exists and holds weights and tokenizer files (their contents are read at training time)."""
    from pathlib import Path

    d = Path(path)
    try:
        names = {p.name for p in d.iterdir()} if d.is_dir() else None
    except OSError as e:  # a name too long, no permission, ...: a bad path, not a server error
        raise ValueError(
            f"model directory {path[:200]} cannot be read: {e.strerror or e}"
        ) from None
    if names is None:
        raise ValueError(f"model directory {path} does not exist")
    if not any(
        n.endswith((".safetensors", ".bin")) or n.endswith(".safetensors.index.json") for n in names
    ):
        raise ValueError(f"{path} holds no weights (*.safetensors or *.bin)")
    if not names & {"tokenizer.json", "tokenizer.model", "vocab.json"}:
        raise ValueError(
            f"{path} holds no tokenizer (tokenizer.json, tokenizer.model or vocab.json)"
        )


def pretrained_config(
    path: str,
    *,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float | None = None,
    max_position_embeddings: int | None = None,
) -> dict[str, Any]:
    """config.json with RoPE overrides applied, RoPE in one `rope_parameters` dict (transformers ≥ 5's form).

    A scaling override that needs the pretraining context (yarn, llama3) gets config.json's
    `max_position_embeddings` unless it names `original_max_position_embeddings` itself.
    """
    raw = read_config_json(path)
    out = {k: v for k, v in raw.items() if k not in ("rope_scaling", "rope_theta")}
    rp = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rp["rope_type"] = rp.pop("type", rp.get("rope_type", "default"))
    rp.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    pretrained_context = raw.get("max_position_embeddings", 2048)
    if rope_scaling is not None:
        rp = {"rope_theta": rp["rope_theta"], **rope_scaling}
    if rope_theta is not None:
        rp["rope_theta"] = rope_theta
    if rp["rope_type"] in ("yarn", "llama3"):
        rp.setdefault("original_max_position_embeddings", pretrained_context)
    out["rope_parameters"] = rp
    out["max_position_embeddings"] = max_position_embeddings or pretrained_context
    return out


def rope_coverage_warning(spec: JobSpec) -> str | None:
    """A `plan` warning when training/eval contexts exceed what the pretrained model's RoPE settings cover."""
    covered = spec.model.rope_context()
    longest = max([spec.data.seq_len, *spec.eval_context_lengths()])
    if covered is None or longest <= covered:
        return None
    return (
        f"contexts up to {longest} tokens exceed the {covered} that the model's RoPE settings cover; "
        "set model.rope_scaling (e.g. {rope_type: yarn, factor: ...}) to extend the context"
    )


class JobSpec(StrictModel):
    name: str = Field(..., min_length=1, max_length=128)
    model: ModelSection = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=PasskeyData)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    verify: VerifyConfig = Field(default_factory=VerifyConfig)
    max_restarts: int = Field(2, ge=0, le=100)
    priority: int = Field(
        0, ge=-1000, le=1000, description="higher starts first when jobs wait for capacity"
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        # isprintable() also refuses DEL, C1 controls (e.g. a terminal's CSI), bidi overrides and lone
        # surrogates, which `ord(c) < 32` let through into terminals, logs and the dashboard
        if not v.strip() or not v.isprintable():
            raise ValueError("name must be printable (no control characters) and not blank")
        return v

    @field_validator("model", mode="wrap")
    @classmethod
    def _model_kind(cls, v: Any, handler: Any, info: Any) -> ModelSection:
        """`kind` picks the class (native when absent) so errors stay at `model.<field>`, with no union tag."""
        if isinstance(v, dict):
            kind = v.get("kind", "native")
            model_cls = MODEL_CONFIGS.get(kind) if isinstance(kind, str) else None
            if model_cls is not None:
                return model_cls.model_validate(v, context=info.context)
            known = " or ".join(repr(k) for k in MODEL_CONFIGS)
            _fail("kind", kind, f"model.kind must be {known}, got {kind!r}")
        if isinstance(v, ModelSection):
            return v
        raise PydanticCustomError(
            "dict_type", "Input should be a valid dictionary (the model section)"
        )

    @model_validator(mode="after")
    def _model_fits(self) -> JobSpec:
        """Each model kind's own rules about the rest of the job (a pretrained sliding window)."""
        for path, value, message in self.model.spec_problems(self):
            _fail(path, value, message)
        return self

    @model_validator(mode="after")
    def _cross_fields(self) -> JobSpec:
        p = self.parallel
        # ring_size auto: checked as ring 1 here (what every ring needs), in full once resolved
        ring = max(p.ring_size, 1)
        need = seq_multiple(p.layout, ring, p.ulysses_size, p.tensor_size)
        if self.data.seq_len % need:
            _fail(
                "data.seq_len",
                self.data.seq_len,
                f"data.seq_len ({self.data.seq_len}) must be divisible by {need} for the {p.layout} layout "
                f"with parallel.ring_size={ring}"
                + (f" and parallel.ulysses_size={p.ulysses_size}" if p.ulysses_size > 1 else "")
                + (f" and parallel.tensor_size={p.tensor_size}" if p.tensor_size > 1 else ""),
            )
        if self.model.shape_known and (why := tensor_heads_problem(self.model, p.tensor_size)):
            _fail("parallel.tensor_size", p.tensor_size, why)
        if self.model.shape_known and (
            why := ulysses_heads_problem(self.model, p.ulysses_size, p.tensor_size)
        ):
            _fail("parallel.ulysses_size", p.ulysses_size, why)
        if self.train.batch_size % p.data_parallel:
            _fail(
                "train.batch_size",
                self.train.batch_size,
                f"train.batch_size ({self.train.batch_size}) is the global batch and must be divisible by "
                f"parallel.data_parallel ({p.data_parallel})",
            )
        if p.data_parallel * ring * p.ulysses_size * p.tensor_size > MAX_WORLD:
            _fail(
                "parallel.ring_size",
                p.ring_size,
                f"ring_size x data_parallel x ulysses_size x tensor_size must be <= {MAX_WORLD}",
            )
        if self.train.offload_activations and self.resources.accelerator == "cpu":
            _fail(
                "train.offload_activations",
                True,
                "train.offload_activations moves activations from GPU to host memory: it needs "
                "resources.accelerator gpu or auto, not cpu",
            )
        if self.train.offload_activations and self.train.activation_checkpointing != "full":
            _fail(
                "train.offload_activations",
                True,
                "train.offload_activations offloads the inputs that full checkpointing keeps: it needs "
                "train.activation_checkpointing: full",
            )
        if self.train.warmup_steps > self.train.steps:
            _fail(
                "train.warmup_steps",
                self.train.warmup_steps,
                "train.warmup_steps must be <= train.steps",
            )
        for i, length in enumerate(self.eval.context_lengths or []):
            if length < 64 or length > MAX_SEQ_LEN or length % need:
                _fail(
                    f"eval.context_lengths.{i}",
                    length,
                    f"eval context length {length} must be in [64, {MAX_SEQ_LEN}] and divisible by {need}",
                )
        if self.data.kind == "passkey" and self.data.seq_len < 16 * self.data.key_digits:
            _fail("data.seq_len", self.data.seq_len, "data.seq_len is too short to hide a passkey")
        if self.data.kind == "passkey":
            for i, stage in enumerate(self.data.curriculum):
                if (
                    stage.seq_len > self.data.seq_len
                    or stage.seq_len % need
                    or stage.seq_len < 16 * self.data.key_digits
                ):
                    _fail(
                        f"data.curriculum.{i}.seq_len",
                        stage.seq_len,
                        f"curriculum seq_len {stage.seq_len} must be <= data.seq_len "
                        f"({self.data.seq_len}), >= 16 x key_digits and divisible by {need}",
                    )
        return self

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    def eval_context_lengths(self) -> list[int]:
        return list(self.eval.context_lengths or [self.data.seq_len])


def seq_multiple(layout: str, ring_size: int, ulysses_size: int = 1, tensor_size: int = 1) -> int:
    """The global sequence length must be a multiple of this (`ParallelDims.seq_divisor`)."""
    dims = ParallelDims(ring_size=ring_size, ulysses_size=ulysses_size, tensor_size=tensor_size)
    return dims.seq_divisor(layout)


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
    GQA rule), or None. With tensor parallelism the Ulysses group splits each tensor rank's share."""
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


def _fail(path: str, value: Any, message: str) -> None:
    loc = tuple(int(p) if p.isdigit() else p for p in path.split("."))
    err = PydanticCustomError("spec_rule", message)
    raise ValidationError.from_exception_data(
        "JobSpec", [InitErrorDetails(type=err, loc=loc, input=value)]
    )


def load_spec(text: str) -> JobSpec:
    """Parse a YAML or JSON job spec (YAML is a superset of JSON). Aliases are refused: no YAML bombs."""
    import yaml

    class _NoAliasLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                raise yaml.YAMLError("YAML aliases/anchors are not allowed in job specs")
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, str) and key in seen:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {key!r}: each field may appear once",
                        key_node.start_mark,
                    )
                seen.add(key)
            return super().construct_mapping(node, deep)

    data = yaml.load(text, Loader=_NoAliasLoader)
    if not isinstance(data, dict):
        raise ValueError("a job spec must be a mapping (YAML or JSON object)")
    return JobSpec.model_validate(data)


__all__ = [
    "MAX_SEQ_LEN",
    "MODEL_CONFIGS",
    "SKIP_FILE_CHECKS",
    "CheckpointConfig",
    "CurriculumStage",
    "DataConfig",
    "EvalConfig",
    "HFModelConfig",
    "JobSpec",
    "Layout",
    "ModelConfig",
    "ModelSection",
    "ParallelConfig",
    "PasskeyData",
    "ResourcesConfig",
    "RopeScaling",
    "TextData",
    "TokensData",
    "TrainConfig",
    "VerifyConfig",
    "load_spec",
    "pretrained_config",
    "rope_coverage_warning",
    "seq_multiple",
]
