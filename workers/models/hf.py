"""Pretrained Hugging Face causal LMs (llama, mistral, qwen2, qwen3) trained on the ring.

The model *is* transformers' own modeling code — every family detail (q/k/v biases, qwen3's q/k
norms, tied heads, each RoPE scaling variant) is exactly what `from_pretrained` users get, and
export is transformers' `save_pretrained`. Two things are swapped in from outside, without touching
its code:

- attention: `ring_attention` registered through `transformers.AttentionInterface` under
  `ATTN_NAME`, with a mask function that returns None (causality is the ring's job and depends on
  the layout; an HF mask would be O(seq²) and wrong for non-monotonic zigzag/striped positions);
- the sequence length RoPE sees: length-dependent RoPE (`dynamic`, `longrope`) scales by
  max(position_ids) + 1, which on a shard is that shard's last position. A forward pre-hook on the
  rotary module appends the *global* last position (max over the ring) and a forward hook drops it,
  so every rank scales exactly as transformers does on the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workers.attention.decode import pass_q_attention
from workers.config import HFModelConfig, JobSpec, pretrained_config
from workers.models.base import RingModel, SequenceParallel
from workers.models.norm import rms_norm

if (
    TYPE_CHECKING
):  # transformers is imported lazily at run time (heavy); only its types are needed here
    from transformers import PreTrainedModel

ATTN_NAME = "ringtrain_ring"
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass
class _RingState:
    """Shared by the wrapper and every attention module of one model (set per forward)."""

    sp: SequenceParallel | None = None
    seq_len: int = 0  # global sequence length of the current forward
    cu_seqlens: torch.Tensor | None = None  # packed documents of the current forward
    # decoding with a cache (`decode_step`): the cache slots this rank's keys count for
    decode_keep: torch.Tensor | None = None


def _ring_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: q/k/v [batch, heads, seq, head_dim] → [batch, seq, heads,
    head_dim]."""
    state: _RingState | None = getattr(module, "ringtrain_state", None)
    if state is None:
        raise RuntimeError(f"{ATTN_NAME} attention runs only inside a ringtrain PretrainedLM")
    if dropout:
        raise ValueError(
            "attention dropout is not supported by ring attention (set attention_dropout to 0)"
        )
    window = kwargs.get("sliding_window")
    if window is not None and window < state.seq_len:
        raise ValueError(
            f"sliding_window {window} < sequence length {state.seq_len}: "
            "ring attention is full causal"
        )
    if state.decode_keep is not None:  # new tokens against every rank's cache (pass-Q)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        group = state.sp.group if state.sp is not None else None
        return pass_q_attention(
            q, k, v, group=group, softmax_scale=scaling, keep=state.decode_keep
        ), None
    if state.sp is None and state.cu_seqlens is None:  # the whole sequence is local and in order
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2), None
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    sp = state.sp or SequenceParallel(None)
    return sp.attend(q, k, v, softmax_scale=scaling, cu_seqlens=state.cu_seqlens), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Mask function for ATTN_NAME: the ring applies the (layout-aware) causal mask itself."""
    return None


def register_ring_attention() -> None:
    """Make ATTN_NAME a valid `attn_implementation` in this process (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, _ring_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, _no_mask)


# transformers' RMSNorm classes whose forward is, op for op, `rms_norm`'s (checked against each
# family in tests/unit/workers/models/test_hf_models.py)
LEAN_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def _lean_norms(model: nn.Module) -> None:
    """Run each RMSNorm of the supported families through `rms_norm`: the same forward values, and
    a backward that keeps the input and its rsqrt instead of autograd's normalised copy (one
    activation per token and norm). Patched on the instance, so names, state dicts and export are
    unchanged."""
    for module in model.modules():
        if type(module).__name__ in LEAN_NORMS:
            # read the weight at each call: FSDP swaps the parameter (sharded, gathered) in and out
            def forward(x: torch.Tensor, _norm: Any = module) -> torch.Tensor:
                return rms_norm(x, _norm.weight, float(_norm.variance_epsilon))

            module.forward = forward


class PretrainedLM(RingModel):
    """A transformers causal LM behind ringtrain's model interface.

    `forward(tokens, positions) -> logits`: tokens [batch, seq_local], positions [seq_local] (the
    global (layout) positions of the rank's tokens), fp32 logits [batch, seq_local, vocab].
    """

    def __init__(self, hf_model: PreTrainedModel, source_dir: str | None = None) -> None:
        super().__init__()
        register_ring_attention()
        self.hf: PreTrainedModel = hf_model
        self.source_dir = source_dir  # where the tokenizer files come from at export
        self.hf.set_attn_implementation(ATTN_NAME)
        _lean_norms(self.hf)
        self.state = _RingState()
        for layer in self.layers:
            # torch types Module.__setattr__'s value as Tensor | Module;
            # any object is accepted at run time
            layer.get_submodule("self_attn").ringtrain_state = self.state  # type: ignore[assignment]
        rotary = self._decoder.get_submodule("rotary_emb")
        self._rope_last: int | None = None  # global last position, for length-dependent RoPE
        self._length_dependent_rope = (
            str(getattr(rotary, "rope_type", "default")) in LENGTH_DEPENDENT_ROPE
        )
        if self._length_dependent_rope:
            rotary.register_forward_pre_hook(self._append_global_last, with_kwargs=True)
            rotary.register_forward_hook(self._drop_global_last)

    @property
    def config(self) -> Any:
        return self.hf.config

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder blocks (what activation checkpointing and FSDP wrap one by one)."""
        layers = self._decoder.get_submodule("layers")
        if not isinstance(layers, nn.ModuleList):
            raise TypeError(
                f"{type(self.hf).__name__}.model.layers is a {type(layers).__name__}, "
                "not an nn.ModuleList"
            )
        return layers

    @property
    def _decoder(self) -> nn.Module:
        """The decoder without the LM head (`.model` in every supported family): embeddings,
        layers, final norm."""
        return self.hf.get_submodule("model")

    def set_sequence_parallel(self, sp: SequenceParallel | None) -> None:
        """Run attention on this ring from now on (None: plain local attention)."""
        self.state.sp = sp

    @property
    def sequence_parallel(self) -> SequenceParallel | None:
        return self.state.sp

    def _ring_world(self) -> int:
        return 1 if self.state.sp is None else self.state.sp.world

    def _global_last_position(self, positions: torch.Tensor) -> int:
        """max(position) over the whole sequence (ring × Ulysses): what transformers' RoPE sees
        unsharded."""
        last = (
            positions.max().detach().to(torch.int64).reshape(1)
        )  # on the tokens' device: the backend's
        sp = self.state.sp
        if sp is not None and sp.world > 1:
            dist.all_reduce(
                last, op=dist.ReduceOp.MAX, group=sp.group
            )  # None: the default group, as the ring
            if sp.ulysses_group is not None:
                dist.all_reduce(last, op=dist.ReduceOp.MAX, group=sp.ulysses_group)
        return int(last.item())

    def _append_global_last(
        self, module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict]:
        if self._rope_last is None:
            return args, kwargs
        pos = kwargs["position_ids"] if "position_ids" in kwargs else args[1]
        extra = torch.full((pos.shape[0], 1), self._rope_last, dtype=pos.dtype, device=pos.device)
        pos = torch.cat([pos, extra], dim=1)
        if "position_ids" in kwargs:
            return args, {**kwargs, "position_ids": pos}
        return (args[0], pos, *args[2:]), kwargs

    def _drop_global_last(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self._rope_last is None:
            return output
        cos, sin = output
        return cos[:, :-1], sin[:, :-1]

    def _inputs(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        cache: Any = None,
    ) -> dict[str, Any]:
        b, s = tokens.shape
        positions = positions.to(tokens.device)
        self.state.seq_len = s * self._ring_world()
        self.state.cu_seqlens = cu_seqlens
        self._rope_last = (
            self._global_last_position(positions) if self._length_dependent_rope else None
        )
        position_ids = positions if positions.dim() == 2 else positions.unsqueeze(0).expand(b, -1)
        if cache is None:
            return {"input_ids": tokens, "position_ids": position_ids, "use_cache": False}
        return {
            "input_ids": tokens,
            "position_ids": position_ids,
            "use_cache": True,
            "cache": cache,
        }

    def sequence_ends(self) -> tuple[nn.Module, nn.Module]:
        return self._decoder.get_submodule("embed_tokens"), self._decoder.get_submodule("norm")

    @property
    def output_weight(self) -> torch.Tensor:
        """The LM head [vocab, hidden] (none of the families has a head bias): `forward` =
        features @ weightᵀ."""
        return self.hf.get_output_embeddings().weight

    def features(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [batch, seq_local, hidden]: what a chunked loss projects chunk by
        chunk. `positions` may be per row ([batch, seq_local]) for packed documents, with their
        `cu_seqlens`."""
        return self._decoder(**self._inputs(tokens, positions, cu_seqlens)).last_hidden_state

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.hf(**self._inputs(tokens, positions, cu_seqlens)).logits.float()

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        """Logits of this rank's prompt shard (ring attention, as in training), its keys and values
        kept in `cache` (a transformers `DynamicCache`): the start of `decode_step`s."""
        self.state.decode_keep = None
        return self.hf(**self._inputs(tokens, positions, None, cache)).logits.float()

    @torch.no_grad()
    def decode_step(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: Any, keep: torch.Tensor
    ) -> torch.Tensor:
        """Logits of new tokens [batch, n] at global `positions` [n], attending every rank's cache
        (`workers.attention.decode`); `keep`: which of this rank's cache slots count, the new
        tokens' own slots included (appended to the cache before attention). Collective over
        the ring: every rank calls it with the same tokens and gets the same logits."""
        self.state.decode_keep = keep.to(tokens.device)
        try:
            return self.hf(**self._inputs(tokens, positions, None, cache)).logits.float()
        finally:
            self.state.decode_keep = None


def load_pretrained(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float | None = None,
    max_position_embeddings: int | None = None,
) -> PretrainedLM:
    """An unsharded PretrainedLM from a local model directory, with optional RoPE overrides
    (context extension)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a progress bar per load would flood every rank's log
    register_ring_attention()
    cfg = pretrained_config(
        str(path),
        rope_scaling=rope_scaling,
        rope_theta=rope_theta,
        max_position_embeddings=max_position_embeddings,
    )
    config = AutoConfig.for_model(**cfg)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path), config=config, dtype=dtype, attn_implementation=ATTN_NAME, local_files_only=True
    )
    return PretrainedLM(hf, source_dir=str(path))


def build_pretrained(cfg: HFModelConfig, spec: JobSpec) -> PretrainedLM:
    """The spec's pretrained model, unsharded, fp32, with its overrides. Memory knobs are applied
    from outside (`workers.training.parallelize`), as for every kind."""
    return load_pretrained(cfg.path, dtype=torch.float32, **cfg.overrides())


def construct_pretrained(cfg: HFModelConfig) -> PretrainedLM:
    """The architecture from config.json plus overrides, randomly initialised (weights: later)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    register_ring_attention()
    config = AutoConfig.for_model(**pretrained_config(cfg.path, **cfg.overrides()))
    hf = AutoModelForCausalLM.from_config(
        config,
        dtype=torch.float32,
        attn_implementation=ATTN_NAME,
    )
    return PretrainedLM(hf, source_dir=cfg.path)


def pretrained_tp_plan(model: PretrainedLM) -> dict[str, str]:
    """The family's per-block tensor-parallel plan: transformers' `base_model_tp_plan` (what it uses
    for `tp_plan="auto"`), block-relative."""
    config = model.config
    plan = {}
    for pattern, style in (getattr(config, "base_model_tp_plan", None) or {}).items():
        if not pattern.startswith("layers.*."):
            raise ValueError(
                f"{config.model_type}: tensor-parallel plan entry {pattern!r} is outside the "
                "decoder blocks; parallel.tensor_size supports per-block plans only"
            )
        plan[pattern.removeprefix("layers.*.")] = style
    if not plan:
        raise ValueError(
            f"{config.model_type} has no tensor-parallel plan in transformers; "
            "use parallel.tensor_size: 1"
        )
    return plan


def load_pretrained_shards(model: PretrainedLM, cfg: HFModelConfig, spec: JobSpec) -> None:
    """Fill a sharded (or plain) model's allocated parameters from the directory's safetensors.

    DCP's `HuggingFaceStorageReader` reads only the byte ranges of this rank's shards (dtype
    converted on the fly); a tied LM head is the input embedding, which checkpoints store once."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    reader = HuggingFaceStorageReader(cfg.path)
    on_disk = set(reader.read_metadata().state_dict_metadata)
    tied = bool(getattr(model.hf.config, "tie_word_embeddings", False))
    state: dict[str, Any] = {}
    for key, value in get_model_state_dict(model).items():
        name = key.removeprefix("hf.")
        if name in on_disk:
            state[name] = value
        elif not (tied and name == "lm_head.weight"):
            raise ValueError(f"{cfg.path}: no weights for {name!r} in the safetensors files")
    dcp_load(state, storage_reader=reader)
