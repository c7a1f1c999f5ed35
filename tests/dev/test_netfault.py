"""Network cuts (oobleck_dev.netfault): the nft script as text, and real cuts between real processes.

The real tests put a client process in a cgroup of its own (as the node agent does with a pod's
processes) and check that a cut drops its traffic both ways while other processes still connect, that
"api" mode drops only the API server's port, and that healing restores everything.
"""

from __future__ import annotations

import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from oobleck_dev import netfault

pytestmark = pytest.mark.integration  # starts processes (see tests/conftest.py: make test-unit)


MOUNTINFO = """\
25 30 0:22 / /sys rw,nosuid - sysfs sysfs rw
31 25 0:27 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


def test_cgroup2_mount_is_found_on_a_hybrid_host_and_on_a_pure_v2_host():
    assert netfault.cgroup2_mount(MOUNTINFO) == Path("/sys/fs/cgroup/unified")
    assert netfault.cgroup2_mount("29 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n") == Path("/sys/fs/cgroup")
    assert netfault.cgroup2_mount("29 23 0:26 / /mnt/cg rw - cgroup2 cgroup2 rw\n") is None  # nft cannot name it


def test_ruleset_peers_keeps_the_api_server_and_api_drops_only_it():
    mount = Path("/sys/fs/cgroup/unified")
    pod = mount / "oobleck-a1" / "ns_pod_1234"
    peers = netfault.ruleset("oobleck_a1", {pod: "peers"}, ("127.0.0.1", 6443), mount)
    match = 'socket cgroupv2 level 2 "unified/oobleck-a1/ns_pod_1234"'
    assert f"{match} ip daddr 127.0.0.1 tcp dport 6443 accept\n    {match} drop" in peers
    assert f"{match} ip saddr 127.0.0.1 tcp sport 6443 accept\n    {match} drop" in peers
    assert peers.startswith("add table inet oobleck_a1\ndelete table inet oobleck_a1\n")  # atomic replace
    api = netfault.ruleset("oobleck_a1", {pod: "api"}, ("127.0.0.1", 6443), mount)
    assert f"{match} ip daddr 127.0.0.1 tcp dport 6443 drop" in api and f"{match} drop" not in api
    assert "socket" not in netfault.ruleset("oobleck_a1", {}, ("127.0.0.1", 6443), mount)
    with pytest.raises(ValueError, match="mode"):
        netfault.ruleset("t", {pod: "both"}, ("127.0.0.1", 1), mount)


class _Server:
    """A TCP listener in this process (outside the cut cgroup) that answers b"ok" to every connection."""

    def __init__(self, host: str) -> None:
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.sendall(b"ok")
            conn.close()


CLIENT = """
import socket, sys
out = []
for port in sys.argv[1:]:
    try:
        with socket.create_connection(("127.0.0.1", int(port)), timeout=1.5) as s:
            out.append("ok" if s.recv(2) == b"ok" else "bad")
    except OSError as e:
        out.append(type(e).__name__)
print(",".join(out))
"""


def _connect_from(cgroup: Path, *ports: int) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", CLIENT, *map(str, ports)],
        preexec_fn=netfault.join_cgroup(cgroup),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result.stdout.strip().split(",")


@pytest.fixture
def cut_setup() -> Iterator[tuple[netfault.PodCgroups, netfault.NetworkCuts, Path, _Server, _Server]]:
    agent = f"t{secrets.token_hex(3)}"
    cgroups = netfault.PodCgroups(agent)
    if not cgroups.available:
        pytest.skip(f"network cuts unavailable: {cgroups.reason}")
    try:
        netfault.ensure_nft()
    except netfault.NetFaultUnavailable as error:
        cgroups.close()
        pytest.skip(f"network cuts unavailable: {error}")
    api, peer = _Server("127.0.0.1"), _Server("127.0.0.1")
    cuts = netfault.NetworkCuts(agent, ("127.0.0.1", api.port), cgroups.mount)
    pod = cgroups.create("ns_pod_0001")
    assert pod is not None
    try:
        yield cgroups, cuts, pod, api, peer
    finally:
        cuts.close()
        cgroups.close()


def test_a_cut_drops_the_pods_traffic_but_not_the_api_servers_and_heals(cut_setup):
    cgroups, cuts, pod, api, peer = cut_setup
    other = cgroups.create("ns_other_0002")
    assert _connect_from(pod, api.port, peer.port) == ["ok", "ok"]
    cuts.cut(pod, "peers")
    assert _connect_from(pod, api.port, peer.port) == ["ok", "TimeoutError"]  # dropped: no RST, no EOF
    assert _connect_from(other, api.port, peer.port) == ["ok", "ok"]  # another pod is untouched
    cuts.cut(pod, "api")
    assert _connect_from(pod, api.port, peer.port) == ["TimeoutError", "ok"]
    cuts.heal(pod)
    assert _connect_from(pod, api.port, peer.port) == ["ok", "ok"]
    netfault.PodCgroups.remove(other)


HEALTH_WORKER = Path(__file__).parents[1] / "runtime" / "test_control_health.py"


@pytest.mark.slow
@pytest.mark.xdist_group("control-processes")
def test_a_partitioned_worker_is_found_by_its_peers_within_half_a_second(cut_setup):
    """Real FailureDetector processes (tests/runtime/test_control_health.py's worker) around a real
    coordinator; one runs in a cut-off cgroup: no EOF, no refusal, its process lives. The survivors'
    probes are not answered (the SYN is dropped) and they name it, within the hung-worker bound."""
    import datetime
    import os
    import signal
    import time

    from oobleck.runtime.elastic import keys as co
    from oobleck.runtime.elastic.coordinator import Coordinator
    from oobleck.runtime.elastic.health import wait_alive

    _, cuts, pod, _, _ = cut_setup
    workers = [f"node{i}:0" for i in range(3)]
    victim = workers[2]
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    with Coordinator() as coordinator:
        store = coordinator.store()
        procs = [
            subprocess.Popen(
                [sys.executable, str(HEALTH_WORKER), "--port", str(coordinator.port), "--worker", w]
                + ["--peers", ",".join(workers), "--dead-after", "5"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=netfault.join_cgroup(pod) if w == victim else None,
            )
            for w in workers
        ]
        try:
            wait_alive(store, workers, 60)
            store.wait([f"watching/{w}/0" for w in workers], datetime.timedelta(seconds=60))
            cuts.cut(pod, "peers")
            cut_at = time.time()
            reports: list[dict] = []
            deadline = time.monotonic() + 10
            while not any(victim in r["dead"] for r in reports) and time.monotonic() < deadline:
                reports += co.pop_failures(store)
                time.sleep(0.005)
            assert procs[2].poll() is None, "a partition, not a death: the cut-off process lives"
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
    named = [r for r in reports if victim in r["dead"]]
    assert named, f"nobody named the cut-off worker: {reports}"
    first = min(r["detected_at"] for r in named) - cut_at
    print(f"cut -> first verdict {first:.3f} s: {named[0]['detail']}")
    assert all(r["reporter"] != victim for r in reports), "the cut-off worker cannot report"
    assert "not reached" in named[0]["detail"] or "did not answer" in named[0]["detail"], named[0]
    assert first < 0.5 + (1.0 if os.getloadavg()[0] > 1.0 else 0.0)
