"""decide(): the whole lifecycle as pure steps, with a tiny in-memory "cluster" applying decisions."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta

import pytest

from oobleck.api.conditions import find_condition
from oobleck.api.job import parse_status
from oobleck.operator import render
from oobleck.api.conditions import ConditionType
from oobleck.operator.decide import CurrentPlan, Decision, Tuning, decide, synthetic_profile
from oobleck.operator.observe import observe

TUNING = Tuning()


class World:
    """Pods, nodes, the plan ConfigMap and the job status, changed only by applying Decisions."""

    def __init__(self, h, spec, n_nodes: int = 4, tuning: Tuning = TUNING):
        self.h, self.spec, self.tuning = h, spec, tuning
        self.nodes = h.nodes(n_nodes)
        self.pods = {}
        self.current = None
        self.status = parse_status(None)
        self.now = h.NOW
        self.profile = synthetic_profile(spec, tuning)
        self.free = list(self.nodes)  # nodes without a worker of this job

    def step(self) -> Decision:
        plan = self.current.plan if self.current else None
        gpu = "nvidia.com/gpu" if self.spec.device == "cuda" else None
        obs = observe(self.h.JOB, self.h.UID, list(self.pods.values()), self.nodes, plan, gpu_resource=gpu)
        ctx = replace(self.h.context(self.spec), status=self.status)
        return decide(ctx, obs, self.current, self.profile, self.tuning, self.now)

    def apply(self, d: Decision, *, patches: bool = True) -> None:
        if d.plan is not None:
            self.current = CurrentPlan(d.plan, d.failures_survived)
        if patches:
            for name, annotations in d.patches:
                pod = self.pods[name]
                self.pods[name] = replace(pod, generation=int(annotations[render.GENERATION_ANNOTATION]))
            for name, _ in d.delete:
                pod = self.pods.pop(name, None)
                if pod is not None and pod.node_name and pod.node_name in self.nodes:
                    self.free.append(pod.node_name)
            for name in [n for n, p in self.pods.items() if p.deleting]:  # their grace period ends
                pod = self.pods.pop(name)
                self.free.append(pod.node_name)
            for index in d.create:
                node = self.free.pop(0) if self.free else None
                self.pods[render.worker_name(self.h.JOB, index)] = self.h.worker(
                    index, node=node or "", phase="Running" if node else "Pending",
                    unschedulable=None if node else "0/4 nodes are available: Insufficient nvidia.com/gpu.",
                )
            if d.create_coordinator:
                self.pods["c"] = self.h.coordinator()
            self.status = parse_status(d.status)

    def settle(self, rounds: int = 5) -> Decision:
        for _ in range(rounds):
            d = self.step()
            self.apply(d)
            if d.plan is None and not d.patches and not d.create and not d.delete:
                return d
        raise AssertionError("did not settle")

    def names(self, *indices):
        return [render.worker_name(self.h.JOB, i) for i in indices]


def cond(status, type_):
    return find_condition(parse_status(status).conditions, type_)


def test_create_waits_then_plans_generation_zero(h):
    world = World(h, h.spec(), n_nodes=4)
    d = world.step()
    assert d.create == (0, 1, 2, 3) and d.create_coordinator and d.plan is None
    assert cond(d.status, "Running").reason == "WaitingForNodes"
    world.apply(d)
    d = world.step()
    assert d.plan is not None and d.plan.generation == 0
    assert sorted(d.plan.nodes) == sorted(world.names(0, 1, 2, 3))
    assert sorted(n for n, _ in d.patches) == sorted(world.names(0, 1, 2, 3))
    assert d.status["phase"] == "Running" and d.status["plan"]["generation"] == 0
    world.apply(d)
    quiet = world.settle()
    assert quiet.status == world.status.to_kubernetes()  # a further pass changes nothing


def _running(h, **spec_fields) -> World:
    world = World(h, h.spec(**spec_fields), n_nodes=4)
    world.settle()
    assert world.current.plan.generation == 0
    return world


def test_pod_failure_makes_exactly_one_generation_and_a_replacement(h):
    world = _running(h)
    lost = world.names(2)[0]
    world.pods[lost] = replace(world.pods[lost], phase="Failed", status_reason="Evicted")
    d = world.step()
    assert d.plan.generation == 1 and d.plan.lost_nodes == [lost] and lost not in d.plan.nodes
    assert sorted(n for n, _ in d.patches) == sorted(d.plan.nodes)
    assert all(a[render.GENERATION_ANNOTATION] == "1" for _, a in d.patches)
    assert (lost, "pod tiny-worker-2 failed (Evicted)") in d.delete
    assert d.create == (4,) and d.failures_survived == 1 and d.lost == (lost,)
    assert [e.reason for e in d.events] == ["NodeLost", "Reconfigured"]
    assert cond(d.status_during, "Reconfiguring").status == "True"
    assert cond(d.status, "Reconfiguring").status == "False" and d.status["failuresSurvived"] == 1
    assert d.status["reconfigurations"] == 1
    world.apply(d)
    # No spare node: the replacement stays pending.
    world.pods["tiny-worker-4"] = replace(world.pods["tiny-worker-4"], phase="Pending", node_name=None, unschedulable="no GPUs")
    d = world.step()
    assert d.plan is None and not d.create and not d.patches  # no second generation
    # Once the replacement's node appears it runs and is folded into generation 2.
    world.pods["tiny-worker-4"] = replace(world.pods["tiny-worker-4"], phase="Running", node_name="node-2", unschedulable=None)
    d = world.step()
    assert d.plan.generation == 2 and d.plan.added_nodes == ["tiny-worker-4"] and d.failures_survived == 1


def test_simultaneous_losses_are_one_reconfiguration(h):
    world = _running(h)
    a, b = world.names(0, 3)
    world.pods[a] = replace(world.pods[a], deleting=True)
    world.nodes["node-3"] = h.node("node-3", ready="False")
    d = world.step()
    assert d.plan.generation == 1 and sorted(d.plan.lost_nodes) == sorted([a, b]) and d.failures_survived == 2
    world.apply(d)
    later = world.step()  # the replacements already run here: only added, never lost again
    assert later.plan is not None and later.plan.lost_nodes == [] and later.plan.added_nodes == world.names(5)  # worker-4 landed on the NotReady node


def test_a_vanished_pod_is_lost_too(h):
    world = _running(h)
    gone = world.names(1)[0]
    del world.pods[gone]
    d = world.step()
    assert d.plan.lost_nodes == [gone] and "gone" in d.events[0].message


def test_crash_between_plan_and_patches_finishes_the_patches(h):
    world = _running(h)
    lost = world.names(1)[0]
    world.nodes["node-1"] = h.node("node-1", allocatable=6)
    d = world.step()
    world.apply(d, patches=False)  # the plan was written, then the operator died
    again = world.step()
    assert again.plan is None, "must not write another generation"
    assert sorted(n for n, _ in again.patches) == sorted(d.plan.nodes)
    assert (lost, "dropped from the plan") in again.delete or any(n == lost for n, _ in again.delete)
    world.apply(again)
    assert world.step().patches == ()


def test_scale_down_and_up(h):
    world = _running(h)
    world.spec = h.spec(nodes={"min": 2, "max": 4, "target": 2})
    d = world.step()
    assert d.plan.generation == 1 and sorted(d.plan.lost_nodes) == world.names(2, 3)
    assert d.failures_survived == 0 and cond(d.status_during, "Reconfiguring").reason == "Scaled"
    assert sorted(n for n, _ in d.delete) == world.names(2, 3) and d.create == ()
    world.apply(d)
    world.spec = h.spec(nodes={"min": 2, "max": 4, "target": 3})
    d = world.step()
    assert d.create == (4,) and d.plan is None
    world.apply(d)
    d = world.step()
    assert d.plan.generation == 2 and d.plan.added_nodes == ["tiny-worker-4"]


def test_too_few_nodes_fails_and_cleans_up(h):
    world = _running(h)
    for i in (0, 1, 2):
        name = world.names(i)[0]
        world.pods[name] = replace(world.pods[name], phase="Failed")
    d = world.step()
    assert d.plan is None
    failed = cond(d.status, "Failed")
    assert failed.status == "True" and failed.reason == "TooFewNodes" and "nodes.min is 2" in failed.message
    assert d.status["phase"] == "Failed"
    # cleanPodPolicy Running (the default) deletes the pods still running, not the failed ones.
    assert sorted(n for n, _ in d.delete) == sorted([world.names(3)[0], "tiny-coordinator"])


def test_spec_the_planner_cannot_serve_fails_with_the_reason(h):
    world = World(h, h.spec(), tuning=Tuning(gpu_memory_bytes=1000))
    d = world.step()
    failed = cond(d.status, "Failed")
    assert failed.reason == "InvalidSpec" and "planner cannot serve" in failed.message
    assert d.create == () and d.events[0].type == "Warning"


def test_waits_for_nodes_then_plans_without_pending_after_the_timeout(h):
    world = World(h, h.spec(pendingTimeoutSeconds=60), n_nodes=2)
    world.apply(world.step())
    d = world.step()
    assert d.plan is None and d.create == ()
    running = cond(d.status, "Running")
    assert running.reason == "WaitingForNodes" and "2 of 4 worker pods running" in running.message
    assert "Insufficient nvidia.com/gpu" in running.message
    world.apply(d)
    world.now += timedelta(seconds=120)
    d = world.step()
    assert d.plan is not None and len(d.plan.nodes) == 2
    assert cond(d.status, ConditionType.WORKERS_PENDING) is None or cond(d.status, ConditionType.WORKERS_PENDING).status == "False"
    world.apply(d)
    d = world.step()
    pending = cond(d.status, ConditionType.WORKERS_PENDING)
    assert pending.status == "True" and "unschedulable" in pending.message
    assert d.create == ()  # the pending pods wait; no more are piled up


def test_progress_to_the_last_step_succeeds(h):
    world = _running(h, cleanPodPolicy="All")
    name = world.names(0)[0]
    world.pods[name] = replace(world.pods[name], progress=json.dumps({"generation": 0, "step": 40}))
    d = world.step()
    assert cond(d.status, "Succeeded").status == "True" and d.status["phase"] == "Succeeded"
    assert len(d.delete) == 5 and "completionTime" in d.status
    world.apply(d)
    assert world.step().plan is None and not world.step().create


def _two_node_pipelines(h) -> World:
    # Memory for half the model per GPU: every pipeline spans two nodes.
    spec = h.spec()
    profile = synthetic_profile(spec, TUNING)
    total = sum(layer.state_bytes for layer in profile.layers)
    tuning = Tuning(gpu_memory_bytes=int(total * 0.8))
    return World(h, spec, n_nodes=4, tuning=tuning)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_losing_every_replica_of_a_layer(h, checkpoint):
    world = _two_node_pipelines(h)
    if checkpoint:
        world.spec = h.spec(checkpoint={"path": "/ckpt", "intervalSteps": 10})
    world.settle()
    plan = world.current.plan
    assert len(plan.pipelines) == 2 and all(len(p.nodes) == 2 for p in plan.pipelines)
    # The first stage's node of both pipelines: nobody holds layer 0 any more.
    for pipeline in plan.pipelines:
        first = pipeline.nodes[0]
        world.pods[first] = replace(world.pods[first], phase="Failed")
    d = world.step()
    if checkpoint:
        assert d.plan.generation == 1 and d.plan.reason == "restore-checkpoint"
        assert cond(d.status_during, "Reconfiguring").reason == "RestoringCheckpoint"
    else:
        failed = cond(d.status, "Failed")
        assert failed.reason == "LayersLost" and "no checkpoint configured" in failed.message


def test_fewer_than_f_plus_one_pipelines_is_degraded_not_failed(h):
    world = World(h, h.spec(nodes={"min": 1, "max": 4}), n_nodes=4)
    world.settle()
    for i in (0, 1, 2):
        name = world.names(i)[0]
        world.pods[name] = replace(world.pods[name], phase="Failed")
    world.free = []
    d = world.step()
    assert d.plan is not None and len(d.plan.pipelines) == 1 and d.plan.degraded
    degraded = cond(d.status, "Degraded")
    assert degraded.status == "True" and degraded.reason == "FewerThanFPlusOnePipelines"
    assert d.status["phase"] == "Running" and d.failures_survived == 3
