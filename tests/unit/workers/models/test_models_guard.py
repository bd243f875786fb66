"""Model details the equivalence tests cannot see, each against hand-known values, float64 math or
transformers.

- Native init: norm gains 1, weights N(0, 0.02), residual-branch outputs (wo, w_down) scaled by
  1/sqrt(2·n_layers), and the trainer's in-place init draws the same seeded model. Logit
  equivalence tests start from any init, so a wrong scale or seed passes them.
- Native RoPE with per-row positions (packed documents) and at positions past fp16's integers; the
  per-token cross-entropy; the tensor-parallel plan (transformers' Llama plan); the kernel asked
  for on CUDA (bf16, what autocast feeds it).
- Native export config: every field `LlamaConfig` would otherwise default (rms_norm_eps 1e-6, rope
  theta 10000, eos) comes from the model. The round-trip test's activations are large enough that
  eps never shows.
- Pretrained: the sliding-window refusal compares the window with the *global* length (ring world ×
  local length); dropout is refused; the lean norm keeps the family's own eps (the fixtures all use
  1e-6, transformers' default, so a hard-coded eps passes them).
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from torch import nn

from workers.config import ModelConfig
from workers.models import SequenceParallel, build_model
from workers.models.export import llama_config_for
from workers.models.hf import PretrainedLM, _ring_attention_forward, _RingState
from workers.models.llama import apply_rope, cross_entropy_per_token, rope_tables


def test_native_init_scales() -> None:
    """Every parameter's initial spread, by name: 8 layers make the residual scale 1/4."""
    cfg = ModelConfig(d_model=64, n_layers=8, n_heads=4, tie_embeddings=False)
    model = build_model(cfg, seed=0)
    residual = 0.02 / math.sqrt(2 * 8)
    seen = set()
    for name, p in model.named_parameters():
        if p.ndim == 1:
            assert torch.equal(p, torch.ones_like(p)), name
            seen.add("norm")
            continue
        want = residual if name.endswith(("attn.wo.weight", "mlp.w_down.weight")) else 0.02
        std = float(p.detach().std())
        assert abs(std - want) <= 0.1 * want, f"{name}: std {std:.4g}, want {want:.4g}"
        assert abs(float(p.detach().mean())) <= 0.1 * want, name
        seen.add(name.split(".")[-2])
    assert {"norm", "wo", "w_down", "wq", "w_gate", "tok_emb", "head"} <= seen


def test_native_export_config_fields() -> None:
    """Non-default eps, theta, GQA and FFN width: each reaches the LlamaConfig as given."""
    cfg = ModelConfig(
        d_model=48,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        ffn_mult=3.0,
        rope_theta=777.0,
        norm_eps=0.03,
        tie_embeddings=False,
    )
    config = llama_config_for(build_model(cfg, seed=0), 2048)
    assert config.rms_norm_eps == 0.03
    assert config.rope_parameters["rope_theta"] == 777.0
    assert config.rope_parameters["rope_type"] == "default"
    assert config.intermediate_size == 96  # 2/3 · 3 · 48, a multiple of 8
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (48, 3, 256)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 12)
    assert config.max_position_embeddings == 2048
    assert config.tie_word_embeddings is False
    assert config.eos_token_id == 0  # NUL ends a document in byte-level corpora
    assert config.hidden_act == "silu" and not config.attention_bias and not config.mlp_bias


class _RingOfTwo(SequenceParallel):
    """A ring of two as the model sees it (world = 2), without a process group: the refusal under
    test fires before any exchange."""

    @property
    def world(self) -> int:
        return 2


def _tiny_mistral() -> PretrainedLM:
    """A randomly initialised two-layer Mistral (its attention reads config.sliding_window per call)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "mistral",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=4096,
    )
    torch.manual_seed(0)
    return PretrainedLM(AutoModelForCausalLM.from_config(config, dtype=torch.float32))


def test_sliding_window_is_checked_against_the_global_length() -> None:
    model = _tiny_mistral()
    tokens = torch.randint(0, model.config.vocab_size, (1, 8))
    with torch.no_grad():
        model.config.sliding_window = 8  # one process, 8 tokens: a window of 8 sees everything
        assert model(tokens, torch.arange(8)).shape == (1, 8, model.config.vocab_size)
        model.config.sliding_window = 7
        with pytest.raises(ValueError, match="sliding_window 7 < sequence length 8"):
            model(tokens, torch.arange(8))
        # 8 local tokens on a ring of two are 16 in all: a window of 15 would cut them
        model.set_sequence_parallel(_RingOfTwo(None, "zigzag"))
        model.config.sliding_window = 15
        with pytest.raises(ValueError, match="sliding_window 15 < sequence length 16"):
            model(tokens, torch.tensor([0, 1, 2, 3, 12, 13, 14, 15]))


def test_attention_dropout_is_refused() -> None:
    module = nn.Module()
    module.ringtrain_state = _RingState()  # type: ignore[assignment]
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="dropout"):
        _ring_attention_forward(module, q, q, q, None, dropout=0.1)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_lean_norm_keeps_the_familys_eps(family: str) -> None:
    """eps comparable to mean(x²): the lean norm equals transformers' norm only with the same eps."""
    import importlib

    from workers.models.hf import LEAN_NORMS, _lean_norms

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = next(getattr(module, n) for n in dir(module) if n in LEAN_NORMS)
    norm = cls(16, eps=0.25)
    x = 0.5 * torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = norm(x)
        _lean_norms(norm)
        got = norm(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_rope_with_per_row_positions() -> None:
    """Packed documents give each row its own positions ([batch, seq]): every row is rotated by its
    own angles, as float64 rotate-half RoPE with inv_freq = theta^(-2i/d) computes them."""
    b, s, h, d, theta = 2, 5, 3, 8, 500.0
    x = torch.randn(b, s, h, d, generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 0, 1, 2, 9]])
    cos, sin = rope_tables(positions, d, theta)
    assert cos.shape == (b, s, d // 2)
    got = apply_rope(x, cos, sin)
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions.double()[:, :, None, None] * inv_freq  # [b, s, 1, d/2]
    x1, x2 = x.double()[..., : d // 2], x.double()[..., d // 2 :]
    want = torch.cat(
        [x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], dim=-1
    )
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_rope_angles_at_long_positions() -> None:
    """Positions past fp16's exact integers (2048) keep their value: cos/sin of position · inv_freq
    within fp32 rounding of float64."""
    d, theta = 8, 10000.0
    positions = torch.tensor([4097, 30001, 131071])
    cos, sin = rope_tables(positions, d, theta)
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions.double()[:, None] * inv_freq
    torch.testing.assert_close(cos.double(), angle.cos(), rtol=0, atol=2e-2)
    torch.testing.assert_close(sin.double(), angle.sin(), rtol=0, atol=2e-2)


def test_native_tp_plan_is_transformers_llama_plan() -> None:
    """The native block's tensor-parallel styles equal transformers' own plan for LlamaForCausalLM,
    read through export's native -> Llama name map (the two models compute the same thing)."""
    from transformers import LlamaConfig

    from workers.models.export import _LAYER_NAMES
    from workers.models.llama import native_tp_plan

    theirs = {k.removeprefix("layers.*."): v for k, v in LlamaConfig.base_model_tp_plan.items()}
    ours = native_tp_plan(build_model(ModelConfig(d_model=32, n_layers=1, n_heads=2), seed=0))
    assert {
        _LAYER_NAMES[f"{k}.weight"].removesuffix(".weight"): v for k, v in ours.items()
    } == theirs


def test_cross_entropy_per_token_is_the_plain_nll() -> None:
    """Per token, -log softmax(logits)[label], in float64 by hand: no smoothing, no reduction."""
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2, 5, 11, generator=g)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    want = -logits.double().log_softmax(-1).gather(-1, labels[..., None])[..., 0]
    got = cross_entropy_per_token(logits, labels)
    assert got.shape == (2, 5) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_training_backend_is_asked_for_bf16_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model runs under bf16 autocast on CUDA, fp32 elsewhere: the kernel is picked for that."""
    from workers.models import llama

    asked = []
    monkeypatch.setattr(
        llama.attention,
        "attention_backend",
        lambda device, dtype: asked.append((torch.device(device).type, dtype)) or "stub",
    )
    assert llama.training_attention_backend(torch.device("cuda")) == "stub"
    assert llama.training_attention_backend(torch.device("cpu")) == "stub"
    assert asked == [("cuda", torch.bfloat16), ("cpu", torch.float32)]


def test_init_shards_draws_the_seeded_model() -> None:
    """The trainer's in-place init (`init_shards`, here on an unsharded model) draws from
    `train.seed` exactly what `build_model(cfg, seed)` draws: a resumed or resharded job and a tool
    building the model see the same initial weights."""
    from tests.support.trainutil import tiny_spec
    from workers.models.llama import Transformer, init_shards

    spec = tiny_spec()
    want = build_model(spec.model, seed=spec.train.seed)
    model = Transformer(spec.model)
    init_shards(model, spec.model, spec)
    for (name, p), q in zip(model.named_parameters(), want.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("rank", [0, 1])
def test_length_dependent_rope_sees_the_last_position_across_ulysses(
    rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Length-dependent RoPE (dynamic) scales by the whole sequence's last position. Ulysses 2 ×
    ring 1, 16 tokens: the ring group (one rank) holds only its own positions, the Ulysses group
    holds the rest. The exchange is emulated in process: each group's all-reduce (MAX) sees the
    maxima of its members' positions."""
    from workers.attention import usp_shard_positions
    from workers.models import hf

    members = {"ring": [rank], "ulysses": [0, 1]}
    local_max = [int(usp_shard_positions(16, "zigzag", u, 2, 0, 1).max()) for u in (0, 1)]
    assert local_max == [7, 15]

    def all_reduce(t: torch.Tensor, op: object = None, group: object = None) -> None:
        assert op == hf.dist.ReduceOp.MAX and group in members, (op, group)
        t.fill_(max([int(t.item())] + [local_max[r] for r in members[str(group)]]))

    monkeypatch.setattr(hf.dist, "all_reduce", all_reduce)
    sp = types.SimpleNamespace(world=2, group="ring", ulysses_group="ulysses")
    holder = types.SimpleNamespace(state=_RingState(sp=sp))  # the method reads only `self.state`
    positions = usp_shard_positions(16, "zigzag", rank, 2, 0, 1)
    assert PretrainedLM._global_last_position(holder, positions) == 15  # type: ignore[arg-type]
