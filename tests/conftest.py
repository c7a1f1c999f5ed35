"""Fixtures shared by every test folder: the `cluster` a test talks to.

By default each pytest process (each pytest-xdist worker) starts one local control plane
(etcd + kube-apiserver + controller-manager + scheduler, RBAC on, CRDs from crds/ installed) for
the whole session and stops it at the end — also after failures and Ctrl-C. With
`OOBLECK_USE_EXISTING_CLUSTER=1` and `KUBECONFIG` set, the same tests run against that cluster.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from oobleck_dev.controlplane import Cluster
    from oobleck_dev.nodeagent import NodeAgent

USE_EXISTING = "OOBLECK_USE_EXISTING_CLUSTER"


UNIT_TIER_EXCLUDES = ("cluster", "integration", "slow", "gpu", "image", "realnodes")
"""Markers of the tests `--unit` (make test-unit) leaves out: everything that needs a process, a
cluster, a GPU or more than a few seconds."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--unit",
        action="store_true",
        help="the unit tier: pure tests only (no cluster, no processes, no GPU); a test that starts a process fails",
    )
    parser.addoption(
        "--realnodes",
        action="store_true",
        help="also run the tests on real kubelet + containerd nodes (scripts/test runs them in a pytest run of their own; root)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A test that uses the cluster is a cluster test, marked or not (`-m "not cluster"` skips it).
    for item in items:
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)
    if not config.getoption("--realnodes"):
        # A run of their own (`make test` starts it beside this one at nice 19): in the same xdist run
        # they took a worker from the rest for minutes and their load failed local-node e2e tests on timing.
        kept = [item for item in items if not item.get_closest_marker("realnodes")]
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
    if config.getoption("--unit"):
        kept = [item for item in items if not any(item.get_closest_marker(m) for m in UNIT_TIER_EXCLUDES)]
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


@pytest.fixture(autouse=True)
def _the_job_key_variable_is_left_as_found() -> Iterator[None]:
    """A test that leaves $OOBLECK_JOB_KEY_FILE set gives every later test in its process a keyed job_signer(),
    and unsealed marks they write no longer verify (a CI run failed that way, depending on xdist's order)."""
    before = os.environ.get("OOBLECK_JOB_KEY_FILE")
    yield
    after = os.environ.get("OOBLECK_JOB_KEY_FILE")
    assert after == before, f"the test changed OOBLECK_JOB_KEY_FILE from {before!r} to {after!r}"


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In the unit tier, starting a process is an error: such a test belongs to the integration tier
    (mark its module `pytestmark = pytest.mark.integration`)."""
    if not request.config.getoption("--unit"):
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a unit test starts no process: mark the test or its module `integration`")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """A running Kubernetes cluster for this test process (session scope, one per xdist worker).

    Interface (stable; other folders' tests rely on it):
    - `.kubeconfig` (str): an admin kubeconfig path. `.server` (str): the API server URL.
    - `.bin`: `oobleck_dev.tools.K8sTools` (`.bin.kubectl`, `.bin.helm`, ...), never PATH's kubectl.
    - `.kubectl(*args, input=None, check=True, timeout=None) -> subprocess.CompletedProcess`:
      text mode, stdout/stderr captured, raises `KubectlError` (stderr in the message) if `check`.
      `.kubectl_json(*args)` adds `-o json` and parses.
    - `.namespace(name_prefix="test") -> str`: a fresh namespace whose `default` ServiceAccount
      exists. Isolate each test in its own namespace; names never repeat across workers.
    - `.start_kwok()`: run the kwok controller (once per session; idempotent).
    - `.add_kwok_nodes(n, gpus=8, **options) -> list[str]`: register fake nodes with
      `nvidia.com/gpu: gpus` (starts kwok; pods bound to them become Running). Nodes are
      cluster-wide and shared by the tests of this worker: select yours with the node label
      `oobleck.dev/fake-node-group` (`kwok.FAKE_GROUP_LABEL`, one value per call; read it from a
      returned node), and remove them with `.delete_kwok_nodes(names)` when a test is done.
    - `.control_plane`: the local `ControlPlane`, or None on an existing cluster.
    - `.owner`: a DNS-safe tag unique to this worker, part of every name it creates.
    On an existing cluster the namespaces and nodes created are deleted at the end of the session.
    """
    # Imported here so that test folders which never use the cluster do not import it.
    from oobleck_dev.controlplane import Cluster, ControlPlane
    from oobleck_dev.tools import ToolsNotFound, find_tools

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    owner = f"{worker}-{secrets.token_hex(2)}".lower()
    try:
        tools = find_tools()
    except ToolsNotFound as error:
        pytest.fail(f"cannot run cluster tests: {error}", pytrace=False)
    if os.environ.get(USE_EXISTING) == "1":
        kubeconfig = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
        if not kubeconfig:
            pytest.fail(f"{USE_EXISTING}=1 needs KUBECONFIG to name the cluster's kubeconfig", pytrace=False)
        handle = Cluster.existing(kubeconfig, tools, owner=owner)
        try:
            yield handle
        finally:
            handle.close()
        return
    with ControlPlane(tools) as control_plane:
        handle = Cluster.local(control_plane, owner=owner)
        try:
            yield handle
        finally:
            handle.close()


@pytest.fixture(scope="module")
def local_nodes(
    cluster: Cluster, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NodeAgent]:
    """A local node agent on the session cluster for one test module: nodes whose pods run as processes.

    Default: 2 nodes x 2 `nvidia.com/gpu`; a module overrides any `NodeAgent` keyword with a
    module-level dict `LOCAL_NODES = {"nodes": 4, "gpus_per_node": 8, "timeouts": AgentTimeouts(...)}`.
    Nodes are named `local-<owner>-<random>-<i>`; pin pods to them with `nodeSelector:
    agent.node_selector` (kwok nodes of the same session also offer GPUs). Container logs and pod
    folders stay in a pytest temp folder (`agent.workdir`). Stopped at the end of the module: no
    process is left and the nodes are deleted. See `oobleck_dev.nodeagent.NodeAgent`.
    """
    from oobleck_dev.nodeagent import NodeAgent

    options = {"nodes": 2, "gpus_per_node": 2, **getattr(request.module, "LOCAL_NODES", {})}
    agent = NodeAgent(
        cluster.kubeconfig,
        name_prefix=f"local-{cluster.owner}-{secrets.token_hex(2)}-",
        workdir=tmp_path_factory.mktemp("nodeagent"),
        **options,
    )
    with agent:
        yield agent
