"""Startup latency: job submission → end of the first training step, ringtrain vs Ray Train's TorchTrainer.

Both run as Ray jobs submitted through the same Jobs API on the same private local Ray head, with 2 CPU workers
and the *same* training code (`workers.training.trainer` on a tiny spec), so the difference is orchestration:
ringtrain's driver (placement group, rank actors, rank ordering, gloo rendezvous) vs Ray Train's controller and
worker group. The first step's end is the wall-clock `time` of the step-1 `loss` point, measured on rank 0.

    python bench/startup.py [--runs 3]

Ray Train needs `ray[train]` (pandas, tensorboardX, python-dateutil, tzdata on top of ray[default]); without it
only the ringtrain column is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SPEC: dict[str, Any] = {
    "name": "startup-bench",
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
    "data": {"kind": "passkey", "seq_len": 128, "key_digits": 3},
    "parallel": {"ring_size": 2},
    "train": {"steps": 2},
    "checkpoint": {"every_steps": 0},
    "eval": {"enabled": False},
}


# -- the Ray Train job (entrypoint mode of this file) -----------------------------------------------------------------
def raytrain_job(spec_json: str, out_path: str, storage: str) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def loop(config: dict[str, Any]) -> None:
        import torch.distributed as dist

        from workers.config import JobSpec
        from workers.protocol import MetricPoint
        from workers.training.trainer import run_training

        first: list[float] = []

        def emit(p: MetricPoint) -> None:
            if p.name == "loss" and p.step == 1 and not first:
                first.append(p.time)

        run_training(
            JobSpec.model_validate_json(config["spec"]), checkpoint_dir=None, emit=emit, max_steps=1
        )
        if dist.get_rank() == 0:
            Path(config["out"]).write_text(json.dumps({"first_step_time": first[0]}))

    ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", logging_level="WARNING")
    trainer = TorchTrainer(
        loop,
        train_loop_config={"spec": spec_json, "out": out_path},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=storage, name=f"bench-{os.getpid()}"),
    )
    trainer.fit()


# -- the benchmark ----------------------------------------------------------------------------------------------------
def _wait_file(path: Path, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size:
            return json.loads(path.read_text())
        time.sleep(0.05)
    raise TimeoutError(f"{path} not written within {timeout_s}s")


def run_ringtrain(launcher: Any, receiver: Any, spec: Any, tmp: Path, i: int) -> float:
    from service.launcher import LaunchRequest

    job_id = f"bench{i}-{os.getpid()}"
    receiver.add_job(job_id, "tok")
    t0 = time.time()
    sid = launcher.submit(
        LaunchRequest(
            job_id=job_id,
            spec=spec,
            control_url=receiver.url,
            ingest_token="tok",
            checkpoint_dir=str(tmp),
            placement_timeout_s=120,
        )
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with receiver.lock:
            job = receiver.jobs[job_id]
            first = [p["time"] for p in job.points if p["name"] == "loss" and p["step"] == 1]
            failed = [s for s in job.states if s["state"] == "FAILED"]
        if first:
            _wait_finished(launcher, sid)
            return first[0] - t0
        if failed:
            raise RuntimeError(f"ringtrain job failed: {failed[0]['reason']}")
        time.sleep(0.05)
    raise TimeoutError("ringtrain: no first step within 300s")


def run_raytrain(launcher: Any, spec_json: str, tmp: Path, i: int) -> float:
    out = tmp / f"raytrain-{i}.json"
    storage = tmp / "ray_results"
    entry = f"{sys.executable} {Path(__file__).resolve()} --raytrain-job {out} {storage}"
    t0 = time.time()
    sid = launcher._client.submit_job(
        entrypoint=entry,
        runtime_env={"env_vars": {"RINGTRAIN_BENCH_SPEC": spec_json}},
        submission_id=f"bench-raytrain-{os.getpid()}-{i}",
    )
    try:
        first = _wait_file(out, 300)["first_step_time"]
    except TimeoutError as e:
        raise RuntimeError(
            f"Ray Train job did not reach a first step:\n{launcher.logs(sid)[-3000:]}"
        ) from e
    _wait_finished(launcher, sid)
    return first - t0


def _wait_finished(launcher: Any, sid: str, timeout_s: float = 120) -> None:
    """Runs do not overlap: the next one starts when this Ray job has ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not launcher.status(sid).status.finished:
        time.sleep(0.2)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--raytrain-job", nargs=2, metavar=("OUT", "STORAGE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.raytrain_job:
        raytrain_job(os.environ["RINGTRAIN_BENCH_SPEC"], *args.raytrain_job)
        return 0

    from service.local_ray import LocalRayHead
    from service.ray_jobs import RayJobLauncher
    from tests.support.ray_fixtures import ReportReceiver
    from workers.config import JobSpec

    try:
        import ray.train.torch  # noqa: F401

        have_train = True
    except ImportError as e:
        print(
            f"note: Ray Train unavailable ({e}); pip install 'ray[train]' to compare",
            file=sys.stderr,
        )
        have_train = False

    spec = JobSpec.model_validate(SPEC)
    tmp = Path(tempfile.mkdtemp(prefix="rt-bench-"))
    results: dict[str, list[float]] = {"ringtrain": [], "ray-train TorchTrainer": []}
    with LocalRayHead(num_cpus=8) as head:
        launcher = RayJobLauncher(head.jobs_url, auth_token=head.auth_token)
        receiver = ReportReceiver()
        try:
            for i in range(args.runs):  # interleaved so drift affects both alike
                results["ringtrain"].append(run_ringtrain(launcher, receiver, spec, tmp, i))
                if have_train:
                    results["ray-train TorchTrainer"].append(
                        run_raytrain(launcher, spec.model_dump_json(), tmp, i)
                    )
                print(
                    f"run {i + 1}/{args.runs}: "
                    + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in results.items() if v),
                    file=sys.stderr,
                )
        finally:
            receiver.close()

    print(
        f"\nsubmit → end of first training step, 2 CPU workers, tiny model, {os.cpu_count()} cores, "
        f"median of {args.runs}"
    )
    print(f"{'system':<26}{'median s':>10}{'min s':>10}{'max s':>10}")
    med = {}
    for name, vals in results.items():
        if vals:
            med[name] = statistics.median(vals)
            print(f"{name:<26}{med[name]:>10.2f}{min(vals):>10.2f}{max(vals):>10.2f}")
    if len(med) == 2:
        print(
            f"ratio ringtrain / ray-train: {med['ringtrain'] / med['ray-train TorchTrainer']:.2f}"
        )
    print(f"command: python bench/startup.py --runs {args.runs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
