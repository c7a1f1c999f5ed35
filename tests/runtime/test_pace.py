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
    # Other layers: recalibrate from scratch.
    pace.on_stage((3, 6, 1))
    assert pace.baseline is None and pace.slowdown is None and not pace.history
    with pytest.raises(ValueError, match="window"):
        Pace(window=0)
