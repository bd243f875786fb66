"""What the pre-training verification costs: its seconds, and as a share of one training step.

    python -m bench.verify_cost

Each job's ranks (gloo, one thread each) set up a `Trainer` and run the check three times, then
three training steps. Columns: `first s` (the first check, which also pays the first-call set-up
that step 1 pays when the check is off: FSDP's lazy init, the first collectives), `verify s` (the
median of the later checks: what the check itself costs), `step s` (the median step) and `share` =
verify / step. Every rank times the same calls, so a machine shared with other work slows both
sides alike. The check runs `verify.tokens` (256) tokens, so its share falls as sequences grow.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from tests.support.dist import run_distributed
from workers.config import JobSpec

STEPS = 3


def _spec(name: str, model: dict[str, Any], seq: int, batch: int, ring: int) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": name,
            "model": model,
            "data": {"kind": "passkey", "seq_len": seq, "key_digits": 1},
            "parallel": {"ring_size": ring, "layout": "zigzag"},
            "train": {"steps": 10, "batch_size": batch, "lr": 1e-3},
            "checkpoint": {"every_steps": 0},
            "eval": {"enabled": False},
        }
    )


SMALL = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}
MID = {"d_model": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 2}
CASES = [
    ("demo (d64 x2, 512 x 16, ring 2)", _spec("demo", SMALL, 512, 16, 2)),
    ("d256 x4, 2048 x 1, ring 2", _spec("mid", MID, 2048, 1, 2)),
    ("d256 x4, 3072 x 1, ring 3", _spec("odd", MID, 3072, 1, 3)),
    ("d256 x4, 8192 x 1, ring 2", _spec("long", MID, 8192, 1, 2)),
]


def _measure(rank: int, world: int, spec_json: str) -> dict[str, Any]:
    from workers.training.trainer import Trainer

    t = Trainer(JobSpec.model_validate_json(spec_json), checkpoint_dir=None, emit=lambda p: None)
    t.load(0)
    checks = []
    for _ in range(3):
        t0 = time.perf_counter()
        t.verify()
        checks.append(time.perf_counter() - t0)
    steps = [t.train_step().seconds for _ in range(STEPS)]
    return {"checks": checks, "steps": steps}


def main() -> None:
    print(f"{'job':<34} {'first s':>8} {'verify s':>9} {'step s':>8} {'share':>7}")
    for label, spec in CASES:
        runs = run_distributed(_measure, spec.world_size, spec.model_dump_json(), timeout=3600)
        first = max(r["checks"][0] for r in runs)
        check = statistics.median(max(r["checks"][i] for r in runs) for i in (1, 2))
        step = statistics.median(max(r["steps"][i] for r in runs) for i in range(STEPS))
        row = f"{label:<34} {first:>8.2f} {check:>9.2f} {step:>8.2f} {check / step:>6.0%}"
        print(row, flush=True)


if __name__ == "__main__":
    main()
