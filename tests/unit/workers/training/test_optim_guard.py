"""The optimizer pieces against hand-computed values: the LR schedule (linear warmup, cosine decay to
min_lr_ratio), gradient clipping (global L2 norm, clipped in place) and which parameters decay.

Only slow multi-step curve tests touched these before; here each is checked in milliseconds against
numbers worked out by hand from the documented rule, not against the code's own formula.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.trainutil import tiny_spec
from workers.config import TrainConfig
from workers.models import build_model
from workers.training.optim import build_optimizer, build_scheduler, clip_grad_norm, lr_at

# steps 10, warmup 4, min_lr_ratio 0.1: warmup (k + 1) / 4, then 0.1 + 0.45 (1 + cos(pi (k - 4) / 6))
# cos(pi/6) = 0.8660254, cos(pi/3) = 0.5, cos(pi/2) = 0, cos(2pi/3) = -0.5, cos(5pi/6) = -0.8660254
EXPECTED_FACTORS = [
    0.25,
    0.5,
    0.75,
    1.0,
    1.0,  # decay starts at progress 0
    0.1 + 0.45 * 1.8660254,
    0.1 + 0.45 * 1.5,
    0.55,
    0.1 + 0.45 * 0.5,
    0.1 + 0.45 * 0.1339746,
    0.1,  # the end of the schedule: min_lr_ratio
    0.1,  # and it stays there
]


def _cfg(**over: float) -> TrainConfig:
    base = {"steps": 10, "warmup_steps": 4, "lr": 2e-3, "min_lr_ratio": 0.1}
    return TrainConfig.model_validate({**base, **over})


def test_lr_warms_up_linearly_then_decays_on_a_cosine_to_the_floor() -> None:
    """lr_at(k) is the documented schedule, step by step, including the first warmup step (not 0)."""
    cfg = _cfg()
    got = [lr_at(k, cfg) for k in range(len(EXPECTED_FACTORS))]
    assert got == pytest.approx([2e-3 * f for f in EXPECTED_FACTORS], rel=1e-6)


def test_no_warmup_starts_at_the_full_lr() -> None:
    cfg = _cfg(warmup_steps=0)
    # progress k / 10: cos(0) = 1, cos(pi/2) = 0, cos(pi) = -1
    assert [lr_at(k, cfg) for k in (0, 5, 10)] == pytest.approx([2e-3, 1.1e-3, 2e-4], rel=1e-6)


def test_scheduler_gives_step_k_the_lr_of_step_k() -> None:
    """What the trainer steps with: the optimizer's lr before optimizer step k is lr_at(k)."""
    cfg = _cfg()
    weight = nn.Parameter(torch.ones(2, 2))
    opt = torch.optim.SGD([weight], lr=cfg.lr)
    sched = build_scheduler(opt, cfg)
    seen = []
    for _ in EXPECTED_FACTORS:
        seen.append(opt.param_groups[0]["lr"])
        weight.grad = torch.ones_like(weight)
        opt.step()
        sched.step()
    assert seen == pytest.approx([2e-3 * f for f in EXPECTED_FACTORS], rel=1e-6)


def _params_with_grads() -> list[nn.Parameter]:
    """Gradients (3, 4) and (12,): a global L2 norm of exactly 13."""
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([12.0])
    return [a, b, nn.Parameter(torch.zeros(3))]  # the last has no gradient: skipped


@pytest.mark.parametrize(
    ("max_norm", "scale"),
    [(1.3, 0.1), (0.0, 1.0), (100.0, 1.0)],  # clipped to 1.3; 0 disables; above the norm: untouched
)
def test_clip_returns_the_global_norm_and_scales_to_max_norm(max_norm: float, scale: float) -> None:
    params = _params_with_grads()
    assert clip_grad_norm(params, max_norm) == pytest.approx(13.0, rel=1e-6)
    torch.testing.assert_close(params[0].grad, torch.tensor([3.0, 4.0]) * scale, rtol=1e-5, atol=0)
    torch.testing.assert_close(params[1].grad, torch.tensor([12.0]) * scale, rtol=1e-5, atol=0)
    assert params[2].grad is None


def test_only_matrices_other_than_embeddings_decay() -> None:
    """AdamW's weight decay applies to projection matrices; norms and the embedding table keep theirs."""
    spec = tiny_spec()
    model = build_model(spec.model, 0)
    opt = build_optimizer(model, spec.train)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = ({names[id(p)] for p in g["params"]} for g in opt.param_groups)
    assert [g["weight_decay"] for g in opt.param_groups] == [spec.train.weight_decay, 0.0]
    assert spec.train.weight_decay > 0
    assert "tok_emb.weight" in no_decay and "layers.0.attn.wq.weight" in decay
    assert all(n.endswith("norm.weight") or n == "tok_emb.weight" for n in no_decay), no_decay
    assert decay | no_decay == set(names.values())
