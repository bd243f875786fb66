"""Llama-style decoder whose attention is exact ring attention over a sequence-parallel group.

Everything except attention is pointwise in the sequence, so it runs unchanged on a rank's shard;
only RoPE needs to know where the shard's tokens sit in the global sequence (`positions`). Which
ring (process group, layout) the model runs on is set from outside with `set_sequence_parallel`,
so the same module trains single-process or on any ring without rebuilding it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from workers import attention
from workers.config import JobSpec, ModelConfig
from workers.models.base import RingModel, SequenceParallel
from workers.models.norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [seq, head_dim/2] (or [batch, seq, head_dim/2] for per-row positions, as packed
    documents have), fp32, for the given *global* position ids."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    )
    angles = positions.to(torch.float32)[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [batch, seq, heads, head_dim]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = (
        (cos[None, :, None, :], sin[None, :, None, :])
        if cos.dim() == 2
        else (cos[:, :, None], sin[:, :, None])
    )
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).to(x.dtype)


class Attention(nn.Module):
    """GQA: K/V keep their own (smaller) head count all the way into ring_attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        sp: SequenceParallel | None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        # heads from the projections' width (-1): under tensor parallelism a rank holds a share
        q = apply_rope(self.wq(x).view(b, s, -1, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(b, s, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if (
            sp is None and cu_seqlens is None
        ):  # no sequence parallelism: the whole sequence is local
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=True,
                enable_gqa=True,
            ).transpose(1, 2)
        else:
            out = (sp or SequenceParallel(None)).attend(q, k, v, cu_seqlens=cu_seqlens)
        return self.wo(out.reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w_down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        sp: SequenceParallel | None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, sp, cu_seqlens)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(RingModel):
    """tokens [batch, seq_local] + global positions [seq_local] → logits [batch, seq_local, vocab]
    (fp32)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.sp: SequenceParallel | None = None
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # Tied: the head *is* the embedding matrix (no second parameter, so safetensors sees no
        # aliasing).
        self.head = (
            None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        )

    def set_sequence_parallel(self, sp: SequenceParallel | None) -> None:
        """Run attention on this ring from now on (None: plain local attention)."""
        self.sp = sp

    @property
    def sequence_parallel(self) -> SequenceParallel | None:
        return self.sp

    def init_value(self, name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        """GPT-2/Llama-style initial value of parameter `name` (full shape, fp32, CPU) drawn from
        `generator`.

        Drawing every parameter in `named_parameters()` order is `init_weights`; a sharded trainer
        draws each full value the same way and keeps its shard, so the model is the same on any
        world size."""
        if len(shape) < 2:
            return torch.ones(shape)  # norm gains
        std = 0.02
        if name.endswith(("wo.weight", "w_down.weight")):
            std /= math.sqrt(2 * self.cfg.n_layers)  # residual-branch outputs
        return torch.empty(shape).normal_(0.0, std, generator=generator)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Init from an explicit generator, so every rank builds identical weights."""
        for name, p in self.named_parameters():
            p.copy_(self.init_value(name, p.shape, generator))

    def sequence_ends(self) -> tuple[nn.Module, nn.Module]:
        return self.tok_emb, self.norm

    @property
    def output_weight(self) -> torch.Tensor:
        """The output head [vocab, d_model] (the embedding when tied): `forward` =
        features @ output_weightᵀ."""
        return self.tok_emb.weight if self.head is None else self.head.weight

    def features(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [batch, seq_local, d_model]: what a chunked loss projects chunk by
        chunk.

        `positions`: [seq_local], or [batch, seq_local] for packed documents, whose boundaries
        `cu_seqlens` gives (`workers.attention.ring_attention`'s convention)."""
        cos, sin = rope_tables(positions.to(tokens.device), self.cfg.head_dim, self.cfg.rope_theta)
        x = self.tok_emb(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, self.sp, cu_seqlens)
        return self.norm(x)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return F.linear(
            self.features(tokens, positions, cu_seqlens=cu_seqlens), self.output_weight
        ).float()


def cross_entropy_per_token(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy [batch, seq] in fp32 (no reduction: the caller forms the global
    mean)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none").view(
        labels.shape
    )


# The native model's tensor-parallel plan per block (`Block`; styles: `training/tensor_parallel`).
NATIVE_PLAN: dict[str, str] = {
    "attn.wq": "colwise",
    "attn.wk": "colwise",
    "attn.wv": "colwise",
    "attn.wo": "rowwise",
    "mlp.w_gate": "colwise",
    "mlp.w_up": "colwise",
    "mlp.w_down": "rowwise",
}


def native_tp_plan(model: Transformer) -> dict[str, str]:
    return dict(NATIVE_PLAN)


def build_model(cfg: ModelConfig, seed: int) -> Transformer:
    """Build and initialise on CPU in fp32 (identical on every rank and device type); move it
    yourself. Memory knobs (checkpointing, tiled MLP) are applied from outside:
    `workers.training.parallelize`."""
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


@torch.no_grad()
def init_shards(model: Transformer, cfg: ModelConfig, spec: JobSpec) -> None:
    """Fill a sharded (or plain) model's allocated parameters from `train.seed`, like `build_model`.

    Each parameter's full initial value is drawn in `named_parameters` order and the rank keeps its
    slice, so the model is the same on any world size, at the cost of one full parameter at a time
    in host memory."""
    generator = torch.Generator().manual_seed(spec.train.seed)
    for name, p in model.named_parameters():
        full = model.init_value(name, p.shape, generator)
        if isinstance(p, DTensor):
            mesh, placements = p.device_mesh, p.placements
            full = distribute_tensor(full.to(p.device), mesh, placements, src_data_rank=None)
            p.to_local().copy_(full.to_local())
        else:
            p.copy_(full)


def training_attention_backend(device: torch.device) -> str:
    """Name of the ring attention block kernel for the dtype the model feeds it (bf16 under CUDA
    autocast)."""
    return attention.attention_backend(
        device, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
