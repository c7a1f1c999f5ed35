"""Real Kubernetes nodes on this host: per node a containerd and a kubelet, plus one kube-proxy.

`RealNodes(control_plane, n, image).up()` starts n nodes (`oobleck-real-1`..n, label
`oobleck.dev/real-node=true`) against a `ControlPlane` started with `advertise_address` (so pods reach
the API server through the `kubernetes` Service), with the project image and a pause image built from
source in each node's containerd, and waits until they are Ready. Pods run in containers (runc), in
their own network namespace on a CNI bridge per node; the in-cluster configuration, projected tokens,
`kubectl logs` and `exec` work as on any cluster. The bridge CNI enforces no NetworkPolicy:
`enforce_network_policy(node)` runs kube-router's firewall for one node (kuberouter.py says why one).
`down()` ends every process it started, kills the nodes' containers, unmounts, removes cgroups,
bridges, iptables chains, ipsets and the nodes' folders, and restores the sysctls the kubelet changed.

Host requirements: root, cgroups at /sys/fs/cgroup, the binaries of scripts/k8s-node/build (which also
installs containerd, runc and the CNI plugins from Debian packages). One set of real nodes per host at a
time (they share the host's iptables and addresses): a second `up()` waits for the first's `down()`.
Settings, and why: nodeconfig.py; the one-import image store shared by the nodes: imagestore.py.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from oobleck_dev import hoststate, kuberouter
from oobleck_dev.controlplane import (
    SERVICE_CIDR,
    ControlPlane,
    ManagedProcess,
    _owner_stamp,
    free_port,
    kubeconfig_yaml,
    process_start_time,
    stop_processes,
)
from oobleck_dev.imagestore import TemplateStore
from oobleck_dev.nodeconfig import (
    MAX_NODES,
    REAL_NODE_LABEL,
    NodeLayout,
    cni_conflist,
    containerd_config,
    kube_proxy_args,
    kubelet_args,
    kubelet_config,
)
from oobleck_dev.tools import cache_root, repo_root

STATE_ROOT = Path("/var/lib/oobleck-realnodes")
"""Node folders (containerd roots, kubelet roots): on the same filesystem as the image cache, so that
a node's containerd root can hard-link the template store's files."""
HOST_LOCK = Path("/run/oobleck-realnodes.lock")
BUILD_SCRIPT = Path("scripts") / "k8s-node" / "build"
IMAGE_SCRIPT = Path("scripts") / "image" / "build"
NODE_SELECTOR = {REAL_NODE_LABEL: "true"}
FREEZER = Path("/sys/fs/cgroup/freezer")
DEVICE_PLUGIN_SOCKET = Path("/var/lib/kubelet/device-plugins/kubelet.sock")
"""Every kubelet binds this fixed path, not one under its --root-dir, right after removing whatever its folder
holds: started together, one kubelet removed another's socket between that one's clean-up and its bind, and
the other exited "bind: address already in use". So each kubelet starts once the one before has bound it."""


class RealNodesError(RuntimeError):
    """Real nodes could not start; the message names the step and shows the relevant log."""


@dataclass(frozen=True)
class NodeBinaries:
    kubelet: Path
    kube_proxy: Path
    pause: Path


def host_problem() -> str | None:
    """Why this host cannot run real nodes, or None."""
    if os.geteuid() != 0:
        return "real nodes need root (containerd, runc, kubelet, iptables, mounts)"
    if not Path("/sys/fs/cgroup").is_dir():
        return "real nodes need cgroups mounted at /sys/fs/cgroup"
    if shutil.which("iptables") is None and shutil.which("apt-get") is None:
        return "real nodes need iptables (or apt-get to install it)"
    return None


def _script(relative: Path) -> Path:
    root = repo_root()
    if root is None or not (root / relative).is_file():
        raise RealNodesError(f"{relative} not found: real nodes run from a source checkout")
    return root / relative


def node_binaries(build: bool = True) -> NodeBinaries:
    """kubelet, kube-proxy and pause from scripts/k8s-node/build (built and packages installed if missing)."""
    args = [str(_script(BUILD_SCRIPT))] + ([] if build else ["--print"])
    result = subprocess.run(args, capture_output=True, text=True, timeout=3 * 3600)
    if result.returncode != 0:
        raise RealNodesError(f"{BUILD_SCRIPT} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    bin_dir = Path(result.stdout.strip().splitlines()[-1])
    return NodeBinaries(bin_dir / "kubelet", bin_dir / "kube-proxy", bin_dir / "pause")


def project_image() -> str:
    """The project image's name (`make image`: built or found in its cache)."""
    script = _script(IMAGE_SCRIPT)
    result = subprocess.run([str(script)], capture_output=True, text=True, timeout=3 * 3600, cwd=script.parents[2])
    if result.returncode != 0:
        raise RealNodesError(f"{IMAGE_SCRIPT} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return result.stdout.strip().splitlines()[-1]


def host_address() -> str:
    """A non-loopback IPv4 address of this host (the default route's source): the API server's advertised one."""
    out = subprocess.run(["ip", "-4", "-o", "route", "get", "192.0.2.255"], capture_output=True, text=True).stdout
    words = out.split()
    if "src" in words:
        return words[words.index("src") + 1]
    for line in subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout.splitlines():
        address = line.split()[3].split("/")[0]
        if not address.startswith("127."):
            return address
    raise RealNodesError("no non-loopback IPv4 address on this host for the API server to advertise")


@dataclass(frozen=True)
class Timeouts:
    host_lock: float = 1800.0
    """another set of real nodes on this host to go down (a test run beside ours)"""
    containerd_ready: float = 60.0
    nodes_ready: float = 180.0
    network_policy_ready: float = 120.0
    """kube-router's caches synced and its health check answering"""
    import_image: float = 1800.0
    stop_grace: float = 15.0


@dataclass
class RealNodes:
    """n real nodes of `control_plane` running `image` (default: `make image`'s)."""

    control_plane: ControlPlane
    n: int = 2
    image: str | None = None
    timeouts: Timeouts = Timeouts()
    nodes: list[NodeLayout] = field(default_factory=list)
    processes: list[ManagedProcess] = field(default_factory=list)
    folder: Path | None = None
    figures: dict[str, float] = field(default_factory=dict)
    """seconds of each start phase (binaries, image, import, clone, nodes_ready, up) and disk figures"""
    _lock_fd: int | None = None
    _record: hoststate.HostRecord | None = None

    @property
    def names(self) -> list[str]:
        return [node.name for node in self.nodes]

    node_selector = NODE_SELECTOR

    def __enter__(self) -> RealNodes:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- up --

    def up(self) -> RealNodes:
        if not 1 <= self.n <= MAX_NODES:
            raise ValueError(f"n: between 1 and {MAX_NODES} real nodes, got {self.n}")
        problem = host_problem()
        if problem:
            raise RealNodesError(problem)
        if self.control_plane.ca is None or not self.control_plane.advertise_address:
            raise RealNodesError(
                "control_plane: start it with advertise_address=realnodes.host_address() (pods reach the API server "
                "through the `kubernetes` Service only at a non-loopback address)"
            )
        began = time.monotonic()
        mark = began
        binaries = node_binaries()
        mark = self._phase("binaries", mark)
        image = self.image or project_image()
        self.image = image
        mark = self._phase("image", mark)
        self._take_host_lock()
        atexit.register(self.down)
        try:
            reap_stale()
            mark = self._phase("host_lock", mark)
            pause_image = f"localhost/oobleck-pause:{binaries.pause.parent.parent.name}"
            store = TemplateStore(
                cache_root() / "k8s-node" / "store",
                pause_image,
                binaries.pause,
                [str(_script(IMAGE_SCRIPT).parent / "buildah")],
            )
            store.ensure(image, self.timeouts.import_image)
            self.figures["import_gb"] = round(store.imported_bytes / 1e9, 3)
            mark = self._phase("import", mark)
            self._start(binaries, store, pause_image)
            self._phase("nodes", mark)
        except BaseException:
            self.down()
            raise
        self.figures["up"] = round(time.monotonic() - began, 1)
        return self

    def _phase(self, name: str, since: float) -> float:
        now = time.monotonic()
        self.figures[name] = round(now - since, 1)
        return now

    def _take_host_lock(self) -> None:
        self._lock_fd = host_lock(self.timeouts.host_lock)

    def _start(self, binaries: NodeBinaries, store: TemplateStore, pause_image: str) -> None:
        cp = self.control_plane
        assert cp.ca is not None and cp.ca_cert is not None
        STATE_ROOT.mkdir(parents=True, exist_ok=True)
        self.folder = STATE_ROOT / f"{os.getpid()}-{time.monotonic_ns() % 10**9}"
        self.folder.mkdir()
        (self.folder / "owner").write_text(_owner_stamp())
        (self.folder / "logs").mkdir()
        self.nodes = [NodeLayout(i, self.folder / f"node-{i}") for i in range(1, self.n + 1)]
        # Record the host first: whatever happens next, down() (or a later reap_stale) undoes it.
        self._record = hoststate.HostRecord(
            sysctls=hoststate.read_sysctls(),
            bridges=[node.bridge for node in self.nodes],
            cgroups=[node.cgroup_root for node in self.nodes],
            folders=[str(self.folder)],
            sockets=[str(node.socket) for node in self.nodes],
            created=hoststate.absent_fixed_paths(),
        )
        self._record.save(self.folder / "host.json")

        pki = self.folder / "pki"
        pki.mkdir()
        began = time.monotonic()
        for node in self.nodes:
            node.folder.mkdir()
            store.clone(node.containerd_root)
        self.figures["clone"] = round(time.monotonic() - began, 1)

        for node in self.nodes:
            self._network(node)
            hoststate.make_cgroup_root(node.cgroup_root)
            config = node.folder / "containerd.toml"
            config.write_text(containerd_config(node, pause_image))
            self.processes.append(
                ManagedProcess(
                    f"containerd-{node.index}",
                    ["containerd", "--config", str(config)],
                    self.folder / "logs" / f"containerd-{node.index}.log",
                )
            )
        for node, containerd in zip(self.nodes, self.processes, strict=True):
            self._wait(
                lambda node=node: node.socket.exists(),
                f"{containerd.name} to open {node.socket}",
                self.timeouts.containerd_ready,
                [containerd],
            )

        for node in self.nodes:
            credentials = cp.ca.issue(
                f"kubelet-{node.index}", f"system:node:{node.name}", organizations=("system:nodes",), client=True
            )
            serving = cp.ca.issue(
                f"kubelet-serving-{node.index}", node.name, server=True, hosts=(node.gateway, node.name)
            )
            kubeconfig = node.folder / "kubelet.kubeconfig"
            kubeconfig.write_text(kubeconfig_yaml(cp.server, cp.ca_cert, credentials, node.name, embed=False))
            config = node.folder / "kubelet.yaml"
            config.write_text(yaml.safe_dump(kubelet_config(node, cp.ca_cert, serving.cert, serving.key)))
            launched = time.time_ns()
            kubelet = ManagedProcess(
                f"kubelet-{node.index}",
                [binaries.kubelet, *kubelet_args(node, config, kubeconfig)],
                self.folder / "logs" / f"kubelet-{node.index}.log",
            )
            self.processes.append(kubelet)
            self._wait(
                lambda launched=launched: _created_since(DEVICE_PLUGIN_SOCKET, launched),
                f"{kubelet.name} to bind {DEVICE_PLUGIN_SOCKET}",
                self.timeouts.nodes_ready,
                self.processes,
            )
        proxy_credentials = cp.ca.issue("kube-proxy", "system:kube-proxy", client=True)
        proxy_kubeconfig = self.folder / "kube-proxy.kubeconfig"
        proxy_kubeconfig.write_text(
            kubeconfig_yaml(cp.server, cp.ca_cert, proxy_credentials, "kube-proxy", embed=False)
        )
        self.processes.append(
            ManagedProcess(
                "kube-proxy",
                [binaries.kube_proxy, *kube_proxy_args(proxy_kubeconfig, self.nodes[0].name, free_port(), free_port())],
                self.folder / "logs" / "kube-proxy.log",
            )
        )
        self._kube_proxy = binaries.kube_proxy
        began = time.monotonic()
        self._wait(
            self._all_ready, f"nodes {', '.join(self.names)} to be Ready", self.timeouts.nodes_ready, self.processes
        )
        self.figures["nodes_ready"] = round(time.monotonic() - began, 1)

    def _network(self, node: NodeLayout) -> None:
        """The node's bridge with its gateway address, before the kubelet starts: the node's InternalIP exists
        at once (the CNI bridge plugin finds the bridge and reuses it)."""
        node.cni_dir.mkdir()
        (node.cni_dir / "10-oobleck.conflist").write_text(cni_conflist(node))
        for args in (
            ["ip", "link", "add", node.bridge, "type", "bridge"],
            ["ip", "addr", "add", f"{node.gateway}/24", "dev", node.bridge],
            ["ip", "link", "set", node.bridge, "up"],
        ):
            result = subprocess.run(args, capture_output=True, text=True)
            if result.returncode != 0:
                raise RealNodesError(f"{' '.join(args)}: {result.stderr.strip()}")

    def _all_ready(self) -> bool:
        result = self.control_plane.kubectl("get", "nodes", "-l", f"{REAL_NODE_LABEL}=true", "-o", "json", check=False)
        if result.returncode != 0:
            return False
        ready = {
            item["metadata"]["name"]
            for item in json.loads(result.stdout)["items"]
            if any(c["type"] == "Ready" and c["status"] == "True" for c in item.get("status", {}).get("conditions", []))
        }
        return set(self.names) <= ready

    def _wait(self, check, what: str, timeout: float, watch: Sequence[ManagedProcess]) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not check():
            for process in watch:
                if not process.alive():
                    raise RealNodesError(
                        f"{process.name} exited ({process.popen.returncode}) while waiting for {what}:\n{process.log_tail()}"
                    )
            if time.monotonic() > deadline:
                tails = "".join(f"\n--- {p.name} ({p.log}) ---\n{p.log_tail(1500)}" for p in watch)
                raise RealNodesError(f"timed out after {timeout:.0f} s waiting for {what}{tails}")
            time.sleep(0.25)

    # -- network policy --

    def enforce_network_policy(self, node_name: str) -> ManagedProcess:
        """Run kube-router's firewall for `node_name` (kuberouter.py: one enforcing node per host), so that
        the NetworkPolicies of the cluster hold for the pods on that node; returns once its health check
        answers. `down` stops it and removes its chains and ipsets."""
        cp = self.control_plane
        node = self._node(node_name)
        if any(p.name == "kube-router" and p.alive() for p in self.processes):
            raise RealNodesError("kube-router already runs on this host (one enforcing node per host)")
        assert cp.ca is not None and cp.ca_cert is not None and self.folder is not None
        binary = kuberouter.binary()
        cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(kuberouter.rbac()))
        credentials = cp.ca.issue("kube-router", kuberouter.USER, client=True)
        kubeconfig = self.folder / "kube-router.kubeconfig"
        kubeconfig.write_text(kubeconfig_yaml(cp.server, cp.ca_cert, credentials, "kube-router", embed=False))
        health_port = free_port()
        process = ManagedProcess(
            "kube-router",
            [binary, *kuberouter.args(kubeconfig, node.name, SERVICE_CIDR, health_port)],
            self.folder / "logs" / "kube-router.log",
        )
        self.processes.append(process)
        self._wait(
            lambda: _answers(f"http://127.0.0.1:{health_port}/healthz"),
            f"kube-router for {node.name} to answer its health check",
            self.timeouts.network_policy_ready,
            [process],
        )
        return process

    # -- faults --

    def process(self, name: str) -> ManagedProcess:
        for process in self.processes:
            if process.name == name:
                return process
        raise KeyError(f"no process {name!r}; running: {', '.join(p.name for p in self.processes)}")

    def stop_kubelet(self, node_name: str) -> None:
        """Stop a node's kubelet (its containers keep running, as on a node that lost its kubelet or its
        network): the node stops renewing its lease and the node lifecycle controller marks it unreachable."""
        stop_processes([self.process(f"kubelet-{self._node(node_name).index}")], self.timeouts.stop_grace)

    def start_kubelet(self, node_name: str) -> None:
        """Start a stopped kubelet again with its original arguments and wait until its node is Ready."""
        old = self.process(f"kubelet-{self._node(node_name).index}")
        if old.alive():
            raise RealNodesError(f"{old.name} is running (pid {old.pid}): stop_kubelet first")
        process = ManagedProcess(old.name, old.args, old.log)
        self.processes[self.processes.index(old)] = process
        self._wait(self._all_ready, f"{node_name} to be Ready again", self.timeouts.nodes_ready, [process])

    def freeze(self, node_name: str) -> None:
        """The node hangs: its kubelet stops and every process of its pods is frozen (the v1 freezer
        cgroup of its cgroupRoot), as a host that froze or dropped off the network; `thaw` undoes it."""
        self.stop_kubelet(node_name)
        (FREEZER / self._node(node_name).cgroup_root.lstrip("/") / "freezer.state").write_text("FROZEN")

    def thaw(self, node_name: str) -> None:
        (FREEZER / self._node(node_name).cgroup_root.lstrip("/") / "freezer.state").write_text("THAWED")
        self.start_kubelet(node_name)

    def _node(self, node_name: str) -> NodeLayout:
        node = next((n for n in self.nodes if n.name == node_name), None)
        if node is None:
            raise KeyError(f"node_name: {node_name!r} is not one of {', '.join(self.names)}")
        return node

    def kill_container(self, node_name: str, container_id: str, signal: str = "SIGKILL") -> None:
        """Signal a container through its node's container runtime (`ctr tasks kill`), as a crash or the
        kernel's OOM killer would end it; `container_id` as a pod's status gives it (`containerd://<id>`)."""
        node = self._node(node_name)
        task = container_id.removeprefix("containerd://")
        args = [
            "ctr",
            "--address",
            str(node.socket),
            "--namespace",
            "k8s.io",
            "tasks",
            "kill",
            "--signal",
            signal,
            task,
        ]
        result = subprocess.run(args, capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise RealNodesError(f"{' '.join(args)}: {result.stderr.strip()}")

    def disk_used(self) -> dict[str, float]:
        """GB on disk: the template store, and what the nodes' folders add beyond it (hard links count once)."""

        def du(*paths: Path) -> float:
            out = subprocess.run(
                ["du", "-scx", "--block-size=1M", *map(str, paths)], capture_output=True, text=True
            ).stdout
            return round(int(out.splitlines()[-1].split()[0]) / 1024, 2) if out else 0.0

        store = cache_root() / "k8s-node" / "store"
        total = du(store, self.folder) if self.folder else du(store)
        return {"template_store_gb": du(store), "nodes_beyond_store_gb": round(total - du(store), 2)}

    # -- down --

    def down(self) -> None:
        """Stop everything and put the host back as `up` found it. Idempotent."""
        atexit.unregister(self.down)
        kubelets = [p for p in self.processes if p.name.startswith(("kubelet-", "kube-proxy", "kube-router"))]
        stop_processes(kubelets, self.timeouts.stop_grace)
        if getattr(self, "_kube_proxy", None):
            subprocess.run(
                [str(self._kube_proxy), "--cleanup", "--proxy-mode=iptables"], capture_output=True, timeout=60
            )
        try:
            if self.folder is not None:
                undo(self.folder, [p for p in self.processes if p not in kubelets], self.timeouts.stop_grace)
        finally:
            # Even if undoing failed: the next owner's `--reap` (or up) finishes it, and needs the lock.
            self.processes, self.nodes, self.folder = [], [], None
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = None


def undo(folder: Path, containerds: Sequence[ManagedProcess], grace: float) -> None:
    """Undo what the nodes recorded in `folder/host.json`, then remove `folder`."""
    try:
        record = hoststate.HostRecord.load(folder / "host.json")
    except (OSError, ValueError, TypeError):
        record = hoststate.HostRecord(folders=[str(folder)])
    # The containers first (their cgroups), then the shims and containerds. Every step is tried even if one
    # before it failed (a bridge left behind would fail the next `up`); the first failure is raised at the end.
    steps: list[Callable[[], object]] = [functools.partial(hoststate.kill_cgroup_tree, c) for c in record.cgroups]
    steps += [functools.partial(hoststate.kill_shims, socket) for socket in record.sockets]
    steps.append(functools.partial(stop_processes, list(containerds), grace))
    for cgroup in record.cgroups:
        steps += [
            functools.partial(hoststate.kill_cgroup_tree, cgroup),
            functools.partial(hoststate.remove_cgroup_tree, cgroup),
        ]
    for path in record.folders:
        steps += [
            functools.partial(hoststate.unmount_under, path),
            functools.partial(hoststate.remove_container_log_links, path),
        ]
    steps += [functools.partial(hoststate.delete_bridge, bridge) for bridge in record.bridges]
    steps.append(hoststate.remove_iptables_chains)
    steps.append(functools.partial(hoststate.remove_ipsets, kuberouter.IPSET_PREFIXES))  # after the rules using them
    if record.sysctls:
        steps.append(functools.partial(hoststate.restore_sysctls, record.sysctls))
    steps += [functools.partial(shutil.rmtree, path, ignore_errors=True) for path in record.folders]
    steps.append(functools.partial(hoststate.remove_created, record.created))
    failures: list[BaseException] = []
    for step in steps:
        try:
            step()
        except Exception as error:
            failures.append(error)
    if failures:
        raise failures[0]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def host_lock(timeout_s: float) -> int:
    """Hold HOST_LOCK (one set of real nodes per host): its file descriptor; closing it releases the lock."""
    fd = os.open(HOST_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise RealNodesError(
                    f"another set of real nodes held {HOST_LOCK} for {timeout_s:.0f} s (host_lock)"
                ) from None
            time.sleep(1)


def reap_stale() -> list[Path]:
    """Undo the nodes of owners that are gone (SIGKILLed); call it holding the host lock."""
    reaped = []
    if not STATE_ROOT.is_dir():
        return reaped
    for folder in STATE_ROOT.iterdir():
        try:
            pid_text, started = (folder / "owner").read_text().split()
            if process_start_time(int(pid_text)) == started:
                continue
        except (OSError, ValueError):
            pass
        undo(folder, [], 1.0)
        reaped.append(folder)
    return reaped


def serve(n: int, kubeconfig: Path | None) -> int:
    """`python -m oobleck_dev real-nodes`: a control plane and n real nodes until Ctrl-C, then everything down."""
    import signal as signals

    control_plane = ControlPlane(advertise_address=host_address(), kubeconfig=kubeconfig)
    nodes = RealNodes(control_plane, n=n)
    stop = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    previous = signals.signal(signals.SIGTERM, request_stop)
    try:
        control_plane.start()
        nodes.up()
        print(f"kubeconfig: {control_plane.kubeconfig}")
        print(f"real nodes: {', '.join(nodes.names)} (image {nodes.image}); node selector {REAL_NODE_LABEL}=true")
        print(f"start figures (s): {nodes.figures}; disk (GB): {nodes.disk_used()}")
        print("Ctrl-C stops the nodes and the control plane and restores the host", flush=True)
        while not stop:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        signals.signal(signals.SIGTERM, previous)
        nodes.down()
        control_plane.stop()
    return 0


def _created_since(path: Path, time_ns: int) -> bool:
    """Whether `path` exists and was created (its inode changed) at or after `time_ns` (time.time_ns())."""
    try:
        return path.stat().st_ctime_ns >= time_ns
    except FileNotFoundError:
        return False
