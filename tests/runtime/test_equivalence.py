"""THE equivalence test: distributed execution of a plan equals single-process training.

Real worker processes, gloo on CPU. Tolerance (see runtime/train/engine.py): loss within 1e-5 relative at
every step, final parameters within 1e-5 absolute, replicas of a layer bitwise identical.
"""

from __future__ import annotations

import math

import pytest
import torch

from oobleck.runtime.train.config import OptimConfig, WorkerConfig
from oobleck.runtime.train.reference import train_reference

pytestmark = pytest.mark.slow  # real worker processes
STEPS = 20
CONFIG = WorkerConfig(
    job="equivalence",
    gradient_sum_dtype="float64",  # compared with the single-process reference to 1e-5
    model={"name": "tiny-gpt"},
    microbatch_size=4,
    steps=STEPS,
    seed=7,
    optim=OptimConfig(lr=3e-3, warmup_steps=3, decay_steps=STEPS),
)
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5


def assert_matches_reference(result, plan, config=CONFIG):
    reference = train_reference(config, plan.global_microbatches)
    steps = [record["step"] for record in result.losses]
    assert steps == list(range(config.steps)), f"logged steps {steps}"
    worst = 0.0
    for record, expected in zip(result.losses, reference.losses):
        relative = abs(record["loss"] - expected) / abs(expected)
        worst = max(worst, relative)
        assert relative <= LOSS_RTOL, f"step {record['step']}: loss {record['loss']} vs reference {expected}"
    assert reference.losses[-1] < reference.losses[0], "training did not reduce the loss: the test would prove little"
    assert set(result.layers) == set(range(plan.num_layers))
    worst_param = 0.0
    for layer, params in result.layers.items():
        for name, value in params.items():
            difference = (value - reference.layers[layer][name]).abs().max().item()
            worst_param = max(worst_param, difference)
            assert difference <= PARAM_ATOL, f"layer {layer} {name}: max abs difference {difference}"
    # Every replica of a layer ends bitwise identical (they apply the same reduced gradients).
    for rank, layers in result.per_rank.items():
        for layer, params in layers.items():
            for name, value in params.items():
                assert torch.equal(value, result.layers[layer][name]), f"rank {rank} layer {layer} {name} diverged"
    return worst, worst_param


def test_two_templates_match_reference(tmp_path, plan_builder, workers):
    """4 single-GPU nodes, f = 1: a 1-node pipeline and a 3-node pipeline with different microbatch counts."""
    make_plan, Spec = plan_builder
    plan = make_plan(
        [
            Spec(stages=[(0, 6, 0, 1)], microbatches=3),
            Spec(stages=[(0, 2, 0, 1), (2, 4, 1, 1), (4, 6, 2, 1)], microbatches=5),
        ],
        num_layers=6,
    )
    result = workers(tmp_path, CONFIG, plan)
    worst, worst_param = assert_matches_reference(result, plan)
    print(f"worst loss rel diff {worst:.2e}, worst param abs diff {worst_param:.2e}, run {result.seconds:.1f} s")


def test_stage_with_two_gpus_matches_reference(tmp_path, plan_builder, workers):
    """Stages of g = 2 ranks split every microbatch: 2 -> 1 ranks in one pipeline, 1 -> 2 (the loss
    itself split) in the other, with different layer splits and microbatch counts."""
    make_plan, Spec = plan_builder
    plan = make_plan(
        [
            Spec(stages=[(0, 3, 0, 2), (3, 6, 1, 1)], microbatches=5),
            Spec(stages=[(0, 4, 0, 1), (4, 6, 1, 2)], microbatches=3),
        ],
        num_layers=6,
        gpus_per_node=2,
    )
    result = workers(tmp_path, CONFIG, plan)
    worst, worst_param = assert_matches_reference(result, plan)
    print(f"worst loss rel diff {worst:.2e}, worst param abs diff {worst_param:.2e}, run {result.seconds:.1f} s")


def test_float32_gradient_sums_stay_close(tmp_path, plan_builder, workers):
    """The cheaper float32 accumulator: same mathematics, float32 rounding (looser tolerance)."""
    make_plan, Spec = plan_builder
    plan = make_plan(
        [Spec(stages=[(0, 1, 0, 1), (1, 6, 1, 1)], microbatches=3), Spec(stages=[(0, 6, 0, 1)], microbatches=1)],
        num_layers=6,
    )
    config = CONFIG.model_copy(update={"steps": 4, "gradient_sum_dtype": "float32"})
    result = workers(tmp_path, config, plan)
    assert [r["step"] for r in result.losses] == [0, 1, 2, 3]
    assert {r["generation"] for r in result.losses} == {0}
    assert {r["rank"] for r in result.losses} == {1}  # last stage of pipeline 0 logs
    reference = train_reference(config, plan.global_microbatches)
    for record, expected in zip(result.losses, reference.losses):
        assert math.isfinite(record["loss"]) and abs(record["loss"] - expected) <= 1e-4 * abs(expected)


def test_planner_made_plan_matches_reference(tmp_path, workers):
    """A plan from the real planner, fed with this runtime's own profile of the model."""
    instantiate = pytest.importorskip("oobleck.planner.instantiate", reason="the planner is not built")
    from oobleck.api.profile import ClusterShape
    from oobleck.runtime.train.config import build_model
    from oobleck.runtime.train.profiler import profile_model

    torch.set_num_threads(1)
    profile = profile_model(build_model(CONFIG), CONFIG.microbatch_size, torch.device("cpu"), warmup=1, iterations=3)
    # Memory for about half the model per GPU: the planner must build multi-stage pipelines.
    cluster = ClusterShape(
        nodes=4, gpus_per_node=1, gpu_memory_bytes=1_500_000, intra_node_bandwidth=1e11, inter_node_bandwidth=1e10
    )
    plan = instantiate.plan_job(profile, cluster, f=1, global_microbatches=8, job="planned")
    assert len(plan.pipelines) >= 2 and max(len(p.stages) for p in plan.pipelines) >= 2
    result = workers(tmp_path, CONFIG, plan)
    worst, worst_param = assert_matches_reference(result, plan)
    layout = [[(s.start, s.end, len(s.ranks)) for s in p.stages] for p in plan.pipelines]
    print(f"planner layout {layout}: worst loss rel diff {worst:.2e}, param diff {worst_param:.2e}")


def test_dropout_masks_do_not_depend_on_the_layout(tmp_path, plan_builder, workers):
    """Dropout draws from an RNG seeded per (step, microbatch, layer): pipelines match the reference,
    and a redone step would draw the same masks (no RNG state to move)."""
    make_plan, Spec = plan_builder
    plan = make_plan(
        [Spec(stages=[(0, 2, 0, 1), (2, 6, 1, 1)], microbatches=3), Spec(stages=[(0, 6, 0, 1)], microbatches=2)],
        num_layers=6,
    )
    config = WorkerConfig.model_validate(
        CONFIG.model_dump() | {"steps": 4, "model": {"name": "tiny-gpt", "sizes": {"dropout": 0.2}}}
    )
    result = workers(tmp_path, config, plan)
    reference = train_reference(config, plan.global_microbatches)
    without = train_reference(
        WorkerConfig.model_validate(config.model_dump() | {"model": {"name": "tiny-gpt"}}), plan.global_microbatches
    )
    assert abs(reference.losses[0] - without.losses[0]) > 1e-4, "dropout had no effect: the test would prove nothing"
    for record, expected in zip(result.losses, reference.losses):
        assert abs(record["loss"] - expected) <= LOSS_RTOL * abs(expected), f"step {record['step']}"
