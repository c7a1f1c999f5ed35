"""Real nodes for the tests in this folder: a control plane that advertises this host's address, and two
kubelet + containerd nodes (a module's REAL_NODES, if it sets one) running the project image
(oobleck_dev.realnodes), once per test module (a module that starts its own waits for the host lock).

Skipped, with the reason, only where the host cannot run nodes at all (not root, no cgroups); anything
else that goes wrong (a build, the import, a node that never turns Ready) is a failure.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from oobleck_dev import realnodes
from oobleck_dev.controlplane import Cluster, ControlPlane
from tests.realnodes.jobs import RealJob, job_served

NODES = 2


@pytest.fixture(scope="module")
def real_cluster(request: pytest.FixtureRequest) -> Iterator[tuple[Cluster, realnodes.RealNodes]]:
    """The module's nodes: NODES, or the module's own REAL_NODES."""
    problem = realnodes.host_problem()
    if problem:
        pytest.skip(problem)
    control_plane = ControlPlane(advertise_address=realnodes.host_address()).start()
    nodes = realnodes.RealNodes(control_plane, n=getattr(request.module, "REAL_NODES", NODES))
    try:
        nodes.up()
        print(f"real nodes up: {nodes.figures}; disk: {nodes.disk_used()}")
        yield Cluster.local(control_plane), nodes
    finally:
        nodes.down()
        control_plane.stop()


@pytest.fixture
def real_job(real_cluster, tmp_path: Path) -> Iterator[RealJob]:
    """One job on the module's real nodes, served by an operator of its own (tests/realnodes/jobs.py)."""
    with job_served(*real_cluster, tmp_path) as job:
        yield job
