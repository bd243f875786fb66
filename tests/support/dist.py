"""Run a function on N real torch.distributed (gloo) processes and collect what each returns.

Processes are new per call (real multi-process, real gloo over loopback), forked from a forkserver
that has imported torch and the training stack once per test process: a spawned rank would pay that
import (2-4 s of CPU) itself, and the fast tier starts hundreds of ranks. `fresh=True` spawns bare
interpreters instead, for tests that measure a rank's resident memory.
"""

from __future__ import annotations

import contextlib
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

# What every rank imports anyway, imported once in the forkserver (a single-threaded process: no
# thread pool is forked); a test module's own imports still happen in each rank.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "workers.training.trainer",
    # pretrained-model ranks import transformers' model classes: ~7 s of CPU each, once here
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.mistral.modeling_mistral",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.tokenization_utils_fast",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    queue: Any,
    env: dict[str, str],
) -> None:
    # the caller's environment now, as a spawned process would see it (a forkserver child starts
    # with the forkserver's, taken when the first call started it)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    import torch

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        dist.barrier()
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0, fresh: bool = False
) -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` gloo processes; return results ordered by rank.

    `fn` must be importable (module level). Any rank's exception fails the call with its traceback.
    `fresh=True`: bare spawned interpreters (nothing preloaded), for resident-memory measurements.
    The rendezvous port is picked free, then bound by rank 0 a moment later; when another process
    took it in between (EADDRINUSE, before any rank ran `fn`), the run starts again on a new port.
    """
    for _ in range(2):
        with contextlib.suppress(_PortTaken):
            return _run_once(fn, world, args, timeout, fresh)
    return _run_once(fn, world, args, timeout, fresh)


class _PortTaken(AssertionError):
    """Rank 0 could not listen on the rendezvous port: another process bound it first."""


def _run_once(
    fn: Callable[..., Any], world: int, args: tuple[Any, ...], timeout: float, fresh: bool
) -> list[Any]:
    if fresh:
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry, args=(r, world, port, fn, args, queue, dict(os.environ)), daemon=True
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        message = "distributed run failed\n" + "\n".join(errors)
        if "EADDRINUSE" in message and "init_process_group" in message:
            raise _PortTaken(message)
        raise AssertionError(message)
    return [results[r] for r in range(world)]
