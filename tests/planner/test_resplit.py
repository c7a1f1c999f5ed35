"""The batch re-split around a straggler (planner_cy/resplit.py), on real planner output."""

from __future__ import annotations

from oobleck.api.profile import ClusterShape, LayerProfile, ModelProfile
from oobleck.planner import instantiate
from oobleck.planner.resplit import pipeline_slowdowns, resplit
from oobleck.planner.templates import generate_templates

PROFILE = ModelProfile(
    model="even",
    microbatch_size=1,
    layers=[
        LayerProfile(
            forward_ms=1.0, backward_ms=2.0, state_bytes=1 << 20, activation_bytes=1 << 16, output_bytes=1 << 10
        )
        for _ in range(8)
    ],
)
CLUSTER = ClusterShape(
    nodes=4, gpus_per_node=1, gpu_memory_bytes=1 << 34, intra_node_bandwidth=1e11, inter_node_bandwidth=1e10
)
NODES = ["a", "b", "c", "d"]


def two_by_two():
    """Two pipelines of two nodes: the issue's 4-node example."""
    templates = generate_templates(PROFILE, CLUSTER, f=1, global_microbatches=32, min_nodes_per_pipeline=2)
    templates = [t for t in templates if t.nodes == 2]
    plan = instantiate(templates, NODES, 1, 32, "job")
    assert [p.nodes for p in plan.pipelines] == [["a", "b"], ["c", "d"]] and [
        p.microbatches for p in plan.pipelines
    ] == [16, 16]
    return plan


def test_a_node_at_half_speed_gives_its_pipeline_a_third_of_the_batch_and_moves_no_layer() -> None:
    plan = two_by_two()
    after = resplit(plan, {"c": 2.0, "a": 0.9})
    assert after is not None
    assert pipeline_slowdowns(plan, {"c": 2.0, "a": 0.9}) == [1.0, 2.0]  # faster than the rest counts as 1
    # 32 microbatches, speeds 1 and 1/2: about 21 and 11, the same microbatches in the same order.
    counts = [p.microbatches for p in after.pipelines]
    assert sum(counts) == 32 and counts[0] > counts[1] and abs(counts[0] - 2 * counts[1]) <= 2
    assert [p.microbatch_offset for p in after.pipelines] == [0, counts[0]]
    assert after.generation == plan.generation + 1 and after.copies == [] and not after.lost_nodes
    assert [[(s.node, s.start, s.end, s.ranks) for s in p.stages] for p in after.pipelines] == [
        [(s.node, s.start, s.end, s.ranks) for s in p.stages] for p in plan.pipelines
    ]
    assert "re-split" in after.reason and "'c': 2.0" in after.reason
    # Both pipelines now finish together, well before the slow one did with half the batch.
    slow_before = 2 * plan.pipelines[1].iteration_ms
    assert after.iteration_ms < 0.8 * slow_before
    # Already split so: nothing to do. Recovered: back to the even split.
    assert resplit(after, {"c": 2.0}) is None
    back = resplit(after, {"c": 1.0})
    assert back is not None and [p.microbatches for p in back.pipelines] == [16, 16]
    assert back.generation == after.generation + 1
