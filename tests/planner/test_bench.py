"""A very slow node taken out as a spare (planner_cy/bench.py) and priced with the other mitigations
(rebalance.mitigate), on real planner output: which option wins at 1/2, 1/4 and 1/8 of a node's speed."""

from __future__ import annotations

import pytest

from oobleck.api.profile import ClusterShape, LayerProfile, ModelProfile
from oobleck.planner import instantiate
from oobleck.planner.bench import BENCH_REASON, READMIT_REASON, bench, readmit
from oobleck.planner.errors import PlanningError
from oobleck.planner.rebalance import mitigate, step_ms
from oobleck.planner.templates import generate_templates

MIB = 1 << 20
PROFILE = ModelProfile(
    model="even12",
    microbatch_size=1,
    layers=[
        LayerProfile(forward_ms=1.0, backward_ms=2.0, state_bytes=MIB, activation_bytes=1 << 16, output_bytes=1 << 10)
        for _ in range(12)
    ],
)
GPU_MEMORY = int(8.2 * MIB)
"""7 layers fit on a GPU, 8 do not (planner_cy/rebalance.memory_rule): a pipeline of two cannot shed all of a
slow node's layers onto its peer, as a memory-bound job cannot"""
CLUSTER = ClusterShape(
    nodes=4, gpus_per_node=1, gpu_memory_bytes=GPU_MEMORY, intra_node_bandwidth=1e11, inter_node_bandwidth=1e10
)
BANDWIDTH, HORIZON = 1e10, 100


def four_nodes():
    """Two pipelines of two nodes (six layers a stage); templates for 2 and 3 nodes."""
    templates = generate_templates(PROFILE, CLUSTER, f=1, global_microbatches=32, min_nodes_per_pipeline=2)
    plan = instantiate(templates, ["a", "b", "c", "d"], 1, 32, "job")
    assert [p.nodes for p in plan.pipelines] == [["a", "b"], ["c", "d"]]
    assert {t.nodes for t in plan.templates} >= {2, 3}
    return plan


def _mitigate(plan, slowdowns, **kwargs):
    return mitigate(
        plan,
        PROFILE,
        slowdowns,
        0.1,
        bandwidth=BANDWIDTH,
        horizon=HORIZON,
        gpu_memory_bytes=GPU_MEMORY,
        **({"bench_min_nodes": 2} | kwargs),
    )


@pytest.mark.parametrize(
    ("speed", "winner"),
    [(1 / 2, "layers moved"), (1 / 4, BENCH_REASON), (1 / 8, BENCH_REASON)],
)
def test_the_price_takes_a_very_slow_node_out_and_moves_layers_off_a_half_speed_one(speed, winner):
    plan = four_nodes()
    slow = {"c": 1 / speed}
    chosen = _mitigate(plan, slow)
    assert chosen is not None and chosen.reason.startswith(winner), chosen.reason
    if winner == BENCH_REASON:
        assert chosen.benched == {"c": 1 / speed} and "c" not in chosen.nodes and len(chosen.nodes) == 3
        assert not chosen.lost_nodes and not chosen.slowdowns  # not lost: its pod stays, as a spare
        # The layers c held come from their replicas on the other pipeline.
        assert chosen.copies and all(x.src_node != "c" for x in chosen.copies)
        # At 1/4 the best plan on 3 nodes is the ideal's 3 nodes' worth: 3/4 of the unthrottled throughput.
        assert step_ms(chosen, PROFILE, slow) == pytest.approx(plan.iteration_ms * 4 / 3, rel=0.05)
    else:
        assert not chosen.benched and "c" in chosen.nodes
    # Without option (c) (mitigation rebalance) the node always stays.
    kept = _mitigate(plan, slow, bench_min_nodes=None)
    assert kept is not None and not kept.benched


def test_a_mildly_slow_node_stays_and_nodes_min_bounds_the_bench():
    plan = four_nodes()
    mild = _mitigate(plan, {"c": 1.25})
    assert mild is None or not mild.benched
    assert _mitigate(plan, {"c": 8.0}, bench_min_nodes=4).reason.startswith("layers moved")
    assert bench(plan, PROFILE, "c", {"c": 8.0}, bandwidth=BANDWIDTH, horizon=HORIZON, min_nodes=4) is None


def test_a_bench_never_rolls_back_and_the_benched_node_is_taken_back_with_its_layers_copied():
    plan = four_nodes()
    out = bench(plan, PROFILE, "c", {"c": 4.0, "a": 1.6}, bandwidth=BANDWIDTH, horizon=HORIZON)
    assert out is not None and out.generation == plan.generation + 1 and out.slowdowns == {"a": 1.6}
    # Three nodes in one pipeline: every layer has one holder; taking another node out would lose state.
    assert bench(out, PROFILE, "a", {"a": 8.0}, bandwidth=BANDWIDTH, horizon=HORIZON) is None
    back = readmit(out, PROFILE, "c", bandwidth=BANDWIDTH, horizon=HORIZON)
    assert back.reason.startswith(READMIT_REASON) and "c" in back.nodes and not back.benched
    assert back.added_nodes == ["c"]  # what the operator reads as the node on probation
    assert back.generation == out.generation + 1 and {x.dst_node for x in back.copies} >= {"c"}
    with pytest.raises(PlanningError, match="not benched"):
        readmit(back, PROFILE, "c", bandwidth=BANDWIDTH, horizon=HORIZON)


def test_a_plan_refuses_a_benched_node_that_trains():
    plan = four_nodes()
    with pytest.raises(ValueError, match=r"benched: nodes \['c'\] are in a pipeline"):
        type(plan).model_validate(plan.model_dump() | {"benched": {"c": 4.0}})


def test_with_a_warm_spare_at_hand_a_half_speed_node_is_swapped_for_it_in_one_generation():
    """The spare at full speed: the unthrottled step again, for one copy of the layers the node held."""
    plan = four_nodes()
    chosen = _mitigate(plan, {"c": 2.0}, bench_replacement="e")  # "e": a warm spare, in no plan
    assert chosen is not None and chosen.reason.startswith(BENCH_REASON), chosen.reason
    assert "spare e in its place" in chosen.reason and chosen.benched == {"c": 2.0}
    assert sorted(chosen.nodes) == ["a", "b", "d", "e"] and chosen.added_nodes == ["e"]
    assert {x.dst_node for x in chosen.copies} == {"e"} and all(x.src_node != "c" for x in chosen.copies)
    assert step_ms(chosen, PROFILE, {"c": 2.0}) == pytest.approx(plan.iteration_ms, rel=0.01)
