"""A rank's pace against the plan's profile (runtime/train/pace.py), on real planner output."""

from __future__ import annotations

import pytest

from oobleck.api.profile import ClusterShape, LayerProfile, ModelProfile
from oobleck.planner import instantiate
from oobleck.planner.templates import generate_templates
from oobleck.runtime.train.pace import Pace, expected_compute_seconds

PROFILE = ModelProfile(
    model="uneven",
    microbatch_size=1,
    layers=[
        LayerProfile(
            forward_ms=1.0 + i,
            backward_ms=2.0 + 2 * i,
            state_bytes=1 << 20,
            activation_bytes=1 << 16,
            output_bytes=1 << 10,
        )
        for i in range(6)
    ],
)
CLUSTER = ClusterShape(
    nodes=5, gpus_per_node=1, gpu_memory_bytes=1 << 34, intra_node_bandwidth=1e11, inter_node_bandwidth=1e10
)


def test_every_rank_of_a_planned_job_gets_its_stage_cost_times_its_microbatches() -> None:
    templates = generate_templates(PROFILE, CLUSTER, f=1, global_microbatches=12)
    plan = instantiate(templates, [f"n{i}" for i in range(5)], 1, 12, "job")
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            # The stage's layers by the profile: what a rank of it computes per microbatch on one GPU.
            layers = PROFILE.layers[stage.start : stage.end]
            per_microbatch = sum(layer.forward_ms + layer.backward_ms for layer in layers) / len(stage.ranks)
            for rank in stage.ranks:
                expected = expected_compute_seconds(plan, rank)
                assert expected == pytest.approx(pipeline.microbatches * per_microbatch / 1000, rel=1e-6)
    assert expected_compute_seconds(plan, plan.world_size) is None  # not a rank of the plan


def test_the_slowdown_is_against_the_calibrated_start_and_ignores_one_noisy_step() -> None:
    pace = Pace(window=5, warmup=2, calibration=5, history=4)
    pace.on_stage((0, 3, 1))
    for seconds in (0.5, 0.5):  # warm-up steps: never the baseline
        pace.add(seconds, 0.05)
    for seconds in (0.15, 0.15, 0.9, 0.15, 0.15):  # calibration with one step 6x slower (a page fault)
        assert pace.slowdown is None
        pace.add(seconds, 0.05)
    assert pace.baseline == pytest.approx(3.0) and pace.slowdown == pytest.approx(1.0)
    assert pace.profile_ratio == pytest.approx(3.0)  # this stage runs 3x its (noisy) profile
    for step in (10, 11, 12):  # three of the last five steps twice as slow: the median moves there
        pace.add(0.3, 0.05, step)
    assert pace.slowdown == pytest.approx(2.0)
    # The last steps' figures, for the operator to line up with the other nodes' (the noisy step, still in
    # the window, tipped the median a step early).
    assert list(pace.history) == [(0, 1.0), (10, 1.0), (11, 2.0), (12, 2.0)]
    pace.add(0.3, None)  # a step without a profiled cost is left out
    pace.add(0.0, 0.05)
    assert pace.slowdown == pytest.approx(2.0)
    # A new batch split of the same stage (its per-microbatch cost is the same): the baseline stays.
    pace.on_stage((0, 3, 1))
    assert pace.baseline == pytest.approx(3.0)
    # Other layers without a profiled cost: recalibrate from scratch.
    pace.on_stage((3, 6, 1), carry=False)
    assert pace.baseline is None and pace.slowdown is None and not pace.history
    with pytest.raises(ValueError, match="window"):
        Pace(window=0)


def test_a_stage_change_carries_the_calibration_so_a_node_moved_while_slow_reads_slow_and_recovers() -> None:
    """The baseline is a ratio to the profile: on a stage with other layers (and another profiled cost) it
    stands for the old calibrated seconds scaled by the profiled ratio of new to old costs."""
    pace = Pace(window=3, warmup=2, calibration=3)
    pace.on_stage((0, 4, 1))
    for _ in range(5):
        pace.add(0.3, 0.1)  # at pace: 3x its profile
    assert pace.baseline == pytest.approx(3.0)
    for step in range(3):
        pace.add(0.6, 0.1, step)  # slowed to half speed
    assert pace.slowdown == pytest.approx(2.0)
    # Moved while slow to a stage of half the profiled cost: half the seconds, still twice its pace.
    pace.on_stage((0, 2, 1))
    assert pace.baseline == pytest.approx(3.0) and pace.slowdown is None and not pace.history
    pace.add(5.0, 0.05, 10)  # the warm-up steps on the new stage are no figure
    pace.add(5.0, 0.05, 11)
    assert pace.slowdown is None
    for step in (12, 13, 14):
        pace.add(0.3, 0.05, step)
    assert pace.slowdown == pytest.approx(2.0) and list(pace.history)[-1] == (14, 2.0)
    # Recovered on the moved stage: at pace, so the operator can give it its layers back.
    for step in (15, 16, 17):
        pace.add(0.15, 0.05, step)
    assert pace.slowdown == pytest.approx(1.0)


def test_a_moved_stage_reports_its_own_profiled_cost() -> None:
    """A stage whose bounds are not its template's (layers moved off a slow node) carries its profiled cost."""
    from oobleck.planner.rebalance import rebalance

    templates = generate_templates(PROFILE, CLUSTER, f=1, global_microbatches=12)
    plan = instantiate([t for t in templates if t.nodes == 2], [f"n{i}" for i in range(4)], 1, 12, "job")
    slow = plan.pipelines[1].stages[0].node
    moved = rebalance(plan, PROFILE, {slow: 3.0})
    assert moved is not None
    changed = 0
    for pipeline in moved.pipelines:
        for stage in pipeline.stages:
            layers = PROFILE.layers[stage.start : stage.end]
            per_microbatch = sum(layer.forward_ms + layer.backward_ms for layer in layers) / len(stage.ranks)
            for rank in stage.ranks:
                expected = expected_compute_seconds(moved, rank)
                assert expected == pytest.approx(pipeline.microbatches * per_microbatch / 1000, rel=1e-6)
            changed += stage.forward_ms is not None
    assert changed == 2  # the slow pipeline's two stages; the other pipeline keeps its template's bounds
