"""kube-router's firewall on a real node: the network plugin that enforces NetworkPolicy there.

The real nodes' bridge CNI connects pods and enforces no NetworkPolicy. kube-router (built from its Go
module by scripts/kube-router/build) runs beside it with its firewall alone (`--run-firewall`, no
router, no service proxy): it watches pods, namespaces and NetworkPolicies and writes iptables chains
and ipsets that admit or reject the traffic to its node's pods (routed between nodes' bridges, and
bridged within one, through br_netfilter).

One enforcing node per host: the real nodes of a host share its network namespace, so its iptables; a
kube-router fences only the pods of its own node (pod hostIP = its node's InternalIP) and, at every
sync, deletes the pod and policy chains it did not write itself, so a second one would undo the first.
Pods that must be fenced run on the enforcing node; the others reach them as any other node's would.

Pure renderings here; `realnodes.RealNodes.enforce_network_policy` starts the process, and `down` (or
a later `reap_stale`) removes its chains (`KUBE-*`, as the kubelet's) and its ipsets (`remove_ipsets`).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from oobleck_dev.tools import repo_root

BUILD_SCRIPT = Path("scripts") / "kube-router" / "build"
USER = "system:kube-router"
"""The client certificate's common name: the user the RBAC below binds."""
IPSET_PREFIXES = ("KUBE-SRC-", "KUBE-DST-")
"""Every ipset its firewall creates starts with one of these (its pod selectors' address sets)."""


class KubeRouterError(RuntimeError):
    """kube-router could not be built or started; the message says which step and shows its output."""


def binary(build: bool = True) -> Path:
    """The kube-router binary of scripts/kube-router/build (built, and ipset installed, if missing)."""
    root = repo_root()
    if root is None or not (root / BUILD_SCRIPT).is_file():
        raise KubeRouterError(f"{BUILD_SCRIPT} not found: kube-router is built from a source checkout")
    args = [str(root / BUILD_SCRIPT)] + ([] if build else ["--print"])
    result = subprocess.run(args, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise KubeRouterError(f"{BUILD_SCRIPT} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return Path(result.stdout.strip().splitlines()[-1]) / "kube-router"


def rbac() -> list[dict[str, Any]]:
    """What kube-router reads (its informers start for every kind below, firewall or not) and writes
    (events), bound to USER."""
    read = ["get", "list", "watch"]
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "oobleck-dev:kube-router"},
        "rules": [
            {"apiGroups": [""], "resources": ["pods", "namespaces", "nodes", "services", "endpoints"], "verbs": read},
            {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": read},
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": read},
            {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch", "update"]},
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "oobleck-dev:kube-router"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "oobleck-dev:kube-router"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}],
    }
    return [role, binding]


def args(kubeconfig: Path, node_name: str, service_cidr: str, health_port: int) -> list[str]:
    """Command-line arguments: the firewall of node `node_name` only, IPv4, its health check on
    `health_port` (`/healthz`), no metrics; a full resync every 30 s besides the event-driven ones."""
    return [
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={node_name}",
        "--run-firewall=true",
        "--run-router=false",
        "--run-service-proxy=false",
        "--enable-cni=false",
        "--enable-ipv4=true",
        "--enable-ipv6=false",
        f"--service-cluster-ip-range={service_cidr}",
        f"--health-port={health_port}",
        "--metrics-port=0",
        "--iptables-sync-period=30s",
    ]
