"""decide(): the whole lifecycle as pure steps, with a tiny in-memory "cluster" applying decisions."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta

from oobleck.api import contract
from oobleck.api.conditions import ConditionType, find_condition
from oobleck.api.status import parse_status
from oobleck.operator import render
from oobleck.operator.decide import decide
from oobleck.operator.decision import CurrentPlan, Decision
from oobleck.operator.faults import assess
from oobleck.operator.observe import observe
from oobleck.operator.planning import Tuning, synthetic_profile

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
        # As the operator does (handlers.reconcile): the verdict on job-caused failures first.
        verdict = assess(
            self.h.UID,
            self.pods.values(),
            self.status.worker_failures,
            self.status.last_worker_failures,
            self.spec.failure_policy,
            self.now.timestamp(),
        )
        return decide(ctx, obs, self.current, self.profile, self.tuning, self.now, verdict)

    def apply(self, d: Decision, *, patches: bool = True) -> None:
        if d.plan is not None:
            self.current = CurrentPlan(d.plan, d.failures_survived)
        if patches:
            for name, written in d.patches:
                pod = self.pods[name]
                self.pods[name] = replace(
                    pod,
                    generation=int(written[contract.GENERATION_ANNOTATION]),
                    ranks=written[contract.RANKS_ANNOTATION],
                )
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
                    index,
                    node=node or "",
                    phase="Running" if node else "Pending",
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
    before = render.ranks_table(world.current.plan)
    d = world.step()
    assert d.plan.generation == 1 and d.plan.lost_nodes == [lost] and lost not in d.plan.nodes
    after = render.ranks_table(d.plan)
    # Only the survivors whose ranks changed are patched (the planner keeps the others' ranks).
    renumbered = sorted(n for n in d.plan.nodes if before[n] != after[n])
    assert sorted(n for n, _ in d.patches) == renumbered and 0 < len(renumbered) < len(d.plan.nodes)
    assert all(
        a[contract.GENERATION_ANNOTATION] == "1" and a[contract.RANKS_ANNOTATION] == after[n] for n, a in d.patches
    )
    assert (lost, "pod tiny-worker-2 failed (Evicted)") in d.delete
    assert d.create == (4,) and d.failures_survived == 1 and d.lost == (lost,)
    assert [e.reason for e in d.events] == ["NodeLost", "Reconfigured"]
    assert cond(d.status_during, "Reconfiguring").status == "True"
    assert cond(d.status, "Reconfiguring").status == "False" and d.status["failuresSurvived"] == 1
    assert d.status["reconfigurations"] == 1
    world.apply(d)
    # No spare node: the replacement stays pending.
    world.pods["tiny-worker-4"] = replace(
        world.pods["tiny-worker-4"], phase="Pending", node_name=None, unschedulable="no GPUs"
    )
    d = world.step()
    assert d.plan is None and not d.create and not d.patches  # no second generation
    # Once the replacement's node appears it runs and is folded into generation 2.
    world.pods["tiny-worker-4"] = replace(
        world.pods["tiny-worker-4"], phase="Running", node_name="node-2", unschedulable=None
    )
    d = world.step()
    assert d.plan.generation == 2 and d.plan.added_nodes == ["tiny-worker-4"] and d.failures_survived == 1


def test_a_replacement_joins_once_its_runtime_is_up_and_the_generation_trains(h):
    """With a runtime that reports progress, a running replacement waits (kept, not duplicated) until it
    reported itself and the survivors trained a step in the current generation."""
    world = _running(h)
    progress = lambda generation: json.dumps({"generation": generation, "step": 3})  # noqa: E731
    for name in world.current.plan.nodes:
        world.pods[name] = replace(world.pods[name], progress=progress(0))
    lost = world.names(2)[0]
    world.pods[lost] = replace(world.pods[lost], phase="Failed")
    d = world.step()
    assert d.plan.generation == 1 and d.create == (4,)
    world.apply(d)
    replacement = world.names(4)[0]
    assert world.pods[replacement].phase == "Running"  # started, but its runtime has not reported yet
    for _ in range(2):
        d = world.step()
        assert d.plan is None and not d.create and replacement not in dict(d.delete)
    world.pods[replacement] = replace(world.pods[replacement], progress=json.dumps({"generation": -1, "step": 0}))
    d = world.step()
    assert d.plan is None, "the survivors have not trained in generation 1 yet"
    for name in world.current.plan.nodes:
        world.pods[name] = replace(world.pods[name], progress=progress(1))
    d = world.step()
    assert d.plan.generation == 2 and d.plan.added_nodes == [replacement]


def test_simultaneous_losses_are_one_reconfiguration(h):
    world = _running(h)
    a, b = world.names(0, 3)
    world.pods[a] = replace(world.pods[a], deleting=True)
    world.nodes["node-3"] = h.node("node-3", ready="False")
    d = world.step()
    assert d.plan.generation == 1 and sorted(d.plan.lost_nodes) == sorted([a, b]) and d.failures_survived == 2
    world.apply(d)
    later = world.step()  # the replacements already run here: only added, never lost again
    assert (
        later.plan is not None and later.plan.lost_nodes == [] and later.plan.added_nodes == world.names(5)
    )  # worker-4 landed on the NotReady node


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
    assert d.patches, "the loss renumbers a survivor"
    world.apply(d, patches=False)  # the plan was written, then the operator died
    again = world.step()
    assert again.plan is None, "must not write another generation"
    assert again.patches == d.patches
    assert (lost, "dropped from the plan") in again.delete or any(n == lost for n, _ in again.delete)
    world.apply(again)
    assert world.step().patches == ()


def test_a_loss_in_a_large_job_patches_a_handful_of_pods(h):
    world = World(
        h,
        h.spec(nodes={"min": 2, "max": 16}, training={"steps": 40, "globalBatchSize": 64, "microbatchSize": 2}),
        n_nodes=16,
    )
    world.settle()
    plan = world.current.plan
    assert len(plan.nodes) == 16
    for victim in (plan.pipelines[0].nodes[0], plan.pipelines[len(plan.pipelines) // 2].nodes[-1]):
        before = render.ranks_table(world.current.plan)
        world.pods[victim] = replace(world.pods[victim], phase="Failed")
        d = world.step()
        assert d.plan is not None and d.plan.lost_nodes == [victim]
        after = render.ranks_table(d.plan)
        assert sorted(n for n, _ in d.patches) == sorted(n for n in d.plan.nodes if before[n] != after[n])
        assert 0 < len(d.patches) <= 2, d.patches  # not one per survivor
        world.apply(d)  # the victim's node is freed: its replacement runs there
        fold = world.step()
        [added] = fold.plan.added_nodes
        renumbered = [n for n, _ in fold.patches if n != added]
        assert added in dict(fold.patches) and len(renumbered) <= 1, fold.patches
        world.apply(fold)
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


def test_a_model_larger_than_the_gpu_memory_fails_before_any_pod_naming_both_numbers(h):
    world = World(h, h.spec(), tuning=Tuning(gpu_memory_bytes=1000))
    d = world.step()
    failed = cond(d.status, "Failed")
    assert failed.reason == "InvalidSpec" and "spec.gpuMemory" in failed.message
    assert "more than the 1000 bytes" in failed.message and "needs at least" in failed.message
    assert d.create == () and d.events[0].type == "Warning"


def test_the_spec_gpu_memory_overrides_the_operators(h):
    # The operator assumes too little; the job says its GPUs hold 80 GiB: it plans.
    world = World(h, h.spec(gpuMemory="80Gi"), tuning=Tuning(gpu_memory_bytes=1000))
    assert cond(world.step().status, "Failed") is None
    # And the other way round: the job's own figure is too small.
    world = World(h, h.spec(gpuMemory="1Ki"))
    failed = cond(world.step().status, "Failed")
    assert failed.reason == "InvalidSpec" and "1024 bytes" in failed.message and "(spec.gpuMemory)" in failed.message


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
    assert (
        cond(d.status, ConditionType.WORKERS_PENDING) is None
        or cond(d.status, ConditionType.WORKERS_PENDING).status == "False"
    )
    world.apply(d)
    d = world.step()
    pending = cond(d.status, ConditionType.WORKERS_PENDING)
    assert pending.status == "True" and "unschedulable" in pending.message
    assert d.create == ()  # the pending pods wait; no more are piled up


def _progress(world: World, step: int, *names: str) -> None:
    for name in names or world.current.plan.nodes:
        world.pods[name] = replace(world.pods[name], progress=json.dumps({"generation": 0, "step": step}))


def test_progress_to_the_last_step_succeeds(h):
    world = _running(h, cleanPodPolicy="All")
    _progress(world, 40)
    d = world.step()
    assert cond(d.status, "Succeeded").status == "True" and d.status["phase"] == "Succeeded"
    assert len(d.delete) == 5 and "completionTime" in d.status
    world.apply(d)
    assert world.step().plan is None and not world.step().create


def test_last_step_in_the_status_succeeds_even_with_the_workers_gone(h):
    """A pass that saw the last step wrote it to the status; if its Succeeded patch was then lost (an etcd
    restart) and the cleanup took the pods, the next pass must still succeed, not count the pods lost."""
    world = _running(h)
    _progress(world, 39)
    world.apply(world.step())
    assert world.status.progress.step == 39 and world.status.phase == "Running"
    world.status = world.status.model_copy(update={"progress": world.status.progress.model_copy(update={"step": 40})})
    world.pods = {n: p for n, p in world.pods.items() if n == "c"}  # every worker pod gone
    d = world.step()
    assert d.status["phase"] == "Succeeded" and cond(d.status, "Succeeded").reason == "StepsCompleted", d.status
    assert d.plan is None and not d.create


def test_one_pod_claiming_the_last_step_does_not_end_the_job(h):
    """Every live member of the plan must report the last step: one pod's word (its code can write its own
    annotation) neither ends the job nor moves status.progress.step; the slowest member's report does."""
    world = _running(h, cleanPodPolicy="All")
    members = world.current.plan.nodes
    _progress(world, 12)
    _progress(world, 10**9, members[0])
    d = world.step()
    assert d.status["phase"] == "Running" and not d.delete, d.status
    assert d.status["progress"]["step"] == 12
    world.apply(d)
    _progress(world, 40, *members[1:-1])  # all but one member done
    assert world.step().status["progress"]["step"] == 12
    _progress(world, 40, members[-1])
    d = world.step()
    assert d.status["phase"] == "Succeeded" and cond(d.status, "Succeeded").message == "40 of 40 steps done"


def test_a_lost_members_report_does_not_hold_the_job_back(h):
    """The agreement is among the members still running (or done): a lost member's stale report is not waited for."""
    world = _running(h, cleanPodPolicy="All")
    members = world.current.plan.nodes
    _progress(world, 40, *members[:-1])
    _progress(world, 7, members[-1])
    world.pods[members[-1]] = replace(world.pods[members[-1]], phase="Failed", status_reason="Evicted")
    assert world.step().status["phase"] == "Succeeded"


def _two_node_pipelines(h) -> World:
    # Memory for half the model per GPU: every pipeline spans two nodes.
    spec = h.spec()
    profile = synthetic_profile(spec, TUNING)
    total = sum(layer.state_bytes for layer in profile.layers)
    tuning = Tuning(gpu_memory_bytes=int(total * 0.8))
    return World(h, spec, n_nodes=4, tuning=tuning)


def test_losing_every_replica_of_a_layer_rolls_back_and_an_unrecoverable_report_fails_the_job(h):
    world = _two_node_pipelines(h)
    world.settle()
    plan = world.current.plan
    assert len(plan.pipelines) == 2 and all(len(p.nodes) == 2 for p in plan.pipelines)
    # The first stage's node of both pipelines: nobody holds layer 0 any more.
    for pipeline in plan.pipelines:
        first = pipeline.nodes[0]
        world.pods[first] = replace(world.pods[first], phase="Failed")
    d = world.step()
    # A fresh layout on the survivors: the workers restore from their snapshots (runtime/elastic/sources.py).
    assert d.plan.generation == 1 and d.plan.reason == "rollback" and not d.plan.copies
    assert cond(d.status_during, "Reconfiguring").reason == "RollingBack"
    world.apply(d)
    world.settle()
    # Nothing held every layer at one step: a member says so, and the job fails with its words.
    member = world.current.plan.nodes[0]
    report = {
        "job": h.JOB,
        "generation": world.current.plan.generation,
        "reporter": f"{member}:0",
        "kind": "unrecoverable",
        "dead": [],
        "detail": "layers [0] have no live holder and no snapshot",
    }
    world.pods[member] = replace(world.pods[member], failure_report=json.dumps(report))
    failed = cond(world.step().status, "Failed")
    assert failed.reason == "LayersLost" and "layers [0] have no live holder" in failed.message


def _report(h, world, kind: str, detected_at: float) -> None:
    member = world.current.plan.nodes[0]
    report = {
        "job": h.JOB,
        "generation": world.current.plan.generation,
        "reporter": f"{member}:0",
        "kind": kind,
        "dead": [],
        "detail": "",
        "detected_at": detected_at,
    }
    world.pods[member] = replace(world.pods[member], failure_report=json.dumps(report))


def test_a_coordinator_restart_redoes_the_generation_on_the_same_nodes(h):
    world = World(h, h.spec(), n_nodes=4)
    world.settle()
    before = world.current.plan
    _report(h, world, "coordinator-restart", world.now.timestamp())
    d = world.step()
    assert d.plan.generation == before.generation + 1 and d.plan.reason == "retry"
    assert d.plan.nodes == before.nodes and d.plan.pipelines == before.pipelines and not d.plan.copies
    assert cond(d.status_during, "Reconfiguring").reason == "GenerationRetried"
    world.apply(d)
    assert world.settle().plan is None  # the old report is about an older generation now


def test_a_failure_that_names_nobody_redoes_the_generation_only_if_nothing_explains_it(h):
    world = World(h, h.spec(), n_nodes=4)
    world.settle()
    _report(h, world, "collective", world.now.timestamp() - 1.0)
    assert world.step().plan is None  # a pod or node status usually names the dead worker within moments
    _report(h, world, "collective", world.now.timestamp() - 6.0)
    d = world.step()
    assert d.plan is not None and d.plan.reason == "retry" and d.plan.nodes == world.current.plan.nodes


def test_progress_carries_loss_and_throughput_into_the_status(h):
    world = World(h, h.spec(), n_nodes=4)
    world.settle()
    first, *others = world.current.plan.nodes
    _progress(world, 7, *others)
    world.pods[first] = replace(
        world.pods[first], progress=json.dumps({"generation": 0, "step": 8, "loss": 5.25, "samplesPerSecond": 300.0})
    )
    progress = parse_status(world.step().status).progress
    # The step all members reached; the loss and throughput of the newest report.
    assert (progress.step, progress.loss, progress.samples_per_second) == (7, 5.25, 300.0)


def test_the_checkpoint_step_the_members_agree_on_is_the_status_s_and_never_goes_back(h):
    world = World(h, h.spec(), n_nodes=4)
    world.settle()
    first, second = world.current.plan.nodes[:2]
    assert parse_status(world.step().status).progress is None or world.status.progress.last_checkpoint_step is None

    def report(name, step, checkpoint=None):
        body = {"generation": 0, "step": step} | ({} if checkpoint is None else {"checkpointStep": checkpoint})
        world.pods[name] = replace(world.pods[name], progress=json.dumps(body))

    report(first, 21, 20)
    report(second, 19, 10)
    world.apply(world.step())
    assert world.status.progress.last_checkpoint_step == 10  # the smallest: one pod's word moves nothing further
    report(first, 31, 30)
    report(second, 30, 20)
    world.apply(world.step())
    assert world.status.progress.last_checkpoint_step == 20
    # The reporters are replaced by workers that have not seen a checkpoint yet: the status keeps 20.
    report(first, 32)
    report(second, 32)
    world.apply(world.step())
    assert world.status.progress.last_checkpoint_step == 20


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


def test_a_microbatch_too_small_to_split_over_two_gpus_gets_one_gpu_stages(h):
    # Two GPUs per node and a model that fits on one node: stages of both GPUs would be faster, but a 1-sample
    # microbatch splits over no more than one GPU, so the planner keeps to 1-GPU stages (no InvalidSpec).
    spec = h.spec(gpusPerNode=2, training={"steps": 40, "globalBatchSize": 16, "microbatchSize": 1})
    world = World(h, spec, n_nodes=4)
    world.settle()
    assert world.status.phase != "Failed" and world.current is not None
    assert all(len(stage.gpus) == 1 for p in world.current.plan.pipelines for stage in p.stages)


def test_a_measure_job_plans_with_the_workers_profile_or_after_the_timeout_with_the_estimate(h):
    world = World(h, h.spec(), n_nodes=4)  # profile: measure (the default)
    ctx = h.context(world.spec)
    gpu = "nvidia.com/gpu"
    d = decide(ctx, observe(h.JOB, h.UID, [], world.nodes, None, gpu_resource=gpu), None, None, TUNING, world.now)
    assert d.plan is None and d.create  # pods are created before anything is measured
    world.apply(d)
    pods = list(world.pods.values())

    def first(measured=None, now=world.now):
        obs = observe(h.JOB, h.UID, pods, world.nodes, None, gpu_resource=gpu)
        return decide(replace(ctx, status=world.status), obs, None, measured, TUNING, now)

    waiting = first()
    assert waiting.plan is None and cond(waiting.status, "Running").reason == "Profiling"
    measured = synthetic_profile(world.spec, TUNING).model_copy(update={"device": "measured on tiny-worker-0"})
    planned = first(measured)
    assert planned.plan is not None and planned.profile is measured
    late = first(now=world.now + timedelta(seconds=TUNING.measure_timeout_s + 1))
    assert late.plan is not None and late.profile == synthetic_profile(world.spec, TUNING)
    assert [e.reason for e in late.events if e.type == "Warning"] == ["ProfileNotMeasured"]


# -- failures caused by the job itself (operator/faults.py through decide) ---------------------------


def _cause(kind: str, message: str) -> str:
    from oobleck.api.causes import make_cause

    return make_cause(kind, message).model_dump_json()


def _fails_with(world: World, index: int, kind: str, message: str, code: int) -> str:
    from oobleck.api.causes import CAUSE_ANNOTATION  # noqa: F401  (the annotation summarize_pod reads)

    name = world.names(index)[0]
    world.pods[name] = replace(
        world.pods[name], phase="Failed", terminated=(code, "Error"), cause=_cause(kind, message)
    )
    return name


def test_a_job_cause_on_two_workers_fails_the_job_with_its_reason_and_an_event(h):
    world = _running(h)
    _fails_with(world, 0, "DataUnavailable", "FileNotFoundError: /data/none.bin", 11)
    d = world.step()  # one report: maybe its node's; the job re-plans and counts it
    assert cond(d.status, "Failed") is None and d.status["workerFailures"] == 1
    assert any(e.reason == "DataUnavailable" and e.type == "Warning" for e in d.events)
    world.apply(d)
    _fails_with(world, 1, "DataUnavailable", "FileNotFoundError: /data/none.bin", 11)
    d = world.step()
    failed = cond(d.status, "Failed")
    assert failed.reason == "DataUnavailable" and "/data/none.bin" in failed.message
    assert d.status["phase"] == "Failed" and d.plan is None and d.create == ()
    assert d.events[-1].reason == "DataUnavailable" and d.events[-1].type == "Warning"


def test_losing_too_many_nodes_to_an_unconfirmed_cause_names_the_cause(h):
    world = _running(h, nodes={"min": 4, "max": 4})
    _fails_with(world, 2, "OutOfMemory", "RuntimeError: DefaultCPUAllocator: can't allocate memory", 13)
    failed = cond(world.step().status, "Failed")
    assert (
        failed.reason == "OutOfMemory" and "can't allocate memory" in failed.message and "nodes.min" in failed.message
    )


def test_replacements_failing_before_the_first_plan_are_bounded_by_the_budget(h):
    world = World(h, h.spec(failurePolicy={"backoffLimit": 1}, nodes={"min": 1, "max": 1}, f=0), n_nodes=2)
    created = 0
    for attempt in range(10):
        d = world.step()
        if cond(d.status, "Failed") is not None:
            break
        created += len(d.create)
        world.apply(d)
        for name, pod in list(world.pods.items()):
            if pod.role == "worker" and pod.phase == "Running":  # it exits before its runtime starts
                # (a new pod of a reused name has a new uid)
                world.pods[name] = replace(
                    pod, uid=f"{pod.uid}-{attempt}", phase="Failed", terminated=(1, "Error"), terminated_message="boom"
                )
    failed = cond(d.status, "Failed")
    assert failed.reason in ("WorkerFailed", "BackoffLimitExceeded") and "boom" in failed.message
    assert created <= 2 and d.status["workerFailures"] <= 2


def test_a_worker_image_that_cannot_be_pulled_fails_the_job_after_the_start_timeout(h):
    world = World(h, h.spec(), n_nodes=4)
    world.apply(world.step())
    stuck = world.names(1)[0]
    world.pods[stuck] = replace(
        world.pods[stuck], phase="Pending", waiting=("ImagePullBackOff", 'Back-off pulling image "nope:1"')
    )
    assert cond(world.step().status, "Failed") is None  # created 5 s ago: the kubelet may still get it
    world.now = world.now.replace(minute=2, second=5)
    d = world.step()
    failed = cond(d.status, "Failed")
    assert failed.reason == "ImagePullBackOff" and stuck in failed.message and "nope:1" in failed.message
    assert d.status["phase"] == "Failed" and d.create == ()


def test_a_failed_checkpoint_write_raises_a_condition_and_one_event(h):
    world = _running(h)
    member = world.current.plan.nodes[1]
    error = "step 20 in /ckpt/tiny: OSError: [Errno 28] No space left on device"
    world.pods[member] = replace(
        world.pods[member], progress=json.dumps({"generation": 0, "step": 21, "checkpointError": error})
    )
    d = world.step()
    failing = cond(d.status, ConditionType.CHECKPOINT_FAILING)
    assert (failing.status, failing.reason, failing.message) == ("True", "CheckpointWriteFailed", f"{member}: {error}")
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "CheckpointWriteFailed")]
    assert d.status["phase"] == "Running"
    world.apply(d)
    assert world.step().events == ()  # one event as it turns True, not one per pass
    _progress(world, 30)  # the next write succeeded: the reports carry no error
    d = world.step()
    assert cond(d.status, ConditionType.CHECKPOINT_FAILING).status == "False"


def _with_spare(h) -> tuple[World, str]:
    """A 3-node job with one warm spare on 5 nodes, every runtime reporting: members in generation 0 at
    step 7, the spare up and waiting (generation -1)."""
    spec = h.spec(nodes={"min": 2, "max": 3, "spares": 1})
    world = World(h, spec, n_nodes=5)
    d = world.step()
    assert d.create == (0, 1, 2, 3), "the wanted nodes and the spare"
    world.apply(d)
    d = world.step()
    assert sorted(d.plan.nodes) == world.names(0, 1, 2), "generation 0 takes the first wanted pods"
    spare = world.names(3)[0]
    assert spare not in dict(d.patches) and d.status["spares"] == 0, "a spare counts once its runtime is up"
    world.apply(d)
    for name in world.current.plan.nodes:
        world.pods[name] = replace(world.pods[name], progress=json.dumps({"generation": 0, "step": 7}))
    world.pods[spare] = replace(world.pods[spare], progress=json.dumps({"generation": -1, "step": 0}))
    quiet = world.settle()
    assert quiet.status["spares"] == 1 and quiet.status["sparePods"] == [spare]
    # The spare is no member: the agreed step is the members' (the spare's 0 would hold it back).
    assert quiet.status["progress"]["step"] == 7 and world.current.plan.generation == 0
    return world, spare


def test_a_warm_spare_is_kept_beside_the_plan_and_counts_for_nothing(h):
    world, spare = _with_spare(h)
    assert sorted(world.pods) == sorted([*world.names(0, 1, 2, 3), "c"])
    # A spare that fails is replaced by a new spare; no generation, no failure survived.
    world.pods[spare] = replace(world.pods[spare], phase="Failed")
    d = world.step()
    assert d.plan is None and dict(d.delete).get(spare) and d.create == (4,) and d.status["spares"] == 0
    assert d.status["failuresSurvived"] == 0


def test_a_loss_folds_the_spare_into_the_generation_that_drops_it(h):
    world, spare = _with_spare(h)
    victim = world.names(1)[0]
    world.pods[victim] = replace(world.pods[victim], phase="Failed")
    d = world.step()
    assert d.plan.generation == 1 and d.plan.lost_nodes == [victim] and d.plan.added_nodes == [spare]
    assert len(d.plan.nodes) == 3, "the full node count in the same reconfiguration"
    assert spare in dict(d.patches) and d.create == (4,) and d.failures_survived == 1
    assert d.status["spares"] == 0 and d.status_during["sparePods"] == [spare]
    world.apply(d)
    fresh = world.names(4)[0]
    world.pods[fresh] = replace(world.pods[fresh], progress=json.dumps({"generation": -1, "step": 0}))
    for name in world.current.plan.nodes:
        world.pods[name] = replace(world.pods[name], progress=json.dumps({"generation": 1, "step": 9}))
    d = world.settle()
    assert world.current.plan.generation == 1, "the replacement becomes the spare, not a member"
    assert d.status["spares"] == 1 and d.status["sparePods"] == [fresh] and d.status["nodes"] == 3


def test_scaling_up_takes_the_spare_at_once(h):
    world, spare = _with_spare(h)
    world.spec = h.spec(nodes={"min": 2, "max": 4, "spares": 1})
    d = world.step()
    assert d.plan.added_nodes == [spare] and len(d.plan.nodes) == 4 and d.create == (4,)


def test_an_ended_job_deletes_its_spares_whatever_the_clean_pod_policy(h):
    world, spare = _with_spare(h)
    world.spec = h.spec(nodes={"min": 2, "max": 3, "spares": 1}, cleanPodPolicy="None")
    for name in world.current.plan.nodes:
        world.pods[name] = replace(world.pods[name], progress=json.dumps({"generation": 0, "step": 40}))
    d = world.step()
    assert d.status["phase"] == "Succeeded" and d.status["spares"] == 0
    assert d.delete == ((spare, "not a member when the job ended"),), "members are kept (cleanPodPolicy None)"
