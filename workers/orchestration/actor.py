"""The rank actor: one per placement-group bundle, runs `workers.training.trainer.run_training` for
one rank.

It is a threaded actor (`max_concurrency`): `train()` occupies one thread for the whole run while
the driver calls `drain_metrics()` / `request_stop()` from others, so metrics stream out and a stop
request lands while training runs. torch is imported lazily so that reporting the actor's location
(the first thing the driver asks) is cheap.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray

from workers.protocol import MetricPoint
from workers.training.lease import Lease

MAX_BUFFERED_POINTS = (
    100_000  # per rank; beyond this the oldest points are dropped rather than growing forever
)


@dataclass(frozen=True)
class RankInfo:
    """Where an actor landed (asked first, before any rank is assigned)."""

    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...]
    pid: int


@dataclass(frozen=True)
class RankResult:
    """What one rank's `train()` returns to the driver."""

    final_step: int
    final_loss: float | None
    resumed_from: int | None
    attention_backend: str
    stopped: bool
    seconds: float


class RankActor:
    """Plain class; `ray.remote(...)(RankActor).options(...)` makes the actor (see
    `remote_rank_actor`)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._points: deque[MetricPoint] = deque(maxlen=MAX_BUFFERED_POINTS)
        self._lock = threading.Lock()
        self._rank: int | None = None
        self._device: str = "cpu"

    # -- where am I --------------------------------------------------------------------------------
    def info(self) -> RankInfo:
        ctx = ray.get_runtime_context()
        gpu_ids = tuple(str(g) for g in ctx.get_accelerator_ids().get("GPU", []))
        return RankInfo(ctx.get_node_id(), ray.util.get_node_ip_address(), gpu_ids, os.getpid())

    def free_port(self) -> int:
        """A free TCP port on this node, for the rendezvous hosted by rank 0."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    # -- process group -----------------------------------------------------------------------------
    def setup(
        self,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        local_world_size: int,
        visible_devices: list[str],
        device: str,
        master_addr: str,
        master_port: int,
        backend: str,
        timeout_s: float = 300.0,
    ) -> str:
        """Set visible devices and join the default process group (collective: all ranks call it
        concurrently)."""
        if visible_devices:
            # Before torch touches CUDA: the node's union of this job's GPUs, so `cuda:local_rank`
            # is our GPU.
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_devices)
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(local_rank),
            LOCAL_WORLD_SIZE=str(local_world_size),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        import torch.distributed as dist

        _pin_socket_interface(ray.util.get_node_ip_address())
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        self._rank = rank
        self._device = device
        return device

    # -- training ----------------------------------------------------------------------------------
    def train(
        self,
        spec_json: str,
        checkpoint_dir: str | None,
        resume_step: int,
        max_steps: int | None = None,
        lease: Lease | None = None,
    ) -> RankResult:
        """Run training from the checkpoint at `resume_step` (0: from scratch) to the end or until
        stopped. Exceptions propagate (the driver tells a dead peer from a raising rank)."""
        import torch

        from workers.config import JobSpec
        from workers.training.trainer import run_training

        spec = JobSpec.model_validate_json(spec_json)
        t0 = time.time()
        result = run_training(
            spec,
            checkpoint_dir=checkpoint_dir,
            emit=self._emit,
            stop=self._stop,
            device=torch.device(self._device),
            max_steps=max_steps,
            resume_step=resume_step,
            lease=lease,
        )
        return RankResult(
            final_step=result.final_step,
            final_loss=result.final_loss,
            resumed_from=result.resumed_from,
            attention_backend=result.attention_backend,
            stopped=self._stop.is_set(),
            seconds=time.time() - t0,
        )

    def _emit(self, point: MetricPoint) -> None:
        with self._lock:
            self._points.append(point)

    def drain_metrics(self) -> list[MetricPoint]:
        with self._lock:
            out = list(self._points)
            self._points.clear()
        return out

    def request_stop(self) -> None:
        self._stop.set()

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def attention_backend(self) -> str:
        import torch

        from workers.models import training_attention_backend

        return training_attention_backend(torch.device(self._device))

    def ping(self) -> bool:
        return True


def _pin_socket_interface(node_ip: str) -> None:
    """Make gloo and NCCL use the interface that carries this node's Ray address.

    Unset, gloo binds to whatever the hostname resolves to, which is 127.0.0.1 in many containers
    (and in network namespaces): peers on other hosts are then told to dial loopback and the
    rendezvous fails. An explicit setting (a fast-links overlay's NCCL_SOCKET_IFNAME, say) is
    kept."""
    import psutil

    if os.environ.get("GLOO_SOCKET_IFNAME") and os.environ.get("NCCL_SOCKET_IFNAME"):
        return
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == node_ip for a in addrs):
            if name != "lo":
                os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
                os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
            return


def remote_rank_actor(
    *,
    num_cpus: float,
    num_gpus: float,
    placement_group: Any,
    bundle_index: int,
    name: str | None = None,
    namespace: str | None = None,
) -> Any:
    """Start one RankActor scheduled into its bundle (not restarted by Ray: the driver owns
    recovery)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cls = ray.remote(RankActor)
    return cls.options(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        max_concurrency=4,
        max_restarts=0,
        name=name,
        namespace=namespace,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=placement_group,
            placement_group_bundle_index=bundle_index,
            placement_group_capture_child_tasks=True,
        ),
    ).remote()
