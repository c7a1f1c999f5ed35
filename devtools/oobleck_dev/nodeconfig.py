"""What one real node (containerd + kubelet) is told: pure renderings of its configuration files.

`realnodes.py` writes them and starts the processes; nothing here touches the host. The settings are
those that work on a 2-core Debian microVM with hybrid cgroups and no CAP_SYS_RESOURCE (checked facts:
/work/shared/notes/real-nodes.md): cgroupfs driver, `failCgroupV1: false`, containerd's
`restrict_oom_score_adj`, one containerd per node (a kubelet kills runtime pods it does not own).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POD_NETWORK = "10.244.0.0/16"
"""Every node's pod subnet is a /24 in it: node i (from 1) has 10.244.i.0/24 on bridge `oobk<i>`."""
KUBELET_PORT = 10250
KUBELET_HEALTHZ_PORT = 10248
REAL_NODE_LABEL = "oobleck.dev/real-node"
"""Label every real node carries (value "true"): jobs pin themselves to real nodes with it."""
MAX_NODES = 8


@dataclass(frozen=True)
class NodeLayout:
    """Names, addresses and folders of real node `index` (1-based) under `folder`."""

    index: int
    folder: Path

    def __post_init__(self) -> None:
        if not 1 <= self.index <= MAX_NODES:
            raise ValueError(f"index: a real node's index is 1..{MAX_NODES}, got {self.index}")

    @property
    def name(self) -> str:
        return f"oobleck-real-{self.index}"

    @property
    def bridge(self) -> str:
        return f"oobk{self.index}"

    @property
    def subnet(self) -> str:
        return f"10.244.{self.index}.0/24"

    @property
    def gateway(self) -> str:
        """The bridge's address on the host: the node's InternalIP, where its kubelet serves."""
        return f"10.244.{self.index}.1"

    @property
    def cgroup_root(self) -> str:
        return f"/{self.name}"

    @property
    def containerd_root(self) -> Path:
        return self.folder / "containerd"

    @property
    def containerd_state(self) -> Path:
        return self.folder / "containerd-state"

    @property
    def socket(self) -> Path:
        return self.folder / "containerd.sock"

    @property
    def runc_root(self) -> Path:
        return self.folder / "runc"

    @property
    def cni_dir(self) -> Path:
        return self.folder / "cni"

    @property
    def kubelet_root(self) -> Path:
        return self.folder / "kubelet"

    @property
    def pod_logs(self) -> Path:
        return self.folder / "pod-logs"


def containerd_config(
    node: NodeLayout, pause_image: str, cni_bin_dir: str = "/usr/lib/cni", root: Path | None = None
) -> str:
    """containerd 1.6's config (version 2) for one node: its own root (`root` instead of the node's: the image
    store's), state, socket and runc root."""
    cri = '[plugins."io.containerd.grpc.v1.cri"]'
    return f"""version = 2
root = "{root or node.containerd_root}"
state = "{node.containerd_state}"
disabled_plugins = ["io.containerd.internal.v1.tracing", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs"]

[grpc]
  address = "{node.socket}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{node.folder / "opt"}"

{cri}
  sandbox_image = "{pause_image}"
  # The VM lacks CAP_SYS_RESOURCE: runc may only raise oom_score_adj, never lower it.
  restrict_oom_score_adj = true
  # Network namespaces under this node's state folder, not the host's /var/run/netns.
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false

{cri[:-1]}.cni]
  bin_dir = "{cni_bin_dir}"
  conf_dir = "{node.cni_dir}"
  max_conf_num = 1

{cri[:-1]}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

{cri[:-1]}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

{cri[:-1]}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "{node.runc_root}"
"""


def cni_conflist(node: NodeLayout) -> str:
    """A bridge network on the node's /24. No masquerade: pods only talk to each other and to this host
    (the API server), which routes between the nodes' bridges itself."""
    document = {
        "cniVersion": "0.4.0",
        "name": f"oobleck-{node.name}",
        "plugins": [
            {
                "type": "bridge",
                "bridge": node.bridge,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": node.subnet, "gateway": node.gateway}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(node.folder / "ipam"),
                },
            },
            {"type": "loopback"},
        ],
    }
    return json.dumps(document, indent=2)


def kubelet_config(node: NodeLayout, client_ca: Path, serving_cert: Path, serving_key: Path) -> dict[str, Any]:
    """The KubeletConfiguration: webhook authn/authz (the API server's client cert is verified against
    `client_ca`), served on the node's bridge address, every folder under the node's own."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": node.gateway,
        "port": KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzBindAddress": node.gateway,
        "healthzPort": KUBELET_HEALTHZ_PORT,
        "tlsCertFile": str(serving_cert),
        "tlsPrivateKeyFile": str(serving_key),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(client_ca)},
        },
        "authorization": {"mode": "Webhook"},
        # This hybrid cgroup layout counts as v1, which the kubelet refuses unless told otherwise.
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        "cgroupRoot": node.cgroup_root,
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{node.socket}",
        "imageServiceEndpoint": f"unix://{node.socket}",
        "podCIDR": node.subnet,
        "podLogsDir": str(node.pod_logs),
        "volumePluginDir": str(node.folder / "volume-plugins"),
        "resolvConf": "/etc/resolv.conf",
        "serializeImagePulls": False,
        # The host's disk is shared: never evict or delete images for it (the image is imported, not pulled).
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "shutdownGracePeriod": "0s",
        "registerNode": True,
        "nodeStatusUpdateFrequency": "2s",
    }


def kubelet_args(node: NodeLayout, config: Path, kubeconfig: Path) -> list[str]:
    return [
        f"--config={config}",
        f"--kubeconfig={kubeconfig}",
        f"--root-dir={node.kubelet_root}",
        f"--cert-dir={node.kubelet_root / 'pki'}",
        f"--hostname-override={node.name}",
        f"--node-ip={node.gateway}",
        f"--node-labels={REAL_NODE_LABEL}=true",
        "--v=1",
    ]


def kube_proxy_args(kubeconfig: Path, hostname: str, healthz_port: int, metrics_port: int) -> list[str]:
    """kube-proxy in iptables mode for every node of this host (the nodes share the host's network)."""
    return [
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={hostname}",
        "--proxy-mode=iptables",
        # The VM may not write nf_conntrack_max: leave it as it is.
        "--conntrack-max-per-core=0",
        f"--cluster-cidr={POD_NETWORK}",
        f"--healthz-bind-address=127.0.0.1:{healthz_port}",
        f"--metrics-bind-address=127.0.0.1:{metrics_port}",
        "--v=1",
    ]
