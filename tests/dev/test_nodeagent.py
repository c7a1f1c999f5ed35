"""The local node agent: real nodes on the real scheduler, pods as real local processes.

The pure parts (env, volumes, quantities, phases) are checked directly; everything else goes
through the API server of the session cluster, with pods running small Python commands.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from datetime import UTC
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException

from oobleck_dev import podenv, poll
from oobleck_dev.controlplane import Cluster
from oobleck_dev.nodeagent import (
    AGENT_LABEL,
    GPU_CONDITION,
    GPU_RESOURCE,
    LOCAL_NODE_LABEL,
    AgentTimeouts,
    GpuSlots,
    IpBlock,
    NodeAgent,
)
from oobleck_dev.podrunner import ContainerRun, exit_code, pod_phase, should_restart

# Quick restarts, so the restartPolicy test needs no 10 s CrashLoopBackOff.
LOCAL_NODES = {"nodes": 2, "gpus_per_node": 2, "timeouts": AgentTimeouts(restart_backoff=0.5)}
WAIT_S = 60.0


def wait_until(check: Callable[[], object], what: str, timeout: float = WAIT_S, interval: float = 0.1) -> object:
    return poll.wait_until(check, what, timeout, interval)


def pid_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def python_pod(
    name: str,
    namespace: str,
    code: str,
    agent: NodeAgent | None,
    *,
    gpus: int = 0,
    restart: str = "Never",
    node: str | None = None,
    grace: int | None = None,
    **container: object,
) -> dict:
    """A pod running `python -c <code>` on the agent's nodes (or on `node`)."""
    selector = dict(agent.node_selector) if agent is not None else {}
    if node is not None:
        selector["kubernetes.io/hostname"] = node
    spec: dict = {
        "restartPolicy": restart,
        "nodeSelector": selector,
        "containers": [
            {
                "name": "main",
                "image": "python:3.11",
                "command": ["python", "-c", textwrap.dedent(code)],
                **({"resources": {"limits": {GPU_RESOURCE: str(gpus)}}} if gpus else {}),
                **container,
            }
        ],
    }
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def apply(cluster: Cluster, *objects: dict) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}))


def get_pod(cluster: Cluster, namespace: str, name: str) -> dict | None:
    """The pod, or None where there is none (polled every 0.1 s: over the cluster's kept connection)."""
    try:
        return cluster.reads.pod(namespace, name)
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def wait_phase(cluster: Cluster, namespace: str, name: str, phases: tuple[str, ...], timeout: float = WAIT_S) -> dict:
    def check() -> dict | None:
        pod = get_pod(cluster, namespace, name)
        return pod if pod and pod.get("status", {}).get("phase") in phases else None

    try:
        return wait_until(check, f"pod {namespace}/{name} in {phases}", timeout)  # type: ignore[return-value]
    except AssertionError as error:  # show where it got stuck
        pod = get_pod(cluster, namespace, name) or {}
        raise AssertionError(
            f"{error}; spec.nodeName={pod.get('spec', {}).get('nodeName')} status={json.dumps(pod.get('status'))}"
        ) from None


def main_state(pod: dict) -> dict:
    return pod["status"]["containerStatuses"][0]["state"]


# --- pure parts ----------------------------------------------------------------------------------


def test_quantities_parse_exactly() -> None:
    assert podenv.parse_quantity("500m") == podenv.parse_quantity("0.5")
    assert podenv.parse_quantity("4Gi") == 4 * 2**30
    assert podenv.parse_quantity("1e3") == 1000
    assert podenv.parse_quantity("2k") == 2000
    with pytest.raises(podenv.PodConfigError, match="cpu: not a Kubernetes quantity: '12x'"):
        podenv.parse_quantity("12x", "cpu")


def test_expansion_follows_kubernetes_rules() -> None:
    env = {"A": "1", "B": "two"}
    assert podenv.expand("$(A)-$(B)", env) == "1-two"
    assert podenv.expand("$$(A) $(MISSING) $ x", env) == "$(A) $(MISSING) $ x"


POD = {
    "metadata": {
        "name": "w-0",
        "namespace": "ns",
        "uid": "u-1",
        "labels": {"app": "x", "z": 'q"r'},
        "annotations": {"a": "b"},
    },
    "spec": {
        "nodeName": "n0",
        "serviceAccountName": "sa",
        "containers": [
            {
                "name": "main",
                "resources": {"limits": {"memory": "1Gi"}, "requests": {"cpu": "250m"}},
                "env": [
                    {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                    {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                    {"name": "SA", "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}},
                    {
                        "name": "MEM_MI",
                        "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
                    },
                    {"name": "CPU_LIMIT", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
                    {
                        "name": "CPU_REQ_M",
                        "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1m"}},
                    },
                    {"name": "KEY", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
                    {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": True}}},
                    {"name": "BOTH", "value": "$(NAME)@$(NODE)"},
                ],
                "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
            }
        ],
        "volumes": [
            {"name": "cfg", "configMap": {"name": "cm", "items": [{"key": "k", "path": "sub/k.txt"}]}},
            {
                "name": "info",
                "downwardAPI": {"items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]},
            },
            {"name": "scratch", "emptyDir": {}},
        ],
    },
    "status": {"podIP": "127.1.1.2", "hostIP": "127.1.1.1"},
}


def test_env_resolves_like_a_kubelet() -> None:
    sources = podenv.Sources(configmaps={"cm": {"k": b"v"}}, secrets={"nope": None})
    env = podenv.container_env(
        POD, POD["spec"]["containers"][0], sources, {"cpu": "16", "memory": "64Gi"}, {"BASE": "1"}
    )
    assert env == {
        "BASE": "1",
        "CM_k": "v",
        "NAME": "w-0",
        "APP": "x",
        "IP": "127.1.1.2",
        "NODE": "n0",
        "SA": "sa",
        "MEM_MI": "1024",
        "CPU_LIMIT": "16",
        "CPU_REQ_M": "250",
        "KEY": "v",
        "BOTH": "w-0@n0",
    }


def test_missing_config_names_the_field() -> None:
    sources = podenv.Sources(configmaps={"cm": None})
    with pytest.raises(
        podenv.PodConfigError, match=r"containers\[main\]\.envFrom\[0\]\.configMapRef: configmap 'cm' not found"
    ):
        podenv.container_env(POD, POD["spec"]["containers"][0], sources, {}, {})
    with pytest.raises(podenv.MountError, match=r"volumes\[cfg\]\.configMap: configmap 'cm' not found"):
        podenv.volume_contents(POD, sources, {})
    bad = {"spec": {"volumes": [{"name": "d", "iscsi": {}}]}}
    with pytest.raises(podenv.MountError, match=r"volumes\[d\]: volume type \['iscsi'\] is not supported"):
        podenv.volume_contents(bad, podenv.Sources(), {})
    with pytest.raises(podenv.PodConfigError, match=r"containers\[c\]\.command: required"):
        podenv.container_argv({"name": "c"}, {})


def test_volume_contents() -> None:
    contents = podenv.volume_contents(POD, podenv.Sources(configmaps={"cm": {"k": b"v"}}), {})
    by_name = {volume.name: volume for volume in contents}
    assert by_name["cfg"].files == {"sub/k.txt": (b"v", 0o644)}
    assert by_name["info"].files == {"labels": (b'app="x"\nz="q\\"r"', 0o644)}
    assert by_name["scratch"].files is None and by_name["scratch"].host_path is None


def test_phase_and_restart_rules() -> None:
    def done(code: int) -> ContainerRun:
        return ContainerRun("c", "i", terminated={"exitCode": code}, finished=True, started_at="t")

    assert pod_phase([], [ContainerRun("c", "i")], False) == "Pending"
    assert pod_phase([], [done(0), done(0)], False) == "Succeeded"
    assert pod_phase([], [done(0), done(1)], False) == "Failed"
    assert pod_phase([], [done(0), ContainerRun("c", "i", started_at="t")], False) == "Running"
    assert pod_phase([ContainerRun("i", "i")], [ContainerRun("c", "i")], True) == "Failed"
    assert [should_restart(p, c) for p in ("Never", "OnFailure", "Always") for c in (0, 1)] == [
        False,
        False,
        False,
        True,
        True,
        True,
    ]
    assert exit_code(-signal.SIGKILL) == 137 and exit_code(-signal.SIGTERM) == 143 and exit_code(3) == 3


def test_devices_are_split_like_the_device_manager_does() -> None:
    pod = {
        "spec": {
            "initContainers": [{"name": "init", "resources": {"limits": {GPU_RESOURCE: "1"}}}],
            "containers": [
                {"name": "a", "resources": {"limits": {GPU_RESOURCE: "2"}}},
                {"name": "b"},
                {"name": "c", "resources": {"requests": {GPU_RESOURCE: "1"}}},
            ],
        }
    }
    init, main = podenv.device_counts(pod, GPU_RESOURCE)
    assert (init, main) == ({"init": 1}, {"a": 2, "b": 0, "c": 1})
    assert podenv.pod_device_total(init, main) == 3
    assert podenv.device_plan(init, main, [4, 5, 7]) == {"a": [4, 5], "b": [], "c": [7], "init": [4]}
    slots = GpuSlots(nodes=2, gpus_per_node=2, devices=["0", "1", "2"])
    assert slots.allocate(1, 3) is None
    taken = slots.allocate(1, 2)
    assert taken == [0, 1] and slots.allocate(1, 1) is None
    assert slots.visible(1, taken) == "2,0"  # node 1's GPUs 0 and 1 are devices[2], devices[3 % 3]
    slots.release(1, taken)
    assert slots.allocate(1, 1) == [0]
    assert GpuSlots(1, 2, None).visible(0, [0]) is None


def test_ip_blocks_are_distinct_per_agent() -> None:
    first, second = IpBlock(), IpBlock()
    try:
        assert first.octet != second.octet
        addresses = {first.allocate(0) for _ in range(253)}
        assert len(addresses) == 253 and first.node_ip(0) not in addresses
        first.release(0, f"127.{first.octet}.1.7")
        assert first.allocate(0) == f"127.{first.octet}.1.7"
    finally:
        first.close()
        second.close()


# --- nodes ---------------------------------------------------------------------------------------


def test_nodes_register_ready_with_gpus(cluster: Cluster, local_nodes: NodeAgent) -> None:
    nodes = cluster.kubectl_json("get", "nodes", "-l", f"{AGENT_LABEL}={local_nodes.agent_id}")["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == local_nodes.node_names
    for node in nodes:
        labels = node["metadata"]["labels"]
        assert labels[LOCAL_NODE_LABEL] == "true" and "kwok.x-k8s.io/node" not in labels
        assert labels["kubernetes.io/hostname"] == node["metadata"]["name"]
        status = node["status"]
        assert status["capacity"][GPU_RESOURCE] == "2" and status["allocatable"][GPU_RESOURCE] == "2"
        conditions = {c["type"]: c["status"] for c in status["conditions"]}
        assert conditions["Ready"] == "True" and conditions[GPU_CONDITION] == "True"
        assert not [t for t in node["spec"].get("taints", []) if t["key"].startswith("node.kubernetes.io/")]
        assert status["addresses"][0]["address"].startswith("127.")
        lease = cluster.kubectl_json("get", "lease", node["metadata"]["name"], "-n", "kube-node-lease")
        assert lease["spec"]["holderIdentity"] == node["metadata"]["name"]
        assert lease["metadata"]["ownerReferences"][0]["uid"] == node["metadata"]["uid"]


def test_gpu_unhealthy_lowers_allocatable_and_blocks_scheduling(cluster: Cluster, local_nodes: NodeAgent) -> None:
    node = local_nodes.node_names[1]
    namespace = cluster.namespace("gpu-health")
    local_nodes.set_gpu_health(node, 1)
    try:
        status = cluster.kubectl_json("get", "node", node)["status"]
        assert status["capacity"][GPU_RESOURCE] == "2" and status["allocatable"][GPU_RESOURCE] == "1"
        condition = next(c for c in status["conditions"] if c["type"] == GPU_CONDITION)
        assert (condition["status"], condition["reason"]) == ("False", "GPUUnhealthy")
        assert condition["message"] == "1 of 2 GPUs healthy"
        apply(cluster, python_pod("two-gpus", namespace, "print('ran')", local_nodes, gpus=2, node=node))
        unschedulable = wait_until(
            lambda: any(
                c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
                for c in (get_pod(cluster, namespace, "two-gpus") or {}).get("status", {}).get("conditions", [])
            ),
            "the scheduler to report two-gpus Unschedulable",
        )
        assert unschedulable
    finally:
        local_nodes.set_gpu_health(node, 2)
    # Healthy again: the scheduler retries and the pod runs there.
    pod = wait_phase(cluster, namespace, "two-gpus", ("Succeeded",))
    assert pod["spec"]["nodeName"] == node
    condition = next(
        c for c in cluster.kubectl_json("get", "node", node)["status"]["conditions"] if c["type"] == GPU_CONDITION
    )
    assert condition["status"] == "True"
    with pytest.raises(ValueError, match="healthy_gpus: must be between 0 and the node's 2 GPUs, got 3"):
        local_nodes.set_gpu_health(node, 3)


def test_more_gpus_than_a_node_has_stays_pending(cluster: Cluster, local_nodes: NodeAgent) -> None:
    namespace = cluster.namespace("too-big")
    apply(cluster, python_pod("greedy", namespace, "print('never')", local_nodes, gpus=3))

    def unschedulable() -> dict | None:
        pod = get_pod(cluster, namespace, "greedy") or {}
        conditions = pod.get("status", {}).get("conditions", [])
        return next((c for c in conditions if c["type"] == "PodScheduled" and c["status"] == "False"), None)

    condition = wait_until(unschedulable, "PodScheduled=False on a pod asking for 3 GPUs")
    assert condition["reason"] == "Unschedulable" and "nvidia.com/gpu" in condition["message"]
    time.sleep(2)
    pod = get_pod(cluster, namespace, "greedy")
    assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
    cluster.kubectl("delete", "pod", "greedy", "-n", namespace, "--wait=false")


def test_node_not_ready_and_back(cluster: Cluster, local_nodes: NodeAgent) -> None:
    node = local_nodes.node_names[0]

    def ready() -> str:
        conditions = cluster.kubectl_json("get", "node", node)["status"]["conditions"]
        return next(c["status"] for c in conditions if c["type"] == "Ready")

    local_nodes.set_node_ready(node, False)
    try:
        assert ready() == "False"
    finally:
        local_nodes.set_node_ready(node, True)
    assert ready() == "True"
    # The node lifecycle controller lifts its not-ready taint again.
    wait_until(
        lambda: (
            not [
                t
                for t in cluster.kubectl_json("get", "node", node)["spec"].get("taints", [])
                if t["key"] == "node.kubernetes.io/not-ready"
            ]
        ),
        "the not-ready taint to go",
    )


# --- pods ----------------------------------------------------------------------------------------

PROBE = """
import json, os, ssl, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"  # where a kubelet mounts it
token = open(os.path.join(sa, "token")).read()
url = "https://%s:%s/api/v1/namespaces/%s/pods/%s" % (
    os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"],
    open(os.path.join(sa, "namespace")).read(), os.environ["POD_NAME"])
request = urllib.request.Request(url, headers={"Authorization": "Bearer " + token})
context = ssl.create_default_context(cafile=os.path.join(sa, "ca.crt"))
me = json.load(urllib.request.urlopen(request, context=context, timeout=20))
keys = ("POD_NAME", "POD_NAMESPACE", "POD_UID", "NODE_NAME", "POD_IP", "HOST_IP", "APP", "CPU_M", "GREETING",
        "GREETING_TWICE", "HOSTNAME")
print(json.dumps({
    "env": {key: os.environ.get(key) for key in keys},
    "greeting_file": open("/etc/greeting/message").read(),
    "labels_file": open("/etc/podinfo/labels").read(),
    "hooks": sorted(key for key in os.environ if key.startswith("OOBLECK_")),
    "own_pod_uid": me["metadata"]["uid"],
    "cwd": os.getcwd(),
    "python": os.path.realpath(__import__("sys").executable),
}))
"""


def test_pod_runs_with_env_volumes_and_a_working_token(cluster: Cluster, local_nodes: NodeAgent) -> None:
    namespace = cluster.namespace("env")

    def field(path: str) -> dict:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    pod = python_pod(
        "probe",
        namespace,
        PROBE,
        local_nodes,
        gpus=1,
        env=[
            {"name": "POD_NAME", **field("metadata.name")},
            {"name": "POD_NAMESPACE", **field("metadata.namespace")},
            {"name": "POD_UID", **field("metadata.uid")},
            {"name": "NODE_NAME", **field("spec.nodeName")},
            {"name": "POD_IP", **field("status.podIP")},
            {"name": "HOST_IP", **field("status.hostIP")},
            {"name": "APP", **field("metadata.labels['app']")},
            {"name": "CPU_M", "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1m"}}},
            {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "greeting", "key": "message"}}},
            {"name": "GREETING_TWICE", "value": "$(GREETING) $(GREETING)"},
        ],
        volumeMounts=[
            {"name": "greeting", "mountPath": "/etc/greeting"},
            {"name": "podinfo", "mountPath": "/etc/podinfo"},
        ],
    )
    pod["metadata"]["labels"] = {"app": "probe"}
    pod["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "250m"}
    pod["spec"]["volumes"] = [
        {"name": "greeting", "configMap": {"name": "greeting"}},
        {
            "name": "podinfo",
            "downwardAPI": {"items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]},
        },
    ]
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "read-pods", "namespace": namespace},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "read-pods", "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read-pods"},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}],
    }
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "greeting", "namespace": namespace},
        "data": {"message": "hello"},
    }
    apply(cluster, role, binding, configmap, pod)

    done = wait_phase(cluster, namespace, "probe", ("Succeeded", "Failed"))
    log = local_nodes.log_path(namespace, "probe", "main").read_text()
    assert done["status"]["phase"] == "Succeeded", log
    terminated = main_state(done)["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (0, "Completed")
    status = done["status"]
    assert done["spec"]["nodeName"] in local_nodes.node_names
    assert status["podIP"].startswith("127.") and status["podIP"] != status["hostIP"]
    report = json.loads(log.strip().splitlines()[-1])
    assert report["env"] == {
        "POD_NAME": "probe",
        "POD_NAMESPACE": namespace,
        "POD_UID": done["metadata"]["uid"],
        "NODE_NAME": done["spec"]["nodeName"],
        "POD_IP": status["podIP"],
        "HOST_IP": status["hostIP"],
        "APP": "probe",
        "CPU_M": "250",
        "GREETING": "hello",
        "GREETING_TWICE": "hello hello",
        "HOSTNAME": "probe",
    }
    # The volumes are where the pod spec mounts them, in the pod's own mount namespace (not on the host).
    assert report["greeting_file"] == "hello"
    assert report["labels_file"] == 'app="probe"'
    assert report["hooks"] == [] and not Path("/etc/greeting").exists()
    # The bound token authenticated as the pod's ServiceAccount, and RBAC let it read its own pod.
    assert report["own_pod_uid"] == done["metadata"]["uid"]
    assert report["python"] == os.path.realpath(sys.executable)  # the project's environment stands in
    assert report["cwd"] == "/"  # no workingDir: the container's root


READ_ONLY_CONFIG = """
import errno, time
who = open("/etc/config/who").read()
try:
    open("/etc/config/who", "w")
except OSError as error:
    print(who, errno.errorcode[error.errno], flush=True)
time.sleep(600)
"""


def test_pods_on_one_node_each_see_their_own_volume_at_the_same_path(cluster: Cluster, local_nodes: NodeAgent) -> None:
    namespace = cluster.namespace("mounts")
    for who in ("a", "b"):
        configmap = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"config-{who}", "namespace": namespace},
            "data": {"who": who},
        }
        mounts = [{"name": "config", "mountPath": "/etc/config"}]
        pod = python_pod(
            f"reader-{who}",
            namespace,
            READ_ONLY_CONFIG,
            local_nodes,
            node=local_nodes.node_names[0],
            volumeMounts=mounts,
        )
        pod["spec"]["volumes"] = [{"name": "config", "configMap": {"name": f"config-{who}"}}]
        apply(cluster, configmap, pod)

    def printed(name: str) -> str:
        return local_nodes.log_path(namespace, name, "main").read_text()

    for who in ("a", "b"):
        running = wait_phase(cluster, namespace, f"reader-{who}", ("Running",))
        log = wait_until(lambda name=f"reader-{who}": printed(name), f"reader-{who} to read its config")
        assert log == f"{who} EROFS\n"  # a ConfigMap volume is read-only, as a kubelet mounts it
        # The process is the agent's to see and signal (its PID), and its files are its own mount namespace's.
        pid = int(running["status"]["containerStatuses"][0]["containerID"].rsplit("/", 1)[1])
        assert pid_running(pid)
        assert Path(f"/proc/{pid}/root/etc/config/who").read_text() == who
        assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    assert not Path("/etc/config/who").exists()  # nothing on the host
    cluster.kubectl("delete", "pod", "reader-a", "reader-b", "-n", namespace, "--wait=false")


def test_a_mount_that_cannot_be_made_keeps_the_pod_creating_with_the_reason(
    cluster: Cluster, local_nodes: NodeAgent
) -> None:
    namespace = cluster.namespace("nomount")
    pod = python_pod(
        "unmountable", namespace, "print('never')", local_nodes, volumeMounts=[{"name": "gone", "mountPath": "/data"}]
    )
    pod["spec"]["volumes"] = [{"name": "gone", "hostPath": {"path": "/nonexistent/oobleck"}}]
    apply(cluster, pod)

    def waiting_message() -> str:
        status = (get_pod(cluster, namespace, "unmountable") or {}).get("status", {})
        waiting = ((status.get("containerStatuses") or [{}])[0].get("state") or {}).get("waiting") or {}
        return waiting.get("message", "") if waiting.get("reason") == "ContainerCreating" else ""

    message = wait_until(lambda: "does not exist" in waiting_message() and waiting_message(), "the mount's error")
    assert "containers[main].volumeMounts[gone]: /nonexistent/oobleck does not exist on this node" in message
    cluster.kubectl("delete", "pod", "unmountable", "-n", namespace, "--wait=false")


POD_IP = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
"""Pods on local nodes share the host's network: each listens on its own address, read as a kubelet gives it."""


def test_pods_get_distinct_ips_and_talk_over_them(cluster: Cluster, local_nodes: NodeAgent) -> None:
    namespace = cluster.namespace("talk")
    server = python_pod(
        "server",
        namespace,
        """
        import os, socket
        ip = os.environ["POD_IP"]
        with socket.create_server((ip, 7070)) as listener:
            print("listening", ip, flush=True)
            connection, peer = listener.accept()
            with connection:
                assert connection.recv(4) == b"ping"
                connection.sendall(b"pong " + peer[0].encode())
        print("served", peer[0])
    """,
        local_nodes,
        node=local_nodes.node_names[0],
        env=[POD_IP],
    )
    apply(cluster, server)
    running = wait_phase(cluster, namespace, "server", ("Running",))
    server_ip = running["status"]["podIP"]
    wait_until(
        lambda: "listening" in local_nodes.log_path(namespace, "server", "main").read_text(), "the server to listen"
    )
    client = python_pod(
        "client",
        namespace,
        """
        import os, socket
        with socket.create_connection((os.environ["SERVER"], 7070), source_address=(os.environ["POD_IP"], 0)) as sock:
            sock.sendall(b"ping")
            print(sock.recv(100).decode())
    """,
        local_nodes,
        node=local_nodes.node_names[1],
        env=[{"name": "SERVER", "value": server_ip}, POD_IP],
    )
    apply(cluster, client)
    client_done = wait_phase(cluster, namespace, "client", ("Succeeded", "Failed"))
    server_done = wait_phase(cluster, namespace, "server", ("Succeeded", "Failed"))
    client_ip = client_done["status"]["podIP"]
    logs = {name: local_nodes.log_path(namespace, name, "main").read_text() for name in ("server", "client")}
    assert (client_done["status"]["phase"], server_done["status"]["phase"]) == ("Succeeded", "Succeeded"), logs
    assert client_ip != server_ip and client_done["status"]["hostIP"] != server_done["status"]["hostIP"]
    assert logs["client"].strip() == f"pong {client_ip}"


def test_failing_command_fails_with_its_exit_code(cluster: Cluster, local_nodes: NodeAgent) -> None:
    namespace = cluster.namespace("fail")
    apply(cluster, python_pod("fails", namespace, "import sys; print('bye'); sys.exit(7)", local_nodes))
    pod = wait_phase(cluster, namespace, "fails", ("Succeeded", "Failed"))
    terminated = main_state(pod)["terminated"]
    assert (pod["status"]["phase"], terminated["exitCode"], terminated["reason"]) == ("Failed", 7, "Error")
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
    assert local_nodes.log_path(namespace, "fails", "main").read_text() == "bye\n"


def test_missing_command_is_reported(cluster: Cluster, local_nodes: NodeAgent) -> None:
    namespace = cluster.namespace("nocmd")
    pod = python_pod("nocmd", namespace, "", local_nodes)
    pod["spec"]["containers"][0]["command"] = ["no-such-program-oobleck"]
    apply(cluster, pod)
    done = wait_phase(cluster, namespace, "nocmd", ("Failed",))
    terminated = main_state(done)["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (128, "StartError")
    assert "no-such-program-oobleck" in terminated["message"]


def test_restart_policy_on_failure_restarts_until_success(
    cluster: Cluster, local_nodes: NodeAgent, tmp_path: Path
) -> None:
    namespace = cluster.namespace("restart")
    counter = tmp_path / "runs"
    code = f"""
        import pathlib, sys
        counter = pathlib.Path({str(counter)!r})
        runs = int(counter.read_text()) + 1 if counter.exists() else 1
        counter.write_text(str(runs))
        sys.exit(0 if runs == 3 else 5)
    """
    apply(cluster, python_pod("flaky", namespace, code, local_nodes, restart="OnFailure"))
    pod = wait_phase(cluster, namespace, "flaky", ("Succeeded", "Failed"))
    container = pod["status"]["containerStatuses"][0]
    # (A fresh clone's run once saw restartCount 6, beside the suite at load ~10: what ran is printed if again.)
    seen = f"{pod['status']}; runs counted: {counter.read_text() if counter.exists() else None}"
    assert pod["status"]["phase"] == "Succeeded", seen
    assert container["restartCount"] == 2, seen
    assert container["lastState"]["terminated"]["exitCode"] == 5, seen
    assert counter.read_text() == "3"


def test_kill_pod_process_fails_the_pod_with_137(cluster: Cluster, local_nodes: NodeAgent) -> None:
    namespace = cluster.namespace("kill")
    created = time.monotonic()
    apply(cluster, python_pod("victim", namespace, "import time; time.sleep(600)", local_nodes, gpus=1))
    running = wait_phase(cluster, namespace, "victim", ("Running",))
    to_running = time.monotonic() - created
    assert (
        running["status"]["conditions"]
        and {c["type"]: c["status"] for c in running["status"]["conditions"]}["Ready"] == "True"
    )
    assert "running" in main_state(running)
    pids = local_nodes.pod_pids(namespace, "victim")
    killed_at = time.monotonic()
    assert local_nodes.kill_pod_process(namespace, "victim") == [pids["main"]]
    failed = wait_phase(cluster, namespace, "victim", ("Failed",), timeout=10)
    to_failed = time.monotonic() - killed_at
    terminated = main_state(failed)["terminated"]
    assert (terminated["exitCode"], terminated["reason"], terminated.get("signal")) == (137, "Error", 9)
    assert not pid_running(pids["main"])
    print(f"\ncreate -> Running {to_running:.2f} s; kill -> Failed(137) seen through kubectl {to_failed:.2f} s")
    assert to_failed < 5.0


def test_delete_pod_sends_sigterm_and_honours_grace(cluster: Cluster, local_nodes: NodeAgent, tmp_path: Path) -> None:
    namespace = cluster.namespace("delete")
    marker = tmp_path / "marker"
    code = f"""
        import signal, sys, time
        def on_term(signum, frame):
            open({str(marker)!r}, "w").write("sigterm")
            time.sleep(1.5)  # cleanup work inside the grace period
            open({str(marker)!r}, "a").write(" done")
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        print("ready", flush=True)
        time.sleep(600)
    """
    apply(cluster, python_pod("graceful", namespace, code, local_nodes, grace=20))
    wait_phase(cluster, namespace, "graceful", ("Running",))
    wait_until(lambda: "ready" in local_nodes.log_path(namespace, "graceful", "main").read_text(), "the handler")
    pid = local_nodes.pod_pids(namespace, "graceful")["main"]
    began = time.monotonic()
    cluster.kubectl("delete", "pod", "graceful", "-n", namespace, "--wait=false")
    wait_until(lambda: get_pod(cluster, namespace, "graceful") is None, "the pod to disappear", timeout=30)
    took = time.monotonic() - began
    assert marker.read_text() == "sigterm done"  # SIGTERM arrived and the handler was allowed to finish
    assert not pid_running(pid)
    assert 1.5 <= took < 15, took


def test_sigterm_ignored_is_sigkilled_after_the_grace_period(cluster: Cluster, local_nodes: NodeAgent) -> None:
    namespace = cluster.namespace("stubborn")
    code = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(600)
    """
    apply(cluster, python_pod("stubborn", namespace, code, local_nodes, grace=2))
    wait_phase(cluster, namespace, "stubborn", ("Running",))
    wait_until(lambda: "ready" in local_nodes.log_path(namespace, "stubborn", "main").read_text(), "the handler")
    pid = local_nodes.pod_pids(namespace, "stubborn")["main"]
    began = time.monotonic()
    cluster.kubectl("delete", "pod", "stubborn", "-n", namespace, "--wait=false")
    wait_until(lambda: not pid_running(pid), "the process to die", timeout=30, interval=0.05)
    killed_after = time.monotonic() - began
    wait_until(lambda: get_pod(cluster, namespace, "stubborn") is None, "the pod to disappear", timeout=30)
    print(f"\nSIGTERM ignored: SIGKILL after {killed_after:.2f} s (grace 2 s)")
    assert 2.0 <= killed_after < 6.0


def test_agent_stop_ends_processes_and_deregisters_nodes(cluster: Cluster, tmp_path: Path) -> None:
    agent = NodeAgent(
        cluster.kubeconfig,
        nodes=1,
        gpus_per_node=1,
        name_prefix=f"stop-{cluster.owner}-",
        workdir=tmp_path / "agent",
        timeouts=AgentTimeouts(stop_grace=1.0),
    )
    namespace = cluster.namespace("stop")
    with agent:
        # A process that ignores SIGTERM and forks a child of its own: both must go.
        code = """
            import signal, subprocess, sys, time
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            print(child.pid, flush=True)
            time.sleep(600)
        """
        apply(cluster, python_pod("sleeper", namespace, code, agent, grace=60))
        wait_phase(cluster, namespace, "sleeper", ("Running",))
        log = wait_until(lambda: agent.log_path(namespace, "sleeper", "main").read_text().strip(), "the child pid")
        pids = [*agent.all_pids(), int(log)]
        assert all(pid_running(pid) for pid in pids)
        began = time.monotonic()
    stopped_in = time.monotonic() - began
    # SIGKILL is asynchronous: the forked grandchild may take a moment to be gone.
    wait_until(
        lambda: not [pid for pid in pids if pid_running(pid)], "every pod process to die", timeout=5, interval=0.02
    )
    assert cluster.kubectl("get", "node", agent.node_names[0], "--ignore-not-found").stdout == ""
    assert (
        cluster.kubectl("get", "lease", agent.node_names[0], "-n", "kube-node-lease", "--ignore-not-found").stdout == ""
    )
    pod = get_pod(cluster, namespace, "sleeper")
    if pod is not None:  # PodGC removes pods of deleted nodes later
        assert pod["status"]["phase"] == "Failed" and pod["status"]["reason"] == "Terminated"
    print(f"\nagent stop (pod ignoring SIGTERM, stop_grace 1 s): {stopped_in:.2f} s")
    assert stopped_in < 10


# --- the command line ----------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]


def oobleck(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "oobleck_dev", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def node_gpus(cluster: Cluster, node: str) -> tuple[str, str]:
    status = cluster.kubectl_json("get", "node", node)["status"]
    return status["allocatable"][GPU_RESOURCE], status["capacity"][GPU_RESOURCE]


def test_cli_nodes_kill_pod_and_gpu_health(cluster: Cluster, tmp_path: Path) -> None:
    state = tmp_path / "state"
    node = f"cli-{cluster.owner}-0"
    log = open(tmp_path / "nodes.log", "w")
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "oobleck_dev",
            "nodes",
            "--count",
            "1",
            "--gpus",
            "2",
            "--kubeconfig",
            cluster.kubeconfig,
            "--state-dir",
            str(state),
            "--name-prefix",
            f"cli-{cluster.owner}-",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    try:
        wait_until(
            lambda: "local nodes ready" in (tmp_path / "nodes.log").read_text() or agent.poll() is not None,
            "`oobleck dev nodes` to be ready",
        )
        assert agent.poll() is None, (tmp_path / "nodes.log").read_text()
        again = oobleck("nodes", "--count", "1", "--kubeconfig", cluster.kubeconfig, "--state-dir", str(state))
        assert again.returncode == 1 and "a node agent already runs" in again.stderr

        namespace = cluster.namespace("cli")
        pod = python_pod("victim", namespace, "import time; time.sleep(600)", agent=None, node=node)  # type: ignore[arg-type]
        apply(cluster, pod)
        wait_phase(cluster, namespace, "victim", ("Running",))
        killed = oobleck("kill-pod", f"{namespace}/victim", "--state-dir", str(state))
        assert killed.returncode == 0 and "sent SIGKILL" in killed.stdout, killed.stderr
        assert (
            main_state(wait_phase(cluster, namespace, "victim", ("Failed",), timeout=10))["terminated"]["exitCode"]
            == 137
        )
        missing = oobleck("kill-pod", f"{namespace}/nobody", "--state-dir", str(state))
        assert missing.returncode == 1 and f"pod {namespace}/nobody has no running process" in missing.stderr

        sick = oobleck("gpu-unhealthy", node, "--kubeconfig", cluster.kubeconfig)
        assert sick.returncode == 0 and node_gpus(cluster, node) == ("1", "2"), sick.stderr
        healed = oobleck("gpu-healthy", node, "--kubeconfig", cluster.kubeconfig)
        assert healed.returncode == 0 and node_gpus(cluster, node) == ("2", "2"), healed.stderr
        bad = oobleck("gpu-unhealthy", node, "--healthy-gpus", "5", "--kubeconfig", cluster.kubeconfig)
        assert bad.returncode == 1 and "healthy_gpus: must be between 0 and the node's 2 GPUs, got 5" in bad.stderr
    finally:
        agent.send_signal(signal.SIGINT)
        code = agent.wait(30)
        log.close()
    assert code == 0, (tmp_path / "nodes.log").read_text()
    assert cluster.kubectl("get", "node", node, "--ignore-not-found").stdout == ""
    assert not (state / "nodeagent" / "agent.json").exists()


SHOW_DEVICES_AND_SLEEP = "import os, time; print(os.environ['CUDA_VISIBLE_DEVICES'], flush=True); time.sleep(600)"


@pytest.mark.slow
def test_dev_up_with_local_nodes_runs_pods_and_down_cleans_up(tmp_path: Path) -> None:
    from oobleck_dev.controlplane import process_start_time, run_kubectl
    from oobleck_dev.tools import find_tools

    state = tmp_path / "state"
    up = oobleck(
        "up", "--state-dir", str(state), "--local-nodes", "2", "--gpus-per-node", "2", "--gpu-devices", "7", timeout=600
    )
    pids: list[int] = []
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        record = json.loads((state / "state.json").read_text())
        assert len(record["local_nodes"]) == 2 and "local nodes: " in up.stdout
        kubeconfig = str(state / "kubeconfig")

        def kubectl(*args: str, input: str | None = None) -> str:
            return run_kubectl(find_tools(), kubeconfig, args, input=input).stdout

        kubectl("create", "namespace", "demo")
        wait_until(lambda: kubectl("get", "serviceaccount", "-n", "demo", "-o", "name").strip(), "the default SA")
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "sleeper", "namespace": "demo"},
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "main",
                        "image": "x",
                        "command": ["python", "-c", SHOW_DEVICES_AND_SLEEP],
                        "resources": {"limits": {GPU_RESOURCE: "2"}},
                    }
                ],
            },
        }
        kubectl("apply", "-f", "-", input=json.dumps(pod))
        wait_until(
            lambda: kubectl("get", "pod", "sleeper", "-n", "demo", "-o", "jsonpath={.status.phase}") == "Running",
            "the pod to run on a local node",
        )
        agent_record = json.loads((state / "nodeagent" / "agent.json").read_text())
        pids = [int(stamp.split()[0]) for stamp in agent_record["pods"]["demo/sleeper"]["containers"].values()]
        assert pids and all(pid_running(pid) for pid in pids)
        status = oobleck("status", "--state-dir", str(state))
        assert "local nodes: " in status.stdout
        logs = list((state / "nodeagent" / "work" / "logs").glob("demo_sleeper_*_main.log"))
        assert wait_until(lambda: logs[0].read_text(), "the pod's output") == "7,7\n"
    finally:
        down = oobleck("down", "--state-dir", str(state), timeout=120)
    assert down.returncode == 0 and "down" in down.stdout, down.stdout + down.stderr
    assert not [pid for pid in pids if pid_running(pid)]
    supervisor = record["supervisor"].split()
    assert process_start_time(int(supervisor[0])) != supervisor[1]
    assert not state.exists()


def test_a_restarted_agent_takes_over_its_nodes_and_fails_lost_pods(cluster: Cluster, tmp_path: Path) -> None:
    prefix = f"takeover-{cluster.owner}-"
    node = f"{prefix}0"
    state = tmp_path / "state"
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "oobleck_dev",
            "nodes",
            "--count",
            "1",
            "--gpus",
            "1",
            "--kubeconfig",
            cluster.kubeconfig,
            "--state-dir",
            str(state),
            "--name-prefix",
            prefix,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    try:
        assert "local nodes ready" in first.stdout.readline()  # type: ignore[union-attr]
        namespace = cluster.namespace("takeover")
        apply(cluster, python_pod("orphan", namespace, "import time; time.sleep(600)", None, node=node))
        wait_phase(cluster, namespace, "orphan", ("Running",))
        record = json.loads((state / "nodeagent" / "agent.json").read_text())
        pid = int(record["pods"][f"{namespace}/orphan"]["containers"]["main"].split()[0])
    finally:  # the agent crashes; its pods' processes die with it (and a failed test leaves no Ready node behind)
        first.kill()
        first.wait(10)
    wait_until(lambda: not pid_running(pid), "the pod process to die with its agent", timeout=10)
    assert get_pod(cluster, namespace, "orphan")["status"]["phase"] == "Running"  # nobody told the API

    with NodeAgent(
        cluster.kubeconfig, nodes=1, gpus_per_node=1, name_prefix=prefix, workdir=tmp_path / "second"
    ) as agent:
        pod = wait_phase(cluster, namespace, "orphan", ("Failed",), timeout=20)
        terminated = main_state(pod)["terminated"]
        assert (terminated["exitCode"], terminated["reason"]) == (137, "ContainerStatusUnknown")
        labels = cluster.kubectl_json("get", "node", node)["metadata"]["labels"]
        assert labels[AGENT_LABEL] == agent.agent_id
        # New pods run on the taken-over node.
        apply(cluster, python_pod("fresh", namespace, "print('ok')", agent))
        assert wait_phase(cluster, namespace, "fresh", ("Succeeded", "Failed"))["status"]["phase"] == "Succeeded"
    assert cluster.kubectl("get", "node", node, "--ignore-not-found").stdout == ""


def test_missing_configmap_waits_in_container_creating_then_runs(cluster: Cluster, local_nodes: NodeAgent) -> None:
    namespace = cluster.namespace("waits")
    code = "print(open('/config/key').read())"
    pod = python_pod("waiter", namespace, code, local_nodes, volumeMounts=[{"name": "config", "mountPath": "/config"}])
    pod["spec"]["volumes"] = [{"name": "config", "configMap": {"name": "late"}}]
    apply(cluster, pod)

    def creating() -> dict | None:
        status = (get_pod(cluster, namespace, "waiter") or {}).get("status", {})
        waiting = ((status.get("containerStatuses") or [{}])[0].get("state") or {}).get("waiting") or {}
        return (
            waiting if waiting.get("reason") == "ContainerCreating" and "late" in waiting.get("message", "") else None
        )

    waiting = wait_until(creating, "ContainerCreating with a message about the missing ConfigMap")
    assert "volumes[config].configMap: configmap 'late' not found" in waiting["message"]
    assert get_pod(cluster, namespace, "waiter")["status"]["phase"] == "Pending"
    apply(
        cluster,
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "late", "namespace": namespace},
            "data": {"key": "arrived"},
        },
    )
    assert wait_phase(cluster, namespace, "waiter", ("Succeeded", "Failed"))["status"]["phase"] == "Succeeded"
    assert local_nodes.log_path(namespace, "waiter", "main").read_text() == "arrived\n"


def test_init_containers_run_first_and_share_volumes(cluster: Cluster, local_nodes: NodeAgent) -> None:
    namespace = cluster.namespace("init")
    read = "print(open('/seeded/seed').read())"
    pod = python_pod("seeded", namespace, read, local_nodes, volumeMounts=[{"name": "work", "mountPath": "/seeded"}])
    pod["spec"]["volumes"] = [{"name": "work", "emptyDir": {}}]
    pod["spec"]["initContainers"] = [
        {
            "name": "seed",
            "image": "python:3.11",
            "volumeMounts": [{"name": "work", "mountPath": "/scratch"}],
            "command": [
                "python",
                "-c",
                "open('/scratch/seed', 'w').write('from init')",
            ],
        }
    ]
    apply(cluster, pod)
    done = wait_phase(cluster, namespace, "seeded", ("Succeeded", "Failed"))
    assert done["status"]["phase"] == "Succeeded", local_nodes.log_path(namespace, "seeded", "main").read_text()
    init = done["status"]["initContainerStatuses"][0]
    assert init["state"]["terminated"]["reason"] == "Completed" and init["ready"]
    assert local_nodes.log_path(namespace, "seeded", "main").read_text() == "from init\n"


def test_lease_heartbeats_keep_the_nodes_ready(cluster: Cluster, local_nodes: NodeAgent) -> None:
    """Past the node lifecycle controller's grace period (50 s) the nodes are still Ready: the Leases renew."""
    from datetime import datetime

    def age_s(stamp: str) -> float:
        return (datetime.now(UTC) - datetime.fromisoformat(stamp.replace("Z", "+00:00"))).total_seconds()

    # Waits for the youngest node (each registers on its own; free when the module ran long).
    nodes = [cluster.kubectl_json("get", "node", name) for name in local_nodes.node_names]
    time.sleep(max(0.0, 60.0 - min(age_s(node["metadata"]["creationTimestamp"]) for node in nodes)))
    for name in local_nodes.node_names:
        node = cluster.kubectl_json("get", "node", name)
        assert age_s(node["metadata"]["creationTimestamp"]) >= 60
        ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True", ready
        assert not node["spec"].get("taints"), node["spec"]["taints"]
        lease = cluster.kubectl_json("get", "lease", name, "-n", "kube-node-lease")
        assert age_s(lease["spec"]["renewTime"]) < 15


def test_an_agent_never_stopped_is_stopped_at_interpreter_exit(cluster: Cluster, tmp_path: Path) -> None:
    prefix = f"forgotten-{cluster.owner}-"
    script = textwrap.dedent(f"""
        from oobleck_dev.nodeagent import NodeAgent
        agent = NodeAgent({cluster.kubeconfig!r}, nodes=1, gpus_per_node=1, name_prefix={prefix!r})
        agent.start()
        print(agent.workdir, flush=True)
    """)  # no stop(): the atexit hook must do it
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert cluster.kubectl("get", "node", f"{prefix}0", "--ignore-not-found").stdout == "", result.stderr
    assert not Path(result.stdout.strip()).exists()  # its temporary work folder is gone too


def test_gpu_devices_become_cuda_visible_devices(cluster: Cluster, tmp_path: Path) -> None:
    agent = NodeAgent(
        cluster.kubeconfig,
        nodes=2,
        gpus_per_node=2,
        name_prefix=f"devices-{cluster.owner}-",
        workdir=tmp_path / "agent",
        gpu_devices=["0", "1", "2"],
    )
    namespace = cluster.namespace("devices")
    show = (
        "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')), repr(os.environ.get('NVIDIA_VISIBLE_DEVICES')))"
    )
    with agent:
        apply(
            cluster,
            python_pod("two", namespace, show, agent, gpus=2, node=agent.node_names[1]),
            python_pod("none", namespace, show, agent, node=agent.node_names[1]),
        )
        for name in ("two", "none"):
            assert wait_phase(cluster, namespace, name, ("Succeeded", "Failed"))["status"]["phase"] == "Succeeded"
        assert agent.log_path(namespace, "two", "main").read_text() == "'2,0' '2,0'\n"
        assert agent.log_path(namespace, "none", "main").read_text() == "'' ''\n"
        # The finished pod gave its GPUs back: another 2-GPU pod runs on the same node.
        apply(cluster, python_pod("again", namespace, show, agent, gpus=2, node=agent.node_names[1]))
        assert wait_phase(cluster, namespace, "again", ("Succeeded", "Failed"))["status"]["phase"] == "Succeeded"
