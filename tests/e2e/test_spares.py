"""Warm spares end to end (issue #22, item 4): `spec.nodes.spares: 1` keeps a worker pod started, its runtime
up and connected to the job's store, in no plan; a member's process SIGKILLed -> the generation that drops
it folds the spare in (the full node count in one reconfiguration), and the replacement pod becomes the new
spare; every logged loss so far equals the no-failure reference, every generation was adopted once, no pod was
created twice, and the operator's metrics count the spare. The test ends there, with the job training.

The same kill without a spare, for comparison (the full node count one generation later, once the replacement
pod started and imported torch), runs on real nodes: tests/realnodes/test_spares_in_containers.py, which also
times both in containers; folding a replacement in is test_failures.py's too. That a job that ends deletes
its spare is the operator's part: tests/operator/test_operator_cluster.py checks it.
"""

from __future__ import annotations

import time

import pytest

from oobleck.operator import render
from oobleck_dev.poll import wait_until
from tests.targets import SPARE_RESTORE_TARGET_S

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.xdist_group("local-node-jobs-2")]
LOCAL_NODES = {"nodes": 4, "gpus_per_node": 1, "cpu": "4", "memory": "16Gi"}
NODES = 3
STEPS = 1500
"""Long enough for the replacement to become the next spare before the job ends (23 s from the kill at load
~25, 2026-11-26; at 800 steps a run at load ~10 finished first). The test ends while the job trains."""
SPARE_RESTORE_BESIDE_REAL_NODES_S = 10.0
"""What this test asserts: in `make test` it runs beside the real-node run, and at load 17-22 it took 5.70 s
(2026-11-29). Still half a replacement pod's start (18 s alone), and the plan is checked to fold the spare in."""


def _trains_in(run, pod: str, generation: int, killed_at: float) -> float:
    """Seconds from `killed_at` until `pod` reported a step of `generation` (its progress annotation)."""
    run.wait_for(lambda: run.progress(pod).get("generation") == generation, f"{pod} training in {generation}", 120)
    return time.monotonic() - killed_at


def test_a_kill_folds_the_spare_in_at_once(job_run, local_nodes):
    run = job_run
    run.STEPS = STEPS
    spec = run.job_spec(STEPS, nodes=NODES)
    spec["nodes"]["spares"] = 1
    run.apply(spec)
    first = run.wait_for(run.plan, "generation 0")
    assert first.generation == 0 and len(first.nodes) == NODES
    # Generation 0 takes the first NODES pods to run; the one left over, whichever it is, is the spare.
    (spare,) = {render.worker_name("tiny", i) for i in range(NODES + 1)} - set(first.nodes)
    # Up and waiting: started, torch imported, the store reached (its progress report), counted as a spare.
    job = run.wait_for(lambda: (j := run.job())["status"].get("spares") == 1 and j, "the spare ready")
    assert job["status"]["sparePods"] == [spare] and job["status"]["nodes"] == NODES
    assert run.progress(spare)["generation"] == -1
    assert run.operator_metrics()['oobleck_operator_spares{job="tiny",namespace="' + run.ns + '"}'] == 1
    survivor, victim = first.nodes[0], first.nodes[1]
    run.wait_for(lambda: run.step(survivor) >= 10, "10 steps trained")
    killed_at = time.monotonic()
    assert local_nodes.kill_pod_process(run.ns, victim)
    at_kill = run.step(survivor)
    assert at_kill < run.STEPS, "the job finished before the kill: raise STEPS"

    # The plan ConfigMap polled every 20 ms.
    full = wait_until(
        lambda: len((p := run.plan()).nodes) == NODES and p.generation > 0 and p, "3 nodes again", 120, 0.02
    )
    restore_s = time.monotonic() - killed_at
    resumed_s = _trains_in(run, spare, full.generation, killed_at)
    print(
        f"kill -> full node count in generation {full.generation} {restore_s:.2f} s; "
        f"-> {spare} training in it {resumed_s:.2f} s"
    )
    # One reconfiguration: the generation that drops the victim is the one that folds the spare in.
    assert full.generation == 1 and full.lost_nodes == [victim] and full.added_nodes == [spare]
    if restore_s > SPARE_RESTORE_TARGET_S:
        print(f"over the {SPARE_RESTORE_TARGET_S} s target here (a loaded host?): {restore_s:.2f} s")
    assert restore_s <= SPARE_RESTORE_BESIDE_REAL_NODES_S, f"{restore_s:.2f} s from the kill to the full node count"
    replacement = render.worker_name("tiny", NODES + 1)
    job = run.wait_for(
        lambda: (j := run.job())["status"].get("sparePods") == [replacement] and j, "the replacement a spare"
    )
    assert job["status"]["spares"] == 1 and job["status"]["nodes"] == NODES
    assert run.plan().generation == 1, "the replacement waits as the spare: no generation folds it in"
    run.check_losses_so_far(full.nodes, after=at_kill + 1)
    assert run.plan().generation == 1 and run.job()["status"]["failuresSurvived"] == 1
    run.check_generations(full.generation)
    run.check_no_duplicate_pods(NODES + 2)
