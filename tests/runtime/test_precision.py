"""Precision (bf16 autocast), activation recomputation, gradient clipping and float32 gradient sums.

Pure single-process checks first, then real worker processes (gloo on CPU) against the single-process
reference trainer (runtime/train/reference.py), which runs the same layer code and clips with the stock
`torch.nn.utils.clip_grad_norm_`.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

from oobleck.runtime.models.layered import layer_seed
from oobleck.runtime.train.compute import autocast, run_layer
from oobleck.runtime.train.config import ModelConfig, OptimConfig, WorkerConfig, build_model
from oobleck.runtime.train.groups import group_specs
from oobleck.runtime.train.profiler import profile_model
from oobleck.runtime.train.reference import ReferenceResult, ReferenceState, train_reference

CPU = torch.device("cpu")
BASE = WorkerConfig(
    job="precision",
    model={"name": "tiny-gpt"},
    microbatch_size=4,
    steps=6,
    seed=5,
    optim=OptimConfig(lr=3e-3, warmup_steps=2, decay_steps=6),
    gradient_sum_dtype="float64",
)
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5


def _grads(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]


def test_recompute_gives_the_same_outputs_and_gradients_with_dropout():
    """A checkpointed block reruns its forward with the RNG state of the first run: same dropout masks,
    bitwise the same output and gradients."""
    model = build_model(WorkerConfig(model={"name": "tiny-gpt", "sizes": {"dropout": 0.3}}))
    block = model.build_layer(1)
    x = torch.randn(2, 16, model.sizes.hidden)
    results = []
    for recompute in (False, True):
        torch.manual_seed(layer_seed(0, 0, 0, 1))
        inp = x.clone().requires_grad_(True)
        out = run_layer(block, inp, recompute)
        out.square().sum().backward()
        results.append((out.detach(), inp.grad, _grads(block)))
        block.zero_grad(set_to_none=True)
    (out0, dx0, g0), (out1, dx1, g1) = results
    assert torch.equal(out0, out1) and torch.equal(dx0, dx1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_bf16_autocast_keeps_float32_master_weights_and_gradients():
    model = build_model(WorkerConfig())
    block = model.build_layer(1)
    x = torch.randn(2, 16, model.sizes.hidden, requires_grad=True)
    with autocast(CPU, "bf16"):
        out = run_layer(block, x, recompute=False)
    out.float().sum().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in block.parameters())
    with autocast(CPU, "fp32"):
        reference = block(x)
    assert not torch.equal(out.float(), reference), "bf16 autocast changed nothing: the test would prove little"
    with pytest.raises(ValueError, match="precision"):
        autocast(CPU, "fp16")


def test_config_rejects_bad_values_naming_the_field():
    for field, value in [
        ("precision", "fp16"),
        ("recompute", "some"),
        ("max_grad_norm", 0),
        ("gradient_sum_dtype", "half"),
    ]:
        with pytest.raises(ValidationError, match=field):
            WorkerConfig(**{field: value})
    assert WorkerConfig().gradient_sum_dtype == "float32"


def test_profile_reflects_recompute_and_precision():
    """With recompute a block keeps only its input; bf16 keeps smaller activations than fp32."""
    torch.set_num_threads(1)
    model = build_model(WorkerConfig())
    plain = profile_model(model, 4, CPU, warmup=0, iterations=1)
    recomputed = profile_model(model, 4, CPU, warmup=0, iterations=1, recompute="full")
    bf16 = profile_model(model, 4, CPU, warmup=0, iterations=1, precision="bf16")
    for index in range(1, model.num_layers - 1):
        block_input = plain.layers[index - 1].output_bytes
        assert recomputed.layers[index].activation_bytes == block_input < plain.layers[index].activation_bytes
        assert bf16.layers[index].activation_bytes < plain.layers[index].activation_bytes
        assert recomputed.layers[index].state_bytes == plain.layers[index].state_bytes
    with pytest.raises(ValueError, match="recompute"):
        profile_model(model, 4, CPU, recompute="some")


def test_clipping_adds_one_group_of_all_ranks(plan_builder):
    make_plan, Spec = plan_builder
    plan = make_plan(
        [Spec(stages=[(0, 3, 0, 1), (3, 6, 1, 1)], microbatches=2), Spec(stages=[(0, 6, 0, 1)], microbatches=1)],
        num_layers=6,
    )
    without = {spec.name for spec in group_specs(plan, 4)}
    with_all = {spec.name: spec.members for spec in group_specs(plan, 4, everyone=True)}
    assert "everyone" not in without and with_all.pop("everyone") == (0, 1, 2)
    assert set(with_all) == without


# -- real worker processes ---------------------------------------------------------------------------


def assert_matches(result, reference, plan, rtol=LOSS_RTOL, atol=PARAM_ATOL):
    assert [r["step"] for r in result.losses] == list(range(len(reference.losses)))
    worst_loss = max(abs(r["loss"] - e) / abs(e) for r, e in zip(result.losses, reference.losses))
    worst_param = max(
        (value - reference.layers[layer][name]).abs().max().item()
        for layer, params in result.layers.items()
        for name, value in params.items()
    )
    assert worst_loss <= rtol, f"worst relative loss difference {worst_loss}"
    assert worst_param <= atol, f"worst parameter difference {worst_param}"
    assert set(result.layers) == set(range(plan.num_layers))
    for layers in result.per_rank.values():
        for layer, params in layers.items():
            for name, value in params.items():
                assert value.dtype == torch.float32, f"layer {layer} {name}: {value.dtype} master weights"
                assert torch.equal(value, result.layers[layer][name]), f"replicas of layer {layer} {name} diverged"
    return worst_loss, worst_param


@pytest.mark.slow
def test_clipping_by_the_global_norm_matches_clip_grad_norm(tmp_path, plan_builder, workers):
    """Layers replicated in two pipelines and split over a 2-rank stage: each layer's squared norm is
    counted once, so the clipped run equals single-process training with clip_grad_norm_."""
    make_plan, Spec = plan_builder
    plan = make_plan(
        [Spec(stages=[(0, 2, 0, 2), (2, 6, 1, 1)], microbatches=3), Spec(stages=[(0, 6, 0, 1)], microbatches=2)],
        num_layers=6,
        gpus_per_node=2,
    )
    # The reference's gradient norms run ~0.3-1; 0.05 clips every step.
    config = BASE.model_copy(update={"max_grad_norm": 0.05})
    reference = train_reference(config, plan.global_microbatches)
    unclipped = train_reference(BASE, plan.global_microbatches)
    assert reference.losses[1:] != unclipped.losses[1:], "clipping changed nothing: the test would prove little"
    result = workers(tmp_path, config, plan, timeout=400)
    worst = assert_matches(result, reference, plan)
    print(f"clipped: worst loss rel diff {worst[0]:.2e}, param diff {worst[1]:.2e}")


def reference_in_a_fresh_process(config: WorkerConfig, microbatches: int, folder):
    """train_reference in its own process, as the workers run: CPU bf16 kernels (oneDNN) can round
    differently in a process whose earlier bf16 calls ran with another thread count (the tests above)."""
    (folder / "reference-config.json").write_text(config.model_dump_json())
    script = (
        "import sys, torch\n"
        "from oobleck.runtime.train.config import load_config\n"
        "from oobleck.runtime.train.reference import train_reference\n"
        "r = train_reference(load_config(sys.argv[1]), int(sys.argv[2]))\n"
        "torch.save({'losses': r.losses, 'layers': r.layers, 'state': vars(r.state)}, sys.argv[3])\n"
    )
    out = folder / "reference.pt"
    subprocess.run(
        [sys.executable, "-c", script, str(folder / "reference-config.json"), str(microbatches), str(out)],
        check=True,
        timeout=600,
    )
    saved = torch.load(out)
    return ReferenceResult(losses=saved["losses"], layers=saved["layers"], state=ReferenceState(**saved["state"]))


@pytest.mark.slow
def test_bf16_with_recompute_matches_the_reference(tmp_path, plan_builder, workers):
    """bf16 autocast + recomputation with dropout on two 1-GPU-stage layouts: the same operations as the
    reference in every stage, so the only difference left is the order of float64 additions."""
    make_plan, Spec = plan_builder
    plan = make_plan(
        [Spec(stages=[(0, 3, 0, 1), (3, 6, 1, 1)], microbatches=3), Spec(stages=[(0, 6, 0, 1)], microbatches=2)],
        num_layers=6,
    )
    config = BASE.model_copy(
        update={"precision": "bf16", "recompute": "full", "model": ModelConfig(name="tiny-gpt", sizes={"dropout": 0.1})}
    )
    reference = reference_in_a_fresh_process(config, plan.global_microbatches, tmp_path)
    fp32 = train_reference(config.model_copy(update={"precision": "fp32"}), plan.global_microbatches)
    assert reference.losses != fp32.losses, "bf16 changed nothing: the test would prove little"
    result = workers(tmp_path, config, plan, timeout=400)
    worst = assert_matches(result, reference, plan)
    print(f"bf16 + recompute: worst loss rel diff {worst[0]:.2e}, param diff {worst[1]:.2e}")


@pytest.mark.slow
def test_float32_sums_against_the_exact_reference(tmp_path, plan_builder, workers):
    """The default float32 sums against float64 single-process training.

    Tolerance: a float32 sum of k terms is off by at most ~k * 2^-24 relative per element (k = 5
    microbatches plus one all-reduce term here: ~4e-7); the loss responds to that linearly, but AdamW
    divides each gradient by its own running scale, so a parameter whose gradient is tiny moves by up
    to lr in a direction the rounding may flip. Over 6 steps at lr 3e-3 the measured differences are
    6e-8 (loss, relative) and 1.5e-6 (parameters, absolute); we allow 1e-5 and 1e-4."""
    make_plan, Spec = plan_builder
    plan = make_plan(
        [Spec(stages=[(0, 1, 0, 1), (1, 6, 1, 1)], microbatches=3), Spec(stages=[(0, 6, 0, 1)], microbatches=2)],
        num_layers=6,
    )
    config = BASE.model_copy(update={"gradient_sum_dtype": "float32"})
    result = workers(tmp_path, config, plan, timeout=400)
    reference = train_reference(BASE, plan.global_microbatches)
    assert all(math.isfinite(r["loss"]) for r in result.losses)
    worst = assert_matches(result, reference, plan, rtol=1e-5, atol=1e-4)
    print(f"float32 sums vs float64 reference: worst loss rel diff {worst[0]:.2e}, param diff {worst[1]:.2e}")
