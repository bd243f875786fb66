"""What the pre-training verification costs: its seconds, and as a share of one training step.

    python -m bench.verify_cost

Each job runs a few steps on gloo ranks (one thread each), once with verification and once without.
Columns: `verify s` (the job's `verify_seconds`, the slowest rank's; it includes the first-call set-up that
step 1 pays when the check is off: FSDP's lazy init, the first collectives), `added s` (what the check adds
to the wall time up to the end of step 1: verify + step 1 with it, minus step 1 without), `step s` (median
step time after step 1) and `share` = added / step. The check runs `verify.tokens` (256) tokens, so its
share falls as sequences grow.
"""

from __future__ import annotations

import statistics
from typing import Any

from tests.dist import run_distributed
from tests.trainutil import series, train
from workers.config import JobSpec

STEPS = 4


def _spec(name: str, model: dict[str, Any], seq: int, batch: int, ring: int) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": name,
            "model": model,
            "data": {"kind": "passkey", "seq_len": seq, "key_digits": 1},
            "parallel": {"ring_size": ring, "layout": "zigzag"},
            "train": {"steps": STEPS, "batch_size": batch, "lr": 1e-3},
            "checkpoint": {"every_steps": 0},
            "eval": {"enabled": False},
        }
    )


CASES = [
    ("demo (d64 x2, 512 x 16, ring 2)", _spec("demo", {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2},
                                              512, 16, 2)),
    ("d256 x4, 2048 x 1, ring 2", _spec("mid", {"d_model": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 2},
                                        2048, 1, 2)),
    ("d128 x4, 3072 x 1, ring 3", _spec("odd", {"d_model": 128, "n_layers": 4, "n_heads": 8, "n_kv_heads": 2},
                                        3072, 1, 3)),
]  # fmt: skip


def _run(rank: int, world: int, on: str, off: str) -> list[list[dict[str, Any]]]:
    return [train(rank, world, spec_json, None, STEPS)["points"] for spec_json in (on, off)]


def main() -> None:
    print(f"{'job':<34} {'verify s':>9} {'added s':>8} {'step s':>8} {'share':>7} {'max rel err':>12}")
    for label, spec in CASES:
        off = spec.model_copy(update={"verify": spec.verify.model_copy(update={"enabled": False})})
        on_pts, off_pts = run_distributed(
            _run, spec.world_size, spec.model_dump_json(), off.model_dump_json(), timeout=3600
        )[0]
        verify_s = series(on_pts, "verify_seconds")[0]
        added = verify_s + series(on_pts, "step_time_s")[0] - series(off_pts, "step_time_s")[0]
        step_s = statistics.median(series(on_pts, "step_time_s")[1:] + series(off_pts, "step_time_s")[1:])
        err = series(on_pts, "verify_max_rel_err")[0]
        print(
            f"{label:<34} {verify_s:>9.2f} {added:>8.2f} {step_s:>8.2f} {added / step_s:>6.0%} {err:>12.2e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
