"""The trainer's loss is the global weighted token mean: its value, its gradients and the norm it reports.

One process, the real `Trainer` (passkey data: answer labels weigh 4, the rest 1, so a plain token
mean or an unweighted sum differs). The reference is an independent float64 computation: the same
initial model (`build_model` with the job's seed), torch's own cross-entropy on the whole batch,
Σ w·CE / Σ w, differentiated by autograd.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.trainutil import one_thread, source_of, tiny_spec
from workers.models import build_model
from workers.training.trainer import Trainer

assert one_thread  # autouse fixture, imported to apply to this module


def _reference(spec) -> tuple[float, dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    """Weighted token mean of step 0's batch and its gradients, in float64 on one unsharded model."""
    model = build_model(spec.model, spec.train.seed).double()
    batch = source_of(spec).global_batch(0, spec.train.batch_size)
    logits = model(batch.inputs, batch.positions).double()
    ce = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="none")
    w = batch.weights.flatten().double()
    assert w.min() == 1.0 and w.max() == 4.0  # weighted: a plain mean would differ
    loss = (ce * w).sum() / w.sum()
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_step_loss_gradients_and_norm_are_the_weighted_token_mean() -> None:
    spec = tiny_spec(data={"seq_len": 128}, train={"grad_clip": 0.0})
    ref_loss, ref_grads = _reference(spec)
    trainer = Trainer(spec, checkpoint_dir=None, emit=lambda p: None)

    stats = trainer.backward_step(trainer.local_batch())
    assert float(stats[0] / stats[1]) == pytest.approx(ref_loss, rel=1e-5)
    for name, p in trainer.model.named_parameters():
        want = ref_grads[name]
        scale = float(want.abs().max())
        assert scale > 0, name
        torch.testing.assert_close(
            p.grad.double(), want, rtol=1e-4, atol=1e-4 * scale, msg=lambda m, n=name: f"{n}: {m}"
        )
    trainer.optimizer.zero_grad(set_to_none=True)

    step = trainer.train_step()  # the same batch (step 0), now through the optimizer step
    ref_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()])))
    assert step.loss == pytest.approx(ref_loss, rel=1e-5)
    assert step.grad_norm == pytest.approx(ref_norm, rel=1e-4)
    assert trainer.last_loss == step.loss
    assert step.lr == pytest.approx(3e-3 / 2)  # step 0 of a 2-step warmup to lr 3e-3
