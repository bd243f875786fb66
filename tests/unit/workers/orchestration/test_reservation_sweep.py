"""A reservation's actors in rank order (`RankGroup.ranked_actors`, `RankGroup.placement`), without Ray.

Ray hands actors back in bundle order, scattered over nodes; the driver trains, drains and reports by rank, so
each rank must reach the actor that landed where the rank order put it (node by node, GPU id ascending), not the
actor with the rank's index. Actors are stand-in strings: only the indexing is under test.
"""

from __future__ import annotations

from workers.orchestration.reservation import RankGroup
from workers.parallel_dims import ParallelDims, WorkerLocation


def test_ranks_reach_the_actor_that_landed_where_the_order_put_them() -> None:
    # bundle i landed on (node, GPU): 0 -> b/1, 1 -> a/0, 2 -> b/0, 3 -> a/1; node b is seen first
    landed = [("b", "1"), ("a", "0"), ("b", "0"), ("a", "1")]
    locations = [WorkerLocation(n, f"10.0.0.{ord(n)}", (g,)) for n, g in landed]
    assignments = ParallelDims(ring_size=4).order_ranks(locations)
    group = RankGroup(
        pg=None,
        actors=[f"actor-{i}" for i in range(4)],
        locations=locations,
        assignments=assignments,
    )
    assert group.ranked_actors() == ["actor-2", "actor-0", "actor-1", "actor-3"]
    assert group.actor(2) == "actor-1"
    got = [(p.rank, p.node_id, p.node_ip, p.device, p.ring) for p in group.placement()]
    assert got == [
        (0, "b", "10.0.0.98", "cuda:0", 0),
        (1, "b", "10.0.0.98", "cuda:1", 0),
        (2, "a", "10.0.0.97", "cuda:0", 0),
        (3, "a", "10.0.0.97", "cuda:1", 0),
    ]
