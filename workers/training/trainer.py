"""The training loop of one rank: sequence parallel over a ring, data parallel over rings.

`run_training` is what the Ray driver's rank actors and the torchrun entry point call. It assumes the
default process group is up (world = data_parallel × ring_size; world 1 may run without one) and does
not know where metrics go: it hands each `MetricPoint` to `emit`.

Loss: each rank backpropagates the *sum* of its weighted token losses; gradients and the token
weight total are summed over all ranks in one bucketed all-reduce, then divided by the global
weight — the global token mean, identical to single-process training on the same batch.

mem_peak_bytes: on CUDA, `torch.cuda.max_memory_allocated` over the step. On CPU, the process's
peak resident set size over the step (Linux VmHWM, reset before the step through
/proc/self/clear_refs); that includes the interpreter and torch libraries (~0.3 GB), so compare
differences. Where the reset is impossible it is the lifetime peak (getrusage maxrss).
"""

from __future__ import annotations

import os
import re
import resource
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from workers.config import JobSpec
from workers.data import build_source, take_shard
from workers.models import SequenceParallel, attention_backend, build_model, token_losses
from workers.protocol import MetricPoint
from workers.training.checkpoint import latest_step, load_checkpoint, save_checkpoint
from workers.training.evals import passkey_accuracy
from workers.training.journal import MetricJournal
from workers.training.mesh import Mesh, all_reduce_grads, build_mesh
from workers.training.optim import Scheduler, build_optimizer, clip_grad_norm


@dataclass
class TrainResult:
    final_step: int
    final_loss: float | None
    resumed_from: int | None
    attention_backend: str


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


class PeakMemory:
    """Per-step peak memory of this rank (see module docstring for what it measures)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.resettable = device.type != "cuda" and self._clear_refs()

    @staticmethod
    def _clear_refs() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets the VmHWM high-water mark (Linux ≥ 4.0)
            return True
        except OSError:
            return False

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.resettable:
            self._clear_refs()

    def peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.resettable:
            m = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
            if m:
                return int(m.group(1)) * 1024
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _autocast(device: torch.device) -> AbstractContextManager:
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def run_training(
    spec: JobSpec,
    *,
    checkpoint_dir: str | Path | None,
    emit: Callable[[MetricPoint], None],
    stop: threading.Event | None = None,
    device: torch.device | None = None,
    max_steps: int | None = None,
) -> TrainResult:
    """Train `spec` (resuming from the newest checkpoint in `checkpoint_dir`); collective over all ranks.

    `max_steps` is an absolute step to stop at (the schedule still follows spec.train.steps). `stop`
    may be set on any rank: all ranks finish the current step, checkpoint and return.
    """
    device = device or default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh: Mesh = build_mesh(spec.parallel.ring_size, spec.parallel.data_parallel)
    tc = spec.train
    torch.manual_seed(tc.seed)

    model = build_model(spec.model, tc.seed, tc.activation_checkpointing).to(device)
    model.set_sequence_parallel(SequenceParallel(mesh.ring_group, spec.parallel.layout))
    model.train()
    params = list(model.parameters())
    optimizer = build_optimizer(model, tc)
    scheduler = Scheduler(optimizer, tc)
    data = build_source(spec)
    backend = attention_backend(device)

    step, resumed_from, last_loss = 0, None, None
    if checkpoint_dir is not None and (found := latest_step(checkpoint_dir)) is not None:
        state = load_checkpoint(checkpoint_dir, found, model)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        data.load_state_dict(state["data"])
        step, resumed_from, last_loss = found, found, state.get("extra", {}).get("loss")

    end = tc.steps if max_steps is None else min(tc.steps, max_steps)
    rank0 = mesh.rank == 0
    memory = PeakMemory(device)
    tokens_per_step = tc.batch_size * spec.data.seq_len

    journal = MetricJournal(checkpoint_dir, mesh.rank, step) if checkpoint_dir is not None else None

    def point(name: str, value: float, rank: int | None = None) -> None:
        p = MetricPoint(step=step, name=name, value=float(value), rank=rank, time=time.time())
        if journal is not None:
            journal.append(p)  # before emit: a point is on disk before anyone can have seen it
        emit(p)

    def checkpoint() -> None:
        if checkpoint_dir is None:
            return
        state = {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "data": data.state_dict(),
            "extra": {"loss": last_loss, "world": mesh.world, "spec": spec.model_dump(mode="json")},
        }
        save_checkpoint(checkpoint_dir, step, model, state, keep=spec.checkpoint.keep)

    def evaluate() -> None:
        if not spec.eval.enabled:
            return
        for name, value in passkey_accuracy(model, spec, mesh, device).items():
            if rank0:
                point(name, value)

    saved_at = evaluated_at = step
    stopped = False
    while step < end and not stopped:
        memory.reset()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        lr = scheduler.apply()

        batch = data.global_batch(step, tc.batch_size)
        local = take_shard(
            batch,
            dp_index=mesh.dp_index,
            dp_size=mesh.data_parallel,
            layout=spec.parallel.layout,
            ring_group=mesh.ring_group,
        ).to(device)
        with _autocast(device):
            logits = model(local.inputs, local.positions)
        loss_sum = (token_losses(logits, local.labels) * local.weights).sum()
        loss_sum.backward()  # unnormalised; divided by the global weight once it is known

        stop_flag = 1.0 if stop is not None and stop.is_set() else 0.0
        stats = torch.stack(
            [loss_sum.detach().float(), local.weights.sum().float(), torch.tensor(stop_flag, device=device)]
        )
        stats = all_reduce_grads(params, stats)
        total_weight = stats[1].clamp_min(1e-12)
        for p in params:
            p.grad.div_(total_weight)
        grad_norm = clip_grad_norm(params, tc.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0

        step += 1
        last_loss = float(stats[0] / total_weight)
        stopped = bool(stats[2] > 0)
        if rank0:
            point("loss", last_loss)
            point("lr", lr)
            point("grad_norm", grad_norm)
            point("tokens_per_s", tokens_per_step / elapsed)
            point("step_time_s", elapsed)
        point("mem_peak_bytes", memory.peak(), rank=mesh.rank)

        # Evaluate before checkpointing: a checkpoint at step k then implies every point of step k was emitted.
        if spec.eval.every_steps and step % spec.eval.every_steps == 0:
            evaluate()
            evaluated_at = step
        if spec.checkpoint.every_steps and step % spec.checkpoint.every_steps == 0:
            checkpoint()
            saved_at = step

    if not stopped and step != evaluated_at:
        evaluate()
    if step != saved_at:
        checkpoint()
    if journal is not None:
        journal.close()
    if mesh.world > 1:
        dist.barrier()
    return TrainResult(final_step=step, final_loss=last_loss, resumed_from=resumed_from, attention_backend=backend)
