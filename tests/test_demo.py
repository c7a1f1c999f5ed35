"""`make demo` runs `oobleck demo`: real training through the operator on local nodes, a worker killed
midway, a summary; it must leave nothing behind."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from oobleck_dev.demo import EXAMPLE, Observation, Timeline, observe, steps_per_second, summarize, victim


@pytest.mark.slow
@pytest.mark.xdist_group("local-node-jobs-2")  # one job at a time per xdist worker (tests/e2e/test_training.py)
def test_demo_trains_survives_a_kill_and_cleans_up(tmp_path: Path) -> None:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["training"]["steps"] = 80  # the example's shape, fewer steps: the suite stays fast
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(manifest))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "oobleck_dev",
            "demo",
            "--job",
            str(job),
            "--kill-at-step",
            "30",
            "--workdir",
            str(tmp_path / "demo"),
        ],
        capture_output=True,
        text=True,
        timeout=420,
    )
    out = result.stdout
    assert result.returncode == 0, out[-5000:] + result.stderr[-3000:]
    assert "oobleckjob.oobleck.dev/llama-tiny created" in out
    assert re.search(r"job Succeeded: 80/80 steps, plan generation [1-9]", out), out[-3000:]
    assert re.search(r"killed llama-tiny-worker-\d+ at step", out), out[-3000:]
    assert re.search(r"training resumed \(step \d+ completed\) [\d.]+ s after the kill", out), out[-3000:]
    assert "done: nothing left running" in out
    # The API server's port is free again: its process is gone (SO_REUSEADDR: closed connections
    # may linger in TIME_WAIT, a listener may not).
    port = int(re.search(r"at https://127\.0\.0\.1:(\d+)", out).group(1))
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))
        probe.listen()


@pytest.mark.integration
def test_demo_rejects_bad_arguments(tmp_path: Path) -> None:
    for args, message in (
        (["--job", str(tmp_path / "none.yaml")], "no such file"),
        (["--nodes", "0"], "--nodes: must be >= 1"),
        (["--kill-at-step", "999"], "--kill-at-step: must be in 1..299"),
        (["--real-nodes", "--nodes", "9"], "--nodes: at most 8 real nodes, got 9"),
    ):
        result = subprocess.run([sys.executable, "-m", "oobleck_dev", "demo", *args], capture_output=True, text=True)
        assert result.returncode == 2 and message in result.stderr, result.stderr


def _seen(at: float, step: int, generation: int = 0, phase: str = "Running") -> Observation:
    return Observation(
        at=at, phase=phase, step=step, generation=generation, pipelines=2, nodes=4, loss=None, samples_per_second=None
    )


def test_observe_reads_the_status_a_user_sees() -> None:
    job = {
        "status": {
            "phase": "Running",
            "nodes": 4,
            "plan": {"generation": 2, "pipelines": 2},
            "progress": {"step": 7, "loss": 5.25, "samplesPerSecond": 120.0},
        }
    }
    seen = observe(job)
    assert (seen.phase, seen.step, seen.generation, seen.pipelines, seen.nodes, seen.loss, seen.samples_per_second) == (
        "Running",
        7,
        2,
        2,
        4,
        5.25,
        120.0,
    )
    failed = observe(
        {
            "status": {
                "phase": "Failed",
                "conditions": [
                    {"type": "Failed", "status": "True", "message": "layer 3: no surviving worker holds it"}
                ],
            }
        }
    )
    assert failed.step == 0 and failed.generation is None and "layer 3" in failed.reason


def test_summary_measures_recovery_and_throughput_around_the_kill() -> None:
    timeline = Timeline()
    for at, step, generation in (
        (0.0, 0, 0),
        (1.0, 2, 0),
        (2.0, 4, 0),
        (2.5, 4, 1),
        (4.0, 5, 1),
        (5.0, 9, 1),
        (5.5, 10, 1),
    ):
        timeline.add(_seen(at, step, generation))
    timeline.kill_at, timeline.kill_step, timeline.killed_pod = 2.1, 4, "tiny-gpt-worker-1"
    timeline.add(_seen(6.0, 10, 1, "Succeeded"))
    lines = summarize(timeline, steps=10, batch=16)
    assert lines[0] == "job Succeeded: 10/10 steps, plan generation 1, 2 pipelines on 4 nodes"
    assert "new plan generation seen 0.40 s after the kill" in lines[2]
    assert "training resumed (step 5 completed) 1.90 s after the kill" in lines[3]
    assert "throughput before the failure: 2.00 steps/s = 32 samples/s" in lines[4]
    assert "throughput after the failure: 3.33 steps/s = 53 samples/s" in lines[5]
    assert steps_per_second({0: 1.0}, 0, 0) is None


def test_the_victim_is_the_second_training_worker_by_index() -> None:
    from oobleck.api.contract import PROGRESS_ANNOTATION

    def pod(name: str, phase: str = "Running", reported: bool = True) -> dict:
        annotations = {PROGRESS_ANNOTATION: '{"step": 3}'} if reported else {}
        return {"metadata": {"name": name, "annotations": annotations}, "status": {"phase": phase}}

    # worker-1 failed to start and was replaced by worker-4; worker-10 sorts by index, not by name.
    pods = [pod("j-worker-10"), pod("j-worker-4"), pod("j-worker-0"), pod("j-worker-2", reported=False)]
    assert victim(pods) == "j-worker-4"
    assert victim([pod("j-worker-3"), pod("j-worker-1", phase="Pending")]) == "j-worker-3"
    with pytest.raises(RuntimeError, match="no worker pod"):
        victim([pod("j-worker-0", reported=False)])
