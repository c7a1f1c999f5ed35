"""`oobleck launch --max-tensor-parallel`: the planner gives stages t > 1, the job trains like one process,
and a killed node is recovered in place from the survivors' TP shards (workers report them; the members
copy shards, runtime/elastic/shard_sources.py), with no rollback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import torch

from oobleck.api.plan import Plan
from oobleck.runtime.train.config import build_model, load_config
from oobleck.runtime.train.layer_state import state_nbytes
from oobleck.runtime.train.reference import train_reference
from oobleck.runtime.train.tensor_parallel import TensorParallelGroup, split_layer

from .test_tp_engine import whole_layers

pytestmark = pytest.mark.slow  # a whole local job


def worker_events(workdir, event: str) -> list[dict]:
    """The JSON events `event` that the job's workers logged (runtime/elastic/worker.py `_log`, loop.py)."""
    found = []
    for path in sorted(workdir.glob("*-gpu*.log")):
        for line in path.read_text().splitlines():
            start = line.find('{"event": ')
            if start >= 0:
                record = json.loads(line[start:])
                if record["event"] == event:
                    found.append(record)
    return found


def test_a_tp_job_survives_a_killed_node_in_place_and_a_new_node_gets_shard_copies(kit, tmp_path):
    """Three one-node pipelines at t = 2; node2 is killed at step 3: no whole replica of any layer survives,
    but two complete t = 2 shard sets do, so the survivors go on in place (no rollback). A node added at step 5
    then receives each of its shards from a survivor holding that very shard. Every loss and the final
    weights equal single-process training."""
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
            at_step=3,
            add_node_at_step=5,
        ),
    )
    assert code == 0, output
    assert summary["ok"] and summary["steps"] == 8
    lost, added = summary["reconfigurations"]
    assert lost["lost"] == ["node2"] and added["added"], (lost, added)
    print(f"recovery: {lost}\naddition: {added}")
    assert lost["restore_step"] is None and added["restore_step"] is None
    assert worker_events(tmp_path, "restored") == [], "a worker rolled back to its snapshots"
    assert all(event["restore_step"] is None for event in worker_events(tmp_path, "sources-resolved"))
    assert summary["exit_codes"]["node2:0"] == -signal.SIGKILL
    plan = Plan.model_validate_json((tmp_path / "plan.json").read_text())
    assert {stage.tensor_parallel for p in plan.pipelines for stage in p.stages} == {2}, "the planner chose t = 2"
    # The added node's two GPUs each received shard k of every layer: half of each layer's state, from a
    # holder of that shard (a header naming another shard is refused, runtime/train/shard_copy.py).
    [new_node] = added["added"]
    config = load_config(tmp_path / "config.json")
    model = build_model(config)
    with torch.device("meta"):
        half = sum(state_nbytes(split_layer(model.build_layer(i), TensorParallelGroup(None, 0, 2))) for i in range(6))
    joined = [e for e in worker_events(tmp_path, "adopted") if e["node"] == new_node and e["copied_bytes"]]
    assert sorted(e["gpu"] for e in joined) == [0, 1] and {e["copied_bytes"] for e in joined} == {half}
    reference = train_reference(config, 6)
    losses = {int(k): v for k, v in summary["losses"].items()}
    assert sorted(losses) == list(range(8))
    for step, want in enumerate(reference.losses):
        assert abs(losses[step] - want) <= 1e-5 * abs(want), f"step {step}: {losses[step]} vs {want}"
    per_rank = {a.rank: torch.load(tmp_path / f"{a.node}-gpu{a.gpu}.pt") for a in plan.ranks}
    for layer, wholes in whole_layers(per_rank, plan, model).items():
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
