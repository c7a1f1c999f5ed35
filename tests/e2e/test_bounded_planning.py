"""Issue 20: one manifest cannot stall the operator, end to end.

A training job runs on local nodes (real worker processes); a 4096-node x 1024-layer job (an entry
point with a measured profile in a ConfigMap: the API server cannot see its layers) is applied beside
it, and while the operator's planner processes chew on it, one of the training job's workers is
SIGKILLed. The training job recovers in its usual time and trains on, every loss exact, the operator's
liveness answers throughout and it never restarts, and the huge job fails InvalidSpec naming the
planner's limit.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import yaml

from oobleck.planner.synthetic import GPTShape, gpt_profile

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.xdist_group("local-node-jobs-1")]
LOCAL_NODES = {"nodes": 4, "gpus_per_node": 1, "cpu": "4", "memory": "16Gi", "preforked": True}


def _huge_job() -> tuple[dict, dict]:
    """The profile ConfigMap and the job (its pods, were any created, would match no node)."""
    profile = gpt_profile(
        GPTShape(blocks=1022, hidden=64, heads=4, vocab=256),
        seq_len=32,
        microbatch_size=1,
        gpu_flops=300e12,
        hbm_bandwidth=2e12,
    )
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "huge-profile"},
        "data": {"profile.json": profile.model_dump_json()},
    }
    job = {
        "apiVersion": "oobleck.dev/v1alpha1",
        "kind": "OobleckJob",
        "metadata": {"name": "huge"},
        "spec": {
            "model": {"entryPoint": "mypkg.models:build_layers"},
            "nodes": {"min": 2, "max": 4096},
            "device": "cpu",
            "training": {"steps": 10, "globalBatchSize": 8192, "microbatchSize": 1},
            "profile": {"source": "configMap", "configMap": {"name": "huge-profile"}},
            "pod": {"nodeSelector": {"oobleck-test/pool": "none"}},
        },
    }
    return config_map, job


def test_a_huge_spec_beside_a_training_job_stalls_nothing(job_run, local_nodes):
    run = job_run
    # 10 s: the kill 2 s after the huge spec's apply and its recovery fall well inside the planner's work on it.
    run.operator.start("--planner-timeout", "10", "--planner-workers", "2")  # the huge spec keeps one busy
    run.STEPS = run.FAULT_TRAINS_ON_STEPS  # the job trains on while the huge spec is applied before the kill
    spec = run.job_spec(run.STEPS, nodes=3)
    run.apply(spec)
    first = run.wait_for(run.plan, "generation 0")
    run.wait_for(lambda: run.step(first.nodes[0]) >= 10, "10 steps trained")
    survivor, victim = first.nodes[0], first.nodes[1]
    run.cordon_spare_nodes()
    run.cordon(run.node_of(victim))

    probes: list[float] = []
    probing = True

    def probe() -> None:
        while probing:
            began = time.monotonic()
            try:
                run.operator.healthy()
                probes.append(time.monotonic() - began)
            except Exception:
                probes.append(float("inf"))
            time.sleep(0.25)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        config_map, huge = _huge_job()
        run.cluster.kubectl("apply", "-n", run.ns, "-f", "-", input=json.dumps(config_map))
        run.cluster.kubectl("apply", "-n", run.ns, "-f", "-", input=yaml.safe_dump(huge))
        time.sleep(2.0)  # the planner is on the huge spec now
        assert local_nodes.kill_pod_process(run.ns, victim)
        at_kill = run.step(survivor)
        assert at_kill < run.STEPS, "the job finished before the kill: raise STEPS"
        second = run.wait_for(lambda: (p := run.plan()).generation >= 1 and p, "a new generation")
        assert second.lost_nodes == [victim]
        metrics = run.wait_for(
            lambda: (
                (m := run.scrape(survivor))["oobleck_worker_plan_generation"] == 1
                and m["oobleck_worker_recovery_seconds_count"] >= 1
                and m
            ),
            "the survivor training in generation 1",
        )
        failed = run.wait_for(
            lambda: next(
                (
                    c
                    for c in (
                        run.cluster.kubectl_json("get", "oobleckjob", "huge", "-n", run.ns).get("status") or {}
                    ).get("conditions", [])
                    if c["type"] == "Failed" and c["status"] == "True"
                ),
                None,
            ),
            "the huge job Failed",
        )
    finally:
        probing = False
        prober.join()
    recovery = metrics["oobleck_worker_recovery_seconds_sum"]
    print(f"recovery {recovery:.2f} s; liveness: {len(probes)} probes, slowest {max(probes):.2f} s")
    assert recovery < 10, f"recovery took {recovery:.1f} s beside the huge spec"
    assert failed["reason"] == "InvalidSpec" and "--planner-" in failed["message"], failed
    assert probes and max(probes) < 5, f"liveness: slowest probe {max(probes):.1f} s"
    # Every step so far exact, the job training on in generation 1 (its remaining steps would only repeat this).
    run.check_losses_so_far(second.nodes, after=at_kill)
    assert run.plan().generation == 1, run.plan().reason
    assert run.operator.starts == 1 and run.operator.process.poll() is None
