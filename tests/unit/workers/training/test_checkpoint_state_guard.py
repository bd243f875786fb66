"""Checkpoint contents and the lease, in process (workers/training/checkpoint.py, lease.py): a
checkpoint saved with its optimizer still reads back as the model's weights alone, a load restores
the Python and NumPy generators too, and a lease whose file is gone is no longer held."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from workers.training.checkpoint import load_checkpoint, read_weights, save_checkpoint
from workers.training.lease import LEASE_FILE, Fenced, Lease


def test_weights_of_a_checkpoint_with_optimizer_state_are_the_models_alone(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 6)).pow(2).mean().backward()
    opt.step()  # the optimizer now holds exp_avg / exp_avg_sq / step per parameter
    save_checkpoint(tmp_path, 1, model, {}, keep=1, optimizer=opt)
    weights = read_weights(tmp_path, 1)
    assert weights.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(weights[name], value), name


def test_a_load_restores_the_python_and_numpy_generators(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    random.seed(11)
    np.random.seed(12)
    save_checkpoint(tmp_path, 4, model, {}, keep=1)
    want = (random.random(), float(np.random.rand()))  # the draws right after the save
    random.seed(99)
    np.random.seed(99)
    load_checkpoint(tmp_path, 4, model)
    assert (random.random(), float(np.random.rand())) == want


def test_a_lease_whose_file_is_gone_is_not_held(tmp_path: Path) -> None:
    lease = Lease.take(tmp_path, "d0-r0")
    assert lease.held() and (tmp_path / LEASE_FILE).read_text() == lease.token
    (tmp_path / LEASE_FILE).unlink()
    assert not lease.held()
    with pytest.raises(Fenced):
        lease.check()
