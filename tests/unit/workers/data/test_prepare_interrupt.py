"""A prepare killed mid-tokenize (SIGKILL: no handler runs) leaves the previous dataset in place.

`python -m workers.data.prepare` runs as its own process over a source of many files (one chunk, one
shard each) while an older prepared dataset sits at --out. The test polls the file system until the
staging directory holds a first shard, kills the process there (the other chunks still to do), then
checks that --out is still the old dataset, and that the next prepare succeeds and leaves nothing
beside --out (no staging directory, no old version, no lock file). In process (`--in-process`) and on
the session's Ray head (the default path: the driver is killed while Ray tasks tokenize).

The next prepare runs in process in both cases: what it must undo (`recover`, under the lock the
kernel released) is done by the driver before any tokenizing, the same code on Ray or not, and a
successful Ray prepare is checked by the CLI and REST tests; one Ray Data run fewer. On Ray it
starts once no worker process that ran a task of the killed driver still runs one (a task still
writing a shard could otherwise race the new staging directory).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from service.local_ray import RayHead
from tests.support.ray_fixtures import ray_state
from tests.unit.workers.data.test_tokens_memory import write_corpus
from workers.data import open_dataset
from workers.data.prepare import prepare

ROOT = Path(__file__).resolve().parents[4]
FILE_BYTES = 2 << 20


def command(src: Path, out: Path, ray_address: str | None) -> list[str]:
    # on Ray, two tokenize tasks at a time: the kill still finds most chunks to do, and the two
    # cores this runs on are not asked for eight worker processes
    where = ["--ray-address", ray_address, "--workers", "2"] if ray_address else ["--in-process"]
    cmd = [sys.executable, "-m", "workers.data.prepare", str(src), "--tokenizer", "bytes"]
    return [*cmd, "--out", str(out), "--json-progress", *where]


def first_shard(staging: Path, proc: subprocess.Popen[str], timeout_s: float) -> int:
    """Poll until the staging directory holds a shard file; the number of shards seen then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the prepare ended before it wrote a shard"
        shards = staging / "shards"
        if shards.is_dir():
            names = {p.name.split(".")[0] for p in shards.glob("*.npy")}
            if names:
                return len(names)
        time.sleep(0.002)
    raise AssertionError(f"no shard in {staging} within {timeout_s} s")


def task_title(pid: int) -> bytes:
    """Ray worker `pid`'s title where it runs a task; b"" where it is gone or titled `ray::IDLE`
    (Ray keeps the idle workers of a finished job in its pool)."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
    return b"" if title.startswith(b"ray::IDLE") else title


def wait_for_the_killed_drivers_tasks(head: RayHead, pid: int, timeout_s: float) -> int:
    """Wait until no worker process that ran a task of the driver `pid` (dead) still runs one;
    how many there were."""
    time.sleep(1.5)  # workers report task events about once a second
    jobs = [
        j
        for j in ray_state(head, "jobs")
        if str((j.get("driver_info") or {}).get("pid")) == str(pid)
    ]
    assert jobs, f"no Ray job with driver pid {pid}"
    job = max(jobs, key=lambda j: j.get("start_time") or 0)  # the newest, should the pid recur
    tasks = ray_state(head, "tasks", job_id=job["job_id"])
    pids = {
        int(t["worker_pid"]) for t in tasks if t.get("worker_pid") and t["type"] == "NORMAL_TASK"
    }
    deadline = time.monotonic() + timeout_s
    for p in pids:
        while title := task_title(p):
            assert time.monotonic() < deadline, f"worker {p} of the killed driver runs {title!r}"
            time.sleep(0.1)
    return len(pids)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["in-process", pytest.param("ray", marks=pytest.mark.ray)])
def test_a_prepare_killed_mid_tokenize_leaves_the_old_dataset(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    ray_address = request.getfixturevalue("ray_head").gcs_address if where == "ray" else None
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if where == "ray":
        env.update(request.getfixturevalue("ray_head").client_env())
    old_src = tmp_path / "old.jsonl"
    old_src.write_text("".join(json.dumps({"text": f"old document {i}"}) + "\n" for i in range(5)))
    out = tmp_path / "ds"
    old = prepare(old_src, out, tokenizer="bytes", inline=True)

    src = tmp_path / "src"
    src.mkdir()
    files = 12
    for i in range(files):
        write_corpus(src / f"part-{i:02d}.jsonl", FILE_BYTES + i)  # distinct contents
    staging = tmp_path / ".ds.staging"

    proc = subprocess.Popen(
        command(src, out, ray_address),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        seen = first_shard(staging, proc, timeout_s=180)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    left = {p.name.split(".")[0] for p in (staging / "shards").glob("*.npy")}
    print(f"{where}: killed at {seen} of {files} shards ({len(left)} in staging after the kill)")
    assert seen < files  # killed mid-work, with chunks still to do
    assert staging.exists()  # what the kill left

    ds = open_dataset(out)  # still the old dataset, whole
    assert ds.manifest == old and len(ds) == 5
    np.testing.assert_array_equal(ds[4]["tokens"], [*b"old document 4", 0])

    if where == "ray":
        workers = wait_for_the_killed_drivers_tasks(
            request.getfixturevalue("ray_head"), proc.pid, 60
        )
        print(f"ray: {workers} worker process(es) ran the killed driver's tasks, none runs one now")
    done = subprocess.run(
        command(src, out, None),  # in process (the module docstring says why)
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    new = open_dataset(out)
    assert new.id != old["id"] and len(new.manifest["files"]) == files
    assert new.num_tokens == sum(p.stat().st_size for p in src.glob("*.jsonl")) - 12 * len(new)
    text = json.loads((src / "part-03.jsonl").read_text().splitlines()[0])["text"]
    first_of_3 = sum(f["documents"] for f in new.manifest["files"][:3])
    np.testing.assert_array_equal(new[first_of_3]["tokens"], [*text.encode(), 0])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ds")) == []
