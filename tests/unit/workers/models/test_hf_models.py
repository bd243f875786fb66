"""Pretrained models on the ring equal transformers on one process: logits and parameter gradients.

Reference: the same checkpoint in transformers with eager attention on the whole sequence (fp32),
its config built here from config.json with the overrides applied by hand: never by the code under
test (`pretrained_config`), which would make a dropped override invisible.
Each family (llama, mistral, qwen2, qwen3) appears with GQA or MQA, q/k/v biases, qwen3's q/k norms,
tied and untied heads, and each RoPE scaling variant (linear, dynamic, yarn, llama3), from config.json
or from load-time overrides; rings of 2, 3 and 4 processes (gloo), zigzag, striped and contiguous.
`dynamic` runs past max_position_embeddings so its scaling depends on the *global* sequence length.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.hf_fixtures import write_checkpoint

SEQ, BATCH = 48, 2
LAYOUTS = ("zigzag", "striped", "contiguous")
TOL = 1e-4  # fp32, relative, vs transformers on one process (ARCHITECTURE.md, "Contracts")

# name -> (family, config.json fields, load_pretrained overrides)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "llama-gqa-bias-linear": (
        "llama",
        {
            "attention_bias": True,
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        },
        {},
    ),
    "llama-tied-llama3": (
        "llama",
        {"tie_word_embeddings": True},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            "max_position_embeddings": 64,
        },
    ),
    "mistral-yarn-override": (
        "mistral",
        {"sliding_window": 4096},
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 1024},
    ),
    "qwen2-bias-tied-dynamic": (
        "qwen2",
        {
            "tie_word_embeddings": True,
            "max_position_embeddings": 32,  # < SEQ: dynamic NTK scaling is active and length-dependent
            "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        },
        {},
    ),
    "qwen3-mqa-qknorm-theta": (
        "qwen3",
        {"num_key_value_heads": 1, "head_dim": 24, "tie_word_embeddings": False},
        {"rope_theta": 50000.0},
    ),
}


def _loss_weights(vocab: int) -> torch.Tensor:
    """A fixed random projection of the logits: every logit gets its own gradient."""
    return torch.randn(BATCH, SEQ, vocab, generator=torch.Generator().manual_seed(7))


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _reference_model(path: Path, overrides: dict[str, Any]) -> Any:
    """transformers itself, eager attention, from config.json with the overrides applied by hand.

    What an override means: `rope_scaling` replaces the scaling and keeps the base frequency (yarn
    and llama3 get config.json's max_position_embeddings as the pretraining context unless they
    name it), `rope_theta` replaces the base frequency, `max_position_embeddings` the context.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads((path / "config.json").read_text())
    rope = dict(raw["rope_parameters"])  # transformers 5 writes RoPE as one dict, rope_theta inside
    if "rope_scaling" in overrides:
        rope = {"rope_theta": rope["rope_theta"], **overrides["rope_scaling"]}
        if rope["rope_type"] in ("yarn", "llama3"):
            rope.setdefault("original_max_position_embeddings", raw["max_position_embeddings"])
    if "rope_theta" in overrides:
        rope["rope_theta"] = overrides["rope_theta"]
    if "max_position_embeddings" in overrides:
        raw["max_position_embeddings"] = overrides["max_position_embeddings"]
    config = AutoConfig.for_model(**{**raw, "rope_parameters": rope})
    return AutoModelForCausalLM.from_pretrained(
        path,
        config=config,
        attn_implementation="eager",
        dtype=torch.float32,
    )


def _reference(
    path: Path,
    overrides: dict[str, Any],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers itself, eager attention, whole sequence, one process."""
    model = _reference_model(path, overrides)
    vocab = model.config.vocab_size
    logits = model(_tokens(vocab), position_ids=torch.arange(SEQ)[None].expand(BATCH, -1)).logits
    (logits * _loss_weights(vocab)).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _ring_worker(rank: int, world: int, cases: list[tuple[str, str, dict[str, Any]]]) -> dict:
    import torch.distributed as dist

    from workers.attention import shard_positions, shard_sequence
    from workers.models import SequenceParallel, load_pretrained

    out: dict[tuple[str, str], Any] = {}
    for name, path, overrides in cases:
        for layout in LAYOUTS:
            model = load_pretrained(path, **overrides)
            model.set_sequence_parallel(SequenceParallel(None, layout))
            vocab = model.config.vocab_size
            positions = shard_positions(SEQ, layout, rank, world)
            logits = model(shard_sequence(_tokens(vocab), 1, layout), positions)
            (logits * shard_sequence(_loss_weights(vocab), 1, layout)).sum().backward()
            grads = {n: p.grad.clone() for n, p in model.hf.named_parameters()}
            for g in grads.values():
                dist.all_reduce(g)
            # numpy, not tensors: torch would pass tensors as shared memory that dies with this process
            np_grads = {n: g.numpy() for n, g in grads.items()} if rank == 0 else None
            out[name, layout] = (positions.numpy(), logits.detach().numpy(), np_grads)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        name: write_checkpoint(root / name, family, seed=i, **cfg)
        for i, (name, (family, cfg, _)) in enumerate(CASES.items())
    }


@pytest.fixture(scope="module")
def references(
    checkpoints: dict[str, Path],
) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    return {name: _reference(checkpoints[name], CASES[name][2]) for name in CASES}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_equals_transformers(
    world: int, checkpoints: dict[str, Path], references: dict
) -> None:
    cases = [(name, str(checkpoints[name]), CASES[name][2]) for name in CASES]
    results = run_distributed(_ring_worker, world, cases)
    worst: dict[str, float] = {}
    for name in CASES:
        ref_logits, ref_grads = references[name]
        assert ref_logits.std() > 0.5, "reference logits are too flat to test anything"
        for layout in LAYOUTS:
            logits = torch.empty_like(ref_logits)
            for positions, local, _ in (r[name, layout] for r in results):
                logits[:, torch.from_numpy(positions)] = torch.from_numpy(local)
            grads = {n: torch.from_numpy(g) for n, g in results[0][name, layout][2].items()}
            assert grads.keys() == ref_grads.keys()
            errs = [_rel(logits, ref_logits)] + [_rel(grads[n], ref_grads[n]) for n in ref_grads]
            assert max(errs) <= TOL, f"{name} {layout} ring {world}: relative error {max(errs):.2e}"
            worst[name] = max(worst.get(name, 0.0), *errs)
    print(
        f"ring {world}: worst relative error per case:", {k: f"{v:.1e}" for k, v in worst.items()}
    )


# name -> (family, config.json fields, the override under test)
OVERRIDES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "rope_theta": ("qwen3", {}, {"rope_theta": 50000.0}),
    # dynamic NTK scales only past max_position_embeddings: 24 < SEQ < 256 (config.json's)
    "max_position_embeddings": (
        "llama",
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
        {"max_position_embeddings": 24},
    ),
    # yarn over a non-default base frequency (kept), with a longer context: the pretraining context
    # yarn scales from stays config.json's 256, not the new 1024
    "rope_scaling": (
        "llama",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}},
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 1024},
    ),
}


@pytest.mark.parametrize("name", OVERRIDES)
def test_each_override_reaches_the_model(name: str, tmp_path: Path) -> None:
    """One process, whole sequence: `load_pretrained` with an override equals transformers with that
    override applied by hand, and differs from the model without it (a dropped override fails)."""
    from workers.models import load_pretrained

    family, cfg, overrides = OVERRIDES[name]
    path = write_checkpoint(tmp_path / name, family, **cfg)
    positions = torch.arange(SEQ)
    position_ids = positions[None].expand(BATCH, -1)
    with torch.no_grad():
        model = load_pretrained(path, **overrides)
        tokens = _tokens(model.config.vocab_size)
        ours = model(tokens, positions)
        theirs = _reference_model(path, overrides)(tokens, position_ids=position_ids).logits
        without = _reference_model(path, {})(tokens, position_ids=position_ids).logits
    blind = f"the {name} override does not change this model: the test is blind"
    assert _rel(without, theirs) > 1e-2, blind
    assert _rel(ours, theirs) <= TOL, f"{name} override: relative error {_rel(ours, theirs):.2e}"


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_lean_norm_is_the_familys_own_norm(family: str) -> None:
    """`_lean_norms` swaps in `rms_norm` only for norm classes that compute the same thing: the
    forward to the bit, the gradients to fp32 rounding (its backward keeps x and rsqrt, not the copy)."""
    import importlib

    from workers.models.hf import LEAN_NORMS, _lean_norms

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = next(getattr(module, n) for n in dir(module) if n in LEAN_NORMS)
    gen = torch.Generator().manual_seed(5)
    results = []
    for lean in (False, True):
        norm = cls(64, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.3 * torch.randn(64, generator=gen.manual_seed(1)))
        if lean:
            _lean_norms(norm)
            assert "forward" in vars(norm), f"{cls.__name__} was not swapped"
        x = (3 * torch.randn(2, 7, 64, generator=gen.manual_seed(2))).requires_grad_()
        y = norm(x)
        y.backward(torch.randn(2, 7, 64, generator=gen.manual_seed(3)))
        results.append((y.detach(), x.grad, norm.weight.grad))
    (y0, gx0, gw0), (y1, gx1, gw1) = results
    assert torch.equal(y0, y1)
    assert _rel(gx1, gx0) < 1e-6 and _rel(gw1, gw0) < 1e-6, (_rel(gx1, gx0), _rel(gw1, gw0))
