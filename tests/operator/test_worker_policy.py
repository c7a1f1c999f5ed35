"""Worker credentials against a real API server: the rendered worker Role plus the cluster's worker-pod
admission policy (charts/oobleck-operator/files/admission/worker-pods.yaml, installed by the test control
plane as the chart installs it) let a worker's token change only its own pod's report annotations.

Two real OobleckJobs own their rendered ServiceAccount, Role, RoleBinding and worker pods (no operator
runs). Each token is a TokenRequest bound to one worker pod, as a kubelet mounts it, and is used through
the runtime's own client (oobleck.runtime.backends.pod.kube.Kube).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import yaml

from oobleck.api import contract, resource
from oobleck.api.causes import CAUSE_ANNOTATION
from oobleck.api.spec import parse_spec
from oobleck.operator import render
from oobleck.runtime.backends.pod.kube import MERGE_PATCH, ApiException, Kube, api_error_text

pytestmark = [pytest.mark.cluster]
SPEC = {
    "model": {"gpt": {"layers": 2, "hiddenSize": 32, "heads": 2, "sequenceLength": 8, "vocabSize": 64}},
    "nodes": {"min": 1, "max": 2},
    "gpusPerNode": 1,
    "device": "cpu",
    "f": 0,
    "training": {"steps": 10, "globalBatchSize": 4, "microbatchSize": 2},
}
POLICY = Path(__file__).resolve().parents[2] / "charts/oobleck-operator/files/admission/worker-pods.yaml"


def _client(cluster, ns: str, token: str) -> Kube:
    """The runtime's client authenticated with `token` alone (no client certificate)."""
    from kubernetes import client

    configuration = client.Configuration(host=cluster.server)
    configuration.api_key = {"authorization": token}
    configuration.api_key_prefix = {"authorization": "Bearer"}
    kubeconfig = yaml.safe_load(Path(cluster.kubeconfig).read_text())["clusters"][0]["cluster"]
    if "certificate-authority-data" in kubeconfig:
        ca = Path(cluster.kubeconfig).with_name("worker-policy-ca.crt")
        ca.write_bytes(base64.b64decode(kubeconfig["certificate-authority-data"]))
        configuration.ssl_ca_cert = str(ca)
    else:
        configuration.ssl_ca_cert = kubeconfig["certificate-authority"]
    return Kube(client.CoreV1Api(client.ApiClient(configuration)), ns)


def _job(cluster, ns: str, job: str) -> dict[str, Kube]:
    """A job with two worker pods and its rendered RBAC; a token client per worker pod (bound to it)."""
    body = {"apiVersion": "oobleck.dev/v1alpha1", "kind": "OobleckJob", "metadata": {"name": job}, "spec": SPEC}
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(body))
    uid = cluster.kubectl_json("get", "oobleckjob", job, "-n", ns)["metadata"]["uid"]
    spec = parse_spec(SPEC)
    objects = [
        *render.static_children(job, ns, uid),
        *(render.worker_pod(job, ns, uid, spec, i, default_image="i", default_command=["c"]) for i in range(2)),
    ]
    cluster.kubectl(
        "apply", "-n", ns, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
    )
    clients = {}
    for i in range(2):
        pod = cluster.kubectl_json("get", "pod", render.worker_name(job, i), "-n", ns)["metadata"]
        token = cluster.kubectl(
            "create",
            "token",
            render.rbac_name(job),
            "-n",
            ns,
            "--duration=1h",
            "--bound-object-kind=Pod",
            f"--bound-object-name={pod['name']}",
            f"--bound-object-uid={pod['uid']}",
        ).stdout.strip()
        clients[pod["name"]] = _client(cluster, ns, token)
    return clients


@pytest.fixture(scope="module")
def world(cluster):
    ns = cluster.namespace("policy")
    return {"ns": ns, "a": _job(cluster, ns, "alpha"), "b": _job(cluster, ns, "beta")}


def _patch(kube: Kube, pod: str, body: dict, content_type: str = MERGE_PATCH) -> None:
    kube.core.patch_namespaced_pod(pod, kube.namespace, body, _content_type=content_type, _request_timeout=15)


def _refused(kube: Kube, pod: str, body: dict, content_type: str = MERGE_PATCH) -> str:
    """The API server's refusal of this patch (the test fails if it is admitted)."""
    with pytest.raises(ApiException) as refused:
        _patch(kube, pod, body, content_type)
    assert refused.value.status == 403, api_error_text(refused.value)
    return api_error_text(refused.value)


def _annotations(cluster, ns: str, pod: str) -> dict[str, str]:
    return cluster.kubectl_json("get", "pod", pod, "-n", ns)["metadata"].get("annotations", {})


PROGRESS = {"metadata": {"annotations": {contract.PROGRESS_ANNOTATION: '{"generation": 0, "step": 999999}'}}}


def test_the_chart_policy_lists_every_report_annotation_the_runtime_writes():
    """The policy's allowed keys are exactly the runtime's report annotations (oobleck.api.contract)."""
    policy = next(yaml.safe_load_all(POLICY.read_text()))
    reports = next(v["expression"] for v in policy["spec"]["variables"] if v["name"] == "reports")
    wanted = {
        contract.PROGRESS_ANNOTATION,
        contract.FAILURE_ANNOTATION,
        contract.MEASURED_PROFILE_ANNOTATION,
        CAUSE_ANNOTATION,
    }
    assert set(reports.strip("[] ").replace("'", "").replace(" ", "").split(",")) == wanted


def test_a_worker_reports_on_its_own_pod(cluster, world):
    ns, own = world["ns"], render.worker_name("alpha", 0)
    kube = world["a"][own]
    _patch(kube, own, PROGRESS)
    failure = {"metadata": {"annotations": {contract.FAILURE_ANNOTATION: '{"kind": "heartbeat"}'}}}
    _patch(kube, own, failure)
    written = _annotations(cluster, ns, own)
    assert written[contract.PROGRESS_ANNOTATION].endswith("999999}")
    assert contract.FAILURE_ANNOTATION in written


def test_another_jobs_worker_cannot_patch_a_pod(cluster, world):
    ns, target = world["ns"], render.worker_name("alpha", 1)
    intruder = world["b"][render.worker_name("beta", 0)]
    message = _refused(intruder, target, PROGRESS)
    assert "only its own pod" in message and render.worker_name("beta", 0) in message
    assert contract.PROGRESS_ANNOTATION not in _annotations(cluster, ns, target)


def test_a_worker_cannot_patch_another_pod_of_its_own_job(cluster, world):
    ns, other = world["ns"], render.worker_name("alpha", 1)
    kube = world["a"][render.worker_name("alpha", 0)]
    assert "only its own pod" in _refused(kube, other, PROGRESS)
    assert contract.PROGRESS_ANNOTATION not in _annotations(cluster, ns, other)


def test_a_worker_cannot_change_its_own_pods_spec_labels_or_the_operators_annotations(cluster, world):
    ns, own = world["ns"], render.worker_name("alpha", 0)
    kube = world["a"][own]
    before = cluster.kubectl_json("get", "pod", own, "-n", ns)
    assert "spec" in _refused(kube, own, {"spec": {"activeDeadlineSeconds": 1}})
    image = {"spec": {"containers": [{"name": "worker", "image": "attacker/image"}]}}
    # A strategic merge patch, as `kubectl set image` sends (a merge patch would replace the whole list).
    assert "spec" in _refused(kube, own, image, "application/strategic-merge-patch+json")
    assert "labels" in _refused(kube, own, {"metadata": {"labels": {resource.JOB_LABEL: "beta"}}})
    ranks = {"metadata": {"annotations": {contract.RANKS_ANNOTATION: "0"}}}
    assert contract.RANKS_ANNOTATION in _refused(kube, own, ranks)
    after = cluster.kubectl_json("get", "pod", own, "-n", ns)
    assert after["spec"] == before["spec"] and after["metadata"]["labels"] == before["metadata"]["labels"]


def test_a_token_not_bound_to_a_pod_cannot_patch_pods(cluster, world):
    ns, own = world["ns"], render.worker_name("alpha", 0)
    token = cluster.kubectl("create", "token", render.rbac_name("alpha"), "-n", ns, "--duration=1h").stdout.strip()
    assert "bound to pod (none)" in _refused(_client(cluster, ns, token), own, PROGRESS)


def test_a_worker_reads_only_its_plan_and_its_coordinator(cluster, world):
    kube = world["a"][render.worker_name("alpha", 0)]
    for read in (
        lambda: kube.core.read_namespaced_pod(render.worker_name("alpha", 1), kube.namespace),
        lambda: kube.core.read_namespaced_config_map(render.plan_name("beta"), kube.namespace),
        lambda: kube.core.list_namespaced_pod(kube.namespace),
        lambda: kube.core.read_namespaced_secret(render.key_name("beta"), kube.namespace),
    ):
        with pytest.raises(ApiException) as refused:
            read()
        assert refused.value.status == 403
    # Allowed by name (404: the coordinator pod and plan ConfigMap are not created in this test).
    for read in (
        lambda: kube.core.read_namespaced_pod(render.coordinator_name("alpha"), kube.namespace),
        lambda: kube.core.read_namespaced_config_map(render.plan_name("alpha"), kube.namespace),
    ):
        with pytest.raises(ApiException) as missing:
            read()
        assert missing.value.status == 404


def test_the_policy_is_in_force_from_the_start(cluster):
    """The control plane installs it before any test runs (as `helm install` would, with the CRD)."""
    policy = cluster.kubectl_json("get", "validatingadmissionpolicy", "oobleck-worker-pods")
    assert policy["status"]["observedGeneration"] == policy["metadata"]["generation"]
    assert not (policy["status"].get("typeChecking") or {}).get("expressionWarnings"), policy["status"]


def test_other_accounts_ending_in_worker_are_not_restricted(cluster, world):
    """The policy matches the operator's `<job>-oobleck-worker` accounts only: a cluster's own `build-worker`
    (say, a CI runner with pod patch rights) still changes other pods' labels."""
    ns = world["ns"]
    rbac = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "build-worker"}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "build-worker"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "build-worker"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "build-worker"},
            "subjects": [{"kind": "ServiceAccount", "name": "build-worker", "namespace": ns}],
        },
    ]
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": rbac}))
    token = cluster.kubectl("create", "token", "build-worker", "-n", ns, "--duration=1h").stdout.strip()
    target = render.worker_name("beta", 1)
    _patch(_client(cluster, ns, token), target, {"metadata": {"labels": {"example.com/built": "yes"}}})
    assert cluster.kubectl_json("get", "pod", target, "-n", ns)["metadata"]["labels"]["example.com/built"] == "yes"
