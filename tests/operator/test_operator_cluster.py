"""The operator against the real local control plane, run as a subprocess (so tests can SIGKILL it).

Worker pods land on kwok nodes with `nvidia.com/gpu` capacity (kwok keeps them Running); each test
gets its own namespace and its own pool of nodes (a node label the job's nodeSelector names).
Failures are injected the ways the operator must notice: pod deletion, pod status patches, node
conditions (after taking the node away from kwok, which would re-ready it), allocatable changes,
and a worker's failure report.
"""

from __future__ import annotations

import base64
import json
import secrets
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from oobleck.api import contract, planmap, resource
from oobleck.api.plan import Plan
from oobleck.operator import render
from oobleck_dev import operatorproc
from oobleck_dev.kwok import FAKE_NODE_LABEL
from oobleck_dev.operatorproc import OperatorProcess
from oobleck_dev.poll import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
POOL_LABEL = "oobleck-test/pool"
TIMEOUT_S = 60.0


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = TIMEOUT_S) -> Any:
    return wait_until(predicate, what, timeout, 0.2, tolerate=(Exception,))  # the object may not exist yet


def new_operator(cluster, namespace: str, log_dir: Path) -> OperatorProcess:
    """`oobleck operator` in a subprocess for `namespace`; kwok pods run no runtime, so it plans with the
    estimate (`--measure-timeout 0`). One planner process (each costs 0.6 CPU-s to start): a test whose jobs
    must plan at the same time asks for more."""
    return OperatorProcess(
        cluster.kubeconfig, [namespace], log_dir, "--resync", "2", "--measure-timeout", "0", "--planner-workers", "1"
    )


@pytest.fixture
def env(cluster, tmp_path) -> Iterator[dict[str, Any]]:
    namespace = cluster.namespace("op")
    pool = f"p{secrets.token_hex(4)}"
    operator = new_operator(cluster, namespace, tmp_path)
    state: dict[str, Any] = {"ns": namespace, "pool": pool, "operator": operator, "nodes": []}

    def add_nodes(n: int, gpus: int = 8) -> list[str]:
        names = cluster.add_kwok_nodes(n, gpus=gpus, labels={POOL_LABEL: pool})
        state["nodes"] += names
        return names

    state["add_nodes"] = add_nodes
    try:
        yield state
    finally:
        operator.kill()
        if state["nodes"]:
            cluster.delete_kwok_nodes(state["nodes"])
        if operator.starts:
            print(operator.log()[-5000:])


def job_manifest(name: str, pool: str, **spec: Any) -> str:
    body = {
        "apiVersion": "oobleck.dev/v1alpha1",
        "kind": "OobleckJob",
        "metadata": {"name": name},
        "spec": {
            "model": {"gpt": {"layers": 4, "hiddenSize": 64, "heads": 4, "sequenceLength": 32, "vocabSize": 256}},
            "nodes": {"min": 2, "max": 4},
            "gpusPerNode": 1,
            "f": 1,
            "training": {"steps": 40, "globalBatchSize": 16, "microbatchSize": 2},
            "pod": {"nodeSelector": {POOL_LABEL: pool}},
            "pendingTimeoutSeconds": 600,
            **spec,
        },
    }
    return yaml.safe_dump(body)


def apply_job(cluster, env: dict[str, Any], name: str = "tiny", **spec: Any) -> None:
    cluster.kubectl("apply", "-n", env["ns"], "-f", "-", input=job_manifest(name, env["pool"], **spec))


# The helpers below are polled every 0.2 s: they read over the cluster's kept connection (`cluster.reads`),
# not a kubectl process per read.
def job(cluster, ns: str, name: str = "tiny") -> dict[str, Any]:
    return cluster.reads.custom(resource.GROUP, resource.VERSION, resource.PLURAL, ns, name)


def condition(body: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in body.get("status", {}).get("conditions", []) if c["type"] == type_), None)


def workers(cluster, ns: str, name: str = "tiny") -> dict[str, dict[str, Any]]:
    pods = cluster.reads.pods(ns, resource.worker_selector(name))
    return {p["metadata"]["name"]: p for p in pods}


def current_plan(cluster, ns: str, name: str = "tiny") -> Plan:
    return planmap.read_plan(cluster.reads.config_map(ns, render.plan_name(name)))


def reconfigured_events(cluster, ns: str) -> list[str]:
    items = cluster.reads.events(ns, "reason=Reconfigured")
    return sorted(e["message"] for e in items)


def report_progress(cluster, ns: str, pod: str, generation: int, step: int) -> None:
    """Write `pod`'s progress annotation as its runtime would (kwok pods run none)."""
    progress = json.dumps({"generation": generation, "step": step})
    cluster.kubectl("annotate", "pod", pod, "-n", ns, "--overwrite", f"{contract.PROGRESS_ANNOTATION}={progress}")


def settled(cluster, ns: str, generation: int, name: str = "tiny", *, or_later: bool = False) -> Plan | None:
    """The plan once it has `generation` (or a later one) and every member pod is Running and annotated with
    its ranks."""
    plan = current_plan(cluster, ns, name)
    if plan.generation != generation and not (or_later and plan.generation > generation):
        return None
    pods = workers(cluster, ns, name)
    table = render.ranks_table(plan)
    for node in plan.nodes:
        pod = pods.get(node)
        if pod is None or pod["status"].get("phase") != "Running":
            return None
        annotations = pod["metadata"].get("annotations", {})
        if not render.annotations_current(plan, node, annotations, table):
            return None
        assert int(annotations[contract.GENERATION_ANNOTATION]) <= plan.generation, (
            "patched before the plan was written"
        )
    return plan


def running_job(cluster, env: dict[str, Any], nodes: int = 4, **spec: Any) -> Plan:
    env["add_nodes"](nodes)
    env["operator"].start(*spec.pop("operator_args", ()))
    apply_job(cluster, env, **spec)
    return wait_for(lambda: settled(cluster, env["ns"], 0), "generation 0 on every worker")


# -- lifecycle ---------------------------------------------------------------------------------------


def test_lifecycle_waits_for_nodes_runs_and_cleans_up(cluster, env):
    ns = env["ns"]
    env["add_nodes"](2)
    env["operator"].start()
    apply_job(cluster, env, nodes={"min": 2, "max": 3})
    # Polled until both pods on the two nodes run (a loaded scheduler reports "1 of 3" first).
    waiting = wait_for(
        lambda: (
            (c := condition(job(cluster, ns), "Running"))
            and "nodes are available" in c["message"]
            and "2 of 3 worker pods running" in c["message"]
            and c
        ),
        "the WaitingForNodes condition: 2 of 3 worker pods running, with the scheduler's reason",
    )
    assert waiting["reason"] == "WaitingForNodes"
    assert len(workers(cluster, ns)) == 3  # two running, one pending: nothing piled up
    # Registered as a kubelet registers a node (Ready False, tainted not-ready): a pending pod bound to it before
    # kwok reports it Ready would be lost and replaced (seen three times on a loaded host: 5 pods created,
    # worker-2 replaced by worker-3 before generation 0; the taint alone was lifted at once, lacking the condition).
    env["nodes"] += cluster.add_kwok_nodes(1, labels={POOL_LABEL: env["pool"]}, not_ready=True)
    plan = wait_for(lambda: settled(cluster, ns, 0), "generation 0 once the third node exists")
    assert len(plan.nodes) == 3
    # The status is patched after the plan and the pods' ranks (one run here read it Pending in between).
    body = wait_for(
        lambda: (b := job(cluster, ns))["status"].get("phase") == "Running" and b, "the status Running after the plan"
    )
    assert body["status"]["plan"]["generation"] == 0
    # Children: owned, deterministic names.
    uid = body["metadata"]["uid"]
    for kind, name in [
        ("service", "tiny-workers"),
        ("serviceaccount", "tiny-oobleck-worker"),
        ("role", "tiny-oobleck-worker"),
        ("rolebinding", "tiny-oobleck-worker"),
        ("configmap", "tiny-plan"),
        ("pod", "tiny-coordinator"),
        ("secret", "tiny-key"),
        ("networkpolicy", "tiny-isolation"),
    ]:
        child = cluster.kubectl_json("get", kind, name, "-n", ns)
        assert child["metadata"]["ownerReferences"][0]["uid"] == uid, (kind, name)
    # The job's key: random, only in its Secret (never in the plan ConfigMap or a pod), mounted by every worker.
    key = base64.b64decode(cluster.kubectl_json("get", "secret", "tiny-key", "-n", ns)["data"]["key"])
    assert len(key) == 64
    plan_map = json.dumps(cluster.kubectl_json("get", "configmap", "tiny-plan", "-n", ns))
    pods = json.dumps(cluster.kubectl_json("get", "pods", "-n", ns))
    assert key.decode() not in plan_map and key.decode() not in pods
    assert all(
        {"name": "job-key", "secret": {"secretName": "tiny-key", "defaultMode": 0o444}} in pod["spec"]["volumes"]
        for pod in workers(cluster, ns).values()
    )
    metrics = env["operator"].metrics()
    assert 'oobleck_operator_jobs{phase="Running"} 1.0' in metrics
    created = [line for line in metrics.splitlines() if line.startswith("oobleck_operator_pods_created_total ")]
    assert created == ["oobleck_operator_pods_created_total 4.0"], (  # 3 + coordinator
        [line for line in env["operator"].log().splitlines() if ": deleting pod " in line],  # first: CI cuts the rest
        created,
        {name: (p["spec"].get("nodeName"), p["status"].get("phase")) for name, p in workers(cluster, ns).items()},
        reconfigured_events(cluster, ns),
        cluster.kubectl("get", "events", "-n", ns).stdout[-3000:],
    )
    spares_series = f'oobleck_operator_spares{{job="tiny",namespace="{ns}"}} 0.0'
    assert spares_series in metrics
    cluster.kubectl("delete", "oobleckjob", "tiny", "-n", ns, "--wait=true", timeout=90)
    wait_for(
        lambda: (
            not cluster.kubectl_json(
                "get", "pods,configmap,service,serviceaccount,role", "-n", ns, "-l", "oobleck.dev/job=tiny"
            )["items"]
        ),
        "garbage collection of every child",
    )
    # A deleted job's series go with it (a dashboard would show its spares forever).
    wait_for(lambda: f'namespace="{ns}"' not in env["operator"].metrics(), "the deleted job's series gone")


def test_spec_the_planner_cannot_serve_fails_with_an_event(cluster, env):
    ns = env["ns"]
    env["operator"].start()
    # Each block alone needs more memory than a GPU has: no template exists.
    apply_job(
        cluster,
        env,
        model={"gpt": {"layers": 4, "hiddenSize": 32768, "heads": 32, "sequenceLength": 64, "vocabSize": 256}},
    )
    failed = wait_for(
        lambda: (c := condition(job(cluster, ns), "Failed")) and c["status"] == "True" and c, "the Failed condition"
    )
    # Memory admission answers first, naming the field and both numbers (issue 10 item 2).
    message = failed["message"]
    assert failed["reason"] == "InvalidSpec" and "spec.gpuMemory" in message and "per GPU" in message, message
    assert job(cluster, ns)["status"]["phase"] == "Failed"
    events = cluster.kubectl_json("get", "events", "-n", ns, "--field-selector", "reason=InvalidSpec")["items"]
    assert events and events[0]["type"] == "Warning"
    assert not workers(cluster, ns)


# -- failures ----------------------------------------------------------------------------------------


def _take_from_kwok(cluster, node: str) -> None:
    # kwok re-initialises a managed node that is not Ready; unmanaged, the injected state stays.
    cluster.kubectl("label", "node", node, f"{FAKE_NODE_LABEL}-")


def _patch_node_status(cluster, node: str, status: dict[str, Any]) -> None:
    cluster.kubectl("patch", "node", node, "--subresource=status", "-p", json.dumps({"status": status}))


def inject(kind: str, cluster, ns: str, victim: str, plan: Plan) -> None:
    pod = cluster.kubectl_json("get", "pod", victim, "-n", ns)
    node = pod["spec"]["nodeName"]
    if kind == "pod-deleted":
        cluster.kubectl("delete", "pod", victim, "-n", ns, "--wait=false")
    elif kind == "pod-failed":
        cluster.kubectl(
            "patch",
            "pod",
            victim,
            "-n",
            ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": {"phase": "Failed", "reason": "Injected"}}),
        )
    elif kind == "container-exited":
        _take_from_kwok(cluster, node)  # kwok would otherwise report the container running again
        terminated = {
            "name": "worker",
            "ready": False,
            "restartCount": 0,
            "image": "x",
            "imageID": "",
            "state": {"terminated": {"exitCode": 3, "reason": "Error"}},
        }
        cluster.kubectl(
            "patch",
            "pod",
            victim,
            "-n",
            ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": {"containerStatuses": [terminated]}}),
        )
    elif kind == "node-not-ready":
        _take_from_kwok(cluster, node)
        _patch_node_status(cluster, node, {"conditions": [{"type": "Ready", "status": "False", "reason": "Injected"}]})
    elif kind == "gpu-allocatable":
        _take_from_kwok(cluster, node)
        _patch_node_status(cluster, node, {"allocatable": {"nvidia.com/gpu": "7"}})
    elif kind == "gpu-condition":
        _take_from_kwok(cluster, node)
        _patch_node_status(
            cluster, node, {"conditions": [{"type": "GPUUnhealthy", "status": "True", "reason": "XidError"}]}
        )
    elif kind == "worker-report":
        reporter = next(n for n in plan.nodes if n != victim)
        report = {
            "job": "tiny",
            "generation": plan.generation,
            "reporter": reporter,
            "kind": "heartbeat",
            "dead": [victim],
        }
        cluster.kubectl("annotate", "pod", reporter, "-n", ns, f"{contract.FAILURE_ANNOTATION}={json.dumps(report)}")
    elif kind == "gpu-report":
        report = {
            "job": "tiny",
            "generation": plan.generation,
            "reporter": victim,
            "kind": "gpu",
            "dead": [],
            "detail": "Xid 79",
        }
        cluster.kubectl("annotate", "pod", victim, "-n", ns, f"{contract.FAILURE_ANNOTATION}={json.dumps(report)}")
    else:
        raise ValueError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "pod-deleted",
        "pod-failed",
        "container-exited",
        "node-not-ready",
        "gpu-allocatable",
        "gpu-condition",
        "worker-report",
        "gpu-report",
    ],
)
def test_each_failure_kind_is_one_generation_without_the_node(cluster, env, kind):
    ns = env["ns"]
    plan = running_job(cluster, env)
    victim = plan.nodes[1]
    inject(kind, cluster, ns, victim, plan)
    lost = wait_for(lambda: (p := current_plan(cluster, ns)).generation >= 1 and p, f"a new generation after {kind}")
    assert victim not in lost.nodes
    # Every survivor carries the generation that excludes the victim (or a later one adding a replacement).
    wait_for(lambda: settled(cluster, ns, current_plan(cluster, ns).generation), "survivors patched")
    # The event is posted after the plan is written.
    with_losses = wait_for(
        lambda: [e for e in reconfigured_events(cluster, ns) if "lost" in e], "the Reconfigured event of the loss"
    )
    assert len(with_losses) == 1 and f"lost ['{victim}']" in with_losses[0], with_losses
    assert victim not in workers(cluster, ns) or workers(cluster, ns)[victim]["metadata"].get("deletionTimestamp")
    # The status is written after the patches (Reconfiguring -> Running). A timeout shows the status last read
    # (once, at load ~11, it was not Running with one failure 60 s after generation 2: what it was is unknown).
    seen: list[dict[str, Any]] = []

    def running_with_one_failure() -> bool:
        seen[:] = [job(cluster, ns)["status"]]
        return seen[0]["phase"] == "Running" and seen[0]["failuresSurvived"] == 1

    try:
        wait_for(running_with_one_failure, "status Running, 1 failure")
    except AssertionError as error:
        raise AssertionError(f"{error}; the status: {seen}; the plan: {current_plan(cluster, ns)}") from None
    assert "oobleck_operator_failure_to_patch_seconds_count 1.0" in env["operator"].metrics()


def test_a_silent_node_is_kept_for_the_grace_then_lost(cluster, env):
    """After a control-plane outage the kubelets renew one by one, and the node lifecycle controller can mark
    one node Unknown after the others are back (a CI run lost a node that way). A member whose node went
    silent counts as lost only once it stayed silent for --silent-node-grace: back within it, it was never
    lost; silent past it, it is, and not before."""
    ns, grace = env["ns"], 10.0
    plan = running_job(cluster, env, operator_args=("--silent-node-grace", str(grace), "--resync", "1"))
    victim = plan.nodes[1]
    node = cluster.kubectl_json("get", "pod", victim, "-n", ns)["spec"]["nodeName"]
    _take_from_kwok(cluster, node)

    def ready(status: str) -> float:
        at = time.time()
        stamp = datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        condition = {"type": "Ready", "status": status, "reason": "Injected", "lastTransitionTime": stamp}
        _patch_node_status(cluster, node, {"conditions": [condition]})
        return int(at)  # the time as the node records it, to the second

    ready("Unknown")
    time.sleep(3)
    ready("True")
    time.sleep(grace + 3)  # past the grace, with resyncs every second
    assert current_plan(cluster, ns).generation == 0, "a node back within the grace was lost"

    silent_at = ready("Unknown")
    lost = wait_for(lambda: (p := current_plan(cluster, ns)).generation >= 1 and p, "the silent node lost")
    assert time.time() - silent_at >= grace, "lost before the grace ended"
    assert victim not in lost.nodes
    # The event is posted after the plan is written.
    with_losses = wait_for(
        lambda: [e for e in reconfigured_events(cluster, ns) if "lost" in e], "the Reconfigured event of the loss"
    )
    assert len(with_losses) == 1 and f"lost ['{victim}']" in with_losses[0], with_losses


def test_simultaneous_losses_make_one_generation(cluster, env):
    ns = env["ns"]
    env["add_nodes"](6)
    # Both deletions reach the operator within the window even when a loaded host delays kopf's
    # handling of the second pod event by a second or more (0.5 s was exceeded at load ~15).
    env["operator"].start("--batch-window", "2.0")
    apply_job(cluster, env, f=2, nodes={"min": 2, "max": 6})
    plan = wait_for(lambda: settled(cluster, ns, 0), "generation 0")
    victims = plan.nodes[1:3]
    cluster.kubectl("delete", "pod", *victims, "-n", ns, "--wait=false")
    wait_for(lambda: current_plan(cluster, ns).generation >= 1, "a new generation")
    wait_for(lambda: settled(cluster, ns, current_plan(cluster, ns).generation), "survivors patched")
    with_losses = wait_for(
        lambda: [e for e in reconfigured_events(cluster, ns) if "lost" in e], "the Reconfigured event of the loss"
    )
    assert len(with_losses) == 1 and all(v in with_losses[0] for v in victims), with_losses
    wait_for(
        lambda: job(cluster, ns)["status"]["failuresSurvived"] == 2, "status.failuresSurvived == 2"
    )  # written after the patches


# -- restart safety -------------------------------------------------------------------------------------


def test_an_operator_start_whose_liveness_port_was_taken_is_retried_on_fresh_ports(env, monkeypatch):
    # CI lost a start this way: another process bound the picked port before kopf did.
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    picks = iter([operatorproc.free_port(), taken_port])  # metrics, then liveness
    real_free_port = operatorproc.free_port
    monkeypatch.setattr(operatorproc, "free_port", lambda: next(picks, None) or real_free_port())
    operator = env["operator"]
    try:
        operator.start()
    finally:
        taken.close()
    assert operator.starts == 1 and operator.healthy()
    assert operator.liveness_port != taken_port
    first, retried = sorted(operator.log_dir.glob("operator-*.log"))
    assert "address already in use" in first.read_text() and "address already in use" not in retried.read_text()


def test_killed_between_plan_write_and_patches_converges(cluster, env):
    ns = env["ns"]
    env["add_nodes"](4)
    operator = env["operator"]
    operator.start()
    apply_job(cluster, env, nodes={"min": 2, "max": 4, "target": 3})
    plan = wait_for(lambda: settled(cluster, ns, 0), "generation 0")
    operator.kill()
    operator.start(program=Path(__file__).parents[1] / "e2e" / "crash_after_plan_write.py")
    victim = plan.nodes[0]
    cluster.kubectl("delete", "pod", victim, "-n", ns, "--wait=false")
    wait_for(lambda: operator.process.poll() is not None, "the operator to crash after writing generation 1")
    written = current_plan(cluster, ns)
    assert written.generation == 1
    pods = workers(cluster, ns)
    stale = [n for n in written.nodes if not render.annotations_current(written, n, pods[n]["metadata"]["annotations"])]
    assert stale, "the crash must leave a renumbered survivor unpatched"
    operator.start()
    # Generation 1 is finished (survivors patched), then the replacement is folded in as generation 2.
    final = wait_for(
        lambda: len((p := current_plan(cluster, ns)).nodes) == 3 and settled(cluster, ns, p.generation), "convergence"
    )
    assert final.generation == 2 and final.lost_nodes == [] and len(final.added_nodes) == 1
    time.sleep(3)  # over a resync period: nothing else may happen
    assert current_plan(cluster, ns).generation == 2
    live = [n for n, p in workers(cluster, ns).items() if not p["metadata"].get("deletionTimestamp")]
    assert sorted(live) == sorted(final.nodes)  # no duplicate, no orphan
    assert job(cluster, ns)["status"]["failuresSurvived"] == 1


def test_killed_at_random_moments_never_duplicates(cluster, env):
    ns = env["ns"]
    env["add_nodes"](5)
    operator = env["operator"]
    operator.start()
    apply_job(cluster, env, nodes={"min": 2, "max": 4})
    plan = wait_for(lambda: settled(cluster, ns, 0), "generation 0")
    for round_ in range(3):
        victim = plan.nodes[0]
        cluster.kubectl("delete", "pod", victim, "-n", ns, "--wait=false")
        time.sleep(0.05 * round_)  # kill at a different point of the reconfiguration each round
        operator.kill()
        operator.start()
        plan = wait_for(
            lambda: (
                (p := current_plan(cluster, ns))
                and victim not in p.nodes
                and len(p.nodes) == 4
                and settled(cluster, ns, p.generation)
            ),
            f"round {round_}: a plan without {victim} on 4 nodes",
        )
        live = [n for n, p in workers(cluster, ns).items() if not p["metadata"].get("deletionTimestamp")]
        assert sorted(live) == sorted(plan.nodes), (live, plan.nodes)
    wait_for(
        lambda: job(cluster, ns)["status"]["failuresSurvived"] == 3, "status.failuresSurvived == 3"
    )  # written after the patches


# -- scale ---------------------------------------------------------------------------------------------


def test_kubectl_scale_changes_the_node_count(cluster, env):
    ns = env["ns"]
    plan = running_job(cluster, env)
    cluster.kubectl("scale", "oobleckjob/tiny", "-n", ns, "--replicas=2")
    small = wait_for(lambda: (_p := current_plan(cluster, ns)).generation == 1 and settled(cluster, ns, 1), "scaled in")
    newest = sorted(plan.nodes, key=lambda n: render.worker_index("tiny", n))[2:]
    assert len(small.nodes) == 2 and sorted(small.lost_nodes) == sorted(newest)
    wait_for(lambda: len(workers(cluster, ns)) == 2, "two worker pods")
    wait_for(
        lambda: job(cluster, ns)["status"]["failuresSurvived"] == 0, "status.failuresSurvived == 0"
    )  # written after the patches
    cluster.kubectl("scale", "oobleckjob/tiny", "-n", ns, "--replicas=3")
    big = wait_for(lambda: (_p := current_plan(cluster, ns)).generation == 2 and settled(cluster, ns, 2), "scaled out")
    assert len(big.nodes) == 3 and len(big.added_nodes) == 1
    wait_for(lambda: job(cluster, ns)["status"]["nodes"] == 3, "status.nodes == 3")  # written after the patches


def test_final_step_succeeds_and_cleans_pods(cluster, env):
    """Only once every member reports the last step: one pod's claim (here a huge step) ends nothing."""
    ns = env["ns"]
    plan = running_job(cluster, env, cleanPodPolicy="Running")
    first, *others = plan.nodes
    for pod, step in ((first, 10**9), *((pod, 12) for pod in others)):
        report_progress(cluster, ns, pod, 0, step)
    wait_for(lambda: (job(cluster, ns)["status"].get("progress") or {}).get("step") == 12, "status.progress.step 12")
    time.sleep(2)  # further passes of the operator over the same reports
    assert job(cluster, ns)["status"]["phase"] == "Running"
    for pod in plan.nodes:
        report_progress(cluster, ns, pod, 0, 40)
    wait_for(lambda: job(cluster, ns)["status"]["phase"] == "Succeeded", "Succeeded")
    wait_for(
        lambda: not cluster.reads.pods(ns, "oobleck.dev/job=tiny"),
        "pods cleaned up",
    )
    assert job(cluster, ns)["status"]["progress"]["step"] == 40


def test_an_ended_job_deletes_its_spare_and_keeps_its_members(cluster, env):
    """cleanPodPolicy None keeps a Succeeded job's member pods; its warm spare, which holds nothing, is deleted and
    the status counts no spare. (tests/e2e/test_spares.py shows a real spare's runtime counted ready.)"""
    ns = env["ns"]
    env["add_nodes"](4)
    env["operator"].start()
    apply_job(cluster, env, nodes={"min": 2, "max": 3, "spares": 1}, cleanPodPolicy="None")
    plan = wait_for(lambda: settled(cluster, ns, 0), "generation 0 on every worker")
    # Generation 0 takes the first three pods to run; which of the four that is, kwok's start order decides.
    assert len(plan.nodes) == 3
    (spare,) = {render.worker_name("tiny", i) for i in range(4)} - set(plan.nodes)
    wait_for(lambda: workers(cluster, ns)[spare]["status"]["phase"] == "Running", "the spare pod running")
    report_progress(cluster, ns, spare, -1, 0)  # its runtime is up, in no plan: what a spare reports
    for pod in plan.nodes:
        report_progress(cluster, ns, pod, 0, 12)
    wait_for(lambda: job(cluster, ns)["status"].get("sparePods") == [spare], "the spare counted")
    for pod in plan.nodes:
        report_progress(cluster, ns, pod, 0, 40)
    wait_for(lambda: job(cluster, ns)["status"]["phase"] == "Succeeded", "Succeeded")
    wait_for(lambda: spare not in workers(cluster, ns), "the spare deleted")
    assert set(plan.nodes) <= set(workers(cluster, ns)), "the members' pods stay (cleanPodPolicy None)"
    assert job(cluster, ns)["status"].get("spares", 0) == 0


# -- high availability ----------------------------------------------------------------------------------

# kopf's namespaced peering resource (kopf.dev/v1 KopfPeering): peers write their identity, priority
# and lifetime into the object's top-level `status`, so the schema keeps unknown fields.
PEERING_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "kopfpeerings.kopf.dev"},
    "spec": {
        "group": "kopf.dev",
        "scope": "Namespaced",
        "names": {"plural": "kopfpeerings", "singular": "kopfpeering", "kind": "KopfPeering"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
            }
        ],
    },
}


def test_two_replicas_with_peering_fail_over(cluster, env, tmp_path):
    ns = env["ns"]
    cluster.kubectl("apply", "-f", "-", input=json.dumps(PEERING_CRD))
    wait_for(lambda: cluster.kubectl("get", "kopfpeerings", "-n", ns, check=False).returncode == 0, "the peering CRD")
    peering = {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "oobleck-ha", "namespace": ns}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(peering))
    env["add_nodes"](4)
    leader = env["operator"]
    (tmp_path / "standby").mkdir()
    standby = new_operator(cluster, ns, tmp_path / "standby")
    common = ("--peering", "oobleck-ha", "--peering-lifetime", "5")
    leader.start(*common, "--priority", "100")
    standby.start(*common, "--priority", "50")
    try:
        apply_job(cluster, env, nodes={"min": 2, "max": 4, "target": 3})
        plan = wait_for(lambda: settled(cluster, ns, 0), "generation 0")
        victim = plan.nodes[0]
        cluster.kubectl("delete", "pod", victim, "-n", ns, "--wait=false")
        wait_for(
            lambda: (
                (p := current_plan(cluster, ns))
                and len(p.nodes) == 3
                and victim not in p.nodes
                and settled(cluster, ns, p.generation)
            ),
            "the leader's reconfiguration",
        )
        assert "plan generation" not in standby.log()  # paused: the leader did all of it
        leader.kill()
        time.sleep(1)
        plan = current_plan(cluster, ns)
        victim = plan.nodes[0]
        cluster.kubectl("delete", "pod", victim, "-n", ns, "--wait=false")
        final = wait_for(
            lambda: (
                (p := current_plan(cluster, ns))
                and len(p.nodes) == 3
                and victim not in p.nodes
                and settled(cluster, ns, p.generation)
            ),
            "the standby taking over",
            timeout=90,
        )
        assert "plan generation" in standby.log()
        with_losses = wait_for(
            lambda: len(events := [e for e in reconfigured_events(cluster, ns) if "lost" in e]) >= 2 and events,
            "the Reconfigured events of both losses",
        )
        assert len(with_losses) == 2, with_losses  # one per failure: never both replicas
        live = [n for n, p in workers(cluster, ns).items() if not p["metadata"].get("deletionTimestamp")]
        assert sorted(live) == sorted(final.nodes)
    finally:
        standby.kill()
        print(standby.log()[-3000:])


def test_plan_writes_are_conditional_on_the_version_read(cluster, h):
    """A writer with a stale view (e.g. a replica that was paused) gets 409 instead of undoing a newer plan."""
    import asyncio

    from oobleck.operator.apply import Api, ApiError
    from oobleck.operator.metrics import Metrics
    from oobleck.operator.planning import Tuning, cluster_shape, synthetic_profile
    from oobleck.planner import plan_job

    ns = cluster.namespace("op")
    # A real owner (no operator serves this namespace): the garbage collector deletes children of a missing one.
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=job_manifest("tiny", "none"))
    owner = job(cluster, ns)["metadata"]["uid"]
    spec = h.spec()
    profile = synthetic_profile(spec, Tuning())
    names = [render.worker_name("tiny", i) for i in range(4)]
    plan0 = plan_job(profile, cluster_shape(spec, Tuning()), 1, 8, "tiny", nodes=names)
    plan1 = plan0.model_copy(update={"generation": 1})

    async def scenario() -> None:
        api = await Api.connect(cluster.kubeconfig, Metrics(), 8, 15.0)
        try:
            body0 = render.plan_config_map("tiny", ns, owner, plan0, profile, spec, 0)
            version0 = await api.write_plan(body0, owner, None)
            body1 = render.plan_config_map("tiny", ns, owner, plan1, profile, spec, 0)
            version1 = await api.write_plan(body1, owner, version0)
            assert version1 != version0
            with pytest.raises(ApiError) as stale:  # the generation-0 writer, still holding version0
                await api.write_plan(body0, owner, version0)
            assert stale.value.status == 409
            with pytest.raises(ApiError) as twice:  # creating generation 0 again
                await api.write_plan(body0, owner, None)
            assert twice.value.status == 409
        finally:
            await api.close()

    asyncio.run(scenario())
    assert current_plan(cluster, ns).generation == 1


# -- bounded work (issue 20) -------------------------------------------------------------------------------


def test_a_create_the_api_server_refuses_fails_the_job_with_its_message(cluster, env):
    """A LimitRange refuses the worker pods (403): the job ends Failed/ChildRejected, not retried forever."""
    ns = env["ns"]
    limit_range = {
        "apiVersion": "v1",
        "kind": "LimitRange",
        "metadata": {"name": "small"},
        "spec": {"limits": [{"type": "Container", "max": {"memory": "1Gi"}}]},
    }
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(limit_range))
    env["operator"].start()
    apply_job(cluster, env, resources={"cpu": "1", "memory": "2Gi"})
    failed = wait_for(
        lambda: (c := condition(job(cluster, ns), "Failed")) and c["status"] == "True" and c, "the Failed condition"
    )
    assert failed["reason"] == "ChildRejected", failed
    assert "HTTP 403" in failed["message"] and "maximum memory usage per Container is 1Gi" in failed["message"]
    events = cluster.kubectl_json("get", "events", "-n", ns, "--field-selector", "reason=ChildRejected")["items"]
    assert events and events[0]["type"] == "Warning" and "1Gi" in events[0]["message"]
    errors = env["operator"].metrics().count('api_errors_total{verb="create"}')
    time.sleep(3)  # more than the 1 s retry of before: nothing is retried
    assert env["operator"].metrics().count('api_errors_total{verb="create"}') == errors
    assert not workers(cluster, ns)


def _huge_profile_config_map(name: str) -> dict[str, Any]:
    """1024 layers: what a worker could measure for an entry point (the API server cannot see its layers)."""
    from oobleck.planner.synthetic import GPTShape, gpt_profile

    profile = gpt_profile(
        GPTShape(blocks=1022, hidden=64, heads=4, vocab=256),
        seq_len=32,
        microbatch_size=1,
        gpu_flops=300e12,
        hbm_bandwidth=2e12,
    )
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name},
        "data": {"profile.json": profile.model_dump_json()},
    }


def test_a_huge_spec_is_planned_off_the_loop_while_another_job_recovers(cluster, env):
    """A 4096-node x 1024-layer job beside a training job: the operator's liveness answers throughout, it
    does not restart, the other job's lost worker is replaced in its usual time, and the huge job fails
    InvalidSpec naming the planner's limit. Also: an env from a Secret stays a reference everywhere."""
    ns = env["ns"]
    secret_value = f"s3cr3t-{secrets.token_hex(8)}"
    cluster.kubectl("create", "secret", "generic", "hub", "-n", ns, f"--from-literal=token={secret_value}")
    env_from_secret = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hub", "key": "token"}}}
    plan = running_job(
        cluster,
        env,
        operator_args=("--planner-timeout", "8", "--planner-workers", "2"),  # the huge spec keeps one busy
        pod={"nodeSelector": {POOL_LABEL: env["pool"]}, "env": [env_from_secret]},
    )
    operator = env["operator"]
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(_huge_profile_config_map("huge-profile")))
    huge = yaml.safe_load(job_manifest("huge", env["pool"]))
    huge["spec"].update(
        model={"entryPoint": "mypkg.models:build_layers"},
        nodes={"min": 2, "max": 4096},
        training={"steps": 10, "globalBatchSize": 8192, "microbatchSize": 1},
        profile={"source": "configMap", "configMap": {"name": "huge-profile"}},
    )
    probes: list[float] = []
    probing = True

    def probe() -> None:
        while probing:
            began = time.monotonic()
            try:
                operator.healthy()
                probes.append(time.monotonic() - began)
            except Exception:
                probes.append(float("inf"))
            time.sleep(0.25)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(huge))
        time.sleep(1.0)  # the huge spec is being planned now
        victim = plan.nodes[0]
        began = time.monotonic()
        cluster.kubectl("delete", "pod", victim, "-n", ns, "--wait=false")
        # Alone this takes 2-3 s; beside an e2e job on the 2-core CI host it took over 60 s (2026-11-25): the
        # bound is for the loaded case. A blocked event loop fails the liveness assertion below. The replacement
        # pod can be folded in 0.1 s after the drop (generation 2), before generation 1 was ever seen settled.
        after = wait_for(lambda: settled(cluster, ns, 1, or_later=True), "generation 1 of the other job", timeout=240)
        recovered_s = time.monotonic() - began
        assert victim not in after.nodes
        failed = wait_for(
            lambda: (c := condition(job(cluster, ns, "huge"), "Failed")) and c["status"] == "True" and c,
            "the huge job's Failed condition",
        )
    finally:
        probing = False
        prober.join()
    assert failed["reason"] == "InvalidSpec" and "--planner-" in failed["message"], failed
    assert recovered_s < 180, f"the other job took {recovered_s:.1f} s to get its next generation"
    assert probes and max(probes) < 5, f"liveness: {len(probes)} probes, slowest {max(probes):.1f} s"
    assert operator.starts == 1 and operator.process is not None and operator.process.poll() is None
    assert not workers(cluster, ns, "huge")
    # The Secret's value is nowhere the operator writes: plan ConfigMap (job.json), pods' env and annotations.
    config_map = cluster.kubectl("get", "configmap", "tiny-plan", "-n", ns, "-o", "json").stdout
    pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "json").stdout
    assert secret_value not in config_map and secret_value not in pods
    pod = next(iter(workers(cluster, ns).values()))
    assert env_from_secret in pod["spec"]["containers"][0]["env"]


def test_a_gzip_bomb_in_the_plan_config_map_fails_the_job_and_the_operator_lives(cluster, env, tmp_path):
    ns = env["ns"]
    running_job(cluster, env)
    operator = env["operator"]
    operator.kill()
    stream = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = b"\0" * (1 << 20)
    bomb = b"".join([*(stream.compress(zeros) for _ in range(512)), stream.flush()])  # 512 MiB in ~0.5 MB
    patch = tmp_path / "bomb.json"
    patch.write_text(
        json.dumps(
            {"data": {planmap.PLAN_KEY: ""}, "binaryData": {planmap.PLAN_GZ_KEY: base64.b64encode(bomb).decode()}}
        )
    )
    cluster.kubectl("patch", "configmap", "tiny-plan", "-n", ns, "--type=merge", "--patch-file", str(patch))
    operator.start()
    failed = wait_for(
        lambda: (c := condition(job(cluster, ns), "Failed")) and c["status"] == "True" and c, "the Failed condition"
    )
    assert failed["reason"] == "PlanUnreadable" and "more than the cap of" in failed["message"], failed
    assert operator.healthy() and operator.starts == 2
    assert operator.process is not None
    peak_kib = int(Path(f"/proc/{operator.process.pid}/status").read_text().split("VmHWM:")[1].split()[0])
    assert peak_kib < 450 * 1024, f"the operator's peak RSS was {peak_kib >> 10} MiB"
