"""More than f failures, end to end through `oobleck launch`: real worker processes (gloo), real SIGKILLs.

4 nodes, f = 1: pipelines node0-node1 and node2-node3 with stages [0, 3) [3, 6). Killing node0 and
node2 takes every live replica of layers 0-2; the job rolls back to the newest snapshot step and
replays. Losses (every step, replayed ones included: the launcher fails on a step logged twice with losses
more than 1e-5 apart) and final parameters are compared with the single-process reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# Serial with the other launcher tests (each runs 4+ processes): see test_control_launcher.py.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("control-processes")]


def base(kit) -> list[str]:
    """The flags every test here shares: 4 nodes, f = 1, node0 and node2 killed."""
    return kit.pipelined(kill_node=["node0", "node2"])


def loss_records(workdir: Path) -> list[dict]:
    return [
        json.loads(line) for path in workdir.glob("*.losses.jsonl") for line in path.read_text().splitlines() if line
    ]


def test_losing_every_replica_of_a_layer_rolls_back_to_the_in_memory_snapshot(kit, tmp_path, uniform_profile):
    # Killed at step 7: the snapshot of step 4 has had three steps to reach the buddies.
    code, summary, output = kit.launch(
        tmp_path, *base(kit), "--profile", str(uniform_profile), "--snapshot-interval", "4", "--at-step", "7"
    )
    assert code == 0, output
    assert summary["ok"] and summary["steps"] == 10
    assert len(summary["reconfigurations"]) == 1, summary["reconfigurations"]  # both kills in one generation
    [rollback] = summary["reconfigurations"]
    print(f"rollback: {rollback}")
    assert rollback["lost"] == ["node0", "node2"] and rollback["restore_step"] == 4
    assert rollback["moves"].startswith("rollback")
    # node1 and node3 survive with their own [3, 6) and their buddies' (node0's, node2's) [0, 3): the
    # planner lays the one remaining pipeline over them so that every layer is restored in place.
    assert rollback["restore_sources"] == {"own-snapshot": 6}
    # Steps 4-6 ran twice (generation 0, then the replay in generation 1) with the same loss.
    records = loss_records(tmp_path)
    for step in (4, 5, 6):
        runs = {(r["generation"], r["loss"]) for r in records if r["step"] == step}
        assert {g for g, _ in runs} == {0, 1} and len({loss for _, loss in runs}) == 1, runs
    worst = kit.check_against_reference(tmp_path, summary, 8)
    print(f"worst loss relative difference {worst:.2e}")
    assert kit.leftovers(tmp_path) == []


def test_layers_no_snapshot_holds_are_restored_from_the_checkpoint_directory(kit, tmp_path, uniform_profile):
    """In-memory peer snapshots off: the survivors keep only their own layers of the checkpoint
    steps in memory; layers 0-2, whose every holder died, come from the directory."""
    checkpoints = tmp_path / "checkpoints"
    code, summary, output = kit.launch(
        tmp_path,
        *base(kit),
        "--profile",
        str(uniform_profile),
        "--snapshot-interval",
        "0",
        "--checkpoint-dir",
        str(checkpoints),
        "--checkpoint-interval",
        "3",
        "--at-step",
        "8",
    )
    assert code == 0, output
    [rollback] = summary["reconfigurations"]
    print(f"rollback: {rollback}")
    assert rollback["restore_step"] == 6
    # Layers 0-2 (whose holders died) from the directory, 3-5 from the survivor's own capture of step 6.
    assert rollback["restore_sources"] == {"own-snapshot": 3, "checkpoint": 3}
    from oobleck.runtime.snapshot.checkpoint_dir import checkpoint_holdings

    held = checkpoint_holdings(checkpoints)
    assert held[9] == set(range(6)), "the replay writes on"
    assert 0 not in held, "older complete checkpoints are pruned (keep 2)"
    kit.check_against_reference(tmp_path, summary, 8)
    assert kit.leftovers(tmp_path) == []


def test_without_snapshots_the_job_fails_with_the_clear_message(kit, tmp_path):
    code, summary, output = kit.launch(tmp_path, *base(kit), "--snapshot-interval", "0", "--at-step", "3")
    assert code != 0
    assert not summary["ok"]
    assert "more than f failures; restore from a checkpoint" in summary["error"], summary["error"]
    assert "no in-memory snapshot or checkpoint holds every layer" in summary["error"]
    assert kit.leftovers(tmp_path) == []
