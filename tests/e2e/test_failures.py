"""Failures of every kind, end to end: `kubectl apply` -> the operator (a real process) -> worker pods on
local nodes (real processes) -> a fault -> a new plan generation -> the job Succeeds at the exact step.

Each test checks what issue #6 asks of every fault: the job completes with the exact step count (the pod
delete, the GPU test and the operator crash, whose stories end while the job trains on, stop there: the steps
left would only repeat the loss check); every step's loss, as the workers logged it (replays included), matches a no-failure
run of the same job (the single-process reference trainer) within the runtime's tolerance; plan generations
go 0, 1, ... without a gap or a repeat; no pod is created twice; and the operator's and a worker's /metrics,
scraped over HTTP and parsed, count what happened (pods lost, generations, failure-to-patch observations,
pods created; the survivors' generation, step, pipelines and reconfigurations).

The faults:
- two workers SIGKILLed at once (f = 2: four one-node pipelines on four nodes) -> one generation, the
  survivors' recovery timed by their own histogram;
- `kubectl delete pod` of a worker -> a generation without it while its replacement is Pending, then, once
  the replacement can run, one that folds it in (after its runtime is up and the survivors trained in the
  generation before);
- a node's GPUs marked unhealthy (the node agent lowers allocatable nvidia.com/gpu to 0 and sets
  GPUHealthy=False, as a device plugin would) -> a generation without the node's worker;
- the operator crashing right after writing the plan that drops a killed worker, before any pod patch,
  delete or create (run through tests/e2e/crash_after_plan_write.py, which wraps the operator's plan
  write with an os._exit(137) as abrupt as SIGKILL, staged at that exact point), then restarting: the restart finishes that reconfiguration and plans nothing;
- the operator SIGKILLed together with a worker, then restarting: one generation for the loss.
Where a generation count must be exact, the victim's node and the spare node are cordoned, so the
replacement pod stays Pending and no further generation folds it in.

The GPU test runs a `device: cuda` job whose workers compute on the CPU (WORKER_DEVICE=cpu): the
operator checks GPU health only for jobs that request GPUs (operator/observe.py: a cpu job's pods
use none, so a node's GPUs going bad must not cost it a node), and the local nodes' nvidia.com/gpu
are counted resources, not devices.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from oobleck.api.resource import worker_selector
from oobleck.operator import render

# One job at a time per xdist worker (test_training.py says why there are two groups).
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.xdist_group("local-node-jobs-1")]
LOCAL_NODES = {"nodes": 4, "gpus_per_node": 1, "cpu": "4", "memory": "16Gi", "preforked": True}

CRASH_AFTER_PLAN_WRITE = Path(__file__).with_name("crash_after_plan_write.py")
OUTLASTS_A_START_STEPS = 1200
"""Steps of a job whose survivors must train on while something starts:
- an operator that crashes after its plan write and restarts (it starts the planner processes before it serves:
  from step 33 at the kill to 186 at the restart at load ~10; with 600 steps a full run's job ended 0.5 s after
  the restart served, 2026-11-26);
- a replacement pod (15 s from its creation to its first record in that run, where 600 steps ended 3 s later)."""


def start(run, spec: dict, warm_steps: int = 10):
    """Apply `spec`, wait for generation 0 and `warm_steps` trained steps; the plan."""
    run.apply(spec)
    first = run.wait_for(run.plan, "generation 0")
    assert first.generation == 0 and len(first.nodes) == spec["nodes"]["max"]
    run.wait_for(lambda: run.step(first.nodes[0]) >= warm_steps, f"{warm_steps} steps trained")
    return first


def recovered(run, survivor: str, generation: int, after_step: int) -> dict[str, float]:
    """The survivor's worker metrics once it trained a step of `generation` past `after_step` (the
    recovery histogram counts that first step: the generation gauge is set at adoption, before it)."""
    return run.wait_for(
        lambda: (
            (m := run.scrape(survivor))["oobleck_worker_plan_generation"] == generation
            and m["oobleck_worker_recovery_seconds_count"] >= 1
            and m["oobleck_worker_step"] > after_step
            and m
        ),
        f"{survivor} training in generation {generation}",
    )


def finished(run, final_generation: int, pods: int) -> dict[str, Any]:
    """The job Succeeded at the exact step; losses, generations and pods as they must be; the job."""
    body = run.wait_succeeded()
    assert body["status"]["progress"]["step"] == run.STEPS
    final = run.plan()
    assert final.generation == final_generation, (
        f"expected generation {final_generation}, got {final.generation}: {final.reason}"
    )
    compared = run.check_losses()
    print(f"{compared} logged losses match the no-failure reference within 1e-5")
    run.check_generations(final_generation)
    run.check_no_duplicate_pods(pods)
    return body


# The agent reports the two exits one after the other, up to a few hundred ms apart on a loaded host (seen:
# 200 ms; over 1 s in CI runs at load ~10-12, where a 1 s window split them into two generations); a 3 s batch
# window (default 50 ms) makes "at once" one batch there too. The window counts from the first exit the
# operator sees (operator/handlers.py Waker); counted from any wake-up, as it once was, the workers' progress
# reports made it close at arbitrary moments, and CI saw the two exits split across two generations.
BATCH_WINDOW_S = 3.0


def test_two_workers_killed_at_once_are_one_generation(job_run, local_nodes):
    run = job_run
    run.operator.start("--batch-window", str(BATCH_WINDOW_S))
    # The job trains on through the cordons' batch window below (an idle host trains 80 steps a second).
    run.STEPS = run.FAULT_TRAINS_ON_STEPS
    run.apply(run.job_spec(run.STEPS, nodes=4, f=2))
    first = run.wait_for(run.plan, "generation 0")
    assert first.generation == 0 and len(first.nodes) == 4
    assert len(first.pipelines) >= 3, "f = 2 needs three pipelines"
    survivor, victims = first.nodes[0], first.nodes[2:]
    # The victims' nodes cordoned while the workers start, so that their replacements stay Pending. A cordon
    # may be a loss to the operator, so it opens a batch window; let that one close first, so that the window
    # the kills see counts from the first exit. (After 10 trained steps the sleep outlasted a 200-step job on
    # an idle host.)
    for victim in victims:
        run.cordon(run.node_of(victim))
    time.sleep(BATCH_WINDOW_S + 0.5)
    run.wait_for(lambda: run.step(survivor) >= 10, "10 steps trained")
    before = run.scrape(survivor)
    assert before["oobleck_worker_plan_generation"] == 0 and before["oobleck_worker_step"] >= 10
    assert before["oobleck_worker_pipelines"] == len(first.pipelines)
    for victim in victims:  # back to back: the operator's batch window makes them one loss
        assert local_nodes.kill_pod_process(run.ns, victim)
    at_kill = run.step(survivor)
    assert at_kill < run.STEPS, "the job finished before the kill: raise STEPS"

    second = run.wait_for(lambda: (p := run.plan()).generation >= 1 and p, "a new generation")
    assert sorted(second.lost_nodes) == sorted(victims) and sorted(second.nodes) == sorted(first.nodes[:2])
    metrics = recovered(run, survivor, 1, at_kill)
    assert metrics["oobleck_worker_pipelines"] == len(second.pipelines) == 2
    assert metrics["oobleck_worker_reconfigurations_total"] == 1
    assert metrics["oobleck_worker_recovery_seconds_count"] == 1
    print(
        f"survivor's recovery (generation abandoned -> first step of the next): "
        f"{metrics['oobleck_worker_recovery_seconds_sum']:.2f} s"
    )

    body = finished(run, 1, pods=4 + 2)  # two replacements, Pending on the cordoned nodes
    assert body["status"]["failuresSurvived"] == 2
    operator = run.operator_metrics()
    assert operator["oobleck_operator_pods_lost_total"] == 2
    assert operator["oobleck_operator_plan_generations_total"] == 2
    assert operator["oobleck_operator_failure_to_patch_seconds_count"] == 1
    assert operator["oobleck_operator_pods_created_total"] == 4 + 1 + 2  # workers, coordinator, replacements
    print(f"failure-to-patch: {operator['oobleck_operator_failure_to_patch_seconds_sum']:.3f} s")


def test_kubectl_delete_pod_is_a_lost_node_and_its_replacement_is_folded_in(job_run, local_nodes):
    """`kubectl delete pod` of a worker: with every other node cordoned its replacement stays Pending and the
    job trains on in generation 1 without it; uncordoned, the replacement runs and generation 2 folds it in,
    so the job trains on three nodes again. The survivors train on while the replacement starts:
    OUTLASTS_A_START_STEPS. The test ends once the replacement trains, every loss so far checked (two other tests
    here train to Succeeded)."""
    run = job_run
    run.STEPS = OUTLASTS_A_START_STEPS
    first = start(run, run.job_spec(run.STEPS, nodes=3))
    survivor, victim = first.nodes[0], first.nodes[1]
    run.cordon_spare_nodes()
    run.cordon(run.node_of(victim))
    run.cluster.kubectl("delete", "pod", victim, "-n", run.ns, "--wait=false")
    at_delete = run.step(survivor)
    assert at_delete < run.STEPS

    second = run.wait_for(lambda: (p := run.plan()).generation >= 1 and p, "a new generation")
    assert second.generation == 1 and second.lost_nodes == [victim] and victim not in second.nodes
    lost = run.wait_for(lambda: run.events("NodeLost"), "a NodeLost event")
    # "deleted" when the operator saw the pod terminating, "gone" when it was already removed (a fast node).
    assert lost in ([f"{victim}: pod {victim} deleted"], [f"{victim}: pod {victim} gone"]), lost
    metrics = recovered(run, survivor, 1, at_delete)
    assert metrics["oobleck_worker_reconfigurations_total"] == 1
    replacement = render.worker_name("tiny", 3)
    run.wait_for(lambda: run.pod(replacement)["status"]["phase"] == "Pending", "the replacement Pending")
    assert run.plan().generation == 1

    run.uncordon_all()
    third = run.wait_for(lambda: (p := run.plan()).generation >= 2 and p, "the replacement folded in")
    assert third.added_nodes == [replacement] and sorted(third.nodes) == sorted([survivor, first.nodes[2], replacement])
    # The newcomer trains, with every layer copied to it (within 60 s: a hang is the failure this catches).
    metrics = run.wait_for(
        lambda: (
            (m := run.scrape(replacement))["oobleck_worker_plan_generation"] == 2
            and m["oobleck_worker_step"] > at_delete
            and m
        ),
        "the replacement training in generation 2",
        timeout=60,
    )
    assert metrics["oobleck_worker_bytes_copied_total"] > 0

    run.check_losses_so_far(third.nodes, after=int(metrics["oobleck_worker_step"]))
    assert run.plan().generation == 2
    run.wait_for(lambda: run.job()["status"].get("failuresSurvived") == 1, "one failure survived in status")
    assert run.operator_metrics()["oobleck_operator_pods_lost_total"] == 1
    run.check_generations(2)
    run.wait_for(lambda: len(run.pods_seen) >= 4, "the recorder sees the replacement pod")
    run.check_no_duplicate_pods(3 + 1)


def test_unhealthy_gpus_on_a_node_are_a_lost_node(job_run, local_nodes):
    run = job_run
    run.STEPS = run.FAULT_TRAINS_ON_STEPS  # every worker trains on in generation 0 until the operator drops the node
    spec = run.job_spec(run.STEPS, nodes=3, device="cuda", env={"WORKER_DEVICE": "cpu"})
    first = start(run, spec)
    survivor, victim = first.nodes[0], first.nodes[1]
    assert run.pod(victim)["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "1"
    run.cordon_spare_nodes()  # the replacement must stay Pending: no generation folds it in
    node = run.node_of(victim)
    run.mark_gpus_unhealthy(node)  # no cordon: the replacement needs a GPU this node no longer offers
    at_fault = run.step(survivor)
    assert at_fault < run.STEPS

    second = run.wait_for(lambda: (p := run.plan()).generation >= 1 and p, "a new generation")
    assert second.lost_nodes == [victim]
    lost = run.wait_for(lambda: run.events("NodeLost"), "a NodeLost event")
    assert len(lost) == 1 and lost[0].startswith(f"{victim}: node {node}: allocatable nvidia.com/gpu 0 < capacity 1"), (
        lost
    )
    recovered(run, survivor, 1, at_fault)
    # The replacement waits for a node with a healthy GPU (none left: the victim's has none, the spare
    # is cordoned, the others hold the job's pods).
    replacement = render.worker_name("tiny", 3)
    pending = run.wait_for(
        lambda: (p := run.pod(replacement))["status"].get("conditions") and p, "the replacement's scheduling verdict"
    )
    assert pending["status"]["phase"] == "Pending"

    # Every step so far exact, the job training on in generation 1 (its remaining steps would only repeat this;
    # the other tests here train their jobs to Succeeded).
    run.check_losses_so_far(second.nodes, after=at_fault)
    assert run.plan().generation == 1, run.plan().reason
    run.check_generations(1)
    run.wait_for(lambda: len(run.pods_seen) >= 3 + 1, "the replacement recorded")  # the recorder samples every second
    run.check_no_duplicate_pods(3 + 1)
    run.wait_for(lambda: run.job()["status"].get("failuresSurvived") == 1, "one failure survived in status")
    assert run.operator_metrics()["oobleck_operator_pods_lost_total"] == 1


def test_operator_crash_mid_reconfiguration_is_finished_by_its_restart(job_run, local_nodes):
    """The operator dies right after writing the plan that drops a killed worker, before it patches,
    deletes or creates any pod; its restart finishes that reconfiguration without planning it again."""
    run = job_run
    run.STEPS = OUTLASTS_A_START_STEPS
    # Started before the job (its start takes seconds of training otherwise): it creates generation 0 and
    # exits (137) right after it writes generation 1.
    run.operator.start(program=CRASH_AFTER_PLAN_WRITE)
    first = start(run, run.job_spec(run.STEPS, nodes=3))
    survivor, victim = first.nodes[0], first.nodes[1]
    run.cordon_spare_nodes()
    run.cordon(run.node_of(victim))
    assert local_nodes.kill_pod_process(run.ns, victim)
    at_kill = run.step(survivor)
    assert at_kill < run.STEPS

    assert run.operator.wait_exit(90) == 137, "the operator did not crash after the plan write"
    crashed_at = run.plan()
    assert crashed_at.generation == 1 and crashed_at.lost_nodes == [victim]
    names = {
        p["metadata"]["name"]
        for p in run.cluster.kubectl_json("get", "pods", "-n", run.ns, "-l", worker_selector("tiny"))["items"]
    }
    assert victim in names and render.worker_name("tiny", 3) not in names, (
        f"the crash came after the pod changes: {names}"
    )

    run.operator.start()
    step_at_restart = run.step(survivor)
    print(f"killed at step {at_kill}; the operator back at step {step_at_restart}")
    assert step_at_restart < run.STEPS, "the job finished while the operator was down: raise STEPS"
    # The restart finishes the reconfiguration: this process's counters show the replacement created (Pending:
    # nowhere to go) and nothing planned.
    restarted = run.wait_for(
        lambda: (m := run.operator_metrics())["oobleck_operator_pods_created_total"] >= 1 and m,
        "the restarted operator to create the replacement",
    )
    assert restarted["oobleck_operator_plan_generations_total"] == 0
    assert restarted["oobleck_operator_pods_created_total"] == 1
    run.wait_for(lambda: run.job()["status"].get("failuresSurvived") == 1, "one failure survived in status")
    # Every step so far exact in generations 0 and 1 (the job's remaining steps would only repeat the check).
    run.check_losses_so_far(crashed_at.nodes, after=step_at_restart)
    assert run.plan().generation == 1, run.plan().reason
    run.check_generations(1)
    run.wait_for(lambda: len(run.pods_seen) >= 3 + 1, "the replacement recorded")  # the recorder samples every second
    run.check_no_duplicate_pods(3 + 1)
    assert run.adopted_generations()[f"{survivor}:0"] == [0, 1]
    assert run.operator_metrics()["oobleck_operator_plan_generations_total"] == 0


def test_operator_sigkilled_with_a_worker_is_caught_up_by_its_restart(job_run, local_nodes):
    """A worker and the operator SIGKILLed together (the operator may not even have seen the loss): the
    restarted operator plans exactly one generation for it, and nothing is created twice. The survivors stall
    without the killed worker until that generation, so the default STEPS outlast the restart."""
    run = job_run
    first = start(run, run.job_spec(nodes=3), warm_steps=0)
    survivor, victim = first.nodes[0], first.nodes[1]
    # Cordoned before the training gets going: beside the real nodes the cordons once took longer than the
    # job's steps, and the kill found the job done.
    run.cordon_spare_nodes()
    run.cordon(run.node_of(victim))
    run.wait_for(lambda: run.step(survivor) >= 10, "10 steps trained")
    assert local_nodes.kill_pod_process(run.ns, victim)
    run.operator.kill()
    at_kill = run.step(survivor)
    run.operator.start()
    assert run.step(survivor) < run.STEPS, "the job finished while the operator was down: raise STEPS"

    second = run.wait_for(lambda: (p := run.plan()).generation >= 1 and p, "a new generation")
    assert second.generation == 1 and second.lost_nodes == [victim]
    recovered(run, survivor, 1, at_kill)
    body = finished(run, 1, pods=3 + 1)
    assert body["status"]["failuresSurvived"] == 1
