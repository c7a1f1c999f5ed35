"""Real nodes for the tests in this folder: a control plane that advertises this host's address, and three
kubelet + containerd nodes running the project image (oobleck_dev.realnodes), started once for the run and
shared by every test that takes `real_cluster` (each job in a namespace of its own, torn down after it).

A host runs one set of real nodes at a time (its host lock), so the tests that start nodes of their own run
first, and the shared nodes stay up from the first test that needs them to the end of the run.

Skipped, with the reason, only where the host cannot run nodes at all (not root, no cgroups); anything
else that goes wrong (a build, the import, a node that never turns Ready) is a failure.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from oobleck_dev import realnodes
from oobleck_dev.controlplane import Cluster, ControlPlane
from tests.realnodes.jobs import RealJob, job_served

NODES = 3
"""Two members of a job and a third node for a warm spare or a replacement pod (test_spares_in_containers)."""


LOCAL_SUITE_DONE_ENV = "OOBLECK_LOCAL_SUITE_DONE"
"""A file scripts/test touches once the local suite beside this run has ended (unset: nothing runs beside)."""
LOCAL_SUITE_WAIT_S = 75 * 60


def _order(item: pytest.Item) -> int:
    """Own nodes first (0), then the shared nodes (1), their timing checks (2, see `quiet_host`); last (3), a
    module that leaves kube-router enforcing NetworkPolicies on a shared node (LEAVES_POLICY_ENFORCED), so
    that no other job's story runs under it."""
    if "real_cluster" not in getattr(item, "fixturenames", ()):
        return 0
    if getattr(getattr(item, "module", None), "LEAVES_POLICY_ENFORCED", False):
        return 3
    return 2 if item.get_closest_marker("quiet_host") else 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--realnodes"):
        items.sort(key=lambda item: _order(item) if item.get_closest_marker("realnodes") else 0)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A timing check (marked quiet_host) first waits for the local suite beside this run to end: at nice 19
    under it the pods, the operator and the test's polls wait behind a load of 12-20 and time that, not the
    product. Outermost (tryfirst), so that the wait is not counted in the test's timeout."""
    done = os.environ.get(LOCAL_SUITE_DONE_ENV)
    if done and item.get_closest_marker("quiet_host") and not Path(done).exists():
        started = time.monotonic()
        print(f"\n{item.nodeid}: waiting for the local suite to end ({done})", flush=True)
        while not Path(done).exists() and time.monotonic() - started < LOCAL_SUITE_WAIT_S:
            time.sleep(2.0)
        # Past the wait the check runs anyway (an error raised here would end the whole session).
        print(f"waited {time.monotonic() - started:.0f} s", flush=True)
    yield


@pytest.fixture(scope="session")
def real_cluster() -> Iterator[tuple[Cluster, realnodes.RealNodes]]:
    """The run's shared nodes."""
    problem = realnodes.host_problem()
    if problem:
        pytest.skip(problem)
    control_plane = ControlPlane(advertise_address=realnodes.host_address()).start()
    nodes = realnodes.RealNodes(control_plane, n=NODES)
    try:
        nodes.up()
        print(f"real nodes up: {nodes.figures}; disk: {nodes.disk_used()}")
        yield Cluster.local(control_plane), nodes
    finally:
        nodes.down()
        control_plane.stop()


@pytest.fixture
def real_job(real_cluster, tmp_path: Path) -> Iterator[RealJob]:
    """One job on the shared real nodes, served by an operator of its own (tests/realnodes/jobs.py)."""
    with job_served(*real_cluster, tmp_path) as job:
        yield job
