"""Fake GPU nodes with kwok: a controller that keeps them Ready and runs their pods on paper.

The kwok controller manages only nodes labelled `FAKE_NODE_LABEL=FAKE_NODE_VALUE`, so other
nodes (a future local node agent's) are left alone. It runs kwok's own stages: `node/fast`
(Ready at once), `node/heartbeat-with-lease` (cheap heartbeats through Leases, which matters with
a thousand nodes) and `pod/fast` (a pod bound to a fake node is Running at once; a Job's pod
completes; a deleted pod goes away).

`add_fake_nodes` registers N nodes with `nvidia.com/gpu` capacity through concurrent API calls.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from oobleck_dev.controlplane import ManagedProcess
    from oobleck_dev.tools import K8sTools

FAKE_NODE_LABEL = "kwok.x-k8s.io/node"
FAKE_NODE_VALUE = "fake"
OWNER_LABEL = "oobleck.dev/owner"
FAKE_GROUP_LABEL = "oobleck.dev/fake-node-group"
GPU_RESOURCE = "nvidia.com/gpu"
STAGE_FOLDERS = ("node/fast", "node/heartbeat-with-lease", "pod/fast")
# kwok renews each node's Lease this often (seconds/4); status heartbeats then come every ~10 min.
NODE_LEASE_SECONDS = 40
# Pod IPs come from here; the default /24 runs out after 254 pods.
POD_CIDR = "10.128.0.0/10"
CREATE_CONCURRENCY = 32
# One create or delete call (seconds).
REQUEST_TIMEOUT_S = 60.0

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def stage_files(stages: Path) -> list[Path]:
    """The stage YAMLs kwok is started with (see STAGE_FOLDERS)."""
    files: list[Path] = []
    for folder in STAGE_FOLDERS:
        found = sorted(p for p in (stages / folder).glob("*.yaml") if p.name != "kustomization.yaml")
        if not found:
            raise FileNotFoundError(f"no kwok stage YAMLs in {stages / folder}")
        files.extend(found)
    return files


def kwok_args(tools: K8sTools, kubeconfig: Path) -> list[str]:
    """The kwok controller's command line."""
    binary, stages = tools.require_kwok()
    return [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        f"--manage-nodes-with-label-selector={FAKE_NODE_LABEL}={FAKE_NODE_VALUE}",
        f"--node-lease-duration-seconds={NODE_LEASE_SECONDS}",
        f"--cidr={POD_CIDR}",
        "--node-ip=127.0.0.1",
        # Explicit configs also keep kwok from reading ~/.kwok/kwok.yaml.
        *(f"--config={path}" for path in stage_files(stages)),
    ]


def start_kwok(tools: K8sTools, kubeconfig: Path, log_dir: Path) -> ManagedProcess:
    """Start the kwok controller as a child that dies with its parent; log to `log_dir/kwok.log`."""
    from oobleck_dev.controlplane import ManagedProcess  # controlplane imports this module

    return ManagedProcess("kwok", kwok_args(tools, kubeconfig), log_dir / "kwok.log")


NOT_READY_TAINT = {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}
NOT_READY_CONDITION = {"type": "Ready", "status": "False", "reason": "KubeletNotReady", "message": "registering"}


def fake_node(
    name: str,
    *,
    gpus: int,
    cpu: str = "96",
    memory: str = "1Ti",
    pods: int = 110,
    labels: dict[str, str] | None = None,
    taints: Sequence[dict[str, str]] = (),
    not_ready: bool = False,
) -> dict:
    """The Node object of one fake GPU node (capacity = allocatable). `not_ready`: registered as a kubelet
    registers, Ready False and tainted not-ready (NoSchedule) until kwok's node-initialize stage reports it
    Ready and the node lifecycle controller lifts the taint. Without a Ready condition that controller lifts
    the taint at once (no condition asks for it), and a pod bound before kwok's first status reads lost."""
    if gpus < 0:
        raise ValueError(f"gpus: must be >= 0, got {gpus}")
    if pods < 1:
        raise ValueError(f"pods: must be >= 1, got {pods}")
    resources = {"cpu": cpu, "memory": memory, "pods": str(pods), GPU_RESOURCE: str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                **(labels or {}),
                FAKE_NODE_LABEL: FAKE_NODE_VALUE,
                "type": "kwok",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
            },
            # kwok's convention: no TTL-based caching of this node by kubelets.
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"taints": [*taints, *([NOT_READY_TAINT] if not_ready else [])]},
        "status": {
            "capacity": resources,
            "allocatable": dict(resources),
            **({"conditions": [NOT_READY_CONDITION]} if not_ready else {}),
        },
    }


def add_fake_nodes(
    kubeconfig: str | Path,
    n: int,
    *,
    gpus: int = 8,
    owner: str = "dev",
    group: str | None = None,
    cpu: str = "96",
    memory: str = "1Ti",
    pods: int = 110,
    labels: dict[str, str] | None = None,
    taints: Sequence[dict[str, str]] = (),
    not_ready: bool = False,
    concurrency: int = CREATE_CONCURRENCY,
) -> list[str]:
    """Create `n` fake GPU nodes named `kwok-<owner>-<group>-<i>`; return their names.

    Already existing nodes of the same name count as created (so a retry is harmless).
    """
    if n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
    if concurrency < 1:
        raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
    group = group or secrets.token_hex(3)
    for field_name, value in (("owner", owner), ("group", group)):
        if not _DNS_LABEL.match(value) or len(value) > 30:
            raise ValueError(f"{field_name}: must be a lowercase DNS label of at most 30 characters, got {value!r}")
    node_labels = {**(labels or {}), OWNER_LABEL: owner, FAKE_GROUP_LABEL: group}
    bodies = [
        fake_node(
            f"kwok-{owner}-{group}-{i}",
            gpus=gpus,
            cpu=cpu,
            memory=memory,
            pods=pods,
            labels=node_labels,
            taints=taints,
            not_ready=not_ready,
        )
        for i in range(n)
    ]
    asyncio.run(_fan_out(kubeconfig, "create", bodies, concurrency))
    return [body["metadata"]["name"] for body in bodies]


def delete_nodes(kubeconfig: str | Path, names: Sequence[str], concurrency: int = CREATE_CONCURRENCY) -> None:
    """Delete nodes by name; missing ones are fine."""
    asyncio.run(_fan_out(kubeconfig, "delete", list(names), concurrency))


async def _fan_out(kubeconfig: str | Path, verb: str, items: list, concurrency: int) -> None:
    # Imported here: kubernetes_asyncio takes ~0.5 s to import and only this needs it.
    from kubernetes_asyncio import client, config
    from kubernetes_asyncio.client.exceptions import ApiException

    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    configuration.connection_pool_maxsize = concurrency
    limit = asyncio.Semaphore(concurrency)
    async with client.ApiClient(configuration) as api:
        core = client.CoreV1Api(api)

        async def one(item: dict | str) -> None:
            async with limit:
                try:
                    if verb == "create":
                        await core.create_node(item, _request_timeout=REQUEST_TIMEOUT_S)
                    else:
                        await core.delete_node(item, _request_timeout=REQUEST_TIMEOUT_S)
                except ApiException as error:
                    benign = 409 if verb == "create" else 404  # already there / already gone
                    if error.status != benign:
                        name = item if isinstance(item, str) else item["metadata"]["name"]
                        raise RuntimeError(
                            f"{verb} node {name}: HTTP {error.status} {error.reason}: {error.body}"
                        ) from None

        await asyncio.gather(*(one(item) for item in items))
