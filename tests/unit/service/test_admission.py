"""The admission rules (`service.admission`), pure: order, quotas, capacity node by node, no starvation, shrinking."""

from __future__ import annotations

from service.admission import (
    Admitted,
    Demand,
    Free,
    NodeShape,
    Queued,
    Quota,
    decide,
    demand_of,
    fits,
    free_nodes,
    never_within_quota,
    take,
    uses_gpus,
    with_autoscaler,
)
from service.launcher import ClusterInfo, NodeInfo
from workers.config import JobSpec

TWO = Demand(2, 1.0)
FOUR = Demand(4, 1.0)


def nodes(*cpus: float) -> list[Free]:
    return [Free(f"n{i}", c, 0.0) for i, c in enumerate(cpus)]


def q(jid: str, owner: str = "alice", prio: int = 0, t: float = 0.0, d: Demand = TWO) -> Queued:
    return Queued(jid, owner, prio, t, d)


def run(
    queued: list[Queued],
    free: list[Free],
    total: list[Free] | None = None,
    admitted: list[Admitted] | None = None,
    quotas: dict[str, Quota] | None = None,
    now: float = 10.0,
    reserve_after_s: float = 300.0,
):  # type: ignore[no-untyped-def]
    return decide(
        queued, admitted or [], free, total or nodes(8, 8), quotas or {}, now, reserve_after_s
    )


def test_priority_then_submission_order_and_positions() -> None:
    jobs = [
        q("a", t=1),
        q("b", t=2, prio=5),
        q("c", t=3),
        q("d", t=0.5, prio=-1),
        q("e", t=4, prio=5),
    ]
    d = run(jobs, nodes(4))  # room for two 2-rank jobs
    assert d.start == ["b", "e"]  # priority 5 first, in submission order
    assert d.waiting == {
        "a": (1, "waiting for capacity: needs 2 x (1 CPU), room for 0 now"),
        "c": (2, d.waiting["c"][1]),
        "d": (3, d.waiting["d"][1]),  # lowest priority last although submitted first
    }


def test_capacity_is_per_node_and_consumed_by_each_admission() -> None:
    # 3 + 3 free CPUs: a 4-rank job fits across both nodes (PACK); after it, 2 CPUs are left in pieces of 1 and 1
    d = run([q("big", t=1, d=FOUR), q("two", t=2), q("one", t=3, d=Demand(1, 1.0))], nodes(3, 3))
    assert d.start == ["big", "two"] and "one" in d.waiting
    # bundles of 2 CPUs: 3 + 3 free CPUs hold only two of them, not three
    assert not fits(Demand(3, 2.0), nodes(3, 3)) and fits(Demand(2, 2.0), nodes(3, 3))


def test_small_jobs_backfill_until_the_big_one_has_waited_long_enough() -> None:
    free = nodes(2, 2)  # 4 free; the 6-rank job fits the cluster (8) but not what is free now
    jobs = [q("big", t=0, d=Demand(6, 1.0)), q("small", t=5)]
    early = run(jobs, nodes(2, 2), now=100)
    assert early.start == ["small"] and early.waiting["big"][0] == 1  # backfilled past it
    late = run(jobs, free, now=301)
    assert late.start == []  # the big job reserves: nothing behind it starts
    assert "waited over 300s" in late.waiting["big"][1]
    assert (
        late.waiting["small"] == (2, late.waiting["small"][1])
        and "behind job big" in late.waiting["small"][1]
    )
    # a job of higher priority is ahead of the reserving one, not behind it
    urgent = run([*jobs, q("urgent", prio=9, t=300)], nodes(2, 2), now=301)
    assert urgent.start == ["urgent"]


def test_quota_holds_an_owner_back_without_blocking_others() -> None:
    quotas = {"alice": Quota(max_running_jobs=1), "bob": Quota(max_cpus=3)}
    running = [Admitted("r1", "alice", TWO)]
    jobs = [q("a1", "alice", t=1), q("b1", "bob", t=2), q("b2", "bob", t=3), q("c1", "carol", t=4)]
    d = run(jobs, nodes(8, 8), admitted=running, quotas=quotas)
    assert d.start == [
        "b1",
        "c1",
    ]  # alice's job waits at its quota; bob's second would reach 4 CPUs > 3
    assert d.waiting["a1"] == (1, "owner 'alice' is at its quota of 1 running job(s)")
    assert d.waiting["b2"] == (2, "owner 'bob' would use 4 CPUs, over its quota of 3 (2 used)")
    gpu = Quota(max_gpus=2)
    assert "over its quota of 2" in (never_within_quota("dave", Demand(4, 1.0, 1.0), gpu) or "")
    assert never_within_quota("dave", Demand(2, 1.0, 1.0), gpu) is None


def test_a_job_the_shrunken_cluster_cannot_hold_waits_flagged_and_reserves_nothing() -> None:
    jobs = [q("big", t=0, d=FOUR), q("small", t=1)]
    d = run(jobs, nodes(2), total=nodes(2), now=1000)
    assert d.too_big == {"big"} and d.start == [
        "small"
    ]  # never reserving: the small job is not held behind it
    assert d.waiting["big"] == (
        1,
        "the whole cluster now has room for 2 of its 4 x (1 CPU) (nodes lost?)",
    )


def test_free_capacity_is_the_lower_of_rays_view_and_the_ledger() -> None:
    cluster = ClusterInfo(
        nodes=[
            NodeInfo(
                "n0", "10.0.0.1", True, 4, 4, 0, 0
            ),  # Ray's usage report has not caught up with a job here
            NodeInfo("n1", "10.0.0.2", True, 4, 1, 0, 0),  # something outside ringtrain uses 3 CPUs
            NodeInfo("n2", "10.0.0.3", False, 4, 0, 0, 0),  # dead: not counted
        ]
    )
    free = free_nodes(cluster, [("n0", TWO, 2)])
    assert [(f.node_id, f.cpus) for f in free] == [("n0", 2.0), ("n1", 1.0)]
    take(TWO, free)  # charged to the node with the most room first
    assert [(f.node_id, f.cpus) for f in free] == [("n0", 0.0), ("n1", 1.0)]
    # a job admitted but not placed yet: charged to the ledger once, whether or not Ray already shows its group
    before = ClusterInfo(nodes=[NodeInfo("n0", "10.0.0.1", True, 4, 4, 0, 0)])
    after = ClusterInfo(nodes=[NodeInfo("n0", "10.0.0.1", True, 4, 2, 0, 0)])
    assert [f.cpus for f in free_nodes(before, pending=[TWO])] == [2.0]
    assert [f.cpus for f in free_nodes(after, pending=[TWO])] == [2.0]


def test_demand_follows_the_spec_and_the_cluster() -> None:
    spec = JobSpec.model_validate(
        {
            "name": "x",
            "data": {"kind": "passkey", "seq_len": 384},
            "parallel": {"ring_size": 3, "data_parallel": 2},
            "train": {"batch_size": 2},
            "resources": {"cpus_per_worker": 0.5},
        }
    )
    gpu_cluster = ClusterInfo(nodes=[NodeInfo("g", "10.0.0.1", True, 8, 8, 4, 4)])
    assert uses_gpus(spec, gpu_cluster) and not uses_gpus(spec, ClusterInfo())
    d = demand_of(spec, True)
    assert (d.bundles, d.cpus, d.gpus) == (6, 3.0, 6.0)
    assert JobSpec.model_validate({"name": "p", "priority": 7}).priority == 7


def test_nodes_the_autoscaler_may_add_count_as_free_capacity() -> None:
    head = NodeInfo("head", "10.0.0.1", True, 8, 8, 0, 0)
    gpu_pod = NodeInfo("pod-1", "10.0.0.2", True, 8, 0, 8, 0)  # one pod of the group is up and busy
    shapes = [NodeShape(cpus=8, gpus=8, max_nodes=3)]
    c = with_autoscaler(ClusterInfo(nodes=[head, gpu_pod]), shapes)
    assert [n.node_id for n in c.nodes] == ["head", "pod-1", "autoscaler-0-0", "autoscaler-0-1"]
    d = Demand(
        16, 1.0, 1.0
    )  # a ring of 16 GPUs: fits the two pods still to come, so it is admitted
    assert fits(d, free_nodes(c)) and not fits(Demand(17, 1.0, 1.0), free_nodes(c))
    assert with_autoscaler(ClusterInfo(nodes=[head]), []).nodes == [head]


def test_gpu_quota_counts_running_and_just_admitted_gpus() -> None:
    """max_gpus adds the owner's GPUs in use (running, and admitted earlier in the same pass) to the
    job's own GPUs, never its CPUs: 2 running + 2 = 4 fits a quota of 4, a third pair would make 6."""
    pair = Demand(
        2, 4.0, 1.0
    )  # 8 CPUs, 2 GPUs: a CPU count mistaken for GPUs would exceed the quota
    quotas = {"alice": Quota(max_gpus=4)}
    running = [Admitted("r1", "alice", pair)]
    jobs = [q("a1", t=1, d=pair), q("a2", t=2, d=pair)]
    d = run(
        jobs,
        [Free("g0", 64.0, 16.0)],
        total=[Free("g0", 64.0, 16.0)],
        admitted=running,
        quotas=quotas,
    )
    assert d.start == ["a1"]
    assert d.waiting == {"a2": (1, "owner 'alice' would use 6 GPUs, over its quota of 4 (4 used)")}


def test_running_job_quota_counts_jobs_admitted_in_the_same_pass() -> None:
    """Three queued jobs of one owner with max_running_jobs=2 and nothing running: two start in one pass,
    the third waits at the quota (each admission counts at once, not only on the next pass)."""
    # bob's quota was lowered to 0 after his job was accepted: it waits, although he runs nothing
    quotas = {"alice": Quota(max_running_jobs=2), "bob": Quota(max_running_jobs=0)}
    jobs = [q("a1", t=1), q("a2", t=2), q("a3", t=3), q("b1", "bob", t=4)]
    d = run(jobs, nodes(8, 8), quotas=quotas)
    assert d.start == ["a1", "a2"]
    assert d.waiting == {
        "a3": (1, "owner 'alice' is at its quota of 2 running job(s)"),
        "b1": (2, "owner 'bob' is at its quota of 0 running job(s)"),
    }


def test_a_job_reserves_from_the_moment_it_has_waited_reserve_after_s() -> None:
    """The boundary: a job that has waited exactly `reserve_after_s` reserves (nothing behind it starts);
    one second earlier the small job behind it is backfilled."""
    jobs = [q("big", t=0, d=Demand(6, 1.0)), q("small", t=5)]
    at = run(jobs, nodes(2, 2), now=300.0, reserve_after_s=300.0)
    assert at.start == [] and "behind job big" in at.waiting["small"][1]
    before = run(jobs, nodes(2, 2), now=299.0, reserve_after_s=300.0)
    assert before.start == ["small"]


def test_gpu_capacity_in_the_ledger_and_in_each_admission() -> None:
    """GPUs follow the CPUs' rules: the ledger charges every placed rank's GPU (2 ranks x 1 GPU on an
    8-GPU node leave 6, while Ray's lagging view still says 8), and admitting 4 more takes 4."""
    cluster = ClusterInfo(nodes=[NodeInfo("g0", "10.0.0.1", True, 16, 16, 8, 8)])
    free = free_nodes(cluster, [("g0", Demand(2, 1.0, 1.0), 2)])
    assert [(f.cpus, f.gpus) for f in free] == [(14.0, 6.0)]
    take(Demand(4, 1.0, 1.0), free)
    assert [(f.cpus, f.gpus) for f in free] == [(10.0, 2.0)]
    assert not fits(Demand(3, 1.0, 1.0), free) and fits(Demand(2, 1.0, 1.0), free)


def test_a_dead_node_of_an_autoscaler_shape_leaves_room_for_a_new_one() -> None:
    """Only alive nodes count against a worker group's maxReplicas: with one of two pods dead, the
    autoscaler may still add two."""
    head = NodeInfo("head", "10.0.0.1", True, 8, 8, 0, 0)
    dead = NodeInfo("pod-1", "10.0.0.2", False, 8, 0, 8, 0)
    c = with_autoscaler(ClusterInfo(nodes=[head, dead]), [NodeShape(cpus=8, gpus=8, max_nodes=2)])
    assert [n.node_id for n in c.nodes] == ["head", "pod-1", "autoscaler-0-0", "autoscaler-0-1"]


def test_a_job_within_its_running_jobs_quota_alone_is_not_refused() -> None:
    """`never_within_quota` asks about the job alone: with max_running_jobs=1 a single job fits (it is
    refused only when the quota is 0)."""
    assert never_within_quota("eve", TWO, Quota(max_running_jobs=1)) is None
    assert never_within_quota("eve", TWO, Quota(max_running_jobs=0)) == (
        "owner 'eve' is at its quota of 0 running job(s)"
    )
