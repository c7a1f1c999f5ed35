"""The whole loop in containers: an OobleckJob's coordinator and workers run the project image under real
kubelets (containerd + runc), with nothing but what a cluster gives a pod (the `kubernetes` Service, a
projected ServiceAccount token); the operator is the chart's, installed by helm and running the image too, for
the tiny Llama's run, and a host process for the fault tests (its log read directly). The tiny Llama of
examples/llama-tiny.yaml trains to Succeeded at the exact step, and every step's loss, read back with
`kubectl logs`, equals a single-process run of the same job (runtime/train/reference.py).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from oobleck_dev.chart import CHART_PATH
from tests.realnodes.jobs import (
    HOOKS,
    JOB,
    LOST_WITHIN_S,
    OPEN_ENDED_STEPS,
    START_TIMEOUT_S,
    RealJob,
    job_spec,
    wait_for,
)
from tests.realnodes.marks import realnode_marks

pytestmark = realnode_marks(5400)


class HelmOperator:
    """The operator as a user runs it: the chart installed by helm, its Deployment's pod running the project
    image on a real node (non-root, read-only root filesystem, probes), in-cluster credentials only."""

    def __init__(self, cluster, image: str, node_selector: dict[str, str], served: str, values_dir: Path) -> None:
        self.cluster, self.served = cluster, served
        self.name = f"h{secrets.token_hex(3)}"
        self.namespace = cluster.namespace("real-op")
        repository, tag = image.rsplit(":", 1)
        values = {
            "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},  # in the nodes' own store
            "nodeSelector": node_selector,
            "operator": {"watchNamespaces": [served], "extraArgs": ["--resync", "2"]},
            "crds": {"install": True, "keep": True},
            # The control plane installed the cluster-wide worker policy at start; the chart's copy is the same
            # (tests/helm/golden), and an uninstall must not remove it from under the other tests.
            "workerPolicy": {"install": False},
        }
        self.values = values_dir / "values.yaml"
        self.values.write_text(yaml.safe_dump(values))
        self.selector = f"app.kubernetes.io/instance={self.name},app.kubernetes.io/component=operator"

    def helm(self, *args: str) -> None:
        command = [str(self.cluster.bin.helm), "--kubeconfig", self.cluster.kubeconfig, *args]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"helm {' '.join(args)}: {result.stdout}\n{result.stderr}"

    def install(self) -> HelmOperator:
        # --take-ownership: the release adopts the CRD the control plane applied from crds/ (the same content).
        chart = str(Path(__file__).parents[2] / CHART_PATH)
        self.helm("install", self.name, chart, "-n", self.namespace, "--values", str(self.values), "--take-ownership")
        return self

    def pod(self) -> dict[str, Any]:
        pods = self.cluster.kubectl_json("get", "pods", "-n", self.namespace, "-l", self.selector)["items"]
        assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
        return pods[0]

    def ready(self) -> bool:
        conditions = self.pod().get("status", {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def log(self) -> str:
        name = self.pod()["metadata"]["name"]
        return self.cluster.kubectl("logs", name, "-n", self.namespace, check=False, timeout=120).stdout

    def kill(self) -> None:
        self.helm("uninstall", self.name, "-n", self.namespace, "--wait", "--timeout", "2m")


@pytest.fixture
def helm_job(real_cluster, tmp_path) -> Iterator[RealJob]:
    cluster, nodes = real_cluster
    if cluster.bin.helm is None:
        pytest.fail("helm not found: run scripts/k8s-tools/build", pytrace=False)
    namespace = cluster.namespace("real")
    operator = HelmOperator(cluster, nodes.image, nodes.node_selector, namespace, tmp_path).install()
    job = RealJob(cluster, nodes, namespace, operator)  # type: ignore[arg-type]
    try:
        yield job
    finally:
        job.dump()
        cluster.kubectl("delete", "oobleckjob", JOB, "-n", namespace, "--ignore-not-found", "--wait=false", check=False)
        cluster.kubectl("wait", "--for=delete", f"oobleckjob/{JOB}", "-n", namespace, "--timeout=120s", check=False)
        operator.kill()
        cluster.kubectl(
            "delete", "pods", "--all", "-n", namespace, "--grace-period=0", "--wait=true", check=False, timeout=120
        )


def test_llama_trains_to_succeeded_in_containers(helm_job):
    """The operator too runs in its container, installed by helm: the whole loop as a user runs it."""
    job = helm_job
    operator = job.operator
    wait_for(operator.ready, "the operator's pod Ready (its readiness probe answered)", START_TIMEOUT_S)
    pod = operator.pod()
    assert pod["spec"]["nodeName"] in job.nodes.names
    container = pod["spec"]["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True and container["livenessProbe"]
    check = (
        "import os, json\n"
        "try:\n    open('/probe', 'w'); writable = True\nexcept OSError:\n    writable = False\n"
        "print(json.dumps({'uid': os.getuid(), 'root_writable': writable}))"
    )
    name = pod["metadata"]["name"]
    seen = json.loads(job.cluster.kubectl("exec", name, "-n", operator.namespace, "--", "python", "-c", check).stdout)
    assert seen == {"uid": 65532, "root_writable": False}, seen
    steps = 60
    job.apply(job_spec(job.nodes.image, steps, min_nodes=2, node_selector=job.nodes.node_selector))

    # While they run: the workers run in containers on the real nodes, as uid 65532, with the cluster's own
    # in-cluster configuration and none of the local node agent's variables. Checked from the containers'
    # start, not from the first step: `kubectl exec` needs a running container, and beside the suite a
    # 40-step job once ended before this test, polling at nice 19, reached the exec.
    def started() -> list[str]:
        pods = job.workers()
        states = [(p["status"].get("containerStatuses") or [{}])[0].get("state", {}) for p in pods]
        return len(pods) == 2 and all("running" in state for state in states) and [p["metadata"]["name"] for p in pods]

    running = wait_for(started, "two worker containers running", START_TIMEOUT_S)
    for pod in job.workers():
        assert pod["spec"]["nodeName"] in job.nodes.names
        status = pod["status"]["containerStatuses"][0]
        assert status["containerID"].startswith("containerd://") and status["image"].endswith(
            job.nodes.image.split("/")[-1]
        )
        assert not {e["name"] for e in pod["spec"]["containers"][0].get("env", [])} & set(HOOKS)
    worker = sorted(running)[0]
    token = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    probe = (
        "import os, json; print(json.dumps({'uid': os.getuid(), 'host': os.environ.get('KUBERNETES_SERVICE_HOST'), "
        f"'hooks': [h for h in {HOOKS!r} if h in os.environ], 'token': os.path.exists({token!r}), "
        "'pod_ip': os.environ.get('OOBLECK_POD_IP')}))"
    )
    seen = json.loads(
        job.cluster.kubectl("exec", worker, "-n", job.ns, "-c", "worker", "--", "python", "-c", probe).stdout
    )
    pod = job.cluster.kubectl_json("get", "pod", worker, "-n", job.ns)
    run_as, pod_ip = pod["spec"]["securityContext"]["runAsUser"], pod["status"]["podIP"]
    assert seen == {"uid": run_as, "host": "10.96.0.1", "hooks": [], "token": True, "pod_ip": pod_ip}

    body = job.wait_succeeded()
    assert body["status"]["progress"]["step"] == steps
    compared = job.check_losses()
    print(f"{compared} losses compared against the single-process run")
    assert operator.pod()["status"]["containerStatuses"][0]["restartCount"] == 0, "the operator restarted"


def test_kubectl_delete_pod_recovers_in_place(real_job):
    """`kubectl delete pod` of a worker: the kubelet stops its container, the survivor reconfigures in place
    (a new plan generation without it) and trains on, every loss equal to the no-failure run. (Folding the
    replacement back in is tests/e2e's matter.)"""
    job = real_job
    job.apply(job_spec(job.nodes.image, OPEN_ENDED_STEPS, min_nodes=1, node_selector=job.nodes.node_selector))
    running = wait_for(
        lambda: len(s := job.running_worker_steps()) == 2 and min(s.values()) >= 20 and s,
        "two workers past step 20",
        START_TIMEOUT_S,
    )
    survivor, victim = sorted(running)
    job.cluster.kubectl("delete", "pod", victim, "-n", job.ns, "--wait=false")
    at_delete = job.running_worker_steps().get(survivor, 0)

    wait_for(lambda: job.plan().generation >= 1, "a new plan generation", 120)
    assert wait_for(lambda: job.events("NodeLost"), "a NodeLost event", 120) == [f"{victim}: pod {victim} deleted"]
    compared = job.check_trains_past(survivor, at_delete)
    assert job.job()["status"]["failuresSurvived"] >= 1
    print(f"deleted {victim} at step {at_delete}; {compared} losses match the no-failure run")


def test_worker_container_killed_through_the_runtime_recovers_in_place(real_job):
    """A worker's container SIGKILLed through containerd (`ctr tasks kill`), as a crash would end it: the loss is
    reported (by the kubelet, exit 137, or first by the survivor's detector), the survivor reconfigures in place,
    and the job ends at the exact step with every loss equal to the no-failure run."""
    job = real_job
    # The kill as soon as both train, and steps to spare: beside the suite, polling at nice 19, a 100-step job
    # killed past step 20 once ended before the kill landed, and a 150-step one killed past step 2 once did too.
    # So the victim's container is read in the same poll that sees both train: the kill is one `ctr` away.
    steps = 300
    job.apply(job_spec(job.nodes.image, steps, min_nodes=1, node_selector=job.nodes.node_selector))

    def both_training() -> tuple[dict[str, int], dict[str, dict[str, Any]]] | None:
        pods = {pod["metadata"]["name"]: pod for pod in job.workers()}
        steps_now = job.worker_steps(pods.values())
        return (steps_now, pods) if len(steps_now) == 2 and min(steps_now.values()) >= 2 else None

    running, pods = wait_for(both_training, "two workers past step 2", START_TIMEOUT_S)
    survivor, victim = sorted(running)
    pod = pods[victim]
    job.nodes.kill_container(pod["spec"]["nodeName"], pod["status"]["containerStatuses"][0]["containerID"])
    at_kill = job.running_worker_steps().get(survivor, 0)
    assert at_kill < steps, "the job finished before the kill: raise steps"

    # Whichever tells the operator first: the kubelet's report of the exit ("worker container exited with code
    # 137", or "pod ... failed" when the pod's phase is seen before its container's status) or the survivor's
    # detector ("reported dead by <survivor>": the process is gone, or, while the killed process is still being
    # torn down, its socket accepts but nothing answers); one loss either way.
    lost = wait_for(lambda: job.events("NodeLost"), "a NodeLost event", 120)
    assert len(lost) == 1 and lost[0].startswith(f"{victim}: "), lost
    reports = ("exited with code 137", f"pod {victim} failed", f"reported dead by {survivor}")
    assert any(report in lost[0] for report in reports), lost
    wait_for(lambda: job.plan().generation >= 1, "a new plan generation", 120)
    body = job.wait_succeeded()
    assert body["status"]["progress"]["step"] == steps
    assert body["status"]["failuresSurvived"] >= 1
    compared = job.check_losses()
    print(f"killed {victim}'s container at step {at_kill}; {compared} losses match the no-failure run")


def test_a_worker_over_its_memory_limit_is_oom_killed_and_the_job_ends_out_of_memory(real_job):
    """The kubelet holds `limits.memory` (a cgroup per container): a worker that cannot fit (torch alone is
    larger than 192Mi) is OOM-killed, the kubelet reports OOMKilled, and the job fails OutOfMemory."""
    job = real_job
    spec = job_spec(job.nodes.image, 30, min_nodes=2, node_selector=job.nodes.node_selector)
    spec["resources"] = {"cpu": "250m", "memory": "192Mi"}
    job.apply(spec)

    def failed() -> dict[str, Any]:
        body = job.job()
        return body if body.get("status", {}).get("phase") == "Failed" else {}

    body = wait_for(failed, "the job to fail", START_TIMEOUT_S)
    condition = next(c for c in body["status"]["conditions"] if c["type"] == "Failed")
    assert condition["reason"] == "OutOfMemory" and "(OOMKilled)" in condition["message"], condition
    assert job.events("OutOfMemory"), "no OutOfMemory event"


@pytest.mark.skipif(not Path("/sys/fs/cgroup/freezer").is_dir(), reason="needs the cgroup v1 freezer to hang a node")
def test_a_node_that_hangs_is_lost_and_the_job_goes_on(real_job):
    """A node hangs (its kubelet stopped and its pods' processes frozen): the survivor's failure detector
    finds the silent peer, the operator drops it in a new generation, and the survivor trains on, every loss
    equal to the no-failure run."""
    job = real_job
    job.apply(job_spec(job.nodes.image, OPEN_ENDED_STEPS, min_nodes=1, node_selector=job.nodes.node_selector))
    running = wait_for(
        lambda: len(s := job.running_worker_steps()) == 2 and min(s.values()) >= 20 and s,
        "two workers past step 20",
        START_TIMEOUT_S,
    )
    # The worker whose node does not hold the coordinator (whose loss is another test's matter).
    coordinator_node = job.cluster.kubectl_json("get", "pod", f"{JOB}-coordinator", "-n", job.ns)["spec"]["nodeName"]
    nodes = {name: job.cluster.kubectl_json("get", "pod", name, "-n", job.ns)["spec"]["nodeName"] for name in running}
    victim = next(name for name, node in nodes.items() if node != coordinator_node)
    survivor = next(name for name in running if name != victim)
    node = nodes[victim]
    frozen = time.monotonic()
    job.nodes.freeze(node)
    try:
        at_freeze = job.running_worker_steps().get(survivor, 0)
        lost = wait_for(lambda: job.events("NodeLost"), "a NodeLost event", 300)
        elapsed = time.monotonic() - frozen
        print(f"{node} frozen at step {at_freeze}: NodeLost after {elapsed:.1f} s: {lost}")
        assert len(lost) == 1 and lost[0].startswith(f"{victim}: "), lost
        assert elapsed <= LOST_WITHIN_S, f"NodeLost {elapsed:.1f} s after the freeze (at most {LOST_WITHIN_S} s)"
        compared = job.check_trains_past(survivor, at_freeze)
    finally:
        job.nodes.thaw(node)
    assert job.job()["status"]["failuresSurvived"] >= 1
    print(f"{compared} losses match the no-failure run")
