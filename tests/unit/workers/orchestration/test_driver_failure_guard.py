"""A job whose ranks fail (a failed verification, an exception in training) still delivers what they
emitted first: `JobDriver._train` hands the forwarder's held points out before it raises.

The forwarder holds a step until every rank has reported it (`workers.orchestration.forwarding`). A
failed verification is emitted by rank 0 only, at step 0, and then every rank raises: the other ranks
never report step 0, so without the flush the job would fail with its `verify_*` points held back.

Ray's actor calls are stood in for by in-process actors whose refs answer at once; `ray.wait` and
`ray.get` are swapped for their equivalents on those refs (the rest of the path is the driver's own).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from workers.config import JobSpec
from workers.orchestration.driver import JobDriver, Timing, TrainingError
from workers.protocol import MetricPoint

SPEC = JobSpec.model_validate(
    {
        "name": "verify-fails",
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
        "data": {"kind": "passkey", "seq_len": 256, "key_digits": 3},
        "parallel": {"ring_size": 2},
        "train": {"steps": 4},
        "resources": {"accelerator": "cpu", "cpus_per_worker": 1},
    }
)


@dataclass(eq=False)
class Ref:
    value: Any = None
    error: BaseException | None = None


@dataclass(eq=False)
class Actor:
    """A rank actor whose `train` fails once it has emitted `buffer`."""

    buffer: list[MetricPoint] = field(default_factory=list)

    def _remote(self, fn: Any) -> SimpleNamespace:
        return SimpleNamespace(remote=fn)

    @property
    def train(self) -> SimpleNamespace:
        cause = RuntimeError("verification failed: max_rel_err 3.1e-01 > tolerance 1.0e-04")
        return self._remote(
            lambda *a, **kw: Ref(error=ray.exceptions.RayTaskError("train", "", cause))
        )

    @property
    def drain_metrics(self) -> SimpleNamespace:
        def answer() -> Ref:
            out, self.buffer = list(self.buffer), []
            return Ref(out)

        return self._remote(answer)

    @property
    def ping(self) -> SimpleNamespace:
        return self._remote(lambda: Ref("pong"))


@dataclass
class Group:
    actors: list[Actor]
    assignments: list[int]

    def ranked_actors(self) -> list[Actor]:
        return list(self.actors)


class Reporter:
    def __init__(self) -> None:
        self.sent: list[tuple[int, str]] = []

    def metric(self, p: MetricPoint, *, replay: bool = False) -> None:
        self.sent.append((p.step, p.name))


@pytest.fixture
def fake_refs(monkeypatch: pytest.MonkeyPatch) -> None:
    def wait(refs: list[Ref], num_returns: int = 1, timeout: float | None = None) -> tuple:
        return list(refs), []

    def get(ref: Ref, timeout: float | None = None) -> Any:
        if ref.error is not None:
            raise ref.error
        return ref.value

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", get)


def test_a_failed_verification_delivers_its_points_before_the_job_fails(fake_refs: None) -> None:
    verify = [
        MetricPoint(step=0, name=name, value=value, time=0.0)
        for name, value in (("verify_max_rel_err", 0.31), ("verify_passed", 0.0))
    ]
    group = Group([Actor(list(verify)), Actor()], assignments=[0, 1])
    reporter = Reporter()
    env: Any = SimpleNamespace(job_spec=SPEC, restarts=0, delivered_through=0, checkpoint_dir="/x")
    driver = JobDriver(env, reporter, threading.Event(), Timing(poll_interval_s=0.01))  # type: ignore[arg-type]
    with pytest.raises(TrainingError, match="verification failed"):
        driver._train(group, 0)  # type: ignore[arg-type]
    assert reporter.sent == [(0, "verify_max_rel_err"), (0, "verify_passed")]
