"""Tensor-parallel stages in the engine: multi-pipeline jobs whose stages split their layers (t > 1) train
to single-process training's losses and parameters, with pipelines of different t summing their gradients.

Real worker processes, gloo on CPU. Tolerance: the engine's (runtime/train/engine.py) for float64 sums:
every step's loss within 1e-5 relative, the final parameters within 1e-5 absolute; bf16 losses within 1e-2
relative (split bf16 matmuls round differently from the whole ones), parameters within AdamW's 2 lr per step.
"""

from __future__ import annotations

import pytest
import torch

from oobleck.api.plan import Plan
from oobleck.runtime.models.layered import LayeredModel
from oobleck.runtime.train.config import OptimConfig, WorkerConfig, build_model
from oobleck.runtime.train.reference import train_reference
from oobleck.runtime.train.tensor_parallel import TensorParallelGroup, split_layer, split_rules, whole_state

pytestmark = pytest.mark.slow  # real worker processes
STEPS = 8
CONFIG = WorkerConfig(
    job="tp-engine",
    gradient_sum_dtype="float64",
    model={"name": "tiny-gpt", "sizes": {"heads": 4}},  # 4 heads: the blocks split at t = 4 too
    microbatch_size=4,
    steps=STEPS,
    seed=7,
    optim=OptimConfig(lr=3e-3, warmup_steps=2, decay_steps=STEPS),
)


def whole_layers(per_rank: dict, plan: Plan, model: LayeredModel) -> dict[int, list[dict[str, torch.Tensor]]]:
    """Every layer's whole parameters as each holder group has them: a t = 1 rank's own, a TP group's shards
    glued (runtime/train/tensor_parallel.whole_state)."""
    found: dict[int, list[dict[str, torch.Tensor]]] = {}
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            t = stage.tensor_parallel
            for first in range(0, len(stage.ranks), t):
                group = stage.ranks[first : first + t]
                for layer in range(stage.start, stage.end):
                    rules = split_rules(split_layer(model.build_layer(layer), TensorParallelGroup(None, 0, t)))
                    shards = [per_rank[rank][layer] for rank in group]
                    found.setdefault(layer, []).append(whole_state(shards, rules))
    return found


def assert_matches(result, plan: Plan, config: WorkerConfig, reference, loss_rtol: float, param_atol: float):
    steps = [record["step"] for record in result.losses]
    assert steps == list(range(config.steps)), f"logged steps {steps}"
    worst_loss = 0.0
    for record, expected in zip(result.losses, reference.losses):
        relative = abs(record["loss"] - expected) / abs(expected)
        worst_loss = max(worst_loss, relative)
        assert relative <= loss_rtol, f"step {record['step']}: loss {record['loss']} vs reference {expected}"
    assert reference.losses[-1] < reference.losses[0], "training did not reduce the loss: the test would prove little"
    worst_param = 0.0
    wholes = whole_layers(result.per_rank, plan, build_model(config))
    assert set(wholes) == set(range(plan.num_layers))
    for layer, copies in wholes.items():
        for name, want in reference.layers[layer].items():
            for whole in copies:
                difference = (whole[name] - want).abs().max().item()
                worst_param = max(worst_param, difference)
                assert difference <= param_atol, f"layer {layer} {name}: max abs difference {difference}"
    return worst_loss, worst_param


def run_and_check(tmp_path, workers, plan, config=CONFIG, loss_rtol=1e-5, param_atol=1e-5, reference=None):
    reference = reference or train_reference(config, plan.global_microbatches)
    result = workers(tmp_path, config, plan, timeout=400)
    worst = assert_matches(result, plan, config, reference, loss_rtol, param_atol)
    print(f"worst loss rel diff {worst[0]:.2e}, worst param abs diff {worst[1]:.2e}, run {result.seconds:.1f} s")
    return result


def test_a_tp_stage_beside_a_whole_pipeline(tmp_path, plan_builder, workers):
    """t = 2 on the first stage (vocabulary-split embedding) feeding a t = 1 stage; the second pipeline
    holds every layer whole: layers 0-2 sum shards of t = 2 with whole gradients of t = 1."""
    make_plan, Spec = plan_builder
    plan = make_plan(
        [Spec(stages=[(0, 3, 0, 2, 2), (3, 6, 1, 1)], microbatches=3), Spec(stages=[(0, 6, 0, 1)], microbatches=2)],
        num_layers=6,
        gpus_per_node=2,
    )
    run_and_check(tmp_path, workers, plan)


def test_clipping_counts_each_shard_whole(tmp_path, plan_builder, workers):
    """max_grad_norm over TP shards: the global norm counts each layer once, whole, as one process does."""
    make_plan, Spec = plan_builder
    plan = make_plan(
        [Spec(stages=[(0, 2, 0, 1), (2, 6, 1, 2, 2)], microbatches=3), Spec(stages=[(0, 6, 0, 1)], microbatches=2)],
        num_layers=6,
        gpus_per_node=2,
    )
    config = CONFIG.model_copy(update={"max_grad_norm": 0.05})
    reference = train_reference(config, plan.global_microbatches)
    unclipped = train_reference(CONFIG, plan.global_microbatches)
    assert reference.losses[1:] != unclipped.losses[1:], "clipping changed nothing: the test would prove little"
    run_and_check(tmp_path, workers, plan, config, reference=reference)


def test_a_tp_last_stage_and_a_tp_pipeline(tmp_path, plan_builder, workers):
    """t = 1 feeding a t = 2 last stage (vocabulary-split head and parallel cross-entropy), beside a
    one-stage pipeline at t = 2."""
    make_plan, Spec = plan_builder
    plan = make_plan(
        [Spec(stages=[(0, 2, 0, 1), (2, 6, 1, 2, 2)], microbatches=3), Spec(stages=[(0, 6, 0, 1)], microbatches=2)],
        num_layers=6,
        gpus_per_node=2,
    )
    run_and_check(tmp_path, workers, plan)


def test_a_t4_stage(tmp_path, plan_builder, workers):
    """A t = 4 stage (every block split four ways) sending to a t = 1 stage."""
    make_plan, Spec = plan_builder
    plan = make_plan([Spec(stages=[(0, 3, 0, 4, 4), (3, 6, 1, 1)], microbatches=3)], num_layers=6, gpus_per_node=4)
    run_and_check(tmp_path, workers, plan)


def test_two_tp_groups_split_the_microbatch(tmp_path, plan_builder, workers):
    """A stage of 4 GPUs at t = 2: two groups, each its half of every microbatch's rows, fed by a t = 1 stage."""
    make_plan, Spec = plan_builder
    plan = make_plan([Spec(stages=[(0, 2, 0, 1), (2, 6, 1, 4, 2)], microbatches=3)], num_layers=6, gpus_per_node=4)
    run_and_check(tmp_path, workers, plan)


def test_bf16_with_tp_stages(tmp_path, plan_builder, workers):
    """bf16 autocast: split bf16 matmuls round differently from the whole ones, so the losses agree to
    bf16's precision, not bit for bit."""
    from tests.runtime.test_precision import reference_in_a_fresh_process

    make_plan, Spec = plan_builder
    plan = make_plan(
        [Spec(stages=[(0, 3, 0, 2, 2), (3, 6, 1, 2, 2)], microbatches=3), Spec(stages=[(0, 6, 0, 1)], microbatches=2)],
        num_layers=6,
        gpus_per_node=2,
    )
    config = CONFIG.model_copy(update={"precision": "bf16"})
    reference = reference_in_a_fresh_process(config, plan.global_microbatches, tmp_path)
    assert reference.losses != train_reference(CONFIG, plan.global_microbatches).losses, "bf16 changed nothing"
    # AdamW moves an element by up to lr per step whatever its gradient's size: where bf16 rounding flips
    # a tiny gradient's sign, the weights part by up to 2 lr per step (measured: 1.1e-2 on the embedding).
    bound = 2 * config.optim.lr * config.steps
    run_and_check(tmp_path, workers, plan, config, loss_rtol=1e-2, param_atol=bound, reference=reference)


def test_a_tp_job_exports_whole_tensors_that_transformers_loads(tmp_path, plan_builder, workers):
    """Llama at t = 2 in every stage: the lowest holder of every layer holds a shard, yet the finished run's
    Hugging Face export holds whole tensors (the group glues them), which `from_pretrained` loads."""
    from oobleck.runtime.models.hf import load_transformers

    make_plan, Spec = plan_builder
    plan = make_plan([Spec(stages=[(0, 3, 0, 2, 2), (3, 6, 1, 2, 2)], microbatches=3)], num_layers=6, gpus_per_node=2)
    config = WorkerConfig.model_validate(
        CONFIG.model_dump()
        | {
            "job": "tp-export",
            "model": {"transformers": {"preset": "llama-tiny", "sequence_length": 16}},
            "microbatch_size": 2,
            "steps": 4,
            "checkpoint": {"path": str(tmp_path / "ckpt")},
        }
    )
    # Llama's split matmuls change float32 sums more than the GPT's, and AdamW's normalisation amplifies
    # that on parameters with tiny gradients (runtime/train/engine.py): measured 1.2e-5 after 4 steps.
    result = run_and_check(tmp_path, workers, plan, config, param_atol=1e-4)
    assert_export_computes_the_runs_logits(
        tmp_path / "ckpt" / "huggingface",
        result,
        plan,
        load_transformers(None, preset="llama-tiny", sequence_length=16),
    )


def assert_export_computes_the_runs_logits(directory, result, plan: Plan, model: LayeredModel) -> None:
    """The finished run's Hugging Face export is complete, and `from_pretrained` computes the logits the
    run's own final layers (glued whole) compute."""
    from transformers import AutoModelForCausalLM

    from oobleck.runtime.models.hf_checkpoint import is_complete

    assert is_complete(directory)
    wholes = whole_layers(result.per_rank, plan, model)
    tokens = torch.randint(0, model.vocab_size, (2, int(model.example_input(1).shape[1])))
    hidden = tokens
    for index in range(model.num_layers):
        layer = model.build_layer(index)
        layer.load_state_dict(wholes[index][0], strict=False)
        hidden = layer(hidden)
    loaded = AutoModelForCausalLM.from_pretrained(directory)
    torch.testing.assert_close(loaded(input_ids=tokens).logits, hidden, rtol=1e-5, atol=1e-5)
