"""`oobleck launch` end to end: real coordinator, real worker processes (gloo), real SIGKILLs.

Every run is compared with E1's single-process reference trainer (runtime/train/reference.py): the loss of
every step within LOSS_RTOL relative (the engine's documented tolerance), the final parameters
within PARAM_ATOL (both in tests/runtime/conftest.py, served by the `kit` fixture), and the step count exact. `gpu_memory` is set so that the planner must use
2- and 3-node pipeline templates: losing a node then really moves layers between survivors.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

# Serial within one xdist worker (make test uses --dist loadgroup): each test runs 4-8 processes,
# and two at once on a small machine starve heartbeats.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("control-processes")]


def test_a_job_without_faults_matches_the_reference(kit, tmp_path):
    code, summary, output = kit.launch(
        tmp_path,
        *kit.pipelined(steps=6),
    )
    assert code == 0, output
    assert summary["ok"] and summary["generations"] == 1 and summary["reconfigurations"] == []
    kit.check_against_reference(tmp_path, summary, 8)
    assert kit.leftovers(tmp_path) == []


@pytest.mark.parametrize("delay", ["0", "0.012", "0.03"])
def test_kill_rank_reconfigures_and_finishes_every_step_exactly(kit, tmp_path, delay, uniform_profile):
    """The delay moves the kill through the step (forward, backward, gradient sums, update: ~40 ms).

    Plan: two pipelines node0-node1 and node2-node3 with stages [0, 3) [3, 6); node1 dies; the
    survivors form one 3-node pipeline [0, 2) [2, 4) [4, 6), for which layer 3 must be copied.
    """
    code, summary, output = kit.launch(
        tmp_path,
        *kit.pipelined(profile=uniform_profile, kill_rank=1, at_step=4, kill_delay=delay),
    )
    assert code == 0, output
    print(output.split("\n\n")[-1][-1500:])
    assert summary["ok"] and summary["steps"] == 10
    [reconfiguration] = summary["reconfigurations"]
    assert reconfiguration["reason"] == "lost" and reconfiguration["lost"] == ["node1"]
    assert reconfiguration["moves"], "the plan's reason (the planner's moves) is recorded"
    assert reconfiguration["copies"] >= 1, "a 2-node pipeline lost a node: layers must move"
    assert reconfiguration["first_step_s"] < 5.0
    worst = kit.check_against_reference(tmp_path, summary, 8)
    print(f"worst loss relative difference {worst:.2e}; recovery {reconfiguration}")
    assert summary["exit_codes"]["node1:0"] == -signal.SIGKILL
    assert kit.leftovers(tmp_path) == []


def _data_parallel(workdir) -> bool:
    """Whether the job's final plan holds the whole model on every rank (memory for it: single-node pipelines)."""
    plan = json.loads((workdir / "plan.json").read_text())
    return all((s["start"], s["end"]) == (0, plan["num_layers"]) for p in plan["pipelines"] for s in p["stages"])


@pytest.mark.parametrize("fault", ["kill", "coordinator"])
def test_data_parallel_replicas_recover_exactly_without_a_step_commit(kit, tmp_path, fault):
    """Data-parallel steps skip the commit (runtime/elastic/commit.py `needs_commit`): a kill landing in the
    sums or the update, or a coordinator lost mid-step, may leave survivors a step apart; those behind take
    their layers from the newest (runtime/elastic/sources.py), and every loss still matches the reference."""
    faults = {
        "kill": {"kill_rank": 1, "at_step": 4, "kill_delay": "0.02"},
        "coordinator": {"restart_coordinator_at_step": 4},
    }
    code, summary, output = kit.launch(tmp_path, *kit.flags(nodes=3, f=1, steps=8, microbatches=6, **faults[fault]))
    assert code == 0, output
    assert _data_parallel(tmp_path)
    lost = [n for r in summary["reconfigurations"] for n in r["lost"]]
    assert lost == (["node1"] if fault == "kill" else []), summary["reconfigurations"]
    assert all(r["restore_step"] is None for r in summary["reconfigurations"]), "no rollback"
    kit.check_against_reference(tmp_path, summary, 6)
    assert kit.leftovers(tmp_path) == []


def test_heartbeats_alone_detect_the_kill(kit, tmp_path):
    """Without the launcher's process-exit signal, the survivors' heartbeat watchers find the dead worker."""
    code, summary, output = kit.launch(
        tmp_path,
        *kit.pipelined(steps=8, kill_rank=2, at_step=3, heartbeats_only=True, dead_after=3),
    )
    assert code == 0, output
    [reconfiguration] = summary["reconfigurations"]
    assert reconfiguration["lost"] == ["node2"]
    # A killed process no longer answers its liveness probe, so the verdict comes well before the 3 s
    # `--dead-after` (which only spares peers that still answer: slow, not dead). Functional bound only;
    # bench/recovery.py measures the detection time.
    assert reconfiguration["detected_s"] < 2.5, reconfiguration
    print(f"heartbeat path: {reconfiguration}")
    kit.check_against_reference(tmp_path, summary, 8)


def test_two_simultaneous_kills_with_f2_on_7_nodes(kit, tmp_path):
    code, summary, output = kit.launch(
        tmp_path,
        *kit.flags(
            nodes=7,
            f=2,
            steps=8,
            microbatches=8,
            gpu_memory=kit.PIPELINED_MEMORY,
            kill_node=["node1", "node3"],
            at_step=3,
        ),
        timeout=500,
    )
    assert code == 0, output
    lost = sorted(n for r in summary["reconfigurations"] for n in r["lost"])
    assert lost == ["node1", "node3"], summary["reconfigurations"]
    kit.check_against_reference(tmp_path, summary, 8)
    assert kit.leftovers(tmp_path) == []


def test_the_coordinator_lost_and_recreated_mid_run(kit, tmp_path, uniform_profile):
    """The store dies with every key; workers reconnect and re-rendezvous under the new epoch's prefix."""
    code, summary, output = kit.launch(
        tmp_path,
        *kit.pipelined(profile=uniform_profile, restart_coordinator_at_step=4),
    )
    assert code == 0, output
    # A sudden load (CI: two busy processes started beside the job) can hold a worker off the CPU past its
    # probe before the 1-minute load average shows it; its peer's verdict is then a suspicion the launcher
    # does not confirm (the worker beats again), and the step is redone in a "retry" generation that loses
    # nobody. Only the restart itself is this test's business.
    reconfigurations = summary["reconfigurations"]
    retries = [r for r in reconfigurations if r["reason"] == "retry"]
    assert all(r["lost"] == [] for r in retries), retries
    [reconfiguration] = [r for r in reconfigurations if r["reason"] != "retry"]
    assert reconfiguration["reason"] == "coordinator-restart" and reconfiguration["lost"] == []
    kit.check_against_reference(tmp_path, summary, 8)
    assert kit.leftovers(tmp_path) == []


def test_a_kill_during_a_reconfiguration(kit, tmp_path):
    """A second worker dies while the survivors of the first kill rendezvous and copy layers."""
    from oobleck.runtime.backends.local.launcher import Fault, Launcher, LaunchOptions

    options = LaunchOptions(
        nodes=7,
        f=2,
        steps=8,
        microbatches=8,
        gpu_memory=kit.PIPELINED_MEMORY,
        workdir=tmp_path,
        timeout_s=400,
        comm_timeout_s=20,
        faults=(Fault(at_step=3, nodes=("node1",)), Fault(at_step=3, nodes=("node5",), delay_s=0.3)),
    )
    summary = Launcher(options).run().as_dict()
    assert summary["ok"], summary["error"]
    assert sorted(n for r in summary["reconfigurations"] for n in r["lost"]) == ["node1", "node5"]
    print(f"reconfigurations: {summary['reconfigurations']}")
    kit.check_against_reference(tmp_path, summary, 8)
    assert kit.leftovers(tmp_path) == []


def test_a_node_added_mid_run_joins_and_trains(kit, tmp_path):
    # The node is added once step 3 is reached and its worker beats; 40 steps leave it time to start on a loaded
    # host (with 8, a clean-clone suite once finished the job first: data-parallel steps of tens of ms).
    code, summary, output = kit.launch(tmp_path, *kit.flags(nodes=2, f=1, steps=40, microbatches=4, add_node_at_step=3))
    assert code == 0, output
    [reconfiguration] = summary["reconfigurations"]
    assert reconfiguration["reason"] == "add" and reconfiguration["added"] == ["node2"]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert "node2" in [n for p in plan["pipelines"] for n in p["nodes"]]
    log = (tmp_path / "node2-gpu0.log").read_text().splitlines()
    joined = [json.loads(line) for line in log if line.startswith("{")]
    assert any(e.get("event") == "step" for e in joined), "the added node never trained"
    kit.check_against_reference(tmp_path, summary, 4)


@pytest.mark.timeout(1200)  # two launches, each within its liveness bounds below
def test_ctrl_c_and_a_killed_launcher_leave_no_process_behind(kit, tmp_path):
    for how in (signal.SIGINT, signal.SIGKILL):
        workdir = tmp_path / how.name
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "oobleck.cli",
                "launch",
                "--workdir",
                str(workdir),
                "--nodes",
                "3",
                "--steps",
                "100000",
                "--microbatches",
                "3",
            ],
            # A file, not a pipe nobody reads: a launcher blocked writing to a full pipe never exits.
            stdout=(tmp_path / f"{how.name}.out").open("wb"),
            stderr=subprocess.STDOUT,
            env=kit.ENV,
            # Ctrl-C at a terminal: SIGINT at its default even when this suite runs as a background job (a
            # shell starts those with SIGINT ignored, and Python then never turns it into KeyboardInterrupt).
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        # Liveness bounds, not timings: in CI beside the real-node run (load ~20) one of them once ran out.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # until every worker has trained a step
            logs = list(workdir.glob("*.log"))
            if len(logs) == 3 and all('"event": "step"' in p.read_text() for p in logs):
                break
            time.sleep(0.2)
        else:
            proc.kill()
            pytest.fail(f"workers never started training in 300 s (load {os.getloadavg()[0]:.1f})")
        assert len(kit.leftovers(workdir, exclude=proc.pid)) == 3
        tree = kit.descendants(proc.pid)  # the workers, their forkserver and multiprocessing's resource tracker
        assert len(tree) >= 3 + 1, tree
        proc.send_signal(how)
        try:
            proc.wait(180)  # the workers' orderly exit, on a loaded 2-core host
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(
                f"the launcher outlived {how.name} by 180 s (load {os.getloadavg()[0]:.1f}):\n{(tmp_path / f'{how.name}.out').read_text()[-3000:]}"
            )
        if how == signal.SIGINT:
            assert proc.returncode == 1
        deadline = time.monotonic() + 30
        while (kit.leftovers(workdir) or kit.descendants_left(tree)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert kit.leftovers(workdir) == [], how.name
        assert kit.descendants_left(tree) == set(), how.name


def test_bad_options_name_the_argument(kit, tmp_path):
    for args, message in (
        (["--nodes", "0"], "nodes: must be >= 1"),
        (["--nodes", "2", "--kill-rank", "1"], "--at-step: required"),
        (["--nodes", "2", "--steps", "5", "--kill-rank", "1", "--at-step", "9"], "at_step: 9 is outside"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "oobleck.cli", "launch", "--workdir", str(tmp_path), *args],
            capture_output=True,
            text=True,
            env=kit.ENV,
        )
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
