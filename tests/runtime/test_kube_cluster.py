"""The in-pod client against a real API server, authenticated as the workers' ServiceAccount.

A real OobleckJob (no operator runs: nothing acts on it) owns the rendered worker ServiceAccount,
Role and RoleBinding; the client uses a token of that ServiceAccount (the TokenRequest API, as a
kubelet mounts it), so every call here also proves the rendered Role allows exactly what the
runtime does: watch the plan ConfigMap, read the coordinator pod, annotate its own pod.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from oobleck.api import contract, planmap
from oobleck.api.plan import Plan
from oobleck.api.reports import FailureReport
from oobleck.api.spec import parse_spec
from oobleck.operator import render
from oobleck.operator.planning import Tuning, cluster_shape, synthetic_profile
from oobleck.runtime.backends.pod.coordinator_link import CoordinatorAddress
from oobleck.runtime.backends.pod.kube import SERVICEACCOUNT_DIR, ApiException, Kube, WatchTimeouts, api_error_text
from oobleck.runtime.backends.pod.plan_configmap import ConfigMapPlanSource
from oobleck.runtime.backends.pod.report import PodFailureReporter, ProgressReporter
from oobleck_dev.mountns import Filesystem, VolumeMount

pytestmark = [pytest.mark.cluster]
JOB = "kube"
SPEC = {
    "model": {"gpt": {"layers": 2, "hiddenSize": 32, "heads": 2, "sequenceLength": 8, "vocabSize": 64}},
    "nodes": {"min": 1, "max": 2},
    "gpusPerNode": 1,
    "device": "cpu",
    "f": 0,
    "training": {"steps": 10, "globalBatchSize": 4, "microbatchSize": 2},
}
PROFILE = synthetic_profile(parse_spec(SPEC), Tuning())


def make_plan(generation: int, nodes: int = 2) -> Plan:
    """A real plan of the planner for the spec above, at `generation`."""
    from oobleck.planner import instantiate
    from oobleck.planner.templates import generate_templates

    spec = parse_spec(SPEC)
    templates = generate_templates(PROFILE, cluster_shape(spec, Tuning()), f=0)
    plan = instantiate(
        templates,
        [render.worker_name(JOB, i) for i in range(nodes)],
        0,
        spec.training.global_microbatches,
        JOB,
        gpus_per_node=1,
    )
    return plan.model_copy(update={"generation": generation})


@pytest.fixture(scope="module")
def world(cluster, tmp_path_factory):
    """Namespace, job, rendered RBAC, a worker pod and the coordinator pod; a worker's token folder."""
    ns = cluster.namespace("kube")
    body = {"apiVersion": "oobleck.dev/v1alpha1", "kind": "OobleckJob", "metadata": {"name": JOB}, "spec": SPEC}
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(body))
    uid = cluster.kubectl_json("get", "oobleckjob", JOB, "-n", ns)["metadata"]["uid"]
    spec = parse_spec(SPEC)
    objects = [
        *render.static_children(JOB, ns, uid),
        render.worker_pod(JOB, ns, uid, spec, 0, default_image="i", default_command=["c"]),
        render.worker_pod(JOB, ns, uid, spec, 1, default_image="i", default_command=["c"]),
        render.coordinator_pod(JOB, ns, uid, spec, default_image="i"),
    ]
    for pod in objects[-3:]:  # never scheduled: nodes of other tests on this plane must not run them
        pod["spec"]["nodeSelector"] = {"oobleck.dev/test-unschedulable": ns}
    cluster.kubectl(
        "apply", "-n", ns, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
    )
    folder = tmp_path_factory.mktemp("serviceaccount")
    # Bound to worker 0's pod, as a kubelet mounts it (the cluster's worker-pod policy keys on that claim).
    pod = cluster.kubectl_json("get", "pod", render.worker_name(JOB, 0), "-n", ns)["metadata"]
    token = cluster.kubectl(
        "create",
        "token",
        render.rbac_name(JOB),
        "-n",
        ns,
        "--duration=1h",
        "--bound-object-kind=Pod",
        f"--bound-object-name={pod['name']}",
        f"--bound-object-uid={pod['uid']}",
    ).stdout.strip()
    (folder / "token").write_text(token)
    (folder / "namespace").write_text(ns)
    kubeconfig = yaml.safe_load(Path(cluster.kubeconfig).read_text())["clusters"][0]["cluster"]
    if "certificate-authority-data" in kubeconfig:
        (folder / "ca.crt").write_bytes(base64.b64decode(kubeconfig["certificate-authority-data"]))
    else:
        (folder / "ca.crt").write_bytes(Path(kubeconfig["certificate-authority"]).read_bytes())
    url = urlparse(cluster.server)
    env = {"KUBERNETES_SERVICE_HOST": url.hostname, "KUBERNETES_SERVICE_PORT": str(url.port or 443)}
    client = Kube.in_cluster(env, str(folder))
    return {"ns": ns, "uid": uid, "spec": spec, "client": client, "env": env, "serviceaccount": folder}


def write_plan(cluster, world, plan: Plan, inline_limit: int | None = None) -> None:
    """The operator's write (render.plan_config_map), as admin; `inline_limit` forces the gzipped form."""
    body = render.plan_config_map(JOB, world["ns"], world["uid"], plan, PROFILE, world["spec"], 0)
    if inline_limit is not None:
        data, binary = planmap.encode_plan(plan, inline_limit)
        body["data"].update(data)
        body["binaryData"] = binary
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-n", world["ns"], "-f", "-", input=json.dumps(body))


def annotations(cluster, ns: str, pod: str) -> dict[str, str]:
    return cluster.kubectl_json("get", "pod", pod, "-n", ns)["metadata"].get("annotations", {})


def test_in_cluster_defaults_find_the_token_where_the_kubelet_mounts_it(world, tmp_path):
    """A process whose ServiceAccount folder is mounted at the kubelet's path (a mount namespace of its own, as
    local nodes run pods) gets a working client from `Kube.in_cluster()` with nothing configured."""
    code = (
        "from oobleck.runtime.backends.pod.kube import Kube; kube = Kube.in_cluster(); "
        f"print(kube.namespace, kube.read_pod(kube.namespace, {render.coordinator_name(JOB)!r})['metadata']['uid'])"
    )
    mounts = [VolumeMount(SERVICEACCOUNT_DIR, world["serviceaccount"], read_only=True, where="serviceaccount")]
    filesystem = Filesystem.build(tmp_path / "root", mounts)
    report, reported = os.pipe()
    try:
        result = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, **world["env"]},
            preexec_fn=filesystem.preexec(reported),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        os.close(report), os.close(reported)
    assert result.returncode == 0, result.stderr
    pod = world["client"].read_pod(world["ns"], render.coordinator_name(JOB))
    assert result.stdout.split() == [world["ns"], pod["metadata"]["uid"]]
    assert not (Path(SERVICEACCOUNT_DIR) / "token").exists()  # the mount was the process's own


def test_configmap_plan_source_sees_each_new_generation_within_a_second(cluster, world):
    # Short server-side watches: the source must resume (from its resourceVersion) several times.
    source = ConfigMapPlanSource(world["client"], world["ns"], render.plan_name(JOB), WatchTimeouts(server_s=1))
    try:
        source.start()
        assert source.wait_newer(-1, 0.5) is None  # no ConfigMap yet: no plan
        write_plan(cluster, world, make_plan(0))
        first = source.wait_newer(-1, 10.0)
        assert first is not None and first.generation == 0
        assert json.loads(source.config_map()["data"][planmap.JOB_KEY])["training"]["steps"] == 10
        time.sleep(2.5)  # past two server-side watch timeouts
        for generation, limit in ((1, None), (2, 10)):  # inline, then gzipped
            write_plan(cluster, world, make_plan(generation), inline_limit=limit)
            written = time.monotonic()  # the write is done when kubectl returns
            seen = source.wait_newer(generation - 1, 10.0)
            latency = time.monotonic() - written
            assert seen is not None and seen.generation == generation
            print(f"generation {generation} seen {latency * 1000:.1f} ms after the write returned")
            assert latency < 1.0, f"generation {generation} seen after {latency:.2f} s"
        write_plan(cluster, world, make_plan(1))  # a stale writer
        time.sleep(0.5)
        assert source.current().generation == 2
        assert source.last_error is None
    finally:
        source.stop()


def test_reporters_annotate_their_own_pod_with_the_worker_token(cluster, world):
    ns, pod = world["ns"], render.worker_name(JOB, 0)
    report = FailureReport(
        job=JOB,
        generation=4,
        reporter=f"{pod}:0",
        kind="heartbeat",
        dead=(f"{render.worker_name(JOB, 1)}:0",),
        detail="quiet for 3 s",
    )
    PodFailureReporter(world["client"], ns, pod).report(report)
    written = json.loads(annotations(cluster, ns, pod)[contract.FAILURE_ANNOTATION])
    assert written["dead"] == [render.worker_name(JOB, 1)] and written["generation"] == 4

    progress = ProgressReporter(world["client"], ns, pod, min_interval_s=0.5)
    try:
        for step in range(1, 41):
            progress.update(0, step, checkpoint_step=30 if step == 30 else None)  # None keeps the last known
            time.sleep(0.01)
        assert progress.flush()
        written = json.loads(annotations(cluster, ns, pod)[contract.PROGRESS_ANNOTATION])
        assert written == {"generation": 0, "step": 40, "checkpointStep": 30}
        assert progress.writes <= 4, f"rate limit: {progress.writes} writes for 40 steps in ~0.5 s"
    finally:
        progress.stop()


def test_coordinator_address_waits_for_a_running_pod_ip(cluster, world):
    ns = world["ns"]
    pod = render.coordinator_name(JOB)
    address = CoordinatorAddress(world["client"], ns, pod, "fallback.example", contract.STORE_PORT, poll_s=0.05)
    assert address.resolve(0.3) == ("fallback.example", contract.STORE_PORT)  # Pending: no IP yet
    status = {"status": {"phase": "Running", "podIP": "127.16.9.9", "podIPs": [{"ip": "127.16.9.9"}]}}

    def run_it() -> None:
        time.sleep(0.5)
        cluster.kubectl("patch", "pod", pod, "-n", ns, "--subresource=status", "--type=merge", "-p", json.dumps(status))

    threading.Thread(target=run_it).start()
    assert address.resolve(30.0) == ("127.16.9.9", contract.STORE_PORT)


def test_the_worker_token_gets_clear_refusals_beyond_its_role(world):
    core = world["client"].core
    with pytest.raises(ApiException) as refused:
        core.list_namespaced_secret(world["ns"])
    assert refused.value.status == 403 and 'cannot list resource "secrets"' in api_error_text(refused.value)
    with pytest.raises(ApiException) as other:
        core.read_namespaced_config_map("something-else", world["ns"])
    assert other.value.status == 403 and api_error_text(other.value).startswith("403 Forbidden: configmaps ")


def test_store_connection_follows_the_coordinator_pod_to_a_new_ip(cluster, world):
    """connect_endpoint reads the pod IP again between attempts: a recreated coordinator pod may have a
    new IP. The store listens on 127.0.0.1 only, so the stale IP (another loopback address) is refused."""
    from oobleck.runtime.elastic.coordinator import Coordinator
    from oobleck.runtime.elastic.store import StoreTimeouts, connect_endpoint
    from oobleck_dev.controlplane import free_port

    ns, pod = world["ns"], render.coordinator_name(JOB)

    def set_ip(ip: str) -> None:
        status = {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}}
        cluster.kubectl("patch", "pod", pod, "-n", ns, "--subresource=status", "--type=merge", "-p", json.dumps(status))

    port = free_port()
    set_ip("127.0.0.2")  # the old pod's address: nothing listens there
    address = CoordinatorAddress(world["client"], ns, pod, "fallback.invalid", port, poll_s=0.05)
    with Coordinator("127.0.0.1", port) as coordinator:
        threading.Timer(1.0, set_ip, ("127.0.0.1",)).start()
        store, epoch, _ = connect_endpoint(address, StoreTimeouts(connect_s=2.0, reconnect_s=60.0))
        assert address.last == ("127.0.0.1", port)
        assert epoch == coordinator.epoch
        del store
