"""`model.kind: hf`: a pretrained Hugging Face model's section and the config.json it is checked
against (families, RoPE types)."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from workers.config.base import MAX_SEQ_LEN, StrictModel, fail

if TYPE_CHECKING:
    from workers.config.spec import JobSpec


PRETRAINED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")
SKIP_FILE_CHECKS = {
    "check_files": False
}  # validation context for specs re-read after submission (see HFModelConfig)


class RopeScaling(StrictModel):
    """A RoPE scaling override (transformers' `rope_parameters` keys) for extending a pretrained
    model's context."""

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
                    fail(name, None, f"rope_type llama3 needs {name}")
            if self.high_freq_factor <= self.low_freq_factor:  # type: ignore[operator]
                fail(
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
                fail(name, getattr(self, name), f"{name} applies to rope_type yarn only")
        return self


class HFModelConfig(StrictModel):
    """A pretrained Hugging Face causal LM from a local directory (`config.json`, `*.safetensors`,
    tokenizer).

    Validation reads `config.json` (only that) and refuses what ringtrain cannot train exactly. The
    architecture properties (`d_model`, `n_layers`, ...) mirror the native `ModelConfig`'s, read
    from `config.json`, so planners and reports need no second code path. Pass
    `context=SKIP_FILE_CHECKS` to re-read a spec that was validated at submission (the directory may
    live only on the cluster).
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
                fail("path", self.path, str(e))
            if arch.get("attention_dropout", 0.0):
                fail(
                    "path", self.path, "attention_dropout must be 0 (ring attention has no dropout)"
                )
        return self

    @property
    def shape_known(self) -> bool:
        """Whether config.json was read (it is not under SKIP_FILE_CHECKS): the size properties need
        it."""
        return "hf_config" in self.__dict__

    @cached_property
    def hf_config(self) -> dict[str, Any]:
        """config.json with the spec's overrides applied, RoPE in transformers' `rope_parameters`
        form (read once)."""
        return pretrained_config(self.path, **self.overrides())

    def overrides(self) -> dict[str, Any]:
        """The spec's RoPE overrides as `pretrained_config` / `load_pretrained` keyword
        arguments."""
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
        """Tokens the RoPE settings cover: max_position_embeddings, or factor × the pretraining
        context."""
        c = self.hf_config
        rp = c["rope_parameters"]
        if rp.get("rope_type", "default") in ROPE_TYPES:
            original = int(
                rp.get("original_max_position_embeddings") or c["max_position_embeddings"]
            )
            return max(int(c["max_position_embeddings"]), int(rp["factor"] * original))
        return int(c["max_position_embeddings"])

    def sliding_window(self) -> int | None:
        """The sliding attention window some layers use, or None (ring attention is full causal
        attention)."""
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


def read_config_json(path: str) -> dict[str, Any]:
    """A model directory's config.json as a dict; ValueError naming what is wrong (for
    `model.path`)."""
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
    """The directory exists and holds weights and tokenizer files (their contents are read at
    training time)."""
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
    """config.json with RoPE overrides applied, RoPE in one `rope_parameters` dict
    (transformers ≥ 5's form).

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
