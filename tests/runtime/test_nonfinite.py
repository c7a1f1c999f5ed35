"""training.onNonFinite, for real: `oobleck launch` with worker processes (gloo) and a model whose loss
turns NaN at a chosen step (oobleck_dev.faultmodels.nonfinite_gpt: microbatch 0 of that step only, so
one pipeline's ranks see it in their loss and the others only through the gradient sums and the
step's commit: every rank must still take the same branch)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from oobleck.runtime.train.config import load_config
from oobleck.runtime.train.numerics import find_non_finite
from oobleck.runtime.train.reference import train_reference

# Serial with the other launcher tests (each runs several processes): see test_control_launcher.py.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("control-processes")]

BAD_STEP = 5
STEPS = 8
MICROBATCHES = 4
MODEL = "oobleck_dev.faultmodels:nonfinite_gpt"


def launch(kit, workdir: Path, policy: str, *extra: str) -> tuple[int, dict, str]:
    (workdir / "base.json").write_text(json.dumps({"on_non_finite": policy}))
    return kit.launch(
        workdir,
        *("--nodes", "2", "--f", "1", "--steps", str(STEPS), "--microbatches", str(MICROBATCHES)),
        *("--model", MODEL, "--config", str(workdir / "base.json"), *extra),
        env={"NONFINITE_AT_STEPS": str(BAD_STEP)},
    )


def events(workdir: Path, name: str) -> list[dict]:
    found = []
    for path in workdir.glob("*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{") and f'"event": "{name}"' in line:
                found.append(json.loads(line))
    return found


def check_before_the_bad_step(workdir: Path, losses: dict[str, float]) -> None:
    """Steps before BAD_STEP are single-process training's exactly (the same model, nothing went wrong yet)."""
    reference = train_reference(load_config(workdir / "config.json"), MICROBATCHES, steps=BAD_STEP)
    for step, expected in enumerate(reference.losses):
        assert abs(losses[str(step)] - expected) <= 1e-5 * abs(expected), (step, losses[str(step)], expected)


def test_fail_ends_the_job_with_the_cause_at_the_bad_step(kit, tmp_path):
    code, summary, output = launch(kit, tmp_path, "fail")
    assert not summary["ok"], output
    assert "NonFiniteLoss" in summary["error"] and f"step {BAD_STEP}: the loss is nan" in summary["error"]
    assert 14 in summary["exit_codes"].values()  # oobleck.api.causes.EXIT_CODES["NonFiniteLoss"]
    assert sorted(int(s) for s in summary["losses"] if not math.isnan(summary["losses"][s])) == list(range(BAD_STEP))
    check_before_the_bad_step(tmp_path, summary["losses"])
    assert kit.leftovers(tmp_path) == []


def test_skip_step_drops_the_update_on_every_rank_and_goes_on(kit, tmp_path):
    code, summary, output = launch(kit, tmp_path, "skipStep")
    assert code == 0 and summary["ok"] and summary["steps"] == STEPS, output
    losses = summary["losses"]
    assert math.isnan(losses[str(BAD_STEP)])
    assert all(math.isfinite(losses[str(s)]) for s in range(STEPS) if s != BAD_STEP)
    check_before_the_bad_step(tmp_path, losses)
    seen = events(tmp_path, "non-finite")
    assert len(seen) == 2 and {e["step"] for e in seen} == {BAD_STEP}  # both ranks, the same step
    # The final parameters are finite on every rank, and the two replicas agree exactly.
    dumps = [torch.load(p) for p in sorted(tmp_path.glob("*.pt"))]
    assert len(dumps) == 2
    for layer, params in dumps[0].items():
        for name, value in params.items():
            assert torch.isfinite(value).all() and torch.equal(value, dumps[1][layer][name]), (layer, name)


def test_rollback_restores_the_newest_snapshot_and_goes_on_with_the_next_data(kit, tmp_path):
    code, summary, output = launch(kit, tmp_path, "rollback", "--snapshot-interval", "2")
    assert code == 0 and summary["ok"] and summary["steps"] == STEPS, output
    losses = summary["losses"]
    assert math.isnan(losses[str(BAD_STEP)]) and all(math.isfinite(losses[str(s)]) for s in range(BAD_STEP + 1, STEPS))
    check_before_the_bad_step(tmp_path, losses)
    rolled = events(tmp_path, "rolled-back")
    # Snapshots every 2 steps: the newest before step 5 holds the state before step 4.
    assert len(rolled) == 2 and {(e["step"], e["to"]) for e in rolled} == {(BAD_STEP, 4)}
    # Step 6 runs from the state before step 4 (the reference's after 4 steps) with step 6's data.
    config = load_config(tmp_path / "config.json")
    reference = train_reference(config, MICROBATCHES, steps=4)
    from oobleck.runtime.train.config import build_dataset, build_model

    model = build_model(config)
    data = build_dataset(config, model)
    layers = [model.build_layer(index) for index in range(model.num_layers)]
    for index, layer in enumerate(layers):
        for name, parameter in layer.named_parameters():
            parameter.data.copy_(reference.layers[index][name])
    total, samples = 0.0, 0
    with torch.no_grad():
        for m in range(MICROBATCHES):
            x, y = data.microbatch(BAD_STEP + 1, m)
            out = x
            for layer in layers:
                out = layer(out)
            total += float(model.loss(out, y).sum())
            samples += x.shape[0]
    assert abs(losses[str(BAD_STEP + 1)] - total / samples) <= 1e-5 * total / samples


def test_find_non_finite_names_the_loss_or_the_layer():
    grad = torch.zeros(4, dtype=torch.float64)
    param = torch.nn.Parameter(torch.zeros(4))
    assert find_non_finite([grad], None, [(grad, param)], lambda p: (0, "w")) is None
    grad[2] = float("inf")
    assert (
        find_non_finite([grad], None, [(grad, param)], lambda p: (3, "w"))
        == "the gradient of layer 3 (w) is not finite"
    )
    loss = torch.tensor([float("nan")], dtype=torch.float64)
    assert find_non_finite([grad, loss], loss, [], lambda p: (0, "")) == "the loss is nan"


def test_find_non_finite_fast_sum_neither_misses_nor_invents():
    """The fast path sums in float64: float32 values near their maximum do not overflow it, opposite
    infinities still count, and a float64 buffer whose sum overflows on finite values is confirmed finite."""
    param = torch.nn.Parameter(torch.zeros(3))
    big = torch.full((3,), torch.finfo(torch.float32).max, dtype=torch.float32)
    assert find_non_finite([big], None, [(big, param)], lambda p: (0, "w")) is None
    huge = torch.full((3,), torch.finfo(torch.float64).max, dtype=torch.float64)
    assert find_non_finite([huge], None, [(huge, param)], lambda p: (0, "w")) is None
    opposite = torch.tensor([float("inf"), float("-inf"), 1.0])
    assert find_non_finite([opposite], None, [(opposite, param)], lambda p: (1, "b")) == (
        "the gradient of layer 1 (b) is not finite"
    )
    nan = torch.tensor([0.0, float("nan"), 0.0])
    assert find_non_finite([big, nan], None, [(big, param), (nan, param)], lambda p: (2, "c")) == (
        "the gradient of layer 2 (c) is not finite"
    )
