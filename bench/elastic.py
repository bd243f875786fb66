"""Elastic vs non-elastic: the same ring of 4 over two hosts loses one host, which comes back after a fixed delay.

The multi-host harness of tests/multihost/test_multihost.py (a Ray head with 0 CPUs and hosts w1, w2 with 2 CPUs each,
each in its own network namespace; the real control plane in the root namespace). One job per mode, one after the
other on the same cluster: a ring of 4 (2 ranks per host), a checkpoint every `--every` steps; once checkpoint
`--kill-at` is on disk every process of w2 is SIGKILLed, and `--restart-after` seconds after the kill w2's Ray node is
started again. Measured per mode, from the stored metric points' own times:
- loss -> first step: from the kill to the first step trained after it (elastic: on the 2 ranks left; non-elastic:
  the job waits for w2, so its first step is on 4 ranks after w2 is back);
- back -> first step on 4: from w2 alive again (Ray lists it) to the first step on 4 ranks after that;
- steps while w2 was down: steps trained between the kill and w2 alive;
- recomputed: steps trained after the checkpoint that the job resumed from at the loss (lost work), plus, when it
  grew, steps trained on 2 ranks after the checkpoint it grew from (0 by design: the ranks stop at a step and
  checkpoint it);
- job wall time: submission to SUCCEEDED.

    sudo .venv/bin/python -m bench.elastic --restart-after 20      # root: it creates network namespaces
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.integration.test_faults import (
    checkpoint_at_least,
    finished,
    http,
    states,
    stored_points,
    wait_job,
)
from tests.multihost.test_multihost import (
    build,
    control_plane,
    netns_unavailable,
    ranks_in,
    ring_spec,
    start_cluster,
    teardown,
)
from workers.training.checkpoint import latest_step
from workers.training.journal import read_journal


def run_one(nc: Any, tmp: Path, elastic: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One job through the loss and the return of w2; its figures."""
    name = "bench-elastic" if elastic else "bench-fixed"
    js = ring_spec(
        4, args.steps, name, every=args.every, elastic={"enabled": elastic, "grow": True}
    )
    tmp.mkdir(parents=True)
    with control_plane(tmp, nc) as srv, http(srv.url) as c:
        t_submit = time.time()
        jid = c.post("/v1/jobs", json=js).json()["id"]
        ckpt = tmp / "ckpt" / jid
        wait_job(
            c, jid, lambda j: j["state"] == "RUNNING" and len(j["placement"]) == 4, 240, "RUNNING"
        )
        checkpoint_at_least(ckpt, args.kill_at, timeout=240)
        wall_kill = time.time()
        nc.kill("w2")
        job = wait_job(c, jid, lambda j: "RETRYING" in states(j), 120, "RETRYING")
        resumed = latest_step(ckpt) or 0
        reached = max((p.step for p in read_journal(ckpt, 0) if p.name == "loss"), default=0)
        time.sleep(max(0.0, wall_kill + args.restart_after - time.time()))
        wall_restart = time.time()
        nc.restart("w2")
        wall_back = time.time()
        job = finished(c, jid, timeout=600)
        wall_done = time.time()
        assert job["state"] == "SUCCEEDED", job["error"]
        pts = stored_points(c, jid)
    loss = {p["step"]: p["time"] for p in pts if p["name"] == "loss"}
    sizes = {p["step"]: int(p["value"]) for p in pts if p["name"] == "world_size"} or dict.fromkeys(
        loss, 4
    )
    after_kill = sorted(s for s in loss if s > resumed)
    first = after_kill[0]
    grown = next((s for s in after_kill if loss[s] > wall_back and sizes[s] == 4), None)
    back = next((t for t in job["transitions"] if "is back" in t["reason"]), None)
    grow_recomputed = 0
    if back is not None:
        m = re.search(r"checkpoint at step (\d+)", back["reason"])
        grew_from = int(m.group(1)) if m else 0
        grow_recomputed = max(s for s in sizes if sizes[s] == 2) - grew_from
    return {
        "mode": "elastic" if elastic else "non-elastic",
        "shapes": [ranks_in(t["reason"]) for t in job["transitions"] if t["to"] == "RUNNING"],
        "detected_s": next(t["time"] for t in job["transitions"] if t["to"] == "RETRYING")
        - wall_kill,
        "loss_to_first_step_s": loss[first] - wall_kill,
        "first_step_ranks": sizes[first],
        "w2_restart_s": wall_back - wall_restart,
        "back_to_first_step_on_4_s": (loss[grown] - wall_back) if grown else None,
        "steps_while_down": sum(1 for s in after_kill if loss[s] < wall_back),
        "recomputed_at_loss": reached - resumed,
        "recomputed_at_grow": grow_recomputed,
        "job_wall_s": wall_done - t_submit,
    }


ROWS = (
    ("loss -> first step (s)", "loss_to_first_step_s"),
    ("ranks of that step", "first_step_ranks"),
    ("w2 alive -> first step on 4 ranks (s)", "back_to_first_step_on_4_s"),
    ("steps trained while w2 was down", "steps_while_down"),
    ("steps recomputed at the loss", "recomputed_at_loss"),
    ("steps recomputed at the grow", "recomputed_at_grow"),
    ("job wall time, submit -> SUCCEEDED (s)", "job_wall_s"),
)


def table(fixed: dict[str, Any], el: dict[str, Any]) -> str:
    def cell(v: Any) -> str:
        return "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)

    lines = ["| | non-elastic | elastic | elastic / non-elastic |", "|---|---|---|---|"]
    for label, key in ROWS:
        a, b = fixed[key], el[key]
        ratio = (
            f"{b / a:.2f}"
            if isinstance(a, int | float) and isinstance(b, int | float) and a
            else "-"
        )
        lines.append(f"| {label} | {cell(a)} | {cell(b)} | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--steps",
        type=int,
        default=300,
        help="the job's steps (enough to still run after w2 is back)",
    )
    ap.add_argument("--every", type=int, default=3, help="checkpoint every N steps")
    ap.add_argument(
        "--kill-at", type=int, default=6, help="kill w2 once this checkpoint is on disk"
    )
    ap.add_argument(
        "--restart-after", type=float, default=20.0, help="seconds from the kill to w2's restart"
    )
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = ap.parse_args()
    why = netns_unavailable()
    if why:
        print(f"bench.elastic: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stop still removes the namespaces
    tag = f"rb{os.getpid() % 100000}"
    nc = build(100 + os.getpid() % 150, tag)
    work = Path(tempfile.mkdtemp(prefix="rt-bench-elastic-"))
    try:
        start_cluster(nc)
        results = {}
        for elastic in (False, True):
            for name in ("w1", "w2"):  # each job starts on both hosts
                if nc.hosts[name].ip not in nc.alive_ips():
                    nc.restart(name)
            r = run_one(nc, work / ("elastic" if elastic else "fixed"), elastic, args)
            print(json.dumps(r), flush=True)
            results[r["mode"]] = r
    finally:
        teardown(nc)
    fixed, el = results["non-elastic"], results["elastic"]
    print(
        f"\nring of 4 over w1 + w2, {args.steps} steps, checkpoint every {args.every}, w2 killed after checkpoint "
        f"{args.kill_at} and restarted {args.restart_after:g} s later (w2's Ray node took "
        f"{fixed['w2_restart_s']:.1f} / {el['w2_restart_s']:.1f} s to come back); RUNNING shapes: "
        f"non-elastic {fixed['shapes']}, elastic {el['shapes']}\n"
    )
    print(table(fixed, el))
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
