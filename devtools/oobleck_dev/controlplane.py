"""A real Kubernetes control plane on loopback, for tests and by hand.

`ControlPlane` runs etcd, kube-apiserver (RBAC on), kube-controller-manager and kube-scheduler as
child processes on free 127.0.0.1 ports, with certificates generated for this instance only,
writes an admin kubeconfig, installs the CRDs in `crds/` and waits until each is Established.
Nothing is global: several control planes run side by side (one per pytest-xdist worker).

Cleanup guarantees:
- `stop()` (also via the context manager, `atexit`, and a failed or interrupted `start()`) ends
  every child and removes the work folder and the kubeconfig it wrote.
- Children die with the thread that started them even when the owner is SIGKILLed
  (`PR_SET_PDEATHSIG`); each runs in its own session so a terminal's Ctrl-C reaches only the owner,
  which then stops them in order. A work folder orphaned by a SIGKILLed owner is removed by the
  next `start()` on the machine (see `reap_stale_workdirs`).

`Cluster` is what tests and tools use to talk to a running cluster — this one or an existing one.
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from oobleck.api.contract import FIXED_PORTS
from oobleck.processes import die_with_parent
from oobleck_dev import kwok
from oobleck_dev.certs import CertificateAuthority, KeyPair, service_account_keys
from oobleck_dev.tools import K8sTools, find_tools, repo_root

if TYPE_CHECKING:
    from oobleck_dev.reads import ClusterReads

WORKDIR_PREFIX = "oobleck-cp-"
CONTEXT = "oobleck-dev"
SERVICE_CIDR = "10.96.0.0/12"
SERVICE_IP = "10.96.0.1"  # the `kubernetes` Service: first address of SERVICE_CIDR
# A port picked free can be taken by someone else before the child binds it; retry this often.
PORT_ATTEMPTS = 3
# free_port picks from here up to the ephemeral range: above the registered services most hosts run.
PRIVATE_PORTS_FROM = 20000
NAMESPACE_TOKEN_ANNOTATION = "oobleck.dev/created-by-call"
"""On a test namespace: the token of the `Cluster.namespace` call that created it."""


@dataclass(frozen=True)
class Timeouts:
    """Every wait of the control plane, in seconds; each is named in the error when it expires."""

    etcd_ready: float = 60.0
    """etcd answers /health."""
    apiserver_ready: float = 180.0
    """kube-apiserver answers /readyz (bootstrap RBAC roles and priority levels are in)."""
    controllers_ready: float = 120.0
    """controller-manager and scheduler answer /healthz and the `default` ServiceAccount exists."""
    crds_established: float = 60.0
    """every CRD from crds/ reports condition Established."""
    namespace_ready: float = 60.0
    """a new namespace's `default` ServiceAccount exists (pods can be created)."""
    stop_grace: float = 10.0
    """SIGTERM to SIGKILL, per stop."""
    kubectl: float = 120.0
    """one kubectl invocation."""


class ControlPlaneError(RuntimeError):
    """The control plane could not start; the message names the step and shows the log tail."""


# --- child processes -----------------------------------------------------------------------------


class ManagedProcess:
    """A child process in its own session that dies with its parent, logging to a file."""

    def __init__(self, name: str, args: Sequence[str | os.PathLike[str]], log: Path, env: dict[str, str] | None = None):
        self.name = name
        self.args = [str(arg) for arg in args]
        self.log = log
        with open(log, "ab") as out:
            self.popen = subprocess.Popen(
                self.args,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(os.getpid()),
                env=env,
            )
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.pid, signum)  # the whole session: a child of the child too
        except ProcessLookupError:
            pass

    def wait(self, timeout: float) -> bool:
        try:
            self.popen.wait(timeout=max(timeout, 0))
            return True
        except subprocess.TimeoutExpired:
            return False


def stop_processes(processes: Sequence[ManagedProcess], grace: float) -> None:
    """Stop one after the other, in the order given: SIGTERM, up to `grace` seconds, SIGKILL; reap.

    One at a time because order matters: an apiserver whose etcd is already gone takes its
    whole grace period to give up (measured: 1.2 s in order, 10 s all at once).
    """
    for process in processes:
        if process.alive():
            process.signal(signal.SIGTERM)
        if not process.wait(grace):
            process.signal(signal.SIGKILL)
            process.wait(grace)
        # Anything left in the session (nothing, for these single-process Go binaries).
        process.signal(signal.SIGKILL)


class _Exited(Exception):
    def __init__(self, process: ManagedProcess):
        super().__init__(process.name)
        self.process = process


def wait_for(
    check: Callable[[], bool], timeout: float, what: str, timeout_name: str, watch: Sequence[ManagedProcess] = ()
) -> None:
    """Poll `check` until it is true; fail early if a watched process exits."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        for process in watch:
            if not process.alive():
                raise _Exited(process)
        if check():
            return
        if time.monotonic() > deadline:
            tails = "".join(f"\n--- {p.name} log ({p.log}) ---\n{p.log_tail()}" for p in watch)
            raise ControlPlaneError(f"timed out after {timeout:.0f} s ({timeout_name}) waiting for {what}{tails}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now, below the kernel's ephemeral range.

    A port the kernel hands out for `bind(0)` comes from the same range as the local ports of outgoing
    connections, so between picking it and the child binding it, any client on the machine can take it
    (CI lost an operator's liveness port that way). Below that range only other pickers compete, and the
    job pods' fixed ports (oobleck.api.contract.FIXED_PORTS) are never picked.
    """
    low = _ephemeral_low()
    for _ in range(64):
        port = secrets.randbelow(low - PRIVATE_PORTS_FROM) + PRIVATE_PORTS_FROM
        if port in FIXED_PORTS:
            # A pod on local nodes shares the host's network: a test process on 0.0.0.0:29500 (an operator's
            # metrics) made every e2e worker's /metrics bind on its pod IP fail with EADDRINUSE.
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default when it cannot be read)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return max(low, PRIVATE_PORTS_FROM + 1024)


def port_in_use(port: int) -> bool:
    """Whether something listens on 127.0.0.1:`port`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


# --- stale work folders --------------------------------------------------------------------------


def process_start_time(pid: int) -> str | None:
    """A live process's start time in clock ticks since boot (tells a reused pid apart).

    None if there is no such process or it is a zombie (dead, only not yet reaped: where init
    does not reap promptly, a SIGKILLed process stays one for a while).
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def _owner_stamp() -> str:
    return f"{os.getpid()} {process_start_time(os.getpid())}"


def reap_stale_workdirs(parent: Path | None = None, min_age_s: float = 60.0) -> list[Path]:
    """Remove work folders whose owning process is gone (it was SIGKILLed); return them."""
    parent = Path(parent or tempfile.gettempdir())
    removed = []
    for folder in parent.glob(f"{WORKDIR_PREFIX}*"):
        try:
            pid_text, started = (folder / "owner").read_text().split()
            owner_alive = process_start_time(int(pid_text)) == started
        except FileNotFoundError:  # being created right now, or its owner died during mkdtemp
            try:
                owner_alive = time.time() - folder.stat().st_mtime < min_age_s
            except FileNotFoundError:  # removed since the glob: its plane stopped
                continue
        except (OSError, ValueError):
            continue
        if not owner_alive:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


# --- kubeconfigs and HTTPS -----------------------------------------------------------------------


def kubeconfig_yaml(server: str, ca: Path, client: KeyPair, user: str, embed: bool) -> str:
    """A one-context kubeconfig; `embed` inlines the PEM data (the file then stands alone)."""
    if embed:
        cluster = {"certificate-authority-data": base64.b64encode(ca.read_bytes()).decode()}
        creds = {
            "client-certificate-data": base64.b64encode(client.cert.read_bytes()).decode(),
            "client-key-data": base64.b64encode(client.key.read_bytes()).decode(),
        }
    else:
        cluster = {"certificate-authority": str(ca)}
        creds = {"client-certificate": str(client.cert), "client-key": str(client.key)}
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": CONTEXT, "cluster": {"server": server, **cluster}}],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": user}}],
        "current-context": CONTEXT,
    }
    return yaml.safe_dump(document, sort_keys=False)


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def _tls_context(ca: Path, client: KeyPair | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    if client is not None:
        context.load_cert_chain(str(client.cert), str(client.key))
    return context


def _https_ok(url: str, context: ssl.SSLContext, predicate: Callable[[bytes], bool] = lambda body: True) -> bool:
    try:
        with urllib.request.urlopen(url, context=context, timeout=5) as response:
            return response.status == 200 and predicate(response.read())
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


# --- the control plane ---------------------------------------------------------------------------


# "The checkout's crds/": a marker distinct from None (which installs nothing).
DEFAULT_CRDS = Path("<checkout>/crds")


def default_crds_dir() -> Path | None:
    """`crds/` of the source checkout, if there is one."""
    root = repo_root()
    return root / "crds" if root is not None and (root / "crds").is_dir() else None


# "The chart's admission policies": the worker-pod policy every Oobleck cluster runs (see the file).
DEFAULT_ADMISSION = Path("<checkout>/charts/oobleck-operator/files/admission")


def default_admission_dir() -> Path | None:
    """The chart's `files/admission/` in the source checkout, if there is one."""
    root = repo_root()
    folder = root / "charts" / "oobleck-operator" / "files" / "admission" if root is not None else None
    return folder if folder is not None and folder.is_dir() else None


def _not_established(listing: str) -> list[str]:
    """Names of the CustomResourceDefinitions in a `kubectl get -o json` listing not yet Established."""
    data = json.loads(listing)
    items = data.get("items", [data]) if data.get("kind") == "List" else [data]
    return [
        item["metadata"]["name"]
        for item in items
        if not any(
            c.get("type") == "Established" and c.get("status") == "True"
            for c in (item.get("status") or {}).get("conditions") or []
        )
    ]


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on loopback.

    `kubeconfig`: where to write the admin kubeconfig (default: `<workdir>/kubeconfig`); it embeds
    its certificates. `crds_dir`: every *.yaml/*.yml/*.json in it is installed (default: the
    checkout's `crds/`; None or an empty folder installs nothing). `admission_dir`: admission policies
    installed likewise (default: the chart's worker-pod policy, as a Helm install would have it).
    `workdir_parent`: where the
    temporary work folder goes (default: the system temp folder).

    Start it from a thread that outlives it (the main thread): children die with that thread.
    """

    def __init__(
        self,
        tools: K8sTools | None = None,
        *,
        kubeconfig: Path | None = None,
        crds_dir: Path | None = DEFAULT_CRDS,
        admission_dir: Path | None = DEFAULT_ADMISSION,
        timeouts: Timeouts = Timeouts(),
        workdir_parent: Path | None = None,
        advertise_address: str | None = None,
    ) -> None:
        self.tools = tools or find_tools()
        # A non-loopback address of this host for real kubelet nodes (realnodes.py): the API server then
        # also listens there, the `kubernetes` Service points there (pods reach it through kube-proxy),
        # and it reaches kubelets on their InternalIP with a client certificate (`kubectl logs/exec`).
        self.advertise_address = advertise_address
        self.timeouts = timeouts
        self.crds_dir = default_crds_dir() if crds_dir is DEFAULT_CRDS else (Path(crds_dir) if crds_dir else None)
        self.admission_dir = (
            default_admission_dir()
            if admission_dir is DEFAULT_ADMISSION
            else (Path(admission_dir) if admission_dir else None)
        )
        self._kubeconfig_arg = Path(kubeconfig) if kubeconfig else None
        self._workdir_parent = Path(workdir_parent) if workdir_parent else None
        self.workdir: Path | None = None
        self.kubeconfig: Path | None = None
        self.server: str = ""
        self.ports: dict[str, int] = {}
        self.processes: list[ManagedProcess] = []
        self.started_in_s: float | None = None
        self.phase_s: dict[str, float] = {}
        self.ca_cert: Path | None = None
        self.ca: CertificateAuthority | None = None  # issues the real nodes' certificates
        self._admin: KeyPair | None = None
        self._ready: dict[str, tuple[Callable[[], bool], float, str]] = {}  # name -> (check, timeout, its name)

    # -- lifecycle --

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> ControlPlane:
        """Start everything and wait until it is usable; on any failure (or Ctrl-C) clean up."""
        if self.workdir is not None:
            raise ControlPlaneError("already started")
        began = time.monotonic()
        reap_stale_workdirs(self._workdir_parent)
        self.workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX, dir=self._workdir_parent))
        (self.workdir / "owner").write_text(_owner_stamp())
        atexit.register(self.stop)
        try:
            self._start(began)
        except _Exited as exited:
            self.stop()
            raise ControlPlaneError(
                f"{exited.process.name} exited with code {exited.process.popen.returncode} during start"
                f"\n--- {exited.process.name} log ---\n{exited.process.log_tail()}"
            ) from None
        except BaseException:
            self.stop()
            raise
        self.started_in_s = time.monotonic() - began
        return self

    def _phase(self, name: str, since: float) -> float:
        now = time.monotonic()
        self.phase_s[name] = round(now - since, 2)
        return now

    def _start(self, began: float) -> None:
        assert self.workdir is not None
        pki = self.workdir / "pki"
        pki.mkdir()
        (self.workdir / "logs").mkdir()
        ca = CertificateAuthority(pki)
        self.ca, self.ca_cert = ca, ca.cert
        loopback = ("127.0.0.1", "localhost")
        advertised = (self.advertise_address,) if self.advertise_address else ()
        etcd_server = ca.issue("etcd-server", "etcd", server=True, hosts=loopback)
        etcd_client = ca.issue("apiserver-etcd-client", "kube-apiserver-etcd-client", client=True)
        api_names = (
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        )
        apiserver = ca.issue(
            "apiserver", "kube-apiserver", server=True, hosts=(*loopback, *advertised, SERVICE_IP, *api_names)
        )
        # What kubelets trust as the API server (system:masters: every kubelet API, logs and exec included).
        kubelet_client = ca.issue(
            "apiserver-kubelet-client", "kube-apiserver-kubelet-client", organizations=("system:masters",), client=True
        )
        self._admin = ca.issue("admin", "oobleck-admin", organizations=("system:masters",), client=True)
        kcm_client = ca.issue("kcm-client", "system:kube-controller-manager", client=True)
        scheduler_client = ca.issue("scheduler-client", "system:kube-scheduler", client=True)
        kcm_serving = ca.issue("kcm-serving", "kube-controller-manager", server=True, hosts=loopback)
        scheduler_serving = ca.issue("scheduler-serving", "kube-scheduler", server=True, hosts=loopback)
        sa = service_account_keys(pki)
        mark = self._phase("certificates", began)

        # etcd: TLS with client certificates; fsync off because the data is thrown away anyway.
        etcd_tls = _tls_context(ca.cert, etcd_client)

        def etcd_args(ports: dict[str, int]) -> list[str]:
            client_url, peer_url = f"https://127.0.0.1:{ports['etcd']}", f"http://127.0.0.1:{ports['etcd-peer']}"
            # A data folder per attempt: a retry on other ports must not inherit the old member.
            data_dir = self.workdir / f"etcd-{ports['etcd']}"
            return [
                str(self.tools.etcd),
                "--name=default",
                f"--data-dir={data_dir}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=default={peer_url}",
                "--initial-cluster-state=new",
                f"--cert-file={etcd_server.cert}",
                f"--key-file={etcd_server.key}",
                "--client-cert-auth",
                f"--trusted-ca-file={ca.cert}",
                "--unsafe-no-fsync",
                "--log-level=warn",
                "--quota-backend-bytes=4294967296",
            ]

        self._launch(
            "etcd",
            ("etcd", "etcd-peer"),
            etcd_args,
            lambda ports: _https_ok(f"https://127.0.0.1:{ports['etcd']}/health", etcd_tls, lambda b: b'"true"' in b),
            self.timeouts.etcd_ready,
            "etcd_ready",
        )
        mark = self._phase("etcd", mark)

        admin_tls = _tls_context(ca.cert, self._admin)

        def apiserver_args(ports: dict[str, int]) -> list[str]:
            return [
                str(self.tools.kube_apiserver),
                f"--etcd-servers=https://127.0.0.1:{self.ports['etcd']}",
                f"--etcd-cafile={ca.cert}",
                f"--etcd-certfile={etcd_client.cert}",
                f"--etcd-keyfile={etcd_client.key}",
                *(
                    [
                        "--bind-address=0.0.0.0",
                        f"--advertise-address={self.advertise_address}",
                        f"--kubelet-client-certificate={kubelet_client.cert}",
                        f"--kubelet-client-key={kubelet_client.key}",
                        "--kubelet-preferred-address-types=InternalIP",
                    ]
                    if self.advertise_address
                    else ["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1"]
                ),
                f"--secure-port={ports['apiserver']}",
                f"--tls-cert-file={apiserver.cert}",
                f"--tls-private-key-file={apiserver.key}",
                f"--client-ca-file={ca.cert}",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                "--authorization-mode=Node,RBAC",
                "--anonymous-auth=false",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={sa.cert}",
                f"--service-account-signing-key-file={sa.key}",
                "--allow-privileged=true",
                "--profiling=false",
                # The scale tests create ~1000 nodes plus their leases at once.
                "--max-requests-inflight=800",
                "--max-mutating-requests-inflight=400",
            ]

        self._launch(
            "kube-apiserver",
            ("apiserver",),
            apiserver_args,
            lambda ports: _https_ok(f"https://127.0.0.1:{ports['apiserver']}/readyz", admin_tls),
            self.timeouts.apiserver_ready,
            "apiserver_ready",
        )
        self.server = f"https://127.0.0.1:{self.ports['apiserver']}"
        self.kubeconfig = self._kubeconfig_arg or self.workdir / "kubeconfig"
        _write_private(self.kubeconfig, kubeconfig_yaml(self.server, ca.cert, self._admin, "oobleck-admin", embed=True))
        mark = self._phase("kube-apiserver", mark)

        kcm_kubeconfig = self.workdir / "kube-controller-manager.kubeconfig"
        scheduler_kubeconfig = self.workdir / "kube-scheduler.kubeconfig"
        _write_private(kcm_kubeconfig, kubeconfig_yaml(self.server, ca.cert, kcm_client, "kcm", embed=False))
        _write_private(
            scheduler_kubeconfig, kubeconfig_yaml(self.server, ca.cert, scheduler_client, "scheduler", embed=False)
        )

        def delegated(kubeconfig: Path, serving: KeyPair, port: int) -> list[str]:
            return [
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--tls-cert-file={serving.cert}",
                f"--tls-private-key-file={serving.key}",
            ]

        def kcm_args(ports: dict[str, int]) -> list[str]:
            return [
                str(self.tools.kube_controller_manager),
                *delegated(kcm_kubeconfig, kcm_serving, ports["kube-controller-manager"]),
                # Each controller acts as its own ServiceAccount, as in a real cluster (RBAC applies).
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={sa.key}",
                f"--root-ca-file={ca.cert}",
                f"--cluster-signing-cert-file={ca.cert}",
                f"--cluster-signing-key-file={ca.key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # No kubelets evict pods here; kwok-managed nodes keep themselves Ready.
                "--controllers=*,-nodeipam",
            ]

        def scheduler_args(ports: dict[str, int]) -> list[str]:
            return [
                str(self.tools.kube_scheduler),
                *delegated(scheduler_kubeconfig, scheduler_serving, ports["kube-scheduler"]),
            ]

        serving_tls = _tls_context(ca.cert, None)
        for name, args in (("kube-controller-manager", kcm_args), ("kube-scheduler", scheduler_args)):
            self._launch(
                name,
                (name,),
                args,
                lambda ports, name=name: _https_ok(f"https://127.0.0.1:{ports[name]}/healthz", serving_tls),
                self.timeouts.controllers_ready,
                "controllers_ready",
            )
        # The ServiceAccount controller creating `default` proves the controllers run (and pods
        # in the default namespace can be created).
        wait_for(
            lambda: _https_ok(f"{self.server}/api/v1/namespaces/default/serviceaccounts/default", admin_tls),
            self.timeouts.controllers_ready,
            "the default ServiceAccount in namespace default",
            "controllers_ready",
            self.processes,
        )
        mark = self._phase("controllers", mark)

        self._install_crds()
        mark = self._phase("crds", mark)
        self._install_admission()
        self._phase("admission", mark)

    def _launch(
        self,
        name: str,
        port_names: Sequence[str],
        make_args: Callable[[dict[str, int]], list[str]],
        ready: Callable[[dict[str, int]], bool],
        timeout: float,
        timeout_name: str,
    ) -> ManagedProcess:
        """Start a child on fresh free ports and wait until ready; retry if a port was taken."""
        assert self.workdir is not None
        for attempt in range(PORT_ATTEMPTS):
            ports = {port: free_port() for port in port_names}
            process = ManagedProcess(name, make_args(ports), self.workdir / "logs" / f"{name}.log")
            self.processes.append(process)
            try:
                wait_for(lambda: ready(ports), timeout, f"{name} to be ready", timeout_name, self.processes)
            except _Exited as exited:
                lost_port = exited.process is process and "address already in use" in process.log_tail()
                if lost_port and attempt + 1 < PORT_ATTEMPTS:
                    process.wait(1)
                    self.processes.remove(process)
                    continue
                raise
            self.ports.update(ports)
            self._ready[name] = (lambda ports=ports: ready(ports), timeout, timeout_name)
            return process
        raise AssertionError("unreachable")

    def _install_crds(self) -> None:
        if self.crds_dir is None:
            return
        files = sorted(p for p in self.crds_dir.iterdir() if p.suffix in (".yaml", ".yml", ".json"))
        if not files:
            return
        flags = [arg for path in files for arg in ("-f", str(path))]
        self.kubectl("apply", "--server-side", "--force-conflicts", *flags)
        # Polled rather than `kubectl wait`, which fails outright when it reads a CRD before the API
        # server has written any status condition ("<nil> is of the type <nil>").
        timeout = self.timeouts.crds_established
        deadline = time.monotonic() + timeout
        while True:
            result = self.kubectl("get", *flags, "-o", "json", check=False)
            pending = _not_established(result.stdout) if result.returncode == 0 else [result.stderr.strip()]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"timed out after {timeout:.0f} s (crds_established) waiting for the CRDs in {self.crds_dir} "
                    f"to be Established; not yet: {', '.join(pending)}"
                )
            time.sleep(0.2)

    def _install_admission(self) -> None:
        """Apply the admission policies and wait until the API server has type-checked each (its
        status.observedGeneration), so that the first test already meets them."""
        if self.admission_dir is None:
            return
        files = sorted(p for p in self.admission_dir.iterdir() if p.suffix in (".yaml", ".yml"))
        if not files:
            return
        flags = [arg for path in files for arg in ("-f", str(path))]
        self.kubectl("apply", "--server-side", "--force-conflicts", *flags)
        deadline = time.monotonic() + self.timeouts.crds_established
        while True:
            listing = json.loads(self.kubectl("get", "validatingadmissionpolicies", "-o", "json").stdout)
            pending = [
                item["metadata"]["name"]
                for item in listing["items"]
                if (item.get("status") or {}).get("observedGeneration") != item["metadata"]["generation"]
            ]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"admission policies not type-checked in time: {', '.join(pending)}")
            time.sleep(0.2)

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run this control plane's kubectl as its admin."""
        if self.kubeconfig is None:
            raise ControlPlaneError("not started")
        return run_kubectl(self.tools, self.kubeconfig, args, input, check, timeout or self.timeouts.kubectl)

    def start_kwok(self, **options: object) -> ManagedProcess:
        """Run a kwok controller owned by this control plane (stopped with it); see `kwok.start_kwok`."""
        if self.workdir is None or self.kubeconfig is None:
            raise ControlPlaneError("not started")
        process = kwok.start_kwok(self.tools, self.kubeconfig, self.workdir / "logs", **options)  # type: ignore[arg-type]
        self.processes.append(process)
        return process

    def stop(self) -> None:
        """End every child and remove what start() created. Idempotent."""
        atexit.unregister(self.stop)
        # Reverse start order: the apiserver's shutdown still reaches etcd.
        stop_processes(list(reversed(self.processes)), self.timeouts.stop_grace)
        self.processes = []
        if self.kubeconfig is not None and self._kubeconfig_arg is not None:
            self.kubeconfig.unlink(missing_ok=True)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir = None
        self.kubeconfig = None

    # -- outages (fault tests) --

    def _component(self, name: str) -> ManagedProcess:
        for process in self.processes:
            if process.name == name:
                return process
        known = ", ".join(p.name for p in self.processes) or "none (not started)"
        raise ControlPlaneError(f"no control plane component {name!r}; running: {known}")

    def stop_component(self, name: str, signum: int = signal.SIGTERM) -> None:
        """Stop one component (e.g. "kube-apiserver", "etcd") as an outage: its clients see connections
        refused until `start_component(name)` brings it back on the same ports with the same data."""
        process = self._component(name)
        process.signal(signum)
        if not process.wait(self.timeouts.stop_grace):
            process.signal(signal.SIGKILL)
            process.wait(self.timeouts.stop_grace)

    def start_component(self, name: str) -> ManagedProcess:
        """Start a stopped component again with its original arguments and wait until it is ready."""
        old = self._component(name)
        if old.alive():
            raise ControlPlaneError(f"{name} is running (pid {old.pid}): stop_component first")
        check, timeout, timeout_name = self._ready[name]
        process = ManagedProcess(name, old.args, old.log)
        self.processes[self.processes.index(old)] = process
        try:
            wait_for(check, timeout, f"{name} to be ready again", timeout_name, [process])
        except _Exited:
            raise ControlPlaneError(
                f"{name} exited with code {process.popen.returncode} on restart\n--- log ---\n{process.log_tail()}"
            ) from None
        return process

    def pids(self) -> dict[str, int]:
        """name -> pid of every running child."""
        return {process.name: process.pid for process in self.processes}


# --- talking to a running cluster ----------------------------------------------------------------


class KubectlError(subprocess.CalledProcessError):
    """kubectl failed; str() shows the command and its stderr."""

    def __str__(self) -> str:
        return f"kubectl {' '.join(self.cmd[3:])} exited {self.returncode}: {(self.stderr or '').strip()}"


def run_kubectl(
    tools: K8sTools,
    kubeconfig: Path | str,
    args: Sequence[str],
    input: str | None = None,
    check: bool = True,
    timeout: float = Timeouts.kubectl,
) -> subprocess.CompletedProcess[str]:
    """Run `kubectl --kubeconfig <kubeconfig> ARGS` capturing text output."""
    cmd = [str(tools.kubectl), "--kubeconfig", str(kubeconfig), *args]
    result = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise KubectlError(result.returncode, cmd, result.stdout, result.stderr)
    return result


def server_of(kubeconfig: Path | str) -> str:
    """The server URL of a kubeconfig's current context."""
    document = yaml.safe_load(Path(kubeconfig).read_text()) or {}
    current = document.get("current-context")
    contexts = {c["name"]: c["context"] for c in document.get("contexts") or []}
    clusters = {c["name"]: c["cluster"] for c in document.get("clusters") or []}
    try:
        return clusters[contexts[current]["cluster"]]["server"]
    except (KeyError, TypeError):
        raise ValueError(f"{kubeconfig}: current-context {current!r} names no cluster with a server") from None


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass
class Cluster:
    """A running cluster as tests and tools use it (a local `ControlPlane` or an existing one).

    kubeconfig: path of an admin kubeconfig. server: the API server URL. bin: the tools.
    owner: a unique, DNS-safe tag (per pytest-xdist worker) put into the names of namespaces
    and fake nodes this object creates, so that workers sharing one existing cluster never collide.
    """

    kubeconfig: str
    server: str
    bin: K8sTools
    control_plane: ControlPlane | None = None
    owner: str = field(default_factory=lambda: secrets.token_hex(2))
    timeouts: Timeouts = Timeouts()
    namespaces: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    _kwok: ManagedProcess | None = None
    _kwok_logs: Path | None = None  # kwok's log folder when there is no local control plane
    _reads: ClusterReads | None = None

    @property
    def reads(self) -> ClusterReads:
        """Polled reads over one kept connection (`oobleck_dev.reads`), made at first use."""
        if self._reads is None:
            from oobleck_dev.reads import ClusterReads

            self._reads = ClusterReads(self.kubeconfig)
        return self._reads

    @classmethod
    def existing(cls, kubeconfig: str, tools: K8sTools, owner: str = "") -> Cluster:
        """An existing cluster from a kubeconfig (nothing is started or stopped)."""
        return cls(kubeconfig=kubeconfig, server=server_of(kubeconfig), bin=tools, owner=owner or secrets.token_hex(2))

    @classmethod
    def local(cls, control_plane: ControlPlane, owner: str = "") -> Cluster:
        """A started `ControlPlane`."""
        assert control_plane.kubeconfig is not None, "start the control plane first"
        return cls(
            kubeconfig=str(control_plane.kubeconfig),
            server=control_plane.server,
            bin=control_plane.tools,
            control_plane=control_plane,
            owner=owner or secrets.token_hex(2),
            timeouts=control_plane.timeouts,
        )

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float | None = None
    ) -> subprocess.CompletedProcess[str]:
        """`kubectl ARGS` against this cluster (text; stdout/stderr captured; raises on failure if `check`)."""
        return run_kubectl(self.bin, self.kubeconfig, args, input, check, timeout or self.timeouts.kubectl)

    def kubectl_json(self, *args: str) -> dict:
        """`kubectl ARGS -o json`, parsed."""
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def _namespace_token(self, name: str) -> str | None:
        got = self.kubectl("get", "namespace", name, "-o", "json", check=False)
        if got.returncode != 0:
            return None
        return (json.loads(got.stdout)["metadata"].get("annotations") or {}).get(NAMESPACE_TOKEN_ANNOTATION)

    def namespace(self, name_prefix: str = "test") -> str:
        """Create a fresh namespace `<prefix>-<owner>-<random>` and wait until pods can be created in it."""
        if not _DNS_LABEL.match(name_prefix) or len(name_prefix) > 40:
            raise ValueError(
                f"name_prefix: must be a lowercase DNS label of at most 40 characters, got {name_prefix!r}"
            )
        name = f"{name_prefix}-{self.owner}-{secrets.token_hex(3)}"
        # A create can answer AlreadyExists for the namespace it made itself: seen once at load in a full run,
        # for a fresh random name (a request sent twice). The token of this call tells that from a name taken.
        token = secrets.token_hex(8)
        metadata = {"name": name, "annotations": {NAMESPACE_TOKEN_ANNOTATION: token}}
        created = self.kubectl(
            "create",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": metadata}),
            check=False,
        )
        if created.returncode != 0 and not ("AlreadyExists" in created.stderr and self._namespace_token(name) == token):
            raise KubectlError(created.returncode, created.args, created.stdout, created.stderr)
        self.namespaces.append(name)
        deadline = time.monotonic() + self.timeouts.namespace_ready
        while self.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"namespace {name}: no default ServiceAccount after {self.timeouts.namespace_ready:.0f} s "
                    "(namespace_ready); is kube-controller-manager running?"
                )
            time.sleep(0.2)
        return name

    def start_kwok(self) -> None:
        """Run a kwok controller for this cluster's fake nodes (once; later calls do nothing).

        Call it from the main thread: kwok dies with the thread that started it (PR_SET_PDEATHSIG).
        """
        if self._kwok is not None and self._kwok.alive():
            return
        if self.control_plane is not None:
            self._kwok = self.control_plane.start_kwok()
        else:
            logs = Path(tempfile.mkdtemp(prefix="oobleck-kwok-"))
            self._kwok = kwok.start_kwok(self.bin, Path(self.kubeconfig), logs)
            self._kwok_logs = logs

    def add_kwok_nodes(self, n: int, gpus: int = 8, **options: object) -> list[str]:
        """Register `n` fake nodes with `nvidia.com/gpu: gpus` (starts kwok if needed); return their names.

        Nodes are cluster-wide: every node carries the label `oobleck.dev/owner=<owner>` and
        `kwok.FAKE_GROUP_LABEL=<group>` (one group per call) for tests that must tell theirs apart.
        Extra options go to `kwok.add_fake_nodes` (cpu, memory, pods, labels, taints, concurrency).
        """
        self.start_kwok()
        names = kwok.add_fake_nodes(self.kubeconfig, n, gpus=gpus, owner=self.owner, **options)  # type: ignore[arg-type]
        self.nodes.extend(names)
        return names

    def delete_kwok_nodes(self, names: Sequence[str] | None = None) -> None:
        """Delete fake nodes this object registered (default: all of them)."""
        names = list(self.nodes if names is None else names)
        kwok.delete_nodes(self.kubeconfig, names)
        self.nodes = [name for name in self.nodes if name not in set(names)]

    def close(self) -> None:
        """Stop kwok if this object started it; on an existing cluster also delete what it created."""
        if self._kwok is not None:
            stop_processes([self._kwok], self.timeouts.stop_grace)
            if self.control_plane is not None and self._kwok in self.control_plane.processes:
                self.control_plane.processes.remove(self._kwok)
            self._kwok = None
            if self._kwok_logs is not None:
                shutil.rmtree(self._kwok_logs, ignore_errors=True)
                self._kwok_logs = None
        if self.control_plane is None:
            if self.nodes:
                self.delete_kwok_nodes()
            if self.namespaces:
                self.kubectl("delete", "namespace", "--wait=false", "--ignore-not-found", *self.namespaces, check=False)
                self.namespaces = []
