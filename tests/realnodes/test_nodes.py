"""Real nodes themselves: `down` puts the host back as `up` found it, with a container still running and
kube-router enforcing a NetworkPolicy (its iptables chains and ipsets removed too); `--reap` does the same for
the nodes of an owner that was SIGKILLed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oobleck_dev import hoststate, kuberouter, realnodes
from oobleck_dev.controlplane import ControlPlane
from oobleck_dev.tools import find_tools
from tests.realnodes.marks import realnode_marks

pytestmark = realnode_marks(5400)

POLICY = {
    "apiVersion": "networking.k8s.io/v1",
    "kind": "NetworkPolicy",
    "metadata": {"name": "sleeper-from-peers"},
    "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": {}}]}]},
}


def host_snapshot() -> dict[str, object]:
    """What real nodes change on the host, as comparable values."""
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout.splitlines()
    mounts = Path("/proc/self/mountinfo").read_text()
    ipsets = (
        subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True).stdout.split()
        if shutil.which("ipset")
        else []
    )
    return {
        "sysctls": hoststate.read_sysctls(),
        "kube_rules": [line for line in rules if "KUBE-" in line or "CNI-" in line],
        "bridges": sorted(
            line.split(":")[1].strip()
            for line in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.splitlines()
            if ": oobk" in line
        ),
        "cgroups": sorted(str(p) for h in hoststate.cgroup_hierarchies() for p in h.glob("oobleck-real-*")),
        "mounts": [line for line in mounts.splitlines() if str(realnodes.STATE_ROOT) in line],
        "node_folders": sorted(p.name for p in realnodes.STATE_ROOT.glob("*")) if realnodes.STATE_ROOT.is_dir() else [],
        "fixed_paths": [p for p in hoststate.FIXED_PATHS if Path(p).exists()],
        "router_chains": sorted({line.split()[0] for line in rules if line.startswith(":KUBE-ROUTER-")}),
        "ipsets": sorted(name for name in ipsets if name.startswith(kuberouter.IPSET_PREFIXES)),
    }


def sleeper_pod(image: str) -> dict[str, object]:
    command = ["python", "-c", "import time; time.sleep(3600)"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "sleeper"},
        "spec": {
            "nodeSelector": realnodes.NODE_SELECTOR,
            "containers": [{"name": "c", "image": image, "command": command}],
        },
    }


def test_down_leaves_the_host_as_up_found_it():
    problem = realnodes.host_problem()
    if problem:
        pytest.skip(problem)
    kuberouter.binary()  # ipset installed before `before` is read
    before = host_snapshot()
    control_plane = ControlPlane(advertise_address=realnodes.host_address()).start()
    nodes = realnodes.RealNodes(control_plane, n=1)
    try:
        nodes.up()
        control_plane.kubectl("apply", "-f", "-", input=json.dumps(POLICY))
        control_plane.kubectl("apply", "-f", "-", input=json.dumps(sleeper_pod(nodes.image)))
        control_plane.kubectl("wait", "pod/sleeper", "--for=jsonpath={.status.phase}=Running", "--timeout=300s")
        nodes.enforce_network_policy(nodes.names[0])
        deadline = time.monotonic() + 120
        while not ((during := host_snapshot())["ipsets"] and during["router_chains"]):
            assert time.monotonic() < deadline, f"kube-router wrote no chains or ipsets: {during}"
            time.sleep(1)
        assert during["bridges"] == ["oobk1"] and during["mounts"] and during["kube_rules"], during
        # The pod's processes, from the node's cgroups (the sandbox's pause and the container's python).
        pids = {
            int(pid)
            for procs in Path("/sys/fs/cgroup/pids/oobleck-real-1").rglob("cgroup.procs")
            for pid in procs.read_text().split()
        }
        assert len(pids) >= 2, pids
    finally:
        nodes.down()
        control_plane.stop()
    assert host_snapshot() == before
    assert not [pid for pid in pids if hoststate_alive(pid)], "the pod's processes outlived down()"


def hoststate_alive(pid: int) -> bool:
    from oobleck_dev.controlplane import process_start_time

    return process_start_time(pid) is not None


def test_reap_undoes_the_nodes_of_a_killed_owner():
    """`python -m oobleck_dev real-nodes` SIGKILLed with its node up (a container running under a shim that
    outlives it): `real-nodes --reap` puts the host back as it was."""
    problem = realnodes.host_problem()
    if problem:
        pytest.skip(problem)
    before = host_snapshot()
    owner = subprocess.Popen(
        [sys.executable, "-m", "oobleck_dev", "real-nodes", "--count", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert owner.stdout is not None
    try:
        lines = []
        deadline = time.monotonic() + 900
        while not any(line.startswith("Ctrl-C") for line in lines):
            line = owner.stdout.readline()
            assert line and time.monotonic() < deadline, "real-nodes did not come up:\n" + "".join(lines)
            lines.append(line)
        kubeconfig = next(line.split(": ", 1)[1].strip() for line in lines if line.startswith("kubeconfig: "))
        image = next(line.split("(image ", 1)[1].split(")")[0] for line in lines if line.startswith("real nodes: "))
        kubectl = [str(find_tools().kubectl), "--kubeconfig", kubeconfig]
        pod = sleeper_pod(image)
        subprocess.run(
            [*kubectl, "apply", "-f", "-"], input=json.dumps(pod), text=True, check=True, capture_output=True
        )
        subprocess.run(
            [*kubectl, "wait", "pod/sleeper", "--for=jsonpath={.status.phase}=Running", "--timeout=300s"],
            check=True,
            capture_output=True,
        )
    finally:
        owner.kill()
        owner.wait(60)
    left = host_snapshot()
    assert left["bridges"] == ["oobk1"] and left["node_folders"], "nothing was left to reap"
    reaped = subprocess.run(
        [sys.executable, "-m", "oobleck_dev", "real-nodes", "--reap"], capture_output=True, text=True, timeout=300
    )
    assert reaped.returncode == 0 and "undid" in reaped.stdout, reaped.stdout + reaped.stderr
    assert host_snapshot() == before
