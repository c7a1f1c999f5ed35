"""kube-router on a real node leaves nothing behind: `down` removes its iptables chains and its ipsets, and
the host is as `up` found it (test_nodes.py checks the same of the nodes themselves)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from oobleck_dev import kuberouter, realnodes
from oobleck_dev.controlplane import ControlPlane
from tests.realnodes.marks import realnode_marks

from .test_nodes import host_snapshot, sleeper_pod

pytestmark = realnode_marks(3600)

POLICY = {
    "apiVersion": "networking.k8s.io/v1",
    "kind": "NetworkPolicy",
    "metadata": {"name": "sleeper-from-peers"},
    "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": {}}]}]},
}


def with_firewall() -> dict[str, object]:
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout.splitlines()
    ipsets = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True).stdout.split()
    return {
        **host_snapshot(),
        "router_chains": sorted({line.split()[0] for line in rules if line.startswith(":KUBE-ROUTER-")}),
        "ipsets": sorted(name for name in ipsets if name.startswith(kuberouter.IPSET_PREFIXES)),
    }


def test_down_removes_kube_routers_chains_and_ipsets():
    problem = realnodes.host_problem()
    if problem:
        pytest.skip(problem)
    kuberouter.binary()  # ipset installed before `before` is read
    before = with_firewall()
    control_plane = ControlPlane(advertise_address=realnodes.host_address()).start()
    nodes = realnodes.RealNodes(control_plane, n=1)
    try:
        nodes.up()
        control_plane.kubectl("apply", "-f", "-", input=json.dumps(POLICY))
        control_plane.kubectl("apply", "-f", "-", input=json.dumps(sleeper_pod(nodes.image)))
        control_plane.kubectl("wait", "pod/sleeper", "--for=jsonpath={.status.phase}=Running", "--timeout=300s")
        nodes.enforce_network_policy(nodes.names[0])
        deadline = time.monotonic() + 120
        while not ((during := with_firewall())["ipsets"] and during["router_chains"]):
            assert time.monotonic() < deadline, f"kube-router wrote no chains or ipsets: {during}"
            time.sleep(1)
    finally:
        nodes.down()
        control_plane.stop()
    assert with_firewall() == before
