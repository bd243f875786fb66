"""Sequence parallelism end to end: rings of 1-4 ranks (and 2 × 2 with data parallel) train identically,
with the training state sharded by FSDP2 over every rank, for the native model and a pretrained one.

Tolerance: every run computes the same math in fp32; only the summation order differs (ring attention
merges per-block softmax partials with log-sum-exp, gradient sums are split across ranks and reduced
by gloo). Each such reordering costs ~1 ulp (6e-8 relative) per reduction; after a few AdamW steps
these stay below 1e-5 relative on the loss (measured: ≤ 2e-7; the test prints MEASURED). Parameters are
compared with atol 5e-5 after K steps: Adam divides by sqrt(v), so parameters move by ~lr per step
whatever the gradient size, and a gradient element that is ~0 can change sign under reordering — its
update differs by up to lr · (tiny)/sqrt(v); 5e-5 is 60× below a single step's update size (lr = 3e-3), so a real bug
(wrong position, wrong shard, a missing gradient contribution) cannot hide under it. Measured: ≤ 3e-6, except
one element of qwen2's layer-1 down_proj on 2 × 2 (2.3e-5): its first gradient, 3e-8, is about AdamW's eps.

FSDP's reduce-scatter sums each gradient element over ranks in gloo's order rather than one all-reduce's:
another reordering of the same sum, inside the same bound. Each rank holds ≈ 1/W of the state: its
`state_bytes` is ≤ 1.1 × the single process's / W (uneven shards of 32-row tensors on 3 ranks: 11/10.7).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.hf_fixtures import CORPUS, write_checkpoint
from tests.support.trainutil import final_weights, one_thread, series, tiny_spec, train
from workers.models import build_model

assert one_thread  # autouse fixture, imported to apply to this module

K = 4
LOSS_RTOL = 1e-5
PARAM_ATOL = 5e-5
STATE_SLACK = 1.1

# One spawn per world size (spawning costs more than these tiny runs): {world: [(ring, dp, layout, act. ckpt)]}
CASES = {
    2: [(2, 1, "zigzag", False)],
    3: [(3, 1, "striped", False)],
    4: [(4, 1, "zigzag", True), (2, 2, "contiguous", False)],
}
HF_CASES = {2: (2, 1, "zigzag"), 3: (3, 1, "striped"), 4: (2, 2, "zigzag")}
MEASURED: dict[
    str, float
] = {}  # worst relative loss / absolute parameter difference seen, printed at the end


def _train_cases(rank: int, world: int, cases: list[tuple[str, str]]) -> list[dict]:
    return [train(rank, world, spec, out, K) for spec, out in cases]


def _hf_spec(tmp_path, **parallel) -> str:
    """A tiny Qwen2 (tied head, q/k/v biases) on a text corpus in its own BPE tokens."""
    model_dir, corpus = tmp_path / "qwen", tmp_path / "corpus.txt"
    if not model_dir.exists():
        write_checkpoint(model_dir, "qwen2", tie_word_embeddings=True)
        corpus.write_text(CORPUS)
    return tiny_spec(
        model={"kind": "hf", "path": str(model_dir)},
        data={"kind": "text", "path": str(corpus), "seq_len": 96},
        parallel={"ring_size": 1, "data_parallel": 1, "layout": "zigzag", **parallel},
    ).model_dump_json()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_rings_match_single_process(tmp_path):
    ref_dir = tmp_path / "ref"
    ref = train(0, 1, tiny_spec().model_dump_json(), str(ref_dir), K)
    ref_loss = series(ref["points"], "loss")
    ref_w = final_weights(ref_dir)
    assert (
        len(ref_loss) == K and ref_loss[-1] < ref_loss[0]
    )  # it learned something: not a zero test
    init = build_model(tiny_spec().model, tiny_spec().train.seed).state_dict()
    moved = max(float((ref_w[k] - init[k]).abs().max()) for k in ref_w)
    assert moved > 100 * PARAM_ATOL, (
        moved
    )  # measured ≈ 1e-2; the tolerance is far below what training changes
    ref_state = series(ref["points"], "state_bytes")[0]
    assert ref_state == 16 * sum(v.numel() for v in ref_w.values()) + 4 * len(
        ref_w
    )  # fp32 p, g, m, v + step

    hf_ref_dir = tmp_path / "hf-ref"
    hf_ref = train(0, 1, _hf_spec(tmp_path), str(hf_ref_dir), K)
    hf_ref_loss = series(hf_ref["points"], "loss")
    assert len(hf_ref_loss) == K and hf_ref_loss[-1] < hf_ref_loss[0]
    hf_ref_w, hf_ref_state = final_weights(hf_ref_dir), series(hf_ref["points"], "state_bytes")[0]

    for world, cases in CASES.items():
        runs = []
        for ring, dp, layout, ac in cases:
            spec = tiny_spec(
                parallel={"ring_size": ring, "data_parallel": dp, "layout": layout},
                train={"activation_checkpointing": ac},
            )
            runs.append((spec.model_dump_json(), str(tmp_path / f"r{ring}d{dp}{layout}")))
        ring, dp, layout = HF_CASES[world]
        hf_out = tmp_path / f"hf-r{ring}d{dp}"
        runs.append(
            (_hf_spec(tmp_path, ring_size=ring, data_parallel=dp, layout=layout), str(hf_out))
        )
        per_rank = run_distributed(_train_cases, world, runs)
        for c, (ring, dp, layout, _) in enumerate(cases):
            _check(
                tmp_path / f"r{ring}d{dp}{layout}",
                [r[c] for r in per_rank],
                (ref_loss, ref_w, ref_state),
                f"ring {ring}×dp {dp}",
            )
        _check(
            hf_out,
            [r[-1] for r in per_rank],
            (hf_ref_loss, hf_ref_w, hf_ref_state),
            f"qwen2, world {world}",
        )
    print("[equivalence] worst differences:", MEASURED)


def _check(out, results, ref, what):
    ref_loss, ref_w, ref_state = ref
    loss = series(results[0]["points"], "loss")
    torch.testing.assert_close(
        torch.tensor(loss), torch.tensor(ref_loss), rtol=LOSS_RTOL, atol=0, msg=f"loss, {what}"
    )
    rel = max(abs(a - b) / abs(b) for a, b in zip(loss, ref_loss, strict=True))
    MEASURED["loss_rel"] = max(MEASURED.get("loss_rel", 0.0), rel)
    for other in results[1:]:  # only rank 0 reports the loss
        assert series(other["points"], "loss") == []
    w = final_weights(out)
    assert w.keys() == ref_w.keys()
    for name in ref_w:
        torch.testing.assert_close(
            w[name], ref_w[name], rtol=0, atol=PARAM_ATOL, msg=f"{name}, {what}"
        )
        MEASURED["param_abs"] = max(
            MEASURED.get("param_abs", 0.0), float((w[name] - ref_w[name]).abs().max())
        )
    world = len(results)
    for name in ("mem_peak_bytes", "state_bytes"):
        points = [p for r in results for p in r["points"] if p["name"] == name]
        assert sorted({p["rank"] for p in points}) == list(range(world)), name
        assert all(p["value"] > 0 for p in points), name
    held = [p["value"] for r in results for p in r["points"] if p["name"] == "state_bytes"]
    assert max(held) <= STATE_SLACK * ref_state / world, (what, max(held), ref_state / world)
