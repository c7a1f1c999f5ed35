"""The whole loop: `kubectl apply` an OobleckJob -> the operator (a real process) -> worker pods on
local nodes (real processes running `python -m oobleck.runtime.backends.pod`) train -> the job Succeeds.

Each test applies a tiny GPT job (conftest.job_spec: device cpu; 2 nodes of 2 worker processes, or 3
nodes of one) in a namespace of its own, waits for the job's phase, and checks the exact step count
and every step's loss against the single-process reference run of the same job. A worker's /metrics is
scraped over HTTP at its pod IP and parsed. test_failures.py has the faults: kills mid-run, among them.

Every listener of a pod (gloo, the worker's /metrics, the coordinator's store) binds to its pod IP,
so jobs on one host do not collide. Each xdist worker still runs at most one job at a time: the
tests that run jobs on local nodes are split into two xdist groups ("local-node-jobs-1": training, the kills
in test_failures.py, bounded planning, job faults; "local-node-jobs-2": partitions, outages,
spares, stragglers, the demo) of about equal length, one per worker of `make test` (each about 13 min
with -n 0 at load 10-30, 2026-11-26). One group took the whole suite's length (41 min
of 41); more than one job per worker would compete for the CPU and slow each past its timeouts.
"""

from __future__ import annotations

import urllib.request

import pytest

from oobleck.api import contract
from oobleck.runtime.snapshot.agent import layers_to_push

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.xdist_group("local-node-jobs-1")]
LOCAL_NODES = {"nodes": 3, "gpus_per_node": 1, "cpu": "4", "memory": "16Gi", "preforked": True}


def test_job_trains_in_pods_to_the_exact_step(job_run, local_nodes):
    """2 pods x 2 worker processes each (gpusPerNode 2 on cpu: the pod supervises one child per GPU)."""
    run, steps = job_run, 100
    run.apply(run.job_spec(steps, nodes=2, gpus_per_node=2))
    first = run.wait_for(run.plan, "generation 0")
    assert len(first.nodes) == 2 and first.generation == 0 and first.world_size == 4
    pod = first.nodes[1]
    run.wait_for(lambda: run.step(pod) >= 3, "3 steps trained")
    # The agent forked the pod's process from the process that imported torch once (oobleck_dev.podzygote).
    pid = local_nodes.pod_pids(run.ns, pod)["worker"]
    assert f"PPid:\t{local_nodes.zygote_pid}\n" in open(f"/proc/{pid}/status").read()
    for gpu in (0, 1):  # each process serves its own registry at its pod IP
        metrics = run.scrape(pod, gpu)
        assert metrics["oobleck_worker_plan_generation"] == 0 and 3 <= metrics["oobleck_worker_step"] <= steps
        assert metrics["oobleck_worker_rank"] == first.rank_of(pod, gpu)
        assert metrics["oobleck_worker_iteration_seconds_count"] >= 3
    # The progress annotation carries the loss and the throughput for status.progress.
    progress = run.progress(pod)
    assert progress["generation"] == 0 and progress["step"] >= 3
    assert progress["samplesPerSecond"] > 0 and progress["loss"] > 0
    # Bound to the pod IP, not every address: the node's own IP (same host) refuses the port.
    host_ip = run.pod(pod)["status"]["hostIP"]
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{host_ip}:{contract.WORKER_PORT}/metrics", timeout=5)
    body = run.wait_succeeded()
    assert body["status"]["progress"]["step"] == steps
    assert run.plan().generation == 0  # nothing failed: no reconfiguration
    assert body["status"]["reconfigurations"] == 0
    run.check_losses()
    # Every worker ran a snapshot agent (runtime/snapshot/agent.py): one snapshot per 10 steps, pushed to its buddy
    # unless the buddy holds every layer of it too (it captures those itself).
    exits = run.exits(4)
    assert len(exits) == 4 and all(r["code"] == 0 and r["steps"] == steps for r in exits)
    assert all(r["snapshots"]["snapshots"] == steps // 10 for r in exits), exits
    pushes = {(r["node"], r["gpu"]): r["snapshots"]["pushed_bytes"] > 0 for r in exits}
    assert pushes == {(a.node, a.gpu): bool(layers_to_push(first, a.rank)) for a in first.ranks}, (pushes, first.ranks)
    # The annotation's loss is the loss of its last step (step s - 1, 0-based), to 6 significant digits.
    expected = run.reference()[progress["step"] - 1]
    assert abs(progress["loss"] - expected) <= 1e-5 * abs(expected), (progress, expected)
    operator = run.operator_metrics()
    assert (
        operator["oobleck_operator_plan_generations_total"] == 1 and operator["oobleck_operator_pods_lost_total"] == 0
    )
    assert operator['oobleck_operator_jobs{phase="Succeeded"}'] == 1


def test_tensor_parallel_stages_train_in_pods_like_one_process(job_run, local_nodes):
    """spec.maxTensorParallel 2 on pods of 2 GPU processes with 1-sample microbatches: a sample cannot be
    split between the two, so the planner gives the stages t = 2 (each process holds half of every layer of
    its stage); the job trains to its last step with every loss equal to single-process training."""
    run, steps = job_run, 30
    spec = run.job_spec(steps, nodes=2, gpus_per_node=2)
    spec["maxTensorParallel"] = 2
    spec["training"]["microbatchSize"] = 1
    run.apply(spec)
    plan = run.wait_for(run.plan, "generation 0")
    degrees = {stage.tensor_parallel for pipeline in plan.pipelines for stage in pipeline.stages}
    assert degrees == {2}, [(s.start, s.end, s.tensor_parallel) for p in plan.pipelines for s in p.stages]
    body = run.wait_succeeded()
    assert body["status"]["progress"]["step"] == steps and plan.generation == 0
    assert run.check_losses() >= steps
