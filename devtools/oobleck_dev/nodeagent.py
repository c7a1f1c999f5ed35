"""The local node agent: Kubernetes nodes whose pods run as local processes (a kubelet stand-in).

`NodeAgent` registers N Node objects with `nvidia.com/gpu` capacity and acts as their kubelet:
every pod the scheduler binds to one of them runs as local processes, with the pod's command,
args and env; the "image" is ignored and the project's own Python environment stands in for it.
There is no container runtime, no kubelet API (`kubectl logs/exec` do not work) and no DNS.

What a pod sees (see podrunner.py for the folder layout):
- its own loopback address (127.X.N.P; Linux routes all of 127/8 to lo) as status.podIP, the
  node's 127.X.N.1 as hostIP. Pods share the host's network, so each must listen on its own address
  (the downward API's status.podIP, as the operator's pods read it) and reach the others there.
- env as a kubelet resolves it (downward API, ConfigMap/Secret keys, resource fields, $(VAR)),
  plus KUBERNETES_SERVICE_HOST/PORT pointing at the API server, PATH with the project's venv
  first (so `python` and `oobleck` resolve), HOSTNAME, TMPDIR.
- the host's files with its volumes mounted at their mountPaths, in a mount namespace of its own
  (mountns.py; other pods and the host do not see them): configMap, secret, downwardAPI, emptyDir,
  projected (with service-account tokens from the TokenRequest API, bound to the pod, so the
  service-account folder is /var/run/secrets/kubernetes.io/serviceaccount as in a container),
  hostPath, and persistentVolumeClaim (one folder per claim name for the agent, shared like
  ReadWriteMany). API-data volumes and `readOnly` mounts are read-only. The working folder is
  `workingDir`, else `/`.
Not honoured: securityContext (processes run as the agent's user), probes (a running container
is ready), resource limits (nothing is enforced), hostAliases/DNS, image pulls, lifecycle hooks.
Volumes are written once when the pod starts (no ConfigMap sync, no token refresh: the API
server issues the default kube-api-access token for a year). GPUs are handed to pods as a device
plugin does; they map to real devices (CUDA_VISIBLE_DEVICES) only if `gpu_devices` is given.

Status is reported as a kubelet does: Pending (ContainerCreating, podIP) -> Running (started,
Ready) -> Succeeded/Failed (exit codes; 128+N for signal N), with restartPolicy and restartCount
(exponential back-off from `AgentTimeouts.restart_backoff`). Deletion: SIGTERM the process
group, wait the grace period, SIGKILL, report, then delete the pod with grace 0. Processes die
with the agent (PR_SET_PDEATHSIG); stopping the agent ends them and deletes its nodes.

Fault tools for tests and demos: `kill_pod_process`, `set_gpu_health`, `set_node_ready`, and
`cut_network` / `heal_network` (a partition: each pod's processes run in a cgroup of their own, whose
sockets nftables can cut off; see netfault.py).
"""

from __future__ import annotations

import asyncio
import atexit
import fcntl
import json
import logging
import os
import random
import secrets
import shutil
import signal as signals
import sysconfig
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from oobleck_dev import cpulimit, netfault, podenv, podrunner
from oobleck_dev.memlimit import MemoryCgroup
from oobleck_dev.mountns import Filesystem
from oobleck_dev.netfault import NetFaultUnavailable
from oobleck_dev.podrunner import GPU_RESOURCE, PodLifecycle, now_rfc3339
from oobleck_dev.podzygote import ForkedContainer, PodZygote, forkable_module

log = logging.getLogger("oobleck_dev.nodeagent")

LOCAL_NODE_LABEL = "oobleck.dev/local-node"
AGENT_LABEL = "oobleck.dev/local-agent"
GPU_CONDITION = "GPUHealthy"
LEASE_NAMESPACE = "kube-node-lease"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
RUNTIME_VERSION = "oobleck-local://0.1"
# The agent's environment variables a container inherits (they stand in for the image's).
IMAGE_ENV = ("HOME", "LANG", "LC_ALL", "TZ", "LD_LIBRARY_PATH", "SSL_CERT_FILE", "CUDA_HOME")
# Second octets of 127.X.0.0/16 blocks an agent may claim (one per agent; 127.0/16 is left alone).
IP_BLOCKS = range(16, 255)
STATUS_FILE = "agent.json"


@dataclass(frozen=True)
class AgentTimeouts:
    """Every wait and period of the agent, in seconds; each is named in the error when it expires."""

    nodes_ready: float = 60.0
    """registered nodes report Ready and lose the not-ready taint (the node lifecycle controller)."""
    lease_renew: float = 10.0
    """node Lease renewal period (a kubelet's default)."""
    lease_duration: int = 40
    """the Lease's leaseDurationSeconds."""
    request: float = 30.0
    """one API call."""
    watch: int = 300
    """server-side timeout of one pod watch (it is reopened from the last resourceVersion)."""
    retry: float = 1.0
    """retry period while a volume or env source is missing (the pod stays ContainerCreating), and
    after a failed status update."""
    restart_backoff: float = 10.0
    """first restart delay of a failed container (doubles per restart, as CrashLoopBackOff)."""
    restart_backoff_max: float = 300.0
    """the longest restart delay."""
    stop_grace: float = 5.0
    """at agent stop: SIGTERM to SIGKILL for each pod (capped by the pod's own grace period)."""
    start: float = 240.0
    """the whole of `NodeAgent.start()` (the pod zygote's import of torch may have half of it: at load ~24 on
    2 cores that import outlasted a 120 s start, which failed the test's setup)."""


class NodeAgentError(RuntimeError):
    """The agent could not start or a request to it failed; the message names what."""


def now_micro() -> str:
    """The current time as Kubernetes `MicroTime` (Lease renewTime)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# --- pure: the objects the agent writes ---------------------------------------------------------


def _condition(kind: str, status: str, reason: str, message: str, stamp: str) -> dict:
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastHeartbeatTime": stamp,
        "lastTransitionTime": stamp,
    }


def kubelet_conditions(stamp: str) -> list[dict]:
    """The conditions a healthy kubelet posts: Ready and no pressure."""
    return [
        _condition("Ready", "True", "KubeletReady", "local node agent is posting ready status", stamp),
        _condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "no memory pressure", stamp),
        _condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "no disk pressure", stamp),
        _condition("PIDPressure", "False", "KubeletHasSufficientPID", "no PID pressure", stamp),
    ]


def node_object(
    name: str, *, ip: str, gpus: int, cpu: str, memory: str, pods: int, agent_id: str, labels: dict[str, str]
) -> dict:
    """The Node of one local node: Ready, all GPUs healthy (capacity == allocatable)."""
    resources = {"cpu": cpu, "memory": memory, "pods": str(pods), GPU_RESOURCE: str(gpus)}
    stamp = now_rfc3339()
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                **labels,
                LOCAL_NODE_LABEL: "true",
                AGENT_LABEL: agent_id,
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
            },
        },
        "spec": {},
        "status": {
            "capacity": resources,
            "allocatable": dict(resources),
            "conditions": [
                *kubelet_conditions(stamp),
                _condition(GPU_CONDITION, "True", "GPUsHealthy", f"{gpus} of {gpus} GPUs healthy", stamp),
            ],
            "addresses": [{"type": "InternalIP", "address": ip}, {"type": "Hostname", "address": name}],
            "nodeInfo": {
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
                "kernelVersion": os.uname().release,
                "osImage": "oobleck local node",
                "containerRuntimeVersion": RUNTIME_VERSION,
                "kubeletVersion": "v0.0.0-oobleck-local",
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        },
    }


def lease_object(node: str, node_uid: str, duration_s: int) -> dict:
    """The node's heartbeat Lease in kube-node-lease, owned by the node (deleted with it)."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": node,
            "namespace": LEASE_NAMESPACE,
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}],
        },
        "spec": {"holderIdentity": node, "leaseDurationSeconds": duration_s, "renewTime": now_micro()},
    }


def gpu_health_patch(capacity: int, healthy: int) -> dict:
    """Node status patch for `healthy` of `capacity` GPUs (a device plugin lowers allocatable)."""
    if not 0 <= healthy <= capacity:
        raise ValueError(f"healthy_gpus: must be between 0 and the node's {capacity} GPUs, got {healthy}")
    stamp = now_rfc3339()
    ok = healthy == capacity
    return {
        "status": {
            "allocatable": {GPU_RESOURCE: str(healthy)},
            "conditions": [
                {
                    "type": GPU_CONDITION,
                    "status": "True" if ok else "False",
                    "reason": "GPUsHealthy" if ok else "GPUUnhealthy",
                    "message": f"{healthy} of {capacity} GPUs healthy",
                    "lastHeartbeatTime": stamp,
                    "lastTransitionTime": stamp,
                }
            ],
        }
    }


def ready_patch(ready: bool) -> dict:
    """Node status patch for the Ready condition."""
    stamp = now_rfc3339()
    condition = {
        "type": "Ready",
        "status": "True" if ready else "False",
        "reason": "KubeletReady" if ready else "KubeletNotReady",
        "message": "local node agent is posting ready status" if ready else "marked not ready by the local node agent",
        "lastHeartbeatTime": stamp,
        "lastTransitionTime": stamp,
    }
    return {"status": {"conditions": [condition]}}


# --- addresses -----------------------------------------------------------------------------------


class IpBlock:
    """A 127.X.0.0/16 block held by this agent for its lifetime (an flock; released if it dies).

    Node n gets 127.X.(n+1).0/24: .1 is the node (hostIP), .2-.254 its pods, handed out round
    robin so that an address is not reused right after its pod went away.
    """

    def __init__(self, lock_dir: Path | None = None):
        lock_dir = Path(lock_dir or tempfile.gettempdir())
        candidates = list(IP_BLOCKS)
        random.shuffle(candidates)
        for octet in candidates:
            handle = open(lock_dir / f"oobleck-nodeagent-127.{octet}.lock", "w")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            self.octet, self._lock = octet, handle
            break
        else:
            raise NodeAgentError(f"no free 127.X.0.0/16 block in {IP_BLOCKS} (each running agent holds one)")
        self._next: dict[int, int] = {}
        self._used: dict[int, set[int]] = {}

    def node_ip(self, node_index: int) -> str:
        return f"127.{self.octet}.{node_index + 1}.1"

    def allocate(self, node_index: int) -> str:
        """A free pod address on node `node_index`."""
        used = self._used.setdefault(node_index, set())
        start = self._next.get(node_index, 2)
        for step in range(253):
            host = 2 + (start - 2 + step) % 253
            if host not in used:
                used.add(host)
                self._next[node_index] = host + 1
                return f"127.{self.octet}.{node_index + 1}.{host}"
        raise NodeAgentError(f"node {node_index}: all 253 pod addresses are in use")

    def release(self, node_index: int, ip: str) -> None:
        self._used.get(node_index, set()).discard(int(ip.rsplit(".", 1)[1]))

    def close(self) -> None:
        self._lock.close()


class GpuSlots:
    """The GPUs of each node, handed to pods as a device plugin does (the scheduler counted them).

    `devices`: optional physical GPU ids behind the nodes' nvidia.com/gpu; node n's GPU j is
    `devices[(n * gpus_per_node + j) % len(devices)]` (several nodes may share one real GPU).
    """

    def __init__(self, nodes: int, gpus_per_node: int, devices: list[str] | None):
        self.gpus_per_node = gpus_per_node
        self.devices = devices
        self._free = {node: list(range(gpus_per_node)) for node in range(nodes)}

    def allocate(self, node_index: int, count: int) -> list[int] | None:
        """`count` free GPU slots of the node, or None if fewer are free."""
        free = self._free[node_index]
        if count > len(free):
            return None
        taken, self._free[node_index] = free[:count], free[count:]
        return taken

    def release(self, node_index: int, slots: list[int]) -> None:
        self._free[node_index] = sorted(self._free[node_index] + slots)

    def visible(self, node_index: int, slots: list[int]) -> str | None:
        """CUDA_VISIBLE_DEVICES for these slots; None when no physical devices were configured."""
        if not self.devices:
            return None
        base = node_index * self.gpus_per_node
        return ",".join(self.devices[(base + slot) % len(self.devices)] for slot in slots)


# --- the API -------------------------------------------------------------------------------------


class ApiError(Exception):
    """An API call failed with an HTTP status (0: no answer, e.g. a timeout or a refused connection)."""

    def __init__(self, status: int, method: str, path: str, body: str):
        super().__init__(f"{method} {path}: HTTP {status}: {body[:500]}")
        self.status = status


class Api:
    """A few raw JSON calls over kubernetes_asyncio's authenticated client (dicts in and out)."""

    def __init__(self, client: Any, timeout: float):
        self.client = client
        self.timeout = timeout

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: dict | None = None,
        content_type: str = "application/json",
    ) -> dict:
        import aiohttp
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            return await self.client.call_api(
                path,
                method,
                query_params=list((query or {}).items()),
                header_params={"Accept": "application/json", "Content-Type": content_type},
                body=body,
                auth_settings=["BearerToken"],
                response_types_map={200: "object", 201: "object"},
                _return_http_data_only=True,
                _request_timeout=self.timeout,
            )
        except ApiException as error:
            raise ApiError(error.status, method, path, str(error.body or error.reason)) from None
        except (TimeoutError, aiohttp.ClientError) as error:  # no answer: status 0
            raise ApiError(0, method, path, repr(error)) from None

    async def patch(self, path: str, body: dict, strategic: bool = True) -> dict:
        kind = "strategic-merge-patch" if strategic else "merge-patch"
        return await self.call("PATCH", path, body, content_type=f"application/{kind}+json")

    async def stream(self, path: str, query: dict):
        """The raw response of a watch request (lines of JSON events)."""
        response = await self.client.call_api(
            path,
            "GET",
            query_params=list(query.items()),
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=None,
        )
        if response.status != 200:
            body = (await response.read()).decode(errors="replace")
            response.release()
            raise ApiError(response.status, "GET", path, body)
        return response


async def open_api(kubeconfig: str, timeout: float, pool: int = 32) -> tuple[Any, Api, str]:
    """An ApiClient for `kubeconfig`, the JSON wrapper around it, and the server URL."""
    from kubernetes_asyncio import client, config

    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    configuration.connection_pool_maxsize = pool
    api_client = client.ApiClient(configuration)
    return api_client, Api(api_client, timeout), configuration.host


def _pod_path(namespace: str, name: str, sub: str = "") -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}{sub}"


async def patch_gpu_health(api: Api, node: str, healthy_gpus: int | None, restore: bool = False) -> dict:
    """Mark `healthy_gpus` of the node's GPUs healthy (allocatable + the GPUHealthy condition);
    None: all of them if `restore`, else one fewer than before (one more GPU fails). Returns the node."""
    current = await api.call("GET", f"/api/v1/nodes/{node}")
    status = current.get("status") or {}
    capacity = int((status.get("capacity") or {}).get(GPU_RESOURCE, "0"))
    if healthy_gpus is None:
        allocatable = int((status.get("allocatable") or {}).get(GPU_RESOURCE, "0"))
        healthy_gpus = capacity if restore else max(allocatable - 1, 0)
    return await api.patch(f"/api/v1/nodes/{node}/status", gpu_health_patch(capacity, healthy_gpus))


def set_gpu_health_sync(
    kubeconfig: str, node: str, healthy_gpus: int | None, restore: bool = False, timeout: float = 30.0
) -> dict:
    """`patch_gpu_health` from synchronous code. No agent is needed: only this writes a node's
    allocatable GPUs after registration, so the change stands while the agent runs."""

    async def run() -> dict:
        api_client, api, _ = await open_api(kubeconfig, timeout, pool=2)
        async with api_client:
            return await patch_gpu_health(api, node, healthy_gpus, restore)

    return asyncio.run(run())


# --- the agent's event loop ----------------------------------------------------------------------


@dataclass
class _NodeState:
    name: str
    index: int
    uid: str = ""
    heartbeat: bool = True


class _AgentCore:
    """Everything that runs on the agent's event loop."""

    def __init__(self, agent: NodeAgent):
        self.config = agent
        self.timeouts = agent.timeouts
        self.enforce_memory = agent.enforce_memory
        self.workdir = agent.workdir
        self.ips = agent.ips
        self.gpus = GpuSlots(len(agent.node_names), agent.gpus_per_node, agent.gpu_devices)
        self.cgroups = agent.cgroups
        self.nodes = {name: _NodeState(name, i) for i, name in enumerate(agent.node_names)}
        self.allocatable = {"cpu": agent.cpu, "memory": agent.memory, GPU_RESOURCE: str(agent.gpus_per_node)}
        self.workers: dict[str, PodLifecycle] = {}  # uid -> worker
        self.stop_event = asyncio.Event()
        self.api: Api = None  # type: ignore[assignment]
        self.api_client: Any = None
        self.server = ""
        self.status_file = agent.status_file
        self.zygote: PodZygote | None = None

    def start_container(
        self,
        argv: list[str],
        env: dict[str, str],
        filesystem: Filesystem,
        log_path: Path,
        net_cgroup: Path | None,
        memory: MemoryCgroup | None,
    ) -> podrunner.ContainerProcess | ForkedContainer:
        """A container's process: forked from the zygote where the agent has one, it is ready and the command
        is a runtime module (podzygote.py); else exec'd. Raises OSError when it cannot start."""
        module = forkable_module(argv, env)
        if self.zygote is not None and self.zygote.ready.is_set() and module is not None:
            return self.zygote.spawn(module, argv[3:], env, filesystem, log_path, net_cgroup, memory)
        return podrunner.ContainerProcess(argv, env, filesystem, log_path, net_cgroup, memory)

    # -- environment --

    def base_env(self, pod: dict, tmpdir: Path) -> dict[str, str]:
        """The environment before the pod's own: the image's stand-in, service env, agent additions."""
        url = urlparse(self.server)
        port = str(url.port or 443)
        env = {key: os.environ[key] for key in IMAGE_ENV if key in os.environ}
        scripts = sysconfig.get_path("scripts")
        env["PATH"] = os.pathsep.join([scripts, os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")])
        env.update(
            {
                "HOSTNAME": pod["spec"].get("hostname") or pod["metadata"]["name"],
                "TMPDIR": str(tmpdir),
                "KUBERNETES_SERVICE_HOST": url.hostname or "127.0.0.1",
                "KUBERNETES_SERVICE_PORT": port,
                "KUBERNETES_SERVICE_PORT_HTTPS": port,
                "KUBERNETES_PORT": f"tcp://{url.hostname}:{port}",
            }
        )
        env.update(self.config.extra_env)
        return env

    async def send_pod_status(self, namespace: str, name: str, uid: str, status: dict) -> bool | None:
        """Patch a pod's status (strategic merge, uid as precondition, as a kubelet does).

        True if sent, False if it failed (the worker retries), None if the pod is gone.
        """
        try:
            body = {"metadata": {"uid": uid}, "status": status}
            await self.api.patch(_pod_path(namespace, name, "/status"), body)
            return True
        except ApiError as error:
            if error.status in (404, 409):  # gone, or a newer pod of the same name
                return None
            log.warning("%s/%s: status update failed: %s", namespace, name, error)
            return False

    async def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        """The kubelet's last word on a deleted pod: delete it with grace 0 (it disappears)."""
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
        try:
            await self.api.call("DELETE", _pod_path(namespace, name), body)
        except ApiError as error:
            if error.status not in (404, 409):
                log.warning("%s/%s: delete failed: %s", namespace, name, error)

    def log_path(self, namespace: str, name: str, uid: str, container: str) -> Path:
        return self.workdir / "logs" / f"{podrunner.pod_dir_name(namespace, name, uid)}_{container}.log"

    async def fetch_sources(self, pod: dict) -> podenv.Sources:
        """The ConfigMaps, Secrets and tokens the pod refers to (missing objects as None)."""
        refs = podenv.references(pod)
        namespace = pod["metadata"]["namespace"]
        sources = podenv.Sources()

        async def get(kind: str, name: str) -> dict | None:
            try:
                return await self.api.call("GET", f"/api/v1/namespaces/{namespace}/{kind}/{name}")
            except ApiError as error:
                if error.status == 404:
                    return None
                raise

        async def token(request: podenv.TokenRequest) -> str:
            account = pod["spec"].get("serviceAccountName") or "default"
            body = {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {
                    "audiences": [request.audience] if request.audience else [],
                    "expirationSeconds": request.expiration_s,
                    "boundObjectRef": {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": pod["metadata"]["name"],
                        "uid": pod["metadata"]["uid"],
                    },
                },
            }
            path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token"
            return (await self.api.call("POST", path, body))["status"]["token"]

        configmaps = sorted(refs.configmaps)
        secret_names = sorted(refs.secrets)
        tokens = sorted(refs.tokens, key=lambda t: (t.audience, t.expiration_s))
        try:
            results = await asyncio.gather(
                *(get("configmaps", name) for name in configmaps),
                *(get("secrets", name) for name in secret_names),
                *(token(request) for request in tokens),
            )
        except ApiError as error:  # e.g. the ServiceAccount does not exist (yet)
            raise podenv.MountError(str(error)) from None
        for name, obj in zip(configmaps, results[: len(configmaps)]):
            sources.configmaps[name] = None if obj is None else podenv.configmap_data(obj)
        offset = len(configmaps)
        for name, obj in zip(secret_names, results[offset : offset + len(secret_names)]):
            sources.secrets[name] = None if obj is None else podenv.secret_data(obj)
        for request, value in zip(tokens, results[offset + len(secret_names) :]):
            sources.tokens[request] = value
        return sources

    # -- nodes --

    async def register_nodes(self) -> None:
        config = self.config

        async def one(state: _NodeState) -> None:
            body = node_object(
                state.name,
                ip=self.ips.node_ip(state.index),
                gpus=config.gpus_per_node,
                cpu=config.cpu,
                memory=config.memory,
                pods=config.max_pods,
                agent_id=config.agent_id,
                labels=config.labels,
            )
            try:
                created = await self.api.call("POST", "/api/v1/nodes", body)
            except ApiError as error:
                if error.status != 409:
                    raise
                # Left over by an agent that was killed: take it over with fresh labels and status.
                labels = {"metadata": {"labels": body["metadata"]["labels"]}}
                await self.api.patch(f"/api/v1/nodes/{state.name}", labels)
                created = await self.api.patch(f"/api/v1/nodes/{state.name}/status", {"status": body["status"]})
            state.uid = created["metadata"]["uid"]
            await self.renew_lease(state)

        await asyncio.gather(*(one(state) for state in self.nodes.values()))

    async def renew_lease(self, state: _NodeState) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{state.name}"
        try:
            renewal = {"spec": {"renewTime": now_micro(), "holderIdentity": state.name}}
            await self.api.patch(path, renewal, strategic=False)
        except ApiError as error:
            if error.status != 404:
                raise
            body = lease_object(state.name, state.uid, self.timeouts.lease_duration)
            await self.api.call("POST", f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases", body)

    async def heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.timeouts.lease_renew)
            for state in list(self.nodes.values()):
                if not state.heartbeat:
                    continue
                try:
                    await self.renew_lease(state)
                    await self.reassert_ready(state)
                except ApiError as error:
                    log.warning("node %s: lease renewal failed: %s", state.name, error)

    async def reassert_ready(self, state: _NodeState) -> None:
        """As a kubelet's status sync does: a Ready condition that is not True although this agent keeps the
        node alive (the node lifecycle controller set it Unknown while the API server was out of reach and
        no lease could be renewed) is posted again; a renewed lease alone does not undo it."""
        node = await self.api.call("GET", f"/api/v1/nodes/{state.name}")
        conditions = (node.get("status") or {}).get("conditions") or []
        ready = next((c.get("status") for c in conditions if c.get("type") == "Ready"), None)
        if ready != "True":
            log.info("node %s: Ready was %s; posting the node status again", state.name, ready)
            patch = {"status": {"conditions": kubelet_conditions(now_rfc3339())}}
            await self.api.patch(f"/api/v1/nodes/{state.name}/status", patch)

    async def wait_nodes_ready(self) -> None:
        deadline = time.monotonic() + self.timeouts.nodes_ready
        pending = set(self.nodes)
        while pending:
            for name in sorted(pending):
                node = await self.api.call("GET", f"/api/v1/nodes/{name}")
                taints = [t["key"] for t in (node.get("spec") or {}).get("taints") or []]
                if NOT_READY_TAINT not in taints:
                    pending.discard(name)
            if pending and time.monotonic() > deadline:
                raise NodeAgentError(
                    f"timed out after {self.timeouts.nodes_ready:.0f} s (nodes_ready) waiting for the node lifecycle "
                    f"controller to remove the {NOT_READY_TAINT} taint from {sorted(pending)}; "
                    "is kube-controller-manager running?"
                )
            if pending:
                await asyncio.sleep(0.2)

    async def set_node_ready(self, node: str, ready: bool) -> None:
        state = self._node(node)
        state.heartbeat = ready
        await self.api.patch(f"/api/v1/nodes/{node}/status", ready_patch(ready))
        if ready:
            await self.renew_lease(state)

    async def set_gpu_health(self, node: str, healthy_gpus: int) -> None:
        self._node(node)
        await patch_gpu_health(self.api, node, healthy_gpus)

    def _node(self, node: str) -> _NodeState:
        if node not in self.nodes:
            raise ValueError(f"node: {node!r} is not one of this agent's nodes {sorted(self.nodes)}")
        return self.nodes[node]

    async def deregister(self) -> None:
        async def one(state: _NodeState) -> None:
            for path in (
                f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{state.name}",
                f"/api/v1/nodes/{state.name}",
            ):
                try:
                    await self.api.call("DELETE", path)
                except ApiError as error:
                    if error.status != 404:
                        log.warning("deregister %s: %s", state.name, error)

        await asyncio.gather(*(one(state) for state in self.nodes.values()))

    # -- pods --

    def on_pod(self, kind: str, pod: dict) -> None:
        """One watch event (or one item of a relist, as ADDED)."""
        node = (pod.get("spec") or {}).get("nodeName")
        if node not in self.nodes:
            return
        uid = pod["metadata"]["uid"]
        worker = self.workers.get(uid)
        if kind == "DELETED":
            if worker is not None:
                worker.gone = True
                worker.update(pod)
            return
        if worker is not None:
            worker.update(pod)
            return
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed") and pod["metadata"].get("deletionTimestamp") is None:
            return  # finished before this agent started; nothing to run
        worker = PodLifecycle(self, pod, self.nodes[node].index)
        # Containers already started: they ran under an agent that is gone.
        worker.lost = any(
            set(entry.get("state") or {}) & {"running", "terminated"}
            for entry in (pod.get("status") or {}).get("containerStatuses") or []
        )
        self.workers[uid] = worker
        worker.task = asyncio.ensure_future(worker.run())

    def forget(self, worker: PodLifecycle) -> None:
        if self.workers.get(worker.uid) is worker:
            del self.workers[worker.uid]
        self.write_status_file()

    async def watch_pods(self, listed: asyncio.Event) -> None:
        """List + watch every pod bound to a node (one watch for all of the agent's nodes)."""
        import aiohttp

        query = {"fieldSelector": "spec.nodeName!="}
        resource_version = ""
        while True:
            try:
                if not resource_version:
                    resource_version = await self._relist(query)
                    listed.set()
                resource_version = await self._watch_once(query, resource_version)
            except ApiError as error:
                log.warning("pod watch: %s; relisting", error)
                resource_version = ""
                await asyncio.sleep(1)
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as error:  # a broken stream
                log.warning("pod watch interrupted: %r; resuming", error)
                await asyncio.sleep(1)

    async def _relist(self, query: dict) -> str:
        """List the pods, reconcile the workers with them; return the list's resourceVersion."""
        listing = await self.api.call("GET", "/api/v1/pods", query=query)
        seen = set()
        for pod in listing.get("items") or []:
            seen.add(pod["metadata"]["uid"])
            self.on_pod("ADDED", pod)
        for uid, worker in list(self.workers.items()):
            if uid not in seen:  # deleted while the watch was down
                self.on_pod("DELETED", worker.pod)
        return listing["metadata"]["resourceVersion"]

    async def _watch_once(self, query: dict, resource_version: str) -> str:
        """One watch request; return the resourceVersion to resume from ("" to relist)."""
        params = {
            **query,
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.timeouts.watch),
        }
        response = await self.api.stream("/api/v1/pods", params)
        try:
            async for line in response.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                if event["type"] == "ERROR":
                    if obj.get("code") == 410:  # too old: relist
                        return ""
                    raise ApiError(obj.get("code", 0), "WATCH", "/api/v1/pods", obj.get("message", ""))
                resource_version = obj["metadata"]["resourceVersion"]
                if event["type"] != "BOOKMARK":
                    self.on_pod(event["type"], obj)
        finally:
            response.release()
        return resource_version

    # -- the status file the CLI reads --

    def write_status_file(self) -> None:
        if self.status_file is None:
            return
        from oobleck_dev.controlplane import process_start_time

        pods = {}
        for worker in self.workers.values():
            containers = {
                c.name: f"{c.process.pid} {process_start_time(c.process.pid)}"
                for c in (*worker.init, *worker.main)
                if c.process is not None and c.process.returncode is None
            }
            pods[f"{worker.namespace}/{worker.name}"] = {"uid": worker.uid, "ip": worker.ip, "containers": containers}
        agent = f"{os.getpid()} {process_start_time(os.getpid())}"
        record = {"agent": agent, "nodes": sorted(self.nodes), "pods": pods}
        tmp = self.status_file.with_name(self.status_file.name + ".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, self.status_file)

    # -- lifecycle --

    async def main(self, started: threading.Event, errors: list[BaseException]) -> None:
        tasks: list[asyncio.Task] = []
        try:
            if self.config.preforked:  # started on this thread: the zygote and its children die with it
                self.zygote = PodZygote(self.workdir / "zygote.log").start()
            self.api_client, self.api, self.server = await open_api(self.config.kubeconfig, self.timeouts.request)
            await self.register_nodes()
            tasks.append(asyncio.ensure_future(self.heartbeats()))
            await self.wait_nodes_ready()
            if self.zygote is not None:  # so that every pod of the module is forked, not only the later ones
                ready = await asyncio.get_running_loop().run_in_executor(
                    None, self.zygote.wait_ready, self.timeouts.start / 2
                )
                if not ready:
                    log.warning("pods are exec'd: the pod zygote is not ready (%s)", self.zygote.log)
            listed = asyncio.Event()
            tasks.append(asyncio.ensure_future(self.watch_pods(listed)))
            await asyncio.wait([asyncio.ensure_future(listed.wait()), tasks[-1]], return_when=asyncio.FIRST_COMPLETED)
            if tasks[-1].done():
                tasks[-1].result()  # raises what stopped the watch
            self.write_status_file()
            started.set()
            stop = asyncio.ensure_future(self.stop_event.wait())
            await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    log.error("node agent task failed: %r", task.exception())
        except BaseException as error:
            errors.append(error)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.shutdown()
            started.set()

    async def shutdown(self) -> None:
        """Stop every pod (node shutdown), then delete the nodes and their leases."""
        workers = list(self.workers.values())
        for worker in workers:
            worker.stop_for_node_shutdown()
        tasks = [w.task for w in workers if w.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=self.timeouts.stop_grace + self.timeouts.request)
        for worker in workers:  # whatever did not finish in time
            if worker.task is not None and not worker.task.done():
                worker.task.cancel()
            await worker.kill_processes(0)
        if self.zygote is not None:
            self.zygote.close()
        if self.api is not None:
            await self.deregister()
            await self.api_client.close()
        if self.status_file is not None:
            self.status_file.unlink(missing_ok=True)


def _at_exit(callback: Any) -> None:
    """Run `callback` at interpreter exit early enough for asyncio to work: threading's exit hooks
    run last-registered first, before concurrent.futures' own shuts executors down (aiohttp needs
    one); plain atexit hooks would run only after that."""
    register = getattr(threading, "_register_atexit", None)  # private, but what concurrent.futures uses
    (register or atexit.register)(callback)


# --- the public, thread-safe handle --------------------------------------------------------------


class NodeAgent:
    """Local Kubernetes nodes that run their pods as processes of this machine.

    `kubeconfig`: an admin kubeconfig of the cluster. `nodes` x `gpus_per_node` GPUs; `cpu`,
    `memory`, `max_pods`: the rest of each node's capacity. Nodes are named
    `<name_prefix><i>` and labelled `oobleck.dev/local-node=true` and
    `oobleck.dev/local-agent=<agent_id>` (select this agent's nodes with `node_selector`).
    `workdir`: pod folders and container logs (default: a temporary folder, removed at stop).
    `status_dir`: where to keep `agent.json` (pids per pod) for `oobleck dev kill-pod`.
    `extra_env`: added to every container's base environment. `gpu_devices`: physical GPU ids
    behind the nodes' GPUs (see `GpuSlots`); when given, each container gets CUDA_VISIBLE_DEVICES
    and NVIDIA_VISIBLE_DEVICES for the GPUs it was allocated (none: ""), as on a GPU node.
    `enforce_memory`: hold each container to its `limits.memory` as a kubelet does (a memory cgroup,
    oobleck_dev.memlimit; OOMKilled over it), where this machine allows; off, containers are unlimited.
    `preforked`: containers that run a runtime module (`python -m oobleck.runtime...`) are forked from one
    process that imported torch once (oobleck_dev.podzygote), not exec'd: seconds of CPU less per pod
    start, for tests whose pods' start time is not what they measure.

    `start()` returns once the nodes are Ready, schedulable, and the pod watch runs; `stop()`
    (also the context manager) ends every pod process and deletes the nodes. The agent runs on a
    thread of its own; its methods may be called from any thread.
    """

    def __init__(
        self,
        kubeconfig: str | os.PathLike[str],
        nodes: int = 4,
        gpus_per_node: int = 8,
        *,
        cpu: str = "16",
        memory: str = "64Gi",
        max_pods: int = 110,
        name_prefix: str = "oobleck-local-",
        workdir: str | os.PathLike[str] | None = None,
        status_dir: str | os.PathLike[str] | None = None,
        labels: dict[str, str] | None = None,
        extra_env: dict[str, str] | None = None,
        gpu_devices: list[str] | None = None,
        timeouts: AgentTimeouts = AgentTimeouts(),
        enforce_memory: bool = False,
        preforked: bool = False,
    ) -> None:
        if nodes < 1 or nodes > 254:
            raise ValueError(f"nodes: must be between 1 and 254, got {nodes}")
        if gpus_per_node < 0:
            raise ValueError(f"gpus_per_node: must be >= 0, got {gpus_per_node}")
        if max_pods < 1:
            raise ValueError(f"max_pods: must be >= 1, got {max_pods}")
        for field_name, value in (("cpu", cpu), ("memory", memory)):
            podenv.parse_quantity(value, field_name)
        self.kubeconfig = str(kubeconfig)
        self.gpus_per_node = gpus_per_node
        self.cpu, self.memory, self.max_pods = cpu, memory, max_pods
        self.node_names = [f"{name_prefix}{i}" for i in range(nodes)]
        # A letter first: a bare hex string such as 8e123456 reads as a number in YAML (kubectl rejects
        # a manifest whose nodeSelector value is not a string).
        self.agent_id = f"a{secrets.token_hex(4)}"
        self.labels = dict(labels or {})
        self.extra_env = dict(extra_env or {})
        self.gpu_devices = list(gpu_devices) if gpu_devices else None
        self.timeouts = timeouts
        self.enforce_memory = enforce_memory
        self.preforked = preforked
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="oobleck-nodeagent-"))
        self.status_file = Path(status_dir) / STATUS_FILE if status_dir is not None else None
        self.ips: IpBlock | None = None  # type: ignore[assignment]
        self.cgroups: netfault.PodCgroups | None = None
        self._cuts: netfault.NetworkCuts | None = None
        self._cut_pods: dict[tuple[str, str], Path] = {}
        self._cpu_quotas: dict[tuple[str, str], cpulimit.CpuQuota] = {}
        self._core: _AgentCore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def node_selector(self) -> dict[str, str]:
        """A nodeSelector that matches exactly this agent's nodes."""
        return {AGENT_LABEL: self.agent_id}

    def __enter__(self) -> NodeAgent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> NodeAgent:
        """Register the nodes and start serving their pods; raise NodeAgentError if that fails."""
        if self._thread is not None:
            raise NodeAgentError("already started")
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.status_file is not None:
            self.status_file.parent.mkdir(parents=True, exist_ok=True)
        self.ips = IpBlock()
        self.cgroups = netfault.PodCgroups(self.agent_id)
        if not self.cgroups.available:
            log.info("pods run without cgroups (no network faults): %s", self.cgroups.reason)
        started = threading.Event()
        errors: list[BaseException] = []
        self._loop = asyncio.new_event_loop()
        # Its own executor (aiohttp uses one for lookups), created now: the module registers its
        # interpreter-exit hook on import, so the agent's hook, registered below, runs before it.
        self._loop.set_default_executor(ThreadPoolExecutor(max_workers=4, thread_name_prefix="oobleck-nodeagent"))

        def run() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            self._core = _AgentCore(self)
            try:
                self._loop.run_until_complete(self._core.main(started, errors))
            finally:
                self._loop.close()

        # Pod processes die with this thread (PR_SET_PDEATHSIG). A daemon, so that a forgotten stop()
        # cannot hang the interpreter's exit; the exit hook stops it properly instead.
        self._thread = threading.Thread(target=run, name="oobleck-nodeagent", daemon=True)
        self._thread.start()
        _at_exit(self.stop)
        if not started.wait(self.timeouts.start) or errors:
            self.stop()
            if errors:
                raise NodeAgentError(f"node agent failed to start: {errors[0]}") from errors[0]
            raise NodeAgentError(f"node agent not ready after {self.timeouts.start:.0f} s (start)")
        return self

    def stop(self) -> None:
        """Stop every pod process, delete the nodes, end the thread. Idempotent."""
        if self._thread is None:
            return
        core, loop = self._core, self._loop
        if core is not None and loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(core.stop_event.set)
            except RuntimeError:  # the loop already ended
                pass
        self._thread.join()
        self._thread = None
        if self._cuts is not None:
            self._cuts.close()
            self._cuts = None
        for quota in self._cpu_quotas.values():
            quota.release()
        self._cpu_quotas.clear()
        if self.cgroups is not None:
            self.cgroups.close()
        if self.ips is not None:
            self.ips.close()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _call(self, method: str, *args: Any) -> Any:
        """Run a coroutine method of the core on the agent's loop and wait for its result."""
        if self._core is None or self._loop is None or self._thread is None:
            raise NodeAgentError("not started")
        future = asyncio.run_coroutine_threadsafe(getattr(self._core, method)(*args), self._loop)
        return future.result(self.timeouts.request * 2)

    # -- inspection --

    def _worker(self, namespace: str, pod: str) -> PodLifecycle:
        if self._core is None:
            raise NodeAgentError("not started")
        for worker in list(self._core.workers.values()):
            if worker.namespace == namespace and worker.name == pod:
                return worker
        raise LookupError(f"pod {namespace}/{pod} does not run on this agent's nodes {self.node_names}")

    def pod_pids(self, namespace: str, pod: str) -> dict[str, int]:
        """container -> pid of the pod's running containers."""
        worker = self._worker(namespace, pod)
        return {
            c.name: c.process.pid
            for c in (*worker.init, *worker.main)
            if c.process is not None and c.process.returncode is None
        }

    @property
    def zygote_pid(self) -> int | None:
        """The pid of the process that forks runtime containers (`preforked`), None without one."""
        zygote = self._core.zygote if self._core is not None else None
        return zygote.pid if zygote is not None else None

    def log_path(self, namespace: str, pod: str, container: str) -> Path:
        """The log file (stdout + stderr) of one container of a pod this agent runs or ran."""
        matches = sorted((self.workdir / "logs").glob(f"{namespace}_{pod}_*_{container}.log"), key=os.path.getmtime)
        if not matches:
            raise LookupError(f"no log of container {container!r} of pod {namespace}/{pod} in {self.workdir / 'logs'}")
        return matches[-1]

    def all_pids(self) -> list[int]:
        """Every running container process of every pod."""
        if self._core is None:
            return []
        return [
            c.process.pid
            for worker in list(self._core.workers.values())
            for c in (*worker.init, *worker.main)
            if c.process is not None and c.process.returncode is None
        ]

    # -- faults --

    def kill_pod_process(
        self, namespace: str, pod: str, signal: int = signals.SIGKILL, container: str | None = None
    ) -> list[int]:
        """Send `signal` to the process group of the pod's containers (or one of them); return the pids.

        The agent sees the exit and reports it (SIGKILL: exit code 137; restartPolicy Never -> Failed).
        """
        pids = self.pod_pids(namespace, pod)
        if container is not None:
            if container not in pids:
                raise LookupError(f"container: {container!r} is not running in pod {namespace}/{pod} ({sorted(pids)})")
            pids = {container: pids[container]}
        for pid in pids.values():
            try:
                os.killpg(pid, signal)
            except ProcessLookupError:
                pass
        return list(pids.values())

    def set_gpu_health(self, node: str, healthy_gpus: int) -> None:
        """Lower (or restore) the node's allocatable nvidia.com/gpu and set its GPUHealthy condition."""
        self._call("set_gpu_health", node, healthy_gpus)

    def set_node_ready(self, node: str, ready: bool) -> None:
        """Mark the node NotReady and stop its heartbeats (a node that went away), or back to Ready."""
        self._call("set_node_ready", node, ready)

    def network_faults_unavailable(self) -> str | None:
        """Why `cut_network` cannot work on this machine (tests skip with it), or None. Installs nft if
        it is missing and we are root (netfault.ensure_nft)."""
        if self.cgroups is None or not self.cgroups.available:
            return self.cgroups.reason if self.cgroups is not None else "not started"
        try:
            netfault.ensure_nft()
        except NetFaultUnavailable as error:
            return str(error)
        return None

    def cut_network(self, namespace: str, pod: str, mode: str = "peers") -> None:
        """Partition a running pod, its processes alive: "peers" drops all its traffic except with the
        API server, "api" only that (see netfault.py). `heal_network` ends it."""
        cgroup = self._worker(namespace, pod).cgroup
        if cgroup is None:
            raise NodeAgentError(f"pod {namespace}/{pod} runs without a cgroup: {self.network_faults_unavailable()}")
        if self._cuts is None:
            url = urlparse(self._core.server if self._core is not None else "")
            self._cuts = netfault.NetworkCuts(
                self.agent_id, (url.hostname or "127.0.0.1", url.port or 443), self.cgroups.mount
            )
        self._cuts.cut(cgroup, mode)
        self._cut_pods[(namespace, pod)] = cgroup

    def heal_network(self, namespace: str, pod: str) -> None:
        """Undo `cut_network` for the pod (also after the pod is gone)."""
        cgroup = self._cut_pods.pop((namespace, pod), None)
        if cgroup is not None and self._cuts is not None:
            self._cuts.heal(cgroup)

    def throttle_cpu(self, namespace: str, pod: str, cpus: float | None) -> list[int]:
        """Hold a running pod's processes to `cpus` CPUs together by a CFS quota (a node turned slow, see
        cpulimit.py); None lifts the quota. Returns the pids held. `cpulimit.available()` says whether
        this machine can (tests skip with it)."""
        key = (namespace, pod)
        quota = self._cpu_quotas.get(key)
        if quota is None:
            quota = cpulimit.CpuQuota.create(f"{self.agent_id}-{namespace}-{pod}")
            if quota is None:
                raise NodeAgentError(f"pod {namespace}/{pod}: no CPU quota here: {cpulimit.available()}")
            self._cpu_quotas[key] = quota
        return quota.throttle(list(self.pod_pids(namespace, pod).values()), cpus)

    def pod_cpu_seconds(self, namespace: str, pod: str) -> float:
        """CPU time the pod's running processes have used so far (to throttle it relative to its own pace)."""
        return cpulimit.cpu_seconds(list(self.pod_pids(namespace, pod).values()))

    def cpu_throttled_seconds(self, namespace: str, pod: str) -> float:
        """How long the kernel has held the pod back under `throttle_cpu` (0 if never throttled)."""
        quota = self._cpu_quotas.get((namespace, pod))
        return quota.throttled_seconds() if quota is not None else 0.0


def kill_from_status_file(status_dir: Path, namespace: str, pod: str, signum: int = signals.SIGKILL) -> list[int]:
    """`kill_pod_process` for an agent running in another process, through its `agent.json`."""
    from oobleck_dev.controlplane import process_start_time

    try:
        record = json.loads((status_dir / STATUS_FILE).read_text())
    except FileNotFoundError:
        raise NodeAgentError(f"no node agent runs for {status_dir} (no {STATUS_FILE})") from None
    entry = record["pods"].get(f"{namespace}/{pod}")
    if entry is None or not entry["containers"]:
        raise LookupError(f"pod {namespace}/{pod} has no running process on the agent's nodes {record['nodes']}")
    killed = []
    for stamp in entry["containers"].values():
        pid, started = stamp.split()
        if process_start_time(int(pid)) == started:  # not a reused pid
            os.killpg(int(pid), signum)
            killed.append(int(pid))
    return killed
