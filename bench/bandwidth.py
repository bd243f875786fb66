"""Ring attention over a bandwidth-limited link: how much of the K/V transfer the overlap hides, and Ulysses vs ring.

Two ranks, each in its own network namespace, joined by one veth pair shaped with `tc tbf` (addresses only on that
link). Per rate, measured in the same run:
- ring: causal zigzag `ring_attention` forward + backward (K/V in flight while the current block computes);
- transfer: the same bytes a rank moves in that forward + backward (K/V once forward; K/V and fp32 dK/dV backward)
  exchanged alone, no compute;
- compute: the ring on the unshaped link (its transfer is negligible there);
- usp: `usp_attention` over the same two ranks (one all-to-all each way, no ring).
hidden = (compute + transfer - ring) / transfer: 1 means the transfer is fully hidden behind compute, 0 not at all.

    sudo python -m bench.bandwidth --seq 8192 --rates 1gbit 200mbit   # root: it creates namespaces
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

NS = ("rtbw0", "rtbw1")
IPS = ("10.214.7.1", "10.214.7.2")
DEV = ("rtbwv0", "rtbwv1")
ROOT = Path(__file__).resolve().parent.parent


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def setup() -> None:
    teardown()
    for ns in NS:
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh(
        "ip",
        "link",
        "add",
        DEV[0],
        "netns",
        NS[0],
        "type",
        "veth",
        "peer",
        "name",
        DEV[1],
        "netns",
        NS[1],
    )
    for ns, dev, ip in zip(NS, DEV, IPS, strict=True):
        sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")


def shape(rate: str | None) -> None:
    for ns, dev in zip(NS, DEV, strict=True):
        subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
            capture_output=True,
        )
        if rate:
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst",
               "256kb", "latency", "50ms")  # fmt: skip


def teardown() -> None:
    for ns in NS:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run_pair(args: argparse.Namespace, port: int) -> dict[str, float]:
    procs = []
    for rank, (ns, dev) in enumerate(zip(NS, DEV, strict=True)):
        env = {
            **os.environ,
            "GLOO_SOCKET_IFNAME": dev,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "bench.bandwidth", "--worker", str(rank),
               "--port", str(port), "--seq", str(args.seq), "--iters", str(args.iters)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT))
    outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"worker failed: {[p.returncode for p in procs]}")
    return json.loads(outs[0].strip().splitlines()[-1])


def worker(rank: int, port: int, seq: int, iters: int) -> None:
    import torch
    import torch.distributed as dist

    from workers.attention import ring_attention, shard_sequence, usp_attention, usp_shard_sequence

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{IPS[0]}:{port}", rank=rank, world_size=2)
    pair = dist.new_group([0, 1])
    one = [dist.new_group([r]) for r in range(2)][rank]
    g = torch.Generator().manual_seed(0)
    h, d = 8, 64
    full = [torch.randn(1, seq, h, d, generator=g) for _ in range(3)]

    def timed(fn) -> float:
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def ring() -> None:
        q, k, v = (shard_sequence(t, 1, "zigzag", pair).requires_grad_() for t in full)
        ring_attention(q, k, v, causal=True, layout="zigzag", group=pair).sum().backward()

    def usp() -> None:
        q, k, v = (usp_shard_sequence(t, 1, "zigzag", pair, one).requires_grad_() for t in full)
        usp_attention(
            q, k, v, causal=True, layout="zigzag", ulysses_group=pair, ring_group=one
        ).sum().backward()

    kv_bytes = 2 * (seq // 2) * h * d * 4  # one rank's K and V
    buf = torch.zeros(3 * kv_bytes // 4)  # forward K/V, backward K/V and dK/dV

    def transfer() -> None:
        other = 1 - rank
        got = torch.empty_like(buf)
        for w in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, buf, other), dist.P2POp(dist.irecv, got, other)]
        ):
            w.wait()

    out = {
        "ring_s": timed(ring),
        "transfer_s": timed(transfer),
        "usp_s": timed(usp),
        "kv_mb": kv_bytes / 1e6,
    }
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--rates", nargs="+", default=["1gbit", "200mbit"])
    p.add_argument("--worker", type=int, default=None)
    p.add_argument("--port", type=int, default=29611)
    args = p.parse_args()
    if args.worker is not None:
        worker(args.worker, args.port, args.seq, args.iters)
        return
    setup()
    try:
        shape(None)
        base = run_pair(args, args.port)
        compute = base["ring_s"]
        rows = [("unshaped", base, None)]
        for i, rate in enumerate(args.rates):
            shape(rate)
            r = run_pair(args, args.port + 1 + i)
            hidden = (
                (compute + r["transfer_s"] - r["ring_s"]) / r["transfer_s"]
                if r["transfer_s"] > 0
                else 0.0
            )
            rows.append((rate, r, hidden))
        print(f"seq {args.seq}, 2 ranks, fp32, H=8, D=64, causal zigzag; median of {args.iters}; "
              f"K/V per rank {base['kv_mb']:.1f} MB")  # fmt: skip
        head = ("link", "ring s", "transfer s", "compute s", "hidden", "usp s", "usp/ring")
        print(" ".join(f"{h:>{w}}" for h, w in zip(head, (10, 8, 11, 10, 7, 7, 9), strict=True)))
        for name, r, hidden in rows:
            hid = "—" if hidden is None else f"{hidden:.2f}"
            print(f"{name:>10} {r['ring_s']:8.2f} {r['transfer_s']:11.2f} {compute:10.2f} {hid:>7} {r['usp_s']:7.2f} "
                  f"{r['usp_s'] / r['ring_s']:9.2f}")  # fmt: skip
    finally:
        teardown()


if __name__ == "__main__":
    main()
