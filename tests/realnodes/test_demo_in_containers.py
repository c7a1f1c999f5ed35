"""`python -m oobleck_dev demo --real-nodes` (`make demo DEMO_ARGS=--real-nodes`): the demo's story in containers
on kubelet + containerd nodes, a worker's container killed through containerd midway; it must leave the host as
it found it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from oobleck_dev import realnodes
from oobleck_dev.demo import EXAMPLE
from tests.realnodes.marks import realnode_marks
from tests.realnodes.test_nodes import host_snapshot

pytestmark = realnode_marks(1800)


def test_the_demo_runs_in_containers_survives_a_container_kill_and_leaves_the_host_as_found(tmp_path: Path) -> None:
    problem = realnodes.host_problem()
    if problem:
        pytest.skip(problem)
    manifest = yaml.safe_load(EXAMPLE.read_text())
    # The example's shape, fewer steps: the suite stays fast. The kill comes early and the job is not too short: on
    # a busy host the job's status trailed its workers by 8 s once (a 60-step job to be killed at step 20 had
    # finished by then), and at load ~20 the kill came 10 s after the status showed step 41 of 80, too late.
    manifest["spec"]["training"]["steps"] = STEPS = 200
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(manifest))
    before = host_snapshot()
    command = [sys.executable, "-m", "oobleck_dev", "demo", "--real-nodes", "--nodes", "4", "--job", str(job)]
    result = subprocess.run(
        [*command, "--kill-at-step", "3", "--workdir", str(tmp_path / "demo")], capture_output=True, text=True
    )
    out = result.stdout
    assert result.returncode == 0, out[-5000:] + result.stderr[-3000:]
    assert "spec.image: the project image" in out and "oobleckjob.oobleck.dev/llama-tiny created" in out
    assert re.search(r"killed llama-tiny-worker-\d+'s container through containerd \(SIGKILL\)", out), out[-3000:]
    assert re.search(rf"job Succeeded: {STEPS}/{STEPS} steps, plan generation [1-9]", out), out[-3000:]
    assert re.search(r"training resumed \(step \d+ completed\) [\d.]+ s after the kill", out), out[-3000:]
    assert "done: nothing left running" in out
    assert host_snapshot() == before
