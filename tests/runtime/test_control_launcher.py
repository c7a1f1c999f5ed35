"""`oobleck launch` end to end: real coordinator, real worker processes (gloo), real SIGKILLs.

Every run is compared with E1's single-process reference trainer (runtime/reference.py): the loss of
every step within LOSS_RTOL relative (the engine's documented tolerance), the final parameters
within PARAM_ATOL, and the step count exact. `gpu_memory` is set so that the planner must use
2- and 3-node pipeline templates: losing a node then really moves layers between survivors.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from oobleck.runtime.config import load_config
from oobleck.runtime.reference import train_reference

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
PIPELINED_MEMORY = 1_400_000  # bytes: tiny-gpt needs 2-3 nodes per pipeline (see the planner's memory model)
ENV = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}

# Serial within one xdist worker (make test uses --dist loadgroup): each test runs 4-8 processes,
# and two at once on a small machine starve heartbeats.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("control-processes")]


@pytest.fixture(scope="module")
def uniform_profile(tmp_path_factory) -> Path:
    """tiny-gpt's measured bytes with equal per-layer times: the planner's choices become deterministic."""
    from oobleck.api.profile import ModelProfile
    from oobleck.runtime.config import WorkerConfig, build_model
    from oobleck.runtime.profiler import profile_model

    measured = profile_model(build_model(WorkerConfig()), 4, torch.device("cpu"), 1, 1)
    layers = [layer.model_dump() | {"forward_ms": 1.0, "backward_ms": 2.0} for layer in measured.layers]
    path = tmp_path_factory.mktemp("profile") / "uniform.json"
    path.write_text(ModelProfile.model_validate(measured.model_dump() | {"layers": layers}).model_dump_json())
    return path


def launch(workdir: Path, *args: str, timeout: float = 400) -> tuple[int, dict, str]:
    summary = workdir / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "oobleck.cli", "launch", "--workdir", str(workdir), "--summary", str(summary),
         "--timeout", str(timeout - 30), *args],
        capture_output=True, text=True, timeout=timeout, env=ENV,
    )
    data = json.loads(summary.read_text()) if summary.exists() else {}
    return proc.returncode, data, proc.stdout + proc.stderr[-4000:]


def leftovers(workdir: Path, exclude: int | None = None) -> list[str]:
    """Processes whose command line mentions `workdir` (every worker's does), but `exclude`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(workdir) in cmdline and int(entry.name) not in (exclude, os.getpid()):
                found.append(f"{entry.name}: {cmdline[:200]}")
    return found


def check_against_reference(workdir: Path, summary: dict, microbatches: int) -> float:
    config = load_config(workdir / "config.json")
    reference = train_reference(config, microbatches)
    losses = {int(k): v for k, v in summary["losses"].items()}
    assert sorted(losses) == list(range(config.steps)), f"steps logged: {sorted(losses)}"
    worst = 0.0
    for step, expected in enumerate(reference.losses):
        relative = abs(losses[step] - expected) / abs(expected)
        worst = max(worst, relative)
        assert relative <= LOSS_RTOL, f"step {step}: loss {losses[step]} vs reference {expected}"
    # Final parameters: every dump of the final generation, every layer, against the reference.
    plan = json.loads((workdir / "plan.json").read_text())
    seen = set()
    for assignment in plan["ranks"]:
        dump = torch.load(workdir / f"{assignment['node']}-gpu{assignment['gpu']}.pt")
        for layer, params in dump.items():
            seen.add(layer)
            for name, value in params.items():
                difference = (value - reference.layers[layer][name]).abs().max().item()
                assert difference <= PARAM_ATOL, f"layer {layer} {name}: {difference}"
    assert seen == set(range(plan["num_layers"]))
    return worst


def test_a_job_without_faults_matches_the_reference(tmp_path):
    code, summary, output = launch(tmp_path, "--nodes", "4", "--f", "1", "--steps", "6", "--microbatches", "8",
                                   "--gpu-memory", str(PIPELINED_MEMORY))
    assert code == 0, output
    assert summary["ok"] and summary["generations"] == 1 and summary["reconfigurations"] == []
    check_against_reference(tmp_path, summary, 8)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("delay", ["0", "0.012", "0.03"])
def test_kill_rank_reconfigures_and_finishes_every_step_exactly(tmp_path, delay, uniform_profile):
    """The delay moves the kill through the step (forward, backward, gradient sums, update: ~40 ms).

    Plan: two pipelines node0-node1 and node2-node3 with stages [0, 3) [3, 6); node1 dies; the
    survivors form one 3-node pipeline [0, 2) [2, 4) [4, 6), for which layer 3 must be copied.
    """
    code, summary, output = launch(tmp_path, "--nodes", "4", "--f", "1", "--steps", "10", "--microbatches", "8",
                                   "--gpu-memory", str(PIPELINED_MEMORY), "--profile", str(uniform_profile),
                                   "--kill-rank", "1", "--at-step", "4", "--kill-delay", delay)
    assert code == 0, output
    print(output.split("\n\n")[-1][-1500:])
    assert summary["ok"] and summary["steps"] == 10
    [reconfiguration] = summary["reconfigurations"]
    assert reconfiguration["reason"] == "lost" and reconfiguration["lost"] == ["node1"]
    assert reconfiguration["moves"], "the plan's reason (the planner's moves) is recorded"
    assert reconfiguration["copies"] >= 1, "a 2-node pipeline lost a node: layers must move"
    assert reconfiguration["first_step_s"] < 5.0
    worst = check_against_reference(tmp_path, summary, 8)
    print(f"worst loss relative difference {worst:.2e}; recovery {reconfiguration}")
    assert summary["exit_codes"]["node1:0"] == -signal.SIGKILL
    assert leftovers(tmp_path) == []


def test_heartbeats_alone_detect_the_kill(tmp_path):
    """Without the launcher's process-exit signal, the survivors' heartbeat watchers find the dead worker."""
    code, summary, output = launch(tmp_path, "--nodes", "4", "--f", "1", "--steps", "8", "--microbatches", "8",
                                   "--gpu-memory", str(PIPELINED_MEMORY), "--kill-rank", "2", "--at-step", "3",
                                   "--heartbeats-only")
    assert code == 0, output
    [reconfiguration] = summary["reconfigurations"]
    assert reconfiguration["lost"] == ["node2"]
    assert reconfiguration["detected_s"] < 2.0, reconfiguration
    print(f"heartbeat path: {reconfiguration}")
    check_against_reference(tmp_path, summary, 8)


def test_two_simultaneous_kills_with_f2_on_7_nodes(tmp_path):
    code, summary, output = launch(tmp_path, "--nodes", "7", "--f", "2", "--steps", "8", "--microbatches", "8",
                                   "--gpu-memory", str(PIPELINED_MEMORY), "--kill-node", "node1", "--kill-node",
                                   "node3", "--at-step", "3", timeout=500)
    assert code == 0, output
    lost = sorted(n for r in summary["reconfigurations"] for n in r["lost"])
    assert lost == ["node1", "node3"], summary["reconfigurations"]
    check_against_reference(tmp_path, summary, 8)
    assert leftovers(tmp_path) == []


@pytest.mark.xfail(
    strict=False,
    reason="known intermittent hang (seen once in 5 full runs): a worker crashes in the store client while "
    "the coordinator is recreated and the job waits until the launcher's timeout; tracked in issue #4's note",
)
def test_the_coordinator_lost_and_recreated_mid_run(tmp_path, uniform_profile):
    """The store dies with every key; workers reconnect and re-rendezvous under the new epoch's prefix."""
    code, summary, output = launch(tmp_path, "--nodes", "4", "--f", "1", "--steps", "10", "--microbatches", "8",
                                   "--gpu-memory", str(PIPELINED_MEMORY), "--profile", str(uniform_profile),
                                   "--restart-coordinator-at-step", "4")
    assert code == 0, output
    [reconfiguration] = summary["reconfigurations"]
    assert reconfiguration["reason"] == "coordinator-restart" and reconfiguration["lost"] == []
    check_against_reference(tmp_path, summary, 8)
    assert leftovers(tmp_path) == []


def test_a_kill_during_a_reconfiguration(tmp_path):
    """A second worker dies while the survivors of the first kill rendezvous and copy layers."""
    from oobleck.runtime.launcher import Fault, LaunchOptions, Launcher

    options = LaunchOptions(
        nodes=7, f=2, steps=8, microbatches=8, gpu_memory=PIPELINED_MEMORY, workdir=tmp_path, timeout_s=400,
        comm_timeout_s=20,
        faults=(Fault(at_step=3, nodes=("node1",)), Fault(at_step=3, nodes=("node5",), delay_s=0.3)),
    )
    summary = Launcher(options).run().as_dict()
    assert summary["ok"], summary["error"]
    assert sorted(n for r in summary["reconfigurations"] for n in r["lost"]) == ["node1", "node5"]
    print(f"reconfigurations: {summary['reconfigurations']}")
    check_against_reference(tmp_path, summary, 8)
    assert leftovers(tmp_path) == []


def test_a_node_added_mid_run_joins_and_trains(tmp_path):
    code, summary, output = launch(tmp_path, "--nodes", "2", "--f", "1", "--steps", "8", "--microbatches", "4",
                                   "--add-node-at-step", "3")
    assert code == 0, output
    [reconfiguration] = summary["reconfigurations"]
    assert reconfiguration["reason"] == "add" and reconfiguration["added"] == ["node2"]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert "node2" in [a["node"] for a in plan["ranks"]]
    log = (tmp_path / "node2-gpu0.log").read_text().splitlines()
    joined = [json.loads(line) for line in log if line.startswith("{")]
    assert any(e.get("event") == "step" for e in joined), "the added node never trained"
    check_against_reference(tmp_path, summary, 4)


def test_ctrl_c_and_a_killed_launcher_leave_no_process_behind(tmp_path):
    for how in (signal.SIGINT, signal.SIGKILL):
        workdir = tmp_path / how.name
        proc = subprocess.Popen(
            [sys.executable, "-m", "oobleck.cli", "launch", "--workdir", str(workdir), "--nodes", "3",
             "--steps", "100000", "--microbatches", "3"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until every worker has trained a step
            logs = list(workdir.glob("*.log"))
            if len(logs) == 3 and all('"event": "step"' in p.read_text() for p in logs):
                break
            time.sleep(0.2)
        else:
            proc.kill()
            pytest.fail("workers never started training")
        assert len(leftovers(workdir, exclude=proc.pid)) == 3
        proc.send_signal(how)
        proc.wait(30)
        if how == signal.SIGINT:
            assert proc.returncode == 1
        deadline = time.monotonic() + 10
        while leftovers(workdir) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert leftovers(workdir) == [], how.name


def test_bad_options_name_the_argument(tmp_path):
    for args, message in (
        (["--nodes", "0"], "nodes: must be >= 1"),
        (["--nodes", "2", "--kill-rank", "1"], "--at-step: required"),
        (["--nodes", "2", "--steps", "5", "--kill-rank", "1", "--at-step", "9"], "at_step: 9 is outside"),
    ):
        proc = subprocess.run([sys.executable, "-m", "oobleck.cli", "launch", "--workdir", str(tmp_path), *args],
                              capture_output=True, text=True, env=ENV)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
