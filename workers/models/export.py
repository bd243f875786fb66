"""Export any ringtrain model as a Hugging Face directory that transformers reads back with the
same logits.

`save_pretrained` does what every kind shares (gather a sharded model, write beside the target,
rename); what the directory holds is the model kind's `export` hook (`workers.models.registry`).
The two here:
pretrained models are transformers models already: their own `save_pretrained` plus the source
tokenizer. The native decoder maps 1:1 onto `LlamaForCausalLM` (RMSNorm, rotate-half RoPE with the
same inverse frequencies, SwiGLU, GQA) and ships a byte-level tokenizer whose ids are UTF-8 bytes,
as in training. A sharded model (DTensor parameters, FSDP2) is gathered collectively; rank 0
writes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from workers.data.tokenizer import load_tokenizer, save_byte_tokenizer
from workers.models.hf import PretrainedLM
from workers.models.llama import Transformer

DEFAULT_MAX_POSITIONS = 131072  # native RoPE has no trained limit; this only caps inference engines

# native name (after "layers.N.") -> transformers LlamaForCausalLM name
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}


def _full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameters on CPU; collective when parameters are DTensors (every rank must
    call)."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        tensors = {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}
        if len(tensors) != len(full):
            raise TypeError(
                "model state has non-tensor entries, which export cannot write: "
                f"{sorted(full.keys() - tensors)}"
            )
        return tensors
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _native_to_llama(state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    out = {
        "model.embed_tokens.weight": state["tok_emb.weight"],
        "model.norm.weight": state["norm.weight"],
    }
    for key, value in state.items():
        if key.startswith("layers."):
            _, index, rest = key.split(".", 2)
            out[f"model.layers.{index}.{_LAYER_NAMES[rest]}"] = value
    out["lm_head.weight"] = state["tok_emb.weight"] if tied else state["head.weight"]
    return out


def llama_config_for(model: Transformer, max_position_embeddings: int) -> Any:
    """The `LlamaConfig` that computes exactly what the native decoder computes."""
    from transformers import LlamaConfig

    cfg = model.cfg
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=None,
        eos_token_id=0,  # NUL separates documents in byte-level corpora
        pad_token_id=None,
    )


def save_pretrained(
    model: nn.Module,
    out_dir: str | Path,
    *,
    max_position_embeddings: int | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `model` as a transformers directory (weights, config, tokenizer). Collective for
    sharded models.

    The directory appears complete or not at all (written beside it, then renamed; an older export
    is replaced). `max_position_embeddings` (native models) records the context the model was
    trained for. `state`: the whole model's weights already gathered on rank 0 (a pipeline's
    stages, `workers.training.pipeline.full_state`); `model` then only names the kind and config.
    """
    out = Path(out_dir)
    if state is None:
        state = _full_state_dict(model)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return out
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    # imported here: the registry imports this module's writers
    from workers.models.registry import kind_of

    kind_of(model).export(model, state, staging, max_position_embeddings or DEFAULT_MAX_POSITIONS)
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if (
        out.exists()
    ):  # out of sight before it is deleted: a crash mid-delete must not leave half an export
        os.replace(out, old)
    os.replace(staging, out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def write_pretrained(
    model: PretrainedLM,
    state: dict[str, torch.Tensor],
    out: Path,
    max_positions: int,
) -> None:
    """transformers' own `save_pretrained` with the trained weights, plus the source's tokenizer.
    (`max_positions` is unused: config.json already records the model's context.)"""
    hf_state = {k.removeprefix("hf."): v for k, v in state.items()}
    model.hf.save_pretrained(out, state_dict=hf_state)
    if model.source_dir is not None:
        load_tokenizer(model.source_dir).save_pretrained(out)


def write_native(
    model: Transformer,
    state: dict[str, torch.Tensor],
    out: Path,
    max_positions: int,
) -> None:
    """The native decoder as a `LlamaForCausalLM` (same math) with a byte-level tokenizer."""
    from transformers import LlamaForCausalLM

    config = llama_config_for(model, max_positions)
    with torch.device("meta"):
        llama = LlamaForCausalLM(config)
    llama_state = _native_to_llama(state, model.cfg.tie_embeddings)
    llama.load_state_dict(llama_state, assign=True, strict=True)
    llama.tie_weights()
    llama.save_pretrained(out)
    save_byte_tokenizer(out)
