"""`oobleck launch --max-tensor-parallel`: the planner gives stages t > 1, the job trains like one process,
and a killed node is recovered in place (TP shards are not reported as layers, so the survivors roll back
to their whole snapshots and replay)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch

from oobleck.api.plan import Plan
from oobleck.runtime.train.config import build_model, load_config
from oobleck.runtime.train.reference import train_reference

from .test_tp_engine import whole_layers

pytestmark = pytest.mark.slow  # a whole local job


def test_a_tp_job_survives_a_killed_node_and_trains_exactly(kit, tmp_path):
    # microbatch size 1: a sample cannot be split over a stage's two GPUs, so the planner takes t = 2
    code, summary, output = kit.launch(
        tmp_path,
        *kit.flags(
            nodes=3,
            gpus_per_node=2,
            steps=8,
            microbatches=6,
            microbatch_size=1,
            max_tensor_parallel=2,
            snapshot_interval=2,
            kill_node="node2",
            at_step=5,
        ),
    )
    assert code == 0, output
    assert summary["ok"] and summary["steps"] == 8
    [reconfiguration] = summary["reconfigurations"]
    assert reconfiguration["lost"] == ["node2"]
    # The survivors hold shards only, reported as no layer: they restore the last snapshot (taken whole).
    assert reconfiguration["restore_step"] in (2, 4) and set(reconfiguration["restore_sources"]) == {"own-snapshot"}
    print(f"recovery: {reconfiguration}")
    assert summary["exit_codes"]["node2:0"] == -signal.SIGKILL
    plan = Plan.model_validate_json((tmp_path / "plan.json").read_text())
    assert {stage.tensor_parallel for p in plan.pipelines for stage in p.stages} == {2}, "the planner chose t = 2"
    config = load_config(tmp_path / "config.json")
    reference = train_reference(config, 6)
    losses = {int(k): v for k, v in summary["losses"].items()}
    assert sorted(losses) == list(range(8))
    for step, want in enumerate(reference.losses):
        assert abs(losses[step] - want) <= 1e-5 * abs(want), f"step {step}: {losses[step]} vs {want}"
    per_rank = {a.rank: torch.load(tmp_path / f"{a.node}-gpu{a.gpu}.pt") for a in plan.ranks}
    for layer, wholes in whole_layers(per_rank, plan, build_model(config)).items():
        for whole in wholes:
            for name, want in reference.layers[layer].items():
                assert (whole[name] - want).abs().max().item() <= 1e-5, f"layer {layer} {name}"
    assert kit.leftovers(tmp_path) == []


def test_max_tensor_parallel_is_checked_naming_the_option(kit, tmp_path):
    for value in ("3", "4"):
        proc = subprocess.run(
            [sys.executable, "-m", "oobleck.cli", "launch", "--workdir", str(tmp_path), "--nodes", "1"]
            + ["--gpus-per-node", "2", "--max-tensor-parallel", value],
            capture_output=True,
            text=True,
            env=kit.ENV,
        )
        assert proc.returncode == 2 and "max_tensor_parallel: must be a power of two <= gpus_per_node (2)" in (
            proc.stderr
        ), proc.stderr
