"""The chart against the real local control plane: `helm install`, the objects it creates, the
operator run with exactly the chart's RBAC identity through a job's lifecycle, `helm uninstall`.

One release per test module (one pytest-xdist worker runs the whole module, in order): the operator
in one fresh namespace serving another fresh namespace, leader election on (so the peering CRDs,
the KopfPeering post-install hook and the peering permissions are exercised too).

RBAC sufficiency: the operator runs as a subprocess (`python -m oobleck.cli operator`) with the
Deployment's own arguments, logged in with a TokenRequest token of the chart's ServiceAccount, and
must take examples/tiny-gpt.yaml from creation to deletion without a single forbidden answer.
Only the ports (free ones), the kubeconfig and the peering priority differ from the Deployment: the
priority is one higher so that, on a real cluster where the Deployment's pod runs, that replica
pauses and this one acts.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from oobleck.api import planmap
from oobleck.api.resource import JOB_LABEL
from oobleck.operator import render
from oobleck_dev.chart import CHART_PATH
from oobleck_dev.controlplane import free_port
from oobleck_dev.poll import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.xdist_group("helm-chart")]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / CHART_PATH
EXAMPLE = REPO / "examples" / "tiny-gpt.yaml"
POOL_LABEL = "oobleck-test/helm-pool"
TIMEOUT_S = 90.0
# Log lines that mean the chart's RBAC lacks something (API answers, kopf's own warnings).
PERMISSION_MARKERS = ("forbidden", "not enough permissions", "http 403", "status 403", "403 forbidden")


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = TIMEOUT_S) -> Any:
    return wait_until(predicate, what, timeout, 0.3, tolerate=(Exception,))  # the object may not exist yet


@dataclass
class Release:
    """One installed release of the chart."""

    cluster: Any
    name: str
    namespace: str  # where the operator's Deployment and ServiceAccount live
    served: str  # the namespace the operator serves
    peering: str
    uninstalled: bool = False

    @property
    def fullname(self) -> str:
        return f"{self.name}-oobleck-operator"

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        helm = self.cluster.bin.helm
        result = subprocess.run(
            [str(helm), "--kubeconfig", self.cluster.kubeconfig, *args], capture_output=True, text=True, timeout=300
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
            )
        return result

    def uninstall(self) -> None:
        if not self.uninstalled:
            self.helm("uninstall", self.name, "--namespace", self.namespace, "--wait", "--timeout", "2m")
            self.uninstalled = True


@pytest.fixture(scope="module")
def release(cluster, tmp_path_factory) -> Iterator[Release]:
    if cluster.bin.helm is None:
        pytest.fail("helm not found: run scripts/k8s-tools/build", pytrace=False)
    rel = Release(
        cluster=cluster,
        name=f"h{secrets.token_hex(3)}",
        namespace=cluster.namespace("helm-op"),
        served=cluster.namespace("helm-jobs"),
        peering="oobleck-operator",
    )
    values = {
        "operator": {"watchNamespaces": [rel.served]},
        "leaderElection": {"enabled": True, "name": rel.peering, "priority": 1},
        "crds": {"install": True, "keep": True},  # keep: the session's other tests use the CRD
        # The control plane installed the same cluster-wide policy at start, and the session's other tests
        # rely on it: an uninstall here would delete it (its rendering is in tests/helm/golden).
        "workerPolicy": {"install": False},
    }
    values_file = tmp_path_factory.mktemp("helm") / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    # The control plane installed crds/ at start: the release adopts that CRD (same content, see
    # tests/helm/test_chart.py) instead of refusing to touch an object it did not create.
    rel.helm(
        "install",
        rel.name,
        str(CHART),
        "--namespace",
        rel.namespace,
        "--values",
        str(values_file),
        "--take-ownership",
        "--timeout",
        "2m",
    )
    try:
        yield rel
    finally:
        rel.uninstall()


# -- install ----------------------------------------------------------------------------------------


def test_install_creates_the_operator_its_rbac_and_established_crds(release: Release) -> None:
    cluster, ns = release.cluster, release.namespace
    deployment = cluster.kubectl_json("get", "deployment", release.fullname, "-n", ns)
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == release.fullname
    assert pod["containers"][0]["command"] == ["oobleck", "operator"]
    assert f"--namespace={release.served}" in pod["containers"][0]["args"]
    # The API server accepted the secure defaults as they are.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    # The ReplicaSet controller created a pod from the template: the pod spec passes validation.
    # (It stays Pending, or "runs" on a kwok node: nothing executes the image here.)
    selector = f"app.kubernetes.io/instance={release.name},app.kubernetes.io/component=operator"
    pods = wait_for(
        lambda: cluster.kubectl_json("get", "pods", "-n", ns, "-l", selector)["items"], "the operator's pod"
    )
    assert pods[0]["spec"]["containers"][0]["env"][0] == {
        "name": "POD_ID",
        "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}},
    }
    cluster.kubectl("get", "serviceaccount", release.fullname, "-n", ns)
    cluster.kubectl("get", "service", f"{release.fullname}-metrics", "-n", ns)
    for kind, name in [
        ("clusterrole", f"{release.fullname}-cluster"),
        ("clusterrole", f"{release.fullname}-jobs"),
        ("clusterrolebinding", f"{release.fullname}-cluster"),
    ]:
        cluster.kubectl("get", kind, name)
    binding = cluster.kubectl_json("get", "rolebinding", f"{release.fullname}-jobs", "-n", release.served)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": release.fullname, "namespace": ns}]
    for crd in ("oobleckjobs.oobleck.dev", "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"):
        body = cluster.kubectl_json("get", "crd", crd)
        established = [c for c in body["status"]["conditions"] if c["type"] == "Established"]
        assert established and established[0]["status"] == "True", crd
        assert body["metadata"]["annotations"]["meta.helm.sh/release-name"] == release.name
    # The post-install hook created the peering object kopf needs (kopf never creates it).
    cluster.kubectl("get", "kopfpeering", release.peering, "-n", release.served)
    # Not cluster-wide: no binding of the job permissions outside the served namespace.
    assert cluster.kubectl("get", "clusterrolebinding", f"{release.fullname}-jobs", check=False).returncode != 0


def test_upgrade_keeps_the_live_peering_object(release: Release) -> None:
    """Recreating the peering object would wipe its status (a paused replica would resume)."""
    cluster = release.cluster
    before = cluster.kubectl_json("get", "kopfpeering", release.peering, "-n", release.served)["metadata"]["uid"]
    release.helm(
        "upgrade", release.name, str(CHART), "--namespace", release.namespace, "--reuse-values", "--timeout", "2m"
    )
    after = cluster.kubectl_json("get", "kopfpeering", release.peering, "-n", release.served)["metadata"]["uid"]
    assert after == before
    history = yaml.safe_load(
        release.helm("history", release.name, "--namespace", release.namespace, "-o", "yaml").stdout
    )
    assert [entry["status"] for entry in history] == ["superseded", "deployed"]


# -- RBAC sufficiency -------------------------------------------------------------------------------


def service_account_kubeconfig(cluster, release: Release, path: Path) -> Path:
    """A kubeconfig that authenticates as the chart's ServiceAccount (TokenRequest), nothing else."""
    token = cluster.kubectl(
        "create", "token", release.fullname, "-n", release.namespace, "--duration=1h"
    ).stdout.strip()
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    cluster_entry = admin["clusters"][0]["cluster"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster_entry}],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "c", "user": "operator"}}],
        "current-context": "operator",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def as_operator(cluster, kubeconfig: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(cluster.bin.kubectl), "--kubeconfig", str(kubeconfig), *args], capture_output=True, text=True, timeout=60
    )
    if check and result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} (as the operator) failed:\n{result.stderr}")
    return result


def operator_command(cluster, release: Release, kubeconfig: Path, metrics_port: int, liveness_port: int) -> list[str]:
    """The installed Deployment's command, run here: ports, kubeconfig and priority swapped."""
    deployment = cluster.kubectl_json("get", "deployment", release.fullname, "-n", release.namespace)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    command, args = container["command"], container["args"]
    assert command == ["oobleck", "operator"], command
    replaced = {"--metrics-port": str(metrics_port), "--liveness-port": str(liveness_port), "--priority": "2"}
    out = []
    for arg in args:
        flag, _, _value = arg.partition("=")
        out.append(f"{flag}={replaced[flag]}" if flag in replaced else arg)
    assert "--priority=2" in out and "--peering=" + release.peering in out, out
    # kwok pods run no runtime, so nobody measures the example's profile: plan with the estimate at once.
    return [
        sys.executable,
        "-m",
        "oobleck.cli",
        *command[1:],
        *out,
        "--kubeconfig",
        str(kubeconfig),
        "--measure-timeout",
        "0",
    ]


def tiny_gpt(namespace: str, pool: str) -> str:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"]["namespace"] = namespace
    # Only this test's fake nodes (other tests of the session register theirs too).
    body["spec"].setdefault("pod", {})["nodeSelector"] = {POOL_LABEL: pool}
    return yaml.safe_dump(body)


def test_operator_with_the_charts_identity_runs_a_job_lifecycle(release: Release, tmp_path: Path) -> None:
    cluster, served = release.cluster, release.served
    kubeconfig = service_account_kubeconfig(cluster, release, tmp_path / "operator.kubeconfig")
    whoami = json.loads(as_operator(cluster, kubeconfig, "auth", "whoami", "-o", "json").stdout)
    assert whoami["status"]["userInfo"]["username"] == f"system:serviceaccount:{release.namespace}:{release.fullname}"
    # Least privilege, spot checks: no secrets, nothing outside the served namespace, no escalation verbs.
    for denied in (
        ["list", "secrets", "-n", served],
        ["create", "pods", "-n", release.namespace],
        ["delete", "oobleckjobs", "-n", served],
        ["escalate", "roles", "-n", served],
        ["bind", "roles", "-n", served],
        ["patch", "nodes"],
    ):
        assert as_operator(cluster, kubeconfig, "auth", "can-i", *denied, check=False).stdout.strip() == "no", denied

    pool = f"p{secrets.token_hex(4)}"
    job = yaml.safe_load(EXAMPLE.read_text())
    name, workers = job["metadata"]["name"], job["spec"]["nodes"]["max"]
    nodes = cluster.add_kwok_nodes(workers, gpus=8, labels={POOL_LABEL: pool})
    metrics_port, liveness_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    env.update(POD_ID=f"helm-rbac-{secrets.token_hex(2)}", KUBECONFIG=str(kubeconfig))
    log_path = tmp_path / "operator.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            operator_command(cluster, release, kubeconfig, metrics_port, liveness_port),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
    try:

        def healthy() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"operator exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            with urllib.request.urlopen(f"http://127.0.0.1:{liveness_port}/healthz", timeout=2) as response:
                return response.status == 200

        wait_for(healthy, "the operator's liveness probe")
        # Peering works with the chart's permissions: this replica registered itself.
        wait_for(
            lambda: (
                env["POD_ID"]
                in (cluster.kubectl_json("get", "kopfpeering", release.peering, "-n", served).get("status") or {})
            ),
            "the operator's entry in the KopfPeering status",
        )

        cluster.kubectl("apply", "-f", "-", input=tiny_gpt(served, pool))

        def settled(at_least: int) -> list[str] | None:
            """The plan's nodes once its generation is `at_least` or newer and all of them run and carry their ranks."""
            plan = planmap.read_plan(cluster.reads.config_map(served, render.plan_name(name)))  # polled: no kubectl
            generation = plan.generation
            if generation < at_least:
                return None
            members = list(plan.nodes)
            pods = {p["metadata"]["name"]: p for p in cluster.reads.pods(served, f"{JOB_LABEL}={name}")}
            for member in members:
                pod = pods.get(member)
                if pod is None or pod["status"].get("phase") != "Running":
                    return None
                if not render.annotations_current(plan, member, pod["metadata"].get("annotations")):
                    return None
            return members

        members = wait_for(lambda: settled(0), "generation 0 on every worker")
        assert len(members) == workers
        status = cluster.kubectl_json("get", "oobleckjob", name, "-n", served).get("status") or {}
        assert status.get("phase") == "Running", status  # the status subresource was patched
        for kind, child in [
            ("service", f"{name}-workers"),
            ("serviceaccount", f"{name}-oobleck-worker"),
            ("role", f"{name}-oobleck-worker"),
            ("rolebinding", f"{name}-oobleck-worker"),
            ("pod", f"{name}-coordinator"),
        ]:
            cluster.kubectl("get", kind, child, "-n", served)
        events = cluster.kubectl_json("get", "events", "-n", served, "--field-selector", f"involvedObject.name={name}")[
            "items"
        ]
        assert events, "no events about the job: the operator could not post them"

        # A failure: new plan generations replace the ConfigMap's content (a patch) and are patched
        # onto the pods; the lost worker is replaced (a delete and a create).
        cluster.kubectl("delete", "pod", members[-1], "-n", served, "--wait=false")
        wait_for(lambda: settled(1), "a newer plan generation on every member")

        # Deletion: the operator removes its finalizer (a patch), then garbage collection.
        cluster.kubectl("delete", "oobleckjob", name, "-n", served, "--wait=true", timeout=TIMEOUT_S)
        wait_for(
            lambda: (
                not cluster.kubectl_json(
                    "get",
                    "pods,configmaps,services,serviceaccounts,roles,rolebindings",
                    "-n",
                    served,
                    "-l",
                    f"{JOB_LABEL}={name}",
                )["items"]
            ),
            "garbage collection of every child",
        )
        assert process.poll() is None, "the operator exited during the lifecycle"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        cluster.delete_kwok_nodes(nodes)
        text = log_path.read_text()
        print(text[-5000:])
        # Checked even when a wait above timed out: a denied call is the likelier cause, name it.
        denied = [line for line in text.splitlines() if any(marker in line.lower() for marker in PERMISSION_MARKERS)]
        assert not denied, "the chart's RBAC is insufficient:\n" + "\n".join(denied[:20])


# -- uninstall --------------------------------------------------------------------------------------


def test_uninstall_removes_the_release_but_keeps_the_crds(release: Release) -> None:
    cluster = release.cluster
    release.uninstall()
    gone = [
        ("deployment", release.fullname, release.namespace),
        ("serviceaccount", release.fullname, release.namespace),
        ("service", f"{release.fullname}-metrics", release.namespace),
        ("rolebinding", f"{release.fullname}-jobs", release.served),
        ("clusterrole", f"{release.fullname}-cluster", None),
        ("clusterrole", f"{release.fullname}-jobs", None),
        ("clusterrolebinding", f"{release.fullname}-cluster", None),
    ]
    for kind, name, namespace in gone:
        where = ["-n", namespace] if namespace else []
        wait_for(
            lambda: cluster.kubectl("get", kind, name, *where, check=False).returncode != 0 and True,
            f"{kind} {name} to be deleted by helm uninstall",
        )
    # crds.keep: deleting a CRD would delete every job of the cluster with it.
    for crd in ("oobleckjobs.oobleck.dev", "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"):
        cluster.kubectl("get", "crd", crd)
