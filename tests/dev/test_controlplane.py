"""The local control plane: real binaries, real processes, no mocks of the Kubernetes API."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from oobleck_dev import controlplane, kwok, poll
from oobleck_dev.controlplane import Cluster, ControlPlane, port_in_use, process_start_time, reap_stale_workdirs
from oobleck_dev.tools import find_tools

pytestmark = pytest.mark.integration  # starts processes (see tests/conftest.py: make test-unit)


REPO = Path(__file__).resolve().parents[2]
TEST_CRDS = Path(__file__).with_name("data") / "crds"
# Polls for controllers reacting (garbage collector, scheduler, kwok).
REACT_TIMEOUT_S = 90.0


def wait_until(check: Callable[[], object], what: str, timeout: float = REACT_TIMEOUT_S) -> object:
    return poll.wait_until(check, what, timeout, 0.25)


def pinned_kubernetes_version() -> str:
    go_mod = (REPO / "scripts" / "k8s-tools" / "kubernetes" / "go.mod").read_text()
    return re.search(r"^\s*k8s\.io/kubernetes (v\d+\.\d+\.\d+)", go_mod, re.M).group(1)


def local_only(cluster: Cluster) -> ControlPlane:
    if cluster.control_plane is None:
        pytest.skip("checks the local control plane itself (OOBLECK_USE_EXISTING_CLUSTER=1)")
    return cluster.control_plane


def pid_running(pid: int) -> bool:
    # A zombie has been killed already: only its parent's wait() is missing.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# --- the shared cluster ---------------------------------------------------------------------------


def test_version_is_the_pinned_release(cluster: Cluster) -> None:
    control_plane = local_only(cluster)
    expected = pinned_kubernetes_version()
    assert json.loads(cluster.kubectl("get", "--raw", "/version").stdout)["gitVersion"] == expected
    versions = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert versions["clientVersion"]["gitVersion"] == expected
    assert versions["serverVersion"]["gitVersion"] == expected
    assert control_plane.server.startswith("https://127.0.0.1:")


def test_a_namespace_create_answered_already_exists_is_ours_only_with_our_token(cluster: Cluster, monkeypatch) -> None:
    """`Cluster.namespace` takes AlreadyExists as its own create (a request sent twice) only when the namespace
    carries this call's token; a name someone else took is an error."""
    picks = iter(["c0ffee", "our-token", "bad5ee", "our-token"])
    monkeypatch.setattr(controlplane.secrets, "token_hex", lambda n: next(picks))
    for suffix, token in (("c0ffee", "our-token"), ("bad5ee", "someone-else")):
        name = f"echo-{cluster.owner}-{suffix}"
        metadata = {"name": name, "annotations": {controlplane.NAMESPACE_TOKEN_ANNOTATION: token}}
        cluster.kubectl(
            "create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": metadata})
        )
    assert cluster.namespace("echo") == f"echo-{cluster.owner}-c0ffee"
    with pytest.raises(controlplane.KubectlError, match="AlreadyExists"):
        cluster.namespace("echo")
    cluster.kubectl("delete", "namespace", f"echo-{cluster.owner}-bad5ee", "--wait=false")


def test_crds_from_the_repository_are_established(cluster: Cluster) -> None:
    local_only(cluster)
    files = sorted((REPO / "crds").glob("*.yaml"))
    if not files:
        pytest.skip("crds/ is empty")
    for path in files:
        name = yaml.safe_load(path.read_text())["metadata"]["name"]
        conditions = cluster.kubectl_json("get", "crd", name)["status"]["conditions"]
        assert any(c["type"] == "Established" and c["status"] == "True" for c in conditions), (name, conditions)


def test_rbac_denies_an_unprivileged_service_account(cluster: Cluster, tmp_path: Path) -> None:
    namespace = cluster.namespace("rbac")
    cluster.kubectl("create", "serviceaccount", "nobody", "-n", namespace)
    token = cluster.kubectl("create", "token", "nobody", "-n", namespace).stdout.strip()
    # A kubeconfig with the token only: no admin client certificate to fall back on.
    admin = cluster.kubectl_json("config", "view", "--raw", "--minify")
    token_kubeconfig = tmp_path / "nobody.kubeconfig"
    token_kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": admin["clusters"],
                "users": [{"name": "nobody", "user": {"token": token}}],
                "contexts": [
                    {"name": "nobody", "context": {"cluster": admin["clusters"][0]["name"], "user": "nobody"}}
                ],
                "current-context": "nobody",
            }
        )
    )
    as_nobody = ["--kubeconfig", str(token_kubeconfig), "-n", namespace]

    def nobody(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(cluster.bin.kubectl), *as_nobody, *args], capture_output=True, text=True, timeout=60)

    denied = nobody("get", "secrets")
    assert denied.returncode != 0
    assert "forbidden" in denied.stderr.lower() and f"system:serviceaccount:{namespace}:nobody" in denied.stderr
    # The same token works once RBAC grants it: the token was fine, RBAC said no.
    cluster.kubectl("create", "role", "read-secrets", "--verb=list", "--resource=secrets", "-n", namespace)
    cluster.kubectl(
        "create",
        "rolebinding",
        "read-secrets",
        "--role=read-secrets",
        f"--serviceaccount={namespace}:nobody",
        "-n",
        namespace,
    )
    wait_until(lambda: nobody("get", "secrets").returncode == 0, "the RoleBinding to take effect", 30)


def test_garbage_collector_deletes_owned_replicasets(cluster: Cluster) -> None:
    namespace = cluster.namespace("gc")
    cluster.kubectl("create", "deployment", "web", "--image=registry.k8s.io/pause:3.10", "-n", namespace)
    owner_uid = cluster.kubectl_json("get", "deployment", "web", "-n", namespace)["metadata"]["uid"]

    def owned_replicasets() -> list[dict]:
        items = cluster.kubectl_json("get", "replicasets", "-n", namespace)["items"]
        return [rs for rs in items if any(ref["uid"] == owner_uid for ref in rs["metadata"].get("ownerReferences", []))]

    wait_until(owned_replicasets, "the Deployment controller to create a ReplicaSet")
    cluster.kubectl("delete", "deployment", "web", "-n", namespace, "--cascade=background", "--wait=false")
    wait_until(lambda: not cluster.kubectl_json("get", "replicasets", "-n", namespace)["items"], "garbage collection")


def test_gpu_pod_runs_on_a_kwok_node(cluster: Cluster) -> None:
    names = cluster.add_kwok_nodes(2, gpus=8)
    try:
        group = cluster.kubectl_json("get", "node", names[0])["metadata"]["labels"][kwok.FAKE_GROUP_LABEL]
        namespace = cluster.namespace("kwok")

        def pod(name: str, gpus: int) -> str:
            return json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name, "namespace": namespace},
                    "spec": {
                        "nodeSelector": {kwok.FAKE_GROUP_LABEL: group},
                        "containers": [
                            {
                                "name": "main",
                                "image": "example.invalid/trainer",
                                "resources": {"limits": {kwok.GPU_RESOURCE: str(gpus)}},
                            }
                        ],
                    },
                }
            )

        cluster.kubectl("apply", "-f", "-", input=pod("fits", 8))
        cluster.kubectl("apply", "-f", "-", input=pod("too-big", 16))

        def running() -> dict | None:
            status = cluster.kubectl_json("get", "pod", "fits", "-n", namespace)
            return status if status["status"].get("phase") == "Running" else None

        status = wait_until(running, "the pod to run on a kwok node")
        assert status["spec"]["nodeName"] in names

        # 16 GPUs fit on no node: the scheduler counted nvidia.com/gpu.
        def unschedulable() -> bool:
            conditions = cluster.kubectl_json("get", "pod", "too-big", "-n", namespace)["status"].get("conditions", [])
            return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)

        wait_until(unschedulable, "the 16-GPU pod to be reported Unschedulable")
        assert (
            "Insufficient nvidia.com/gpu"
            in cluster.kubectl(
                "get", "pod", "too-big", "-n", namespace, "-o", "jsonpath={.status.conditions[0].message}"
            ).stdout
        )
    finally:
        cluster.delete_kwok_nodes(names)


@pytest.mark.slow
def test_a_thousand_kwok_nodes_register_with_gpus(cluster: Cluster) -> None:
    n, gpus = 1000, 8
    started = time.monotonic()
    names = cluster.add_kwok_nodes(n, gpus=gpus)
    created_s = time.monotonic() - started
    try:
        group = cluster.kubectl_json("get", "node", names[0])["metadata"]["labels"][kwok.FAKE_GROUP_LABEL]

        def ready_nodes() -> list[dict]:
            items = cluster.kubectl_json("get", "nodes", "-l", f"{kwok.FAKE_GROUP_LABEL}={group}")["items"]
            ready = [
                node
                for node in items
                if any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))
            ]
            return ready if len(ready) == n else []

        # Each look lists a thousand nodes (megabytes of JSON, a CPU-second): look every 2 s.
        nodes = poll.wait_until(ready_nodes, f"{n} kwok nodes to be Ready", 300, 2.0)
        ready_s = time.monotonic() - started
        assert sorted(node["metadata"]["name"] for node in nodes) == sorted(names)
        for node in nodes:
            assert node["status"]["capacity"][kwok.GPU_RESOURCE] == str(gpus)
            assert node["status"]["allocatable"][kwok.GPU_RESOURCE] == str(gpus)
        print(f"\n{n} kwok nodes: created in {created_s:.1f} s, all Ready after {ready_s:.1f} s")
    finally:
        cluster.delete_kwok_nodes(names)


# --- control planes of their own ------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.slow
def test_two_control_planes_side_by_side_one_past_a_taken_port_each_stop_leaving_nothing(
    tmp_path: Path, monkeypatch
) -> None:
    """Two planes at once (two test processes on one machine); the first port handed out, the first plane's
    etcd client port, is already in use as if someone took it between the pick and the bind; stopped, each
    plane leaves no process, port, work folder or kubeconfig. (One test: every plane start costs seconds of CPU.)"""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = iter([taken.getsockname()[1]])
    real_free_port = controlplane.free_port
    monkeypatch.setattr(controlplane, "free_port", lambda: next(picks, None) or real_free_port())
    kubeconfig = tmp_path / "admin.kubeconfig"
    tools = find_tools()
    planes = [ControlPlane(tools, kubeconfig=kubeconfig, crds_dir=TEST_CRDS), ControlPlane(tools, crds_dir=None)]
    try:
        with planes[0] as first, planes[1] as second:
            assert first.ports["etcd"] != taken.getsockname()[1]
            assert first.server != second.server and first.workdir != second.workdir
            first.kubectl("create", "namespace", "only-in-first")
            assert second.kubectl("get", "namespace", "only-in-first", check=False).returncode != 0
            # The CRDs of crds_dir are installed and Established before start() returns.
            crd = json.loads(first.kubectl("get", "crd", "widgets.test.oobleck.dev", "-o", "json").stdout)
            assert any(c["type"] == "Established" and c["status"] == "True" for c in crd["status"]["conditions"])
            first.start_kwok()
            assert set(first.pids()) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"}
            running = [(plane.pids(), dict(plane.ports), plane.workdir) for plane in planes]
            for pids, ports, workdir in running:
                assert all(pid_running(pid) for pid in pids.values())
                assert all(port_in_use(port) for port in ports.values())
                assert workdir.is_dir()
            assert kubeconfig.is_file()
            print(f"\ncold start {first.started_in_s:.1f} s: {first.phase_s}")
    finally:
        taken.close()
    for pids, ports, workdir in running:
        assert not [name for name, pid in pids.items() if pid_running(pid)]
        assert not [name for name, port in ports.items() if port_in_use(port)]
        assert not workdir.exists()
    assert not kubeconfig.exists()


def own_children() -> set[str]:
    return set(Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split())


@pytest.mark.cluster
@pytest.mark.slow
def test_failed_start_cleans_up(tmp_path: Path) -> None:
    broken = tmp_path / "crds"
    broken.mkdir()
    (broken / "bad.yaml").write_text(
        "apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\nmetadata: {name: bad}\nspec: {}\n"
    )
    before = own_children()
    control_plane = ControlPlane(find_tools(), crds_dir=broken)
    with pytest.raises(Exception, match='CustomResourceDefinition "bad" is invalid'):
        control_plane.start()
    assert control_plane.workdir is None and control_plane.processes == []
    assert own_children() <= before  # every child start() spawned is gone (and reaped)


OWNER_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from oobleck_dev.controlplane import ControlPlane
    # A folder of its own: another control plane starting on this machine (a parallel test) would
    # otherwise reap the orphaned work folder before this test looks at it.
    plane = ControlPlane(crds_dir=None, workdir_parent=sys.argv[1]).start()
    plane.start_kwok()
    print(json.dumps({"pids": plane.pids(), "workdir": str(plane.workdir)}), flush=True)
    time.sleep(600)
    """
)


@pytest.mark.cluster
@pytest.mark.slow
def test_sigkill_of_the_owner_leaves_no_orphans(tmp_path: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        line = owner.stdout.readline()
        assert line, "the owner process died before reporting its control plane"
        report = json.loads(line)
    finally:
        owner.kill()  # SIGKILL: no atexit, no finally; only PR_SET_PDEATHSIG is left
        owner.wait()
    pids = report["pids"]
    # The children were reparented to init (or a subreaper), which reaps them.
    wait_until(lambda: not [pid for pid in pids.values() if pid_running(pid)], "the children to die", 30)
    # The orphaned work folder goes on the next start on this machine (or an explicit reap).
    workdir = Path(report["workdir"])
    assert workdir.exists()
    assert workdir in reap_stale_workdirs(workdir.parent)
    assert not workdir.exists()


def test_reaping_skips_a_folder_removed_while_it_looks(tmp_path: Path) -> None:
    """Another plane stopping removes its work folder between the reaper's glob and its look (a CI run's
    plane start failed so, 2026-11-27): the reaper passes it by. A dangling link stands for that folder."""
    (tmp_path / f"{controlplane.WORKDIR_PREFIX}gone").symlink_to(tmp_path / "removed")
    starting = tmp_path / f"{controlplane.WORKDIR_PREFIX}starting"  # no owner file yet, just made: kept
    starting.mkdir()
    assert reap_stale_workdirs(tmp_path) == []
    assert starting.is_dir()


# --- `oobleck dev` ----------------------------------------------------------------------------------


def oobleck(*args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "oobleck_dev", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
    )


@pytest.mark.cluster
@pytest.mark.slow
def test_dev_up_status_down(tmp_path: Path) -> None:
    state = tmp_path / "state"
    up = oobleck("up", "--state-dir", str(state), "--kwok-nodes", "3", "--gpus-per-node", "4")
    try:
        assert up.returncode == 0, up.stderr
        kubeconfig = state / "kubeconfig"
        assert f"export KUBECONFIG={kubeconfig}" in up.stdout
        record = json.loads((state / "state.json").read_text())

        status = oobleck("status", "--state-dir", str(state))
        assert status.returncode == 0, status.stdout + status.stderr
        assert "readyz:     ok" in status.stdout

        again = oobleck("up", "--state-dir", str(state))
        assert again.returncode == 0 and "already up" in again.stdout

        nodes = json.loads(
            subprocess.run(
                [str(find_tools().kubectl), "--kubeconfig", str(kubeconfig), "get", "nodes", "-o", "json"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )["items"]
        assert len(nodes) == 3
        assert {node["status"]["allocatable"][kwok.GPU_RESOURCE] for node in nodes} == {"4"}
    finally:
        down = oobleck("down", "--state-dir", str(state))
    assert down.returncode == 0 and "down" in down.stdout, down.stdout + down.stderr
    stamps = [record["supervisor"], *record["processes"].values()]
    assert not [stamp for stamp in stamps if process_start_time(int(stamp.split()[0])) == stamp.split()[1]]
    assert not [port for port in record["ports"].values() if port_in_use(port)]
    assert not Path(record["workdir"]).exists()
    assert not state.exists()
    assert oobleck("status", "--state-dir", str(state)).returncode == 3
    second = oobleck("down", "--state-dir", str(state))
    assert second.returncode == 0 and "not running" in second.stdout


@pytest.mark.cluster
@pytest.mark.slow
def test_dev_down_after_the_supervisor_was_killed(tmp_path: Path) -> None:
    state = tmp_path / "state"
    up = oobleck("up", "--state-dir", str(state))
    assert up.returncode == 0, up.stderr
    record = json.loads((state / "state.json").read_text())
    os.kill(int(record["supervisor"].split()[0]), signal.SIGKILL)
    pids = [int(stamp.split()[0]) for stamp in record["processes"].values()]
    wait_until(
        lambda: not [pid for pid in pids if pid_running(pid)], "the control plane to die with its supervisor", 30
    )
    assert oobleck("status", "--state-dir", str(state)).returncode == 3
    down = oobleck("down", "--state-dir", str(state))
    assert down.returncode == 0 and "removed stale state" in down.stdout
    assert not state.exists() and not Path(record["workdir"]).exists()


def test_dev_rejects_bad_arguments() -> None:
    result = oobleck("up", "--kwok-nodes", "-1")
    assert result.returncode == 2
    assert "--kwok-nodes" in result.stderr and "must be >= 0" in result.stderr


def test_dev_up_without_tools_says_how_to_get_them(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("KUBEBUILDER_ASSETS", "OOBLECK_K8S_TOOLS_FROM_PATH")}
    env["OOBLECK_CACHE"] = str(tmp_path / "empty-cache")  # where scripts/k8s-tools/build looks
    result = oobleck("up", "--state-dir", str(tmp_path / "state"), env=env)
    assert result.returncode == 1
    assert "missing etcd" in result.stderr and "scripts/k8s-tools/build" in result.stderr
    assert not (tmp_path / "state").exists()


def test_free_port_never_picks_a_port_the_jobs_pods_listen_on(monkeypatch) -> None:
    # An operator's metrics on 0.0.0.0:29500 once made every local-node worker's /metrics bind fail.
    from oobleck.api.contract import FIXED_PORTS, STORE_PORT, WORKER_PORT

    draws = iter([WORKER_PORT, STORE_PORT, WORKER_PORT + 63, 25_000])
    monkeypatch.setattr(controlplane.secrets, "randbelow", lambda _: next(draws) - controlplane.PRIVATE_PORTS_FROM)
    # The fourth draw, or the kernel's ephemeral range if 25000 is taken on this host: never a fixed port.
    assert controlplane.free_port() not in FIXED_PORTS
    assert {STORE_PORT, WORKER_PORT, WORKER_PORT + 63} <= FIXED_PORTS and WORKER_PORT + 64 not in FIXED_PORTS
