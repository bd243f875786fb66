"""Rank order on nodes with ten or more GPUs (`workers.parallel_dims.order_ranks`).

GPU ids are strings ("0" .. "15" on a 16-GPU node): ordering them as strings puts "10" before "2",
so ranks would skip across the node and a rank's device index would name another rank's GPU.
"""

from __future__ import annotations

from workers.parallel_dims import ParallelDims, WorkerLocation


def test_gpu_ids_past_nine_are_ordered_as_numbers() -> None:
    """One 12-GPU node, actors landed in a scrambled order: rank k runs on GPU k, device cuda:k."""
    landed = [7, 11, 0, 3, 10, 5, 1, 9, 2, 8, 6, 4]  # bundle i landed on GPU landed[i]
    locations = [WorkerLocation("n0", "10.0.0.1", (str(g),)) for g in landed]
    ranks = ParallelDims(ring_size=12).order_ranks(locations)
    assert [landed[a.actor_index] for a in ranks] == list(range(12))
    assert [a.device for a in ranks] == [f"cuda:{k}" for k in range(12)]
    assert [a.local_rank for a in ranks] == list(range(12))
    want_visible = ("0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11")
    assert all(a.visible_devices == want_visible for a in ranks)


def test_visible_devices_sort_numerically_when_a_job_holds_part_of_a_node() -> None:
    """A job holding GPUs 2, 9 and 10 of a 16-GPU node: visible "2,9,10", devices cuda:0, 1, 2 in rank order."""
    locations = [WorkerLocation("n0", "10.0.0.1", (g,)) for g in ("10", "2", "9")]
    ranks = ParallelDims(ring_size=3).order_ranks(locations)
    assert [a.visible_devices for a in ranks] == [("2", "9", "10")] * 3
    assert [(a.actor_index, a.device) for a in ranks] == [
        (1, "cuda:0"),
        (2, "cuda:1"),
        (0, "cuda:2"),
    ]
