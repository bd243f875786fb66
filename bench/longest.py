"""Longest trainable sequence under a memory cap per rank, measured: every rank of a real
`torchrun -m workers.train` run sits in its own cgroup (v1 memory controller) whose
memory.limit_in_bytes is the cap; a rank over it is OOM-killed by the kernel. For each model, rank
count and configuration the bench searches the longest global sequence that trains, to a
resolution of about 1/8.

    python -m bench.longest --cap-gib 0.75 [--models native qwen2] [--ranks 1 2 4]
        [--configs today fit] [--jobs 2] [--grow 1.25] [--resolution 8] [--json results.json]

Needs root and /sys/fs/cgroup/memory (cgroup v1). The groups it creates (ringtrain-longest-PID-...)
are removed when each run ends, also on errors and Ctrl-C.

- configurations: `today` = activation_checkpointing full, tiled_mlp off, RINGTRAIN_MALLOC=glibc
  (glibc's default allocator, as before `workers/training/memory.py` bounded it); `fit` = full +
  tiled_mlp auto with the bounded allocator (the leanest CPU knobs `plan --fit` chooses from).
- a run: spec with train.steps 2, whose step 1 is a (256 x ranks)-token curriculum stage (it
  allocates AdamW's state cheaply) and step 2 the length under test, so the measured step holds
  the steady state's parameters, gradients and optimizer state; the verify check before step 1
  runs as in every job.
  OK = torchrun exits 0 after step 2; fail = a rank's cgroup recorded an OOM kill (any other
  failure aborts the bench).
- search: the first length is the planner's estimate of the longest (`memory_estimate` at the
  cap + SEED_SLACK; only a starting point), then lengths grow (or shrink) by --grow until the
  outcome flips, then bisect until first-fail - longest-OK <= longest-OK / --resolution. Lengths
  are multiples of 128 x ranks.
- models: NATIVE and QWEN2, one layer each, wide, small vocabulary: per-token memory is large
  relative to the O(S^2) attention compute, so the lengths that fill the cap stay trainable on two
  CPU cores. qwen2 is a random transformers Qwen2 checkpoint with Qwen2-0.5B's block, written
  locally with the 320-token BPE of tests/support/hf_fixtures.py (nothing is downloaded).
- reported peak: the cgroup's memory.max_usage_in_bytes (what the limit is checked against): it
  leaves out shared library pages already in the page cache, which VmHWM (`mem_peak_bytes`)
  counts, so it reads ~100 MiB under `mem_peak_bytes`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
PREFIX = "ringtrain-longest"
WARMUP_TOKENS = 256  # step 1's curriculum stage (allocates the optimizer state)
QUANTUM = 128  # lengths are multiples of QUANTUM x ranks (passkeys need >= 80 tokens)
MIB, GIB = 1 << 20, 1 << 30

NATIVE = {"d_model": 1024, "n_layers": 1, "n_heads": 8, "ffn_mult": 4}  # heads of 128, MHA
# Qwen2-0.5B's block (hidden 896, 14/2 heads of 64, SwiGLU 4864, q/k/v biases, tied head)
QWEN2: dict[str, Any] = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 1,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1 << 18,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
}
MODELS = ("native", "qwen2")
# The search's first length is the planner's longest under cap + slack: the planner models a rank's
# resident set, which includes ~110 MiB of shared library pages a cgroup does not charge to the
# rank (they are in the page cache already); glibc's default allocator (today) keeps more than the
# planner counts. Only a starting point: it changes which lengths are tried, not what is measured.
SEED_SLACK = {"today": 0, "fit": 160 * (1 << 20)}
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "today": (
        {"activation_checkpointing": "full", "tiled_mlp": "off"},
        {"RINGTRAIN_MALLOC": "glibc"},
    ),
    "fit": ({"activation_checkpointing": "full", "tiled_mlp": "auto"}, {}),
}


# --- the search (pure) -------------------------------------------------------------------------


def round_down(n: float, quantum: int) -> int:
    """The largest positive multiple of `quantum` <= n (at least `quantum`)."""
    return max(quantum, int(n) // quantum * quantum)


def longest_under(estimate: Callable[[int], float], budget: float, quantum: int, limit: int) -> int:
    """The largest multiple of `quantum` (<= limit) whose estimate fits `budget`, for a
    non-decreasing `estimate`; `quantum` if none does."""
    lo, hi = quantum, limit // quantum * quantum
    if estimate(hi) <= budget:
        return hi
    if estimate(lo) > budget:
        return quantum
    while hi - lo > quantum:  # estimate(lo) fits, estimate(hi) does not
        mid = (lo + hi) // 2 // quantum * quantum
        if estimate(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def search(
    fits: Callable[[int], bool],
    start: int,
    quantum: int,
    *,
    grow: float = 2.0,
    resolution: int = 8,
    limit: int = 1 << 24,
) -> tuple[int | None, int | None]:
    """(longest length that fits, shortest that does not), both measured by `fits`, for a
    monotone outcome: from `start`, multiply (or divide) by `grow` until the outcome flips, then
    bisect until the gap is at most longest / resolution or one quantum. None: no length that fits
    down to `quantum` (longest), or none that fails up to `limit` (first failing)."""
    ok: int | None = None
    bad: int | None = None
    x = round_down(start, quantum)
    if fits(x):
        ok = x
        while bad is None:
            y = max(round_down(ok * grow, quantum), ok + quantum)
            if y > limit:
                return ok, None
            if fits(y):
                ok = y
            else:
                bad = y
    else:
        bad = x
        while ok is None:
            y = min(round_down(bad / grow, quantum), bad - quantum)
            if y < quantum:
                return None, bad
            if fits(y):
                ok = y
            else:
                bad = y
    while bad - ok > max(quantum, ok // resolution):
        mid = round_down((ok + bad) / 2, quantum)
        if mid in (ok, bad):
            break
        if fits(mid):
            ok = mid
        else:
            bad = mid
    return ok, bad


# --- cgroups and one run -------------------------------------------------------------------------

_live_groups: set[Path] = set()
_live_procs: set[subprocess.Popen[str]] = set()
_lock = threading.Lock()
_stopping = threading.Event()  # set on the first error or Ctrl-C: no new runs start


def oom_kills(oom_control: str) -> int:
    """The `oom_kill` count of a v1 memory.oom_control file."""
    fields = dict(line.split() for line in oom_control.splitlines() if line.strip())
    return int(fields.get("oom_kill", 0))


def _read(group: Path, name: str) -> str:
    return (group / name).read_text()


def _remove(group: Path) -> None:
    """Kill what is left in the group (processes this bench started) and remove it."""
    for _ in range(50):
        try:
            pids = [int(p) for p in _read(group, "cgroup.procs").split()]
        except FileNotFoundError:
            return
        if not pids:
            break
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    for _ in range(50):
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


@contextmanager
def cgroups(tag: str, ranks: int, cap: int) -> Iterator[list[Path]]:
    """One memory cgroup per rank, limit `cap` bytes; removed on exit."""
    groups = [CGROUP_ROOT / f"{PREFIX}-{os.getpid()}-{tag}-r{r}" for r in range(ranks)]
    try:
        for g in groups:
            g.mkdir()
            with _lock:
                _live_groups.add(g)
            (g / "memory.limit_in_bytes").write_text(str(cap))
        yield groups
    finally:
        for g in groups:
            _remove(g)
            with _lock:
                _live_groups.discard(g)


def rank_entry(prefix: str, argv: list[str]) -> int:
    """Under torchrun: join this rank's cgroup before torch is imported, then run the trainer."""
    group = CGROUP_ROOT / f"{prefix}-r{os.environ.get('LOCAL_RANK', '0')}"
    (group / "cgroup.procs").write_text(str(os.getpid()))
    from workers.train import main as train_main

    return train_main(argv)


@dataclass
class Outcome:
    length: int
    status: str  # ok | oom
    wall_s: float
    cgroup_peak_bytes: int  # max over ranks of memory.max_usage_in_bytes
    mem_peak_bytes: float  # max over ranks of step 2's mem_peak_bytes (ok runs)


@dataclass
class Case:
    model: str
    ranks: int
    config: str
    cap: int
    start: int = 0
    longest: int | None = None
    first_fail: int | None = None
    runs: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    estimate_at_longest: float = 0.0  # the planner's memory_estimate there (bytes)


def spec_dict(model: dict[str, Any], length: int, ranks: int, config: str) -> dict[str, Any]:
    return {
        "name": f"longest-{config}-{ranks}-{length}",
        "model": model,
        "data": {
            "kind": "passkey",
            "seq_len": length,
            "curriculum": [{"steps": 1, "seq_len": min(WARMUP_TOKENS * ranks, length)}],
        },
        "parallel": {"ring_size": ranks, "layout": "zigzag"},
        "train": {"steps": 2, "batch_size": 1, "warmup_steps": 0, **CONFIGS[config][0]},
        "checkpoint": {"every_steps": 0},
        "eval": {"enabled": False},
    }


def run_once(
    model: dict[str, Any], length: int, ranks: int, config: str, cap: int, timeout: float
) -> Outcome:
    """One `torchrun -m workers.train` run, each rank capped at `cap` bytes."""
    import yaml

    if _stopping.is_set():
        raise RuntimeError("stopping")
    tag = f"{config}-{ranks}-{length}-{threading.get_ident() % 10000}"
    with tempfile.TemporaryDirectory() as tmp, cgroups(tag, ranks, cap) as groups:
        spec, metrics = Path(tmp) / "spec.yaml", Path(tmp) / "m.jsonl"
        spec.write_text(yaml.safe_dump(spec_dict(model, length, ranks, config)))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={ranks}", "-m", "bench.longest", "--rank-entry"]
        cmd += [groups[0].name[: -len("-r0")], str(spec), "--steps", "2"]
        cmd += ["--metrics-jsonl", str(metrics)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", **CONFIGS[config][1]}
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        with _lock:
            _live_procs.add(proc)
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise RuntimeError(f"{tag}: no result in {timeout:.0f} s") from None
        finally:
            with _lock:
                _live_procs.discard(proc)
        wall = time.monotonic() - t0
        kills = sum(oom_kills(_read(g, "memory.oom_control")) for g in groups)
        peak = max(int(_read(g, "memory.max_usage_in_bytes")) for g in groups)
        points = (
            [json.loads(line) for line in metrics.read_text().splitlines()]
            if metrics.exists()
            else []
        )
        steps = [p["value"] for p in points if p["name"] == "mem_peak_bytes" and p["step"] == 2]
        if proc.returncode == 0 and len(steps) == ranks:
            return Outcome(length, "ok", wall, peak, max(steps))
        if kills:
            return Outcome(length, "oom", wall, peak, 0.0)
        tail = "\n".join(err.splitlines()[-30:])
        raise RuntimeError(f"{tag}: exit {proc.returncode} without an OOM kill:\n{tail}")


# --- models and the planner's starting point ------------------------------------------------


def qwen2_checkpoint(root: Path) -> dict[str, Any]:
    from tests.support.hf_fixtures import write_checkpoint

    path = root / "qwen2-longest"
    if not (path / "config.json").exists():
        write_checkpoint(path, "qwen2", std=0.02, **QWEN2)
    return {"kind": "hf", "path": str(path)}


def planner_estimate(model: dict[str, Any], length: int, ranks: int, config: str) -> float:
    """`service.planner.memory_estimate` of the run's spec (bytes per rank)."""
    from service.planner import memory_estimate
    from workers.config import JobSpec

    spec = JobSpec.model_validate(spec_dict(model, length, ranks, config))
    return float(memory_estimate(spec)["total_bytes"])


def planner_start(model: dict[str, Any], ranks: int, config: str, cap: int) -> int:
    """Where the search begins: the planner's longest length under the cap."""

    def estimate(length: int) -> float:
        return planner_estimate(model, length, ranks, config)

    return longest_under(estimate, cap, QUANTUM * ranks, 1 << 22)


def measure(
    name: str, model: dict[str, Any], ranks: int, config: str, cap: int, args: argparse.Namespace
) -> Case:
    start = planner_start(model, ranks, config, cap + SEED_SLACK[config])
    case = Case(name, ranks, config, cap, start)
    t0 = time.monotonic()

    def fits(length: int) -> bool:
        out = run_once(model, length, ranks, config, cap, args.probe_timeout)
        case.runs.append(out)
        print(
            f"  [{name} x{ranks} {config}] {length}: {out.status} in {out.wall_s:.0f} s, "
            f"cgroup peak {out.cgroup_peak_bytes / MIB:.0f} MiB",
            file=sys.stderr,
            flush=True,
        )
        return out.status == "ok"

    case.longest, case.first_fail = search(
        fits, case.start, QUANTUM * ranks, grow=args.grow, resolution=args.resolution
    )
    case.wall_s = time.monotonic() - t0
    if case.longest:
        case.estimate_at_longest = planner_estimate(model, case.longest, ranks, config)
    return case


def table(cases: list[Case]) -> str:
    by = {(c.model, c.ranks, c.config): c for c in cases}

    def ratio(a: int | None, b: int | None) -> str:
        return f"{a / b:.2f}x" if a and b else "-"

    rows = [
        "| model | ranks | config | cap/rank GiB | longest OK | first fail | vs 1 rank "
        "| vs today's | cgroup peak MiB | mem_peak_bytes MiB | planner error | planner start "
        "| runs | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        one = by.get((c.model, 1, c.config))
        today = by.get((c.model, c.ranks, "today"))
        ok = [r for r in c.runs if r.length == c.longest]
        cg = f"{ok[0].cgroup_peak_bytes / MIB:.0f}" if ok else "-"
        hwm = f"{ok[0].mem_peak_bytes / MIB:.0f}" if ok else "-"
        err = f"{c.estimate_at_longest / ok[0].mem_peak_bytes - 1:+.0%}" if ok else "-"
        rows.append(
            f"| {c.model} | {c.ranks} | {c.config} | {c.cap / GIB:.2f} | {c.longest or '-'} | "
            f"{c.first_fail or '-'} | {ratio(c.longest, one.longest if one else None)} | "
            f"{ratio(c.longest, today.longest if today else None)} | {cg} | {hwm} | {err} | "
            f"{c.start} | {len(c.runs)} | {c.wall_s:.0f} |"
        )
    return "\n".join(rows)


def _cleanup(*_: Any) -> None:
    with _lock:
        procs, groups = list(_live_procs), list(_live_groups)
    for p in procs:
        with suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    for g in groups:
        _remove(g)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--rank-entry":
        sys.exit(rank_entry(sys.argv[2], sys.argv[3:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap-gib", type=float, default=0.75, help="memory cap per rank")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--jobs", type=int, default=2, help="searches run side by side")
    parser.add_argument("--grow", type=float, default=1.25)
    parser.add_argument("--resolution", type=int, default=8)
    parser.add_argument("--probe-timeout", type=float, default=3600)
    parser.add_argument("--json", type=Path, help="write every run here")
    args = parser.parse_args()
    if not (CGROUP_ROOT / "memory.limit_in_bytes").exists():
        raise SystemExit(f"needs the cgroup v1 memory controller at {CGROUP_ROOT} (and root)")
    cap = int(args.cap_gib * GIB)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory() as tmp:
        models = {
            m: {"kind": "native", **NATIVE} if m == "native" else qwen2_checkpoint(Path(tmp))
            for m in args.models
        }
        jobs = [(m, r, c) for m in args.models for r in args.ranks for c in args.configs]
        jobs.sort(key=lambda j: -j[1])  # the slow many-rank searches first
        pool = ThreadPoolExecutor(args.jobs)
        futures = [pool.submit(measure, m, models[m], r, c, cap, args) for m, r, c in jobs]
        try:
            pending = set(futures)
            while pending:  # a timed wait, so that Ctrl-C and SIGTERM reach this thread
                done, pending = wait(pending, timeout=1.0, return_when=FIRST_EXCEPTION)
                for f in done:
                    if f.exception() is not None:
                        raise f.exception()  # type: ignore[misc]
            cases = [f.result() for f in futures]
        finally:
            _stopping.set()
            for f in futures:
                f.cancel()
            _cleanup()
            pool.shutdown(wait=True)
    order = {(m, r, c): i for i, (m, r, c) in enumerate(
        (m, r, c) for m in args.models for r in sorted(args.ranks) for c in args.configs
    )}  # fmt: skip
    cases.sort(key=lambda c: order[(c.model, c.ranks, c.config)])
    print(table(cases))
    if args.json:
        args.json.write_text(json.dumps([asdict(c) for c in cases], indent=1))


if __name__ == "__main__":
    main()
