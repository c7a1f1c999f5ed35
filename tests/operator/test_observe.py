"""Health classification: every way a worker can be lost, and what is not a loss."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from oobleck.api import contract, resource
from oobleck.operator import render
from oobleck.operator.observe import observe, summarize_node, summarize_pod


def _status(obs, index: int):
    worker = obs.get(render.worker_name("tiny", index))
    return worker.status, worker.reason


def test_summaries_from_raw_objects():
    pod = {
        "metadata": {
            "name": "tiny-worker-0",
            "uid": "p",
            "labels": {resource.ROLE_LABEL: "worker"},
            "annotations": {contract.GENERATION_ANNOTATION: "3"},
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "ownerReferences": [{"uid": "uid-1", "controller": True}],
        },
        "spec": {"nodeName": "n1"},
        "status": {
            "phase": "Running",
            "containerStatuses": [{"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}],
            "conditions": [{"type": "PodScheduled", "status": "True"}],
        },
    }
    summary = summarize_pod(pod)
    assert (summary.node_name, summary.generation, summary.terminated, summary.owner_uid) == (
        "n1",
        3,
        (137, "OOMKilled"),
        "uid-1",
    )
    node = {
        "metadata": {"name": "n1"},
        "spec": {
            "taints": [
                {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "timeAdded": "2026-01-01T00:00:05Z"},
                {"key": "other"},
            ]
        },
        "status": {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "Unknown",
                    "reason": "NodeStatusUnknown",
                    "lastTransitionTime": "2026-01-01T00:00:03Z",
                },
                {"type": "GPUUnhealthy", "status": "True"},
                {"type": "MemoryPressure", "status": "False"},
            ],
            "capacity": {"cpu": "8", "nvidia.com/gpu": "8"},
            "allocatable": {"cpu": "7", "nvidia.com/gpu": "7"},
        },
    }
    n = summarize_node(node)
    assert n.ready == "Unknown" and n.taints == ("node.kubernetes.io/unreachable",)
    assert n.true_conditions == ("GPUUnhealthy",)
    assert n.capacity == (("nvidia.com/gpu", 8),) and n.allocatable == (("nvidia.com/gpu", 7),)
    assert n.silent_since == datetime(2026, 1, 1, 0, 0, 3, tzinfo=UTC).timestamp()  # Ready's, not the taint's
    # Unknown again while an earlier silence's taint is still there: this silence began now.
    node["spec"]["taints"][0]["timeAdded"] = "2025-12-31T23:00:00Z"
    assert summarize_node(node).silent_since == datetime(2026, 1, 1, 0, 0, 3, tzinfo=UTC).timestamp()
    node["spec"]["taints"][0]["timeAdded"] = "2026-01-01T00:00:05Z"
    # Ready again, the taint not removed yet: still silent since the taint was added.
    node["status"]["conditions"][0] = {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:09Z"}
    assert summarize_node(node).silent_since == datetime(2026, 1, 1, 0, 0, 5, tzinfo=UTC).timestamp()
    node["spec"]["taints"] = []
    assert summarize_node(node).silent_since is None


@pytest.mark.parametrize(
    "pod_fields, node_fields, expected",
    [
        ({"deleting": True}, {}, "pod tiny-worker-1 deleted"),
        ({"phase": "Failed", "status_reason": "Evicted"}, {}, "failed (Evicted)"),
        ({"terminated": (1, "Error")}, {}, "exited with code 1"),
        ({"disrupted": "DeletionByTaintManager"}, {}, "disruption target"),
        ({}, {"ready": "False", "ready_reason": "KubeletNotReady"}, "NotReady (KubeletNotReady)"),
        ({}, {"ready": "Unknown"}, "unreachable"),
        ({}, {"taints": ("node.kubernetes.io/unreachable",)}, "tainted"),
        ({}, {"allocatable": 7}, "allocatable nvidia.com/gpu 7 < capacity 8"),
        ({}, {"true_conditions": ("GPUUnhealthy",)}, "condition GPUUnhealthy"),
    ],
)
def test_each_failure_kind_loses_the_worker(h, pod_fields, node_fields, expected):
    pods = [h.worker(0), h.worker(1, **pod_fields)]
    nodes = h.nodes(2)
    nodes["node-1"] = h.node("node-1", **node_fields)
    obs = observe("tiny", h.UID, pods, nodes, None, gpu_resource="nvidia.com/gpu", gpu_conditions=("GPUUnhealthy",))
    assert _status(obs, 0) == ("running", "")
    status, reason = _status(obs, 1)
    assert status == "lost" and expected in reason


def test_node_deleted_and_cpu_jobs_skip_gpu_checks(h):
    pods = [h.worker(0), h.worker(1)]
    nodes = {"node-0": h.node("node-0", allocatable=0)}
    obs = observe("tiny", h.UID, pods, nodes, None, gpu_resource=None)
    assert _status(obs, 0) == ("running", "")  # allocatable drop ignored for cpu jobs
    assert _status(obs, 1) == ("lost", "node node-1 deleted")


def test_pending_succeeded_and_foreign(h):
    pods = [
        h.worker(0, node="", phase="Pending", unschedulable="0/3 nodes are available: Insufficient nvidia.com/gpu."),
        h.worker(1, phase="Succeeded", terminated=(0, "Completed")),
        h.worker(2),
        h.coordinator(),
    ]
    foreign = h.worker(3)
    pods.append(type(foreign)(**{**foreign.__dict__, "owner_uid": "someone-else"}))
    obs = observe("tiny", h.UID, pods, h.nodes(4), None, gpu_resource="nvidia.com/gpu")
    assert _status(obs, 0) == ("pending", "0/3 nodes are available: Insufficient nvidia.com/gpu.")
    assert _status(obs, 1)[0] == "succeeded"
    assert obs.coordinator is not None and obs.foreign == ("tiny-worker-3",)
    assert [w.index for w in obs.workers] == [0, 1, 2]


def _plan(h, n=4):
    from oobleck.operator.planning import Tuning, cluster_shape, synthetic_profile
    from oobleck.planner import plan_job

    spec = h.spec()
    profile = synthetic_profile(spec, Tuning())
    return plan_job(
        profile, cluster_shape(spec, Tuning()), 1, 8, "tiny", nodes=[render.worker_name("tiny", i) for i in range(n)]
    )


def test_worker_reports_count_only_for_the_current_generation_from_live_members(h):
    plan = _plan(h)

    def report(gen, kind, dead):
        return json.dumps({"job": "tiny", "generation": gen, "reporter": "x", "kind": kind, "dead": dead})

    pods = [
        h.worker(0, failure_report=report(0, "heartbeat", ["tiny-worker-1"])),
        h.worker(1),
        h.worker(2, failure_report=report(0, "gpu", [])),
        h.worker(3, failure_report=report(7, "heartbeat", ["tiny-worker-0"])),  # another generation: ignored
    ]
    obs = observe("tiny", h.UID, pods, h.nodes(4), plan, gpu_resource="nvidia.com/gpu")
    assert _status(obs, 0) == ("running", "")
    assert _status(obs, 1)[0] == "lost" and "reported dead by tiny-worker-0" in _status(obs, 1)[1]
    assert _status(obs, 2)[0] == "lost" and "unhealthy GPU" in _status(obs, 2)[1]
    assert _status(obs, 3) == ("running", "")
    # Without a plan (or from a lost reporter) nothing is accepted.
    assert (
        observe("tiny", h.UID, pods, h.nodes(4), None, gpu_resource="nvidia.com/gpu").get("tiny-worker-1").status
        == "running"
    )


def test_every_member_node_silent_at_once_is_the_control_plane_not_node_failures(h):
    """After an API-server outage the node lifecycle controller marks every node Unknown (their leases
    could not be renewed): the members are kept, except one that failed for a reason of its own. One
    silent node among healthy ones is still lost."""
    plan = _plan(h)
    unreachable = ("node.kubernetes.io/unreachable",)
    silent = {f"node-{i}": h.node(f"node-{i}", ready="Unknown", taints=unreachable) for i in range(4)}
    pods = [h.worker(i) for i in range(4)]
    obs = observe("tiny", h.UID, pods, silent, plan, gpu_resource="nvidia.com/gpu")
    assert [_status(obs, i) for i in range(4)] == [("running", "")] * 4
    assert obs.silent_held == tuple(render.worker_name("tiny", i) for i in range(4))

    crashed = [*pods[:3], h.worker(3, terminated=(1, "Error"))]
    obs = observe("tiny", h.UID, crashed, silent, plan, gpu_resource="nvidia.com/gpu")
    assert [_status(obs, i)[0] for i in range(4)] == ["running", "running", "running", "lost"]

    # One member finished (reported the last step first, its pod Succeeded) while the others' nodes went
    # silent: the silent ones are still the control plane's blindness, not three node failures.
    finished = [h.worker(0, phase="Succeeded", terminated=(0, "Completed")), *pods[1:]]
    obs = observe("tiny", h.UID, finished, silent, plan, gpu_resource="nvidia.com/gpu")
    assert [_status(obs, i)[0] for i in range(4)] == ["succeeded", "running", "running", "running"]

    one_silent = {**h.nodes(4), "node-1": silent["node-1"]}
    obs = observe("tiny", h.UID, pods, one_silent, plan, gpu_resource="nvidia.com/gpu")
    assert _status(obs, 1)[0] == "lost" and "unreachable" in _status(obs, 1)[1] and obs.silent_held == ()


def test_a_member_node_silent_for_less_than_the_grace_is_kept(h):
    """After an outage the kubelets renew one by one and the node lifecycle controller can mark one node
    Unknown after the others are back (seen in CI: one node dropped after a 41 s API-server outage). A silent
    node counts only once it stayed silent for the grace; then it is lost, as is one with no recorded time."""
    plan = _plan(h)
    now = 1000.0
    silent = h.node("node-1", ready="Unknown", taints=("node.kubernetes.io/unreachable",), silent_since=now - 5)
    pods = [h.worker(i) for i in range(4)]
    nodes = {**h.nodes(4), "node-1": silent}
    obs = observe("tiny", h.UID, pods, nodes, plan, gpu_resource="nvidia.com/gpu", now=now, silent_grace_s=30)
    assert [_status(obs, i) for i in range(4)] == [("running", "")] * 4
    assert obs.silent_held == ("tiny-worker-1",)

    later = observe("tiny", h.UID, pods, nodes, plan, gpu_resource="nvidia.com/gpu", now=now + 25.1, silent_grace_s=30)
    assert _status(later, 1)[0] == "lost" and "unreachable" in _status(later, 1)[1] and later.silent_held == ()

    # A newcomer (in no plan) on a silent node is not kept: it must not be folded in.
    newcomer = observe(
        "tiny", h.UID, [*pods, h.worker(4, node="node-1")], nodes, plan, gpu_resource=None, now=now, silent_grace_s=30
    )
    assert newcomer.get("tiny-worker-4").status == "lost"

    # A node that died for real also stops its worker, and its peers report it: the grace does not hold that.
    crashed = [*pods[:1], h.worker(1, terminated=(137, "Error")), *pods[2:]]
    obs = observe("tiny", h.UID, crashed, nodes, plan, gpu_resource="nvidia.com/gpu", now=now, silent_grace_s=30)
    assert _status(obs, 1)[0] == "lost" and obs.silent_held == ()


def test_the_checkpoint_step_is_the_smallest_any_live_member_reports(h):
    """Only ranks that write a layer report a checkpoint step; one pod claiming a newer one than its peers
    read in the directory moves nothing, and a lost member's report does not count."""
    plan = _plan(h)

    def progress(step, checkpoint=None):
        body = {"generation": 0, "step": step} | ({} if checkpoint is None else {"checkpointStep": checkpoint})
        return json.dumps(body)

    pods = [h.worker(0, progress=progress(40, 30)), h.worker(1, progress=progress(40, 20)), h.worker(2), h.worker(3)]
    assert observe("tiny", h.UID, pods, h.nodes(4), plan, gpu_resource="nvidia.com/gpu").checkpoint_step == 20
    pods[1] = h.worker(1, progress=progress(40, 20), terminated=(1, "Error"))  # lost: no say
    assert observe("tiny", h.UID, pods, h.nodes(4), plan, gpu_resource="nvidia.com/gpu").checkpoint_step == 30
    quiet = [h.worker(i, progress=progress(40)) for i in range(4)]
    assert observe("tiny", h.UID, quiet, h.nodes(4), plan, gpu_resource="nvidia.com/gpu").checkpoint_step is None


def test_a_newcomer_that_never_trained_does_not_hold_the_agreed_step_below_the_end(h):
    """The lone survivor trains the last step while the operator folds a replacement in: the survivor's pod
    Succeeded with the final step, the newcomer (up, waiting for its first plan) reports generation -1. The job
    is at its end; before, the newcomer's 0 held the agreed step at 0 and the job never succeeded."""
    plan = _plan(h)
    waiting = json.dumps({"generation": -1, "step": 0})

    def done(i):
        return h.worker(
            i, phase="Succeeded", terminated=(0, "Completed"), progress=json.dumps({"generation": 1, "step": 300})
        )

    pods = [done(0), done(1), done(2), h.worker(3, progress=waiting)]
    assert observe("tiny", h.UID, pods, h.nodes(4), plan, gpu_resource="nvidia.com/gpu").step == 300
    # A member that has reported nothing yet still counts 0, and trained members still agree on their lowest.
    pods[3] = h.worker(3)
    assert observe("tiny", h.UID, pods, h.nodes(4), plan, gpu_resource="nvidia.com/gpu").step == 0
    training = [h.worker(i, progress=json.dumps({"generation": 2, "step": 40 + i})) for i in range(3)]
    pods = [*training, h.worker(3, progress=waiting)]
    assert observe("tiny", h.UID, pods, h.nodes(4), plan, gpu_resource="nvidia.com/gpu").step == 40
