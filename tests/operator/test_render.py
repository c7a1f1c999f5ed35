"""Manifests: names, owner references, GPU requests, the plan ConfigMap round trip."""

from __future__ import annotations

import base64

from oobleck.api import contract, planmap
from oobleck.api.resource import JOB_LABEL
from oobleck.operator import render
from oobleck.operator.planning import Tuning, synthetic_profile
from oobleck.planner import plan_job


def _plan(h, nodes: int = 4):
    spec = h.spec()
    from oobleck.operator.planning import cluster_shape

    profile = synthetic_profile(spec, Tuning())
    names = [render.worker_name(h.JOB, i) for i in range(nodes)]
    return spec, profile, plan_job(profile, cluster_shape(spec, Tuning()), 1, 8, h.JOB, nodes=names)


def test_worker_pod_requests_gpus_and_is_owned(h):
    spec = h.spec(gpusPerNode=4, resources={"cpu": "2", "memory": "8Gi"})
    pod = render.worker_pod(h.JOB, "ns", h.UID, spec, 3, default_image="img", default_command=["oobleck", "worker"])
    assert pod["metadata"]["name"] == "tiny-worker-3"
    assert pod["metadata"]["labels"][JOB_LABEL] == h.JOB
    assert pod["metadata"]["labels"][render.INDEX_LABEL] == "3"
    owner = pod["metadata"]["ownerReferences"][0]
    assert owner["uid"] == h.UID and owner["controller"] is True
    container = pod["spec"]["containers"][0]
    assert container["resources"]["requests"] == {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": "4"}
    assert container["resources"]["limits"] == {"memory": "8Gi", "nvidia.com/gpu": "4"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["OOBLECK_NODE"] == "tiny-worker-3"
    assert env["OOBLECK_PLAN_CONFIGMAP"] == "tiny-plan"
    assert env["OOBLECK_STORE"] == "tiny-coordinator.tiny-workers.ns.svc:29400"
    assert pod["spec"]["restartPolicy"] == "Never"
    anti = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"


def test_workers_and_the_coordinator_bind_to_their_pod_ip_from_the_downward_api(h):
    worker = render.worker_pod(h.JOB, "ns", h.UID, h.spec(), 0, default_image="img", default_command=["x"])
    coordinator = render.coordinator_pod(h.JOB, "ns", h.UID, h.spec(), default_image="img")
    from_node = {"name": "OOBLECK_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    for pod in (worker, coordinator):
        assert from_node in pod["spec"]["containers"][0]["env"]


def test_every_worker_mounts_the_job_key_and_the_contract_names_its_file(h):
    pod = render.worker_pod(h.JOB, "ns", h.UID, h.spec(), 0, default_image="img", default_command=["x"])
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["OOBLECK_JOB_KEY_FILE"] == f"{render.JOB_KEY_DIR}/{render.JOB_KEY_ITEM}"
    assert {"name": "job-key", "mountPath": render.JOB_KEY_DIR, "readOnly": True} in container["volumeMounts"]
    assert {"name": "job-key", "secret": {"secretName": "tiny-key", "defaultMode": 0o444}} in pod["spec"]["volumes"]
    secret = render.job_key_secret(h.JOB, "ns", h.UID, b"k" * 64)
    assert secret["metadata"]["name"] == "tiny-key" and secret["metadata"]["ownerReferences"][0]["uid"] == h.UID
    assert secret["data"] == {"key": base64.b64encode(b"k" * 64).decode()}


def test_the_network_policy_admits_the_job_s_pods_and_optionally_the_scrapers(h):
    policy = render.network_policy(h.JOB, "ns", h.UID, None)
    assert policy["spec"]["podSelector"] == {"matchLabels": {JOB_LABEL: h.JOB}}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {JOB_LABEL: h.JOB}}}]}]
    scraped = render.network_policy(h.JOB, "ns", h.UID, "monitoring")["spec"]["ingress"][1]
    assert scraped["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert scraped["ports"] == [{"protocol": "TCP", "port": 29500, "endPort": 29500 + contract.METRICS_PORTS - 1}]
    assert [c["kind"] for c in render.static_children(h.JOB, "ns", h.UID)][-1] == "NetworkPolicy"


def test_cpu_pods_request_no_gpu_and_overrides_apply(h):
    spec = h.spec(
        device="cpu",
        image="me/img:1",
        command=["python", "-m", "x"],
        pod={"nodeSelector": {"pool": "a"}, "env": [{"name": "A", "value": "1"}], "labels": {"team": "x"}},
    )
    pod = render.worker_pod(h.JOB, "ns", h.UID, spec, 0, default_image="img", default_command=["oobleck", "worker"])
    container = pod["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["requests"]
    assert container["image"] == "me/img:1" and container["command"] == ["python", "-m", "x"]
    assert {"name": "A", "value": "1"} in container["env"]
    assert pod["spec"]["nodeSelector"] == {"pool": "a"}
    assert pod["metadata"]["labels"]["team"] == "x"


def test_workers_run_as_the_images_user_with_an_fs_group(h):
    """uid 65532 (the Dockerfile's USER), and fsGroup so that a fresh checkpoint or data claim is writable."""
    spec = h.spec(device="cpu", checkpoint={"path": "/ckpt", "claimName": "c", "intervalSteps": 10})
    for pod in (
        render.worker_pod(h.JOB, "ns", h.UID, spec, 0, default_image="i", default_command=["c"]),
        render.coordinator_pod(h.JOB, "ns", h.UID, spec, default_image="i"),
    ):
        security = pod["spec"]["securityContext"]
        assert (security["runAsUser"], security["runAsGroup"], security["fsGroup"]) == (65532, 65532, 65532)
        assert security["runAsNonRoot"] is True and security["fsGroupChangePolicy"] == "OnRootMismatch"


def test_role_is_least_privilege(h):
    role = render.worker_role(h.JOB, "ns", h.UID)
    rules = {(rule["resources"][0], tuple(rule.get("resourceNames", ()))): rule["verbs"] for rule in role["rules"]}
    # By name where RBAC can name the object; patching pods is narrowed to the token's own pod and its report
    # annotations by the cluster's admission policy (tests/operator/test_worker_policy.py).
    assert rules == {
        ("configmaps", ("tiny-plan",)): ["get", "list", "watch"],
        ("pods", ("tiny-coordinator",)): ["get"],
        ("pods", ()): ["patch"],
    }


def test_plan_config_map_round_trips_inline_and_gzipped(h, monkeypatch):
    spec, profile, plan = _plan(h)
    body = render.plan_config_map(h.JOB, "ns", h.UID, plan, profile, spec, failures_survived=2)
    assert body["metadata"]["annotations"][contract.GENERATION_ANNOTATION] == "0"
    assert planmap.read_plan(body) == plan
    assert planmap.read_failures_survived(body) == 2
    assert planmap.read_profile(body) == profile
    monkeypatch.setattr(render, "PLAN_INLINE_LIMIT", 10)
    small = render.plan_config_map(h.JOB, "ns", h.UID, plan, profile, spec, failures_survived=0)
    assert small["data"][planmap.PLAN_KEY] == "" and planmap.PLAN_GZ_KEY in small["binaryData"]
    assert planmap.read_plan(small) == plan
    # Going back to an inline plan removes the gzipped one in the same merge patch.
    assert render.plan_patch(body)["binaryData"] == {planmap.PLAN_GZ_KEY: None}


def test_read_plan_names_the_bad_key():
    import pytest

    with pytest.raises(ValueError, match="key plan.json"):
        planmap.read_plan({"metadata": {"name": "x-plan"}, "data": {"plan.json": "{}"}})


def test_ranks_annotation(h):
    _, _, plan = _plan(h)
    node = plan.ranks[1].node
    annotations = render.worker_annotations(plan, node)
    assert annotations[contract.GENERATION_ANNOTATION] == "0"
    assert annotations[contract.RANKS_ANNOTATION] == str(plan.ranks[1].rank)
    assert render.ranks_value(plan, "absent", 1) == ""
    table = render.ranks_table(plan)
    assert table == {n: render.ranks_value(plan, n, plan.gpus_per_node) for n in plan.nodes}
    # Current means: the pod carries the plan's ranks (whatever generation wrote them).
    assert render.annotations_current(plan, node, {**annotations, contract.GENERATION_ANNOTATION: "0"}, table)
    assert not render.annotations_current(
        plan, node, {contract.GENERATION_ANNOTATION: "0", contract.RANKS_ANNOTATION: "9"}
    )
    assert not render.annotations_current(plan, node, None)


def test_ranks_table_lists_every_gpu_in_order():
    from oobleck.api.plan import Pipeline, Plan, Stage, Template, TemplateStage

    template = Template(
        nodes=1,
        stages=[
            TemplateStage(start=0, end=1, node=0, gpus=1, gpu_offset=0, forward_ms=1, backward_ms=1),
            TemplateStage(start=1, end=2, node=0, gpus=1, gpu_offset=1, forward_ms=1, backward_ms=1),
        ],
        iteration_ms=2,
        m_ref=1,
    )
    # Stages out of GPU order and ranks not in layout order: the table still reads GPU 0, 1, 2.
    stages = [
        Stage(start=0, end=1, node="a", gpus=[2, 0], ranks=[1, 2]),
        Stage(start=1, end=2, node="a", gpus=[1], ranks=[0]),
    ]
    plan = Plan(
        job="j",
        generation=3,
        num_layers=2,
        gpus_per_node=4,
        f=0,
        global_microbatches=1,
        templates=[template],
        pipelines=[
            Pipeline(
                index=0,
                template_nodes=1,
                nodes=["a"],
                microbatches=1,
                microbatch_offset=0,
                stages=stages,
                iteration_ms=2,
            )
        ],
        iteration_ms=2,
    )
    assert render.ranks_table(plan) == {"a": "2,0,1,"}
    assert render.ranks_value(plan, "a", 4) == "2,0,1,"


def test_worker_index_parses_only_our_names():
    assert render.worker_index("job", "job-worker-12") == 12
    assert render.worker_index("job", "job-worker-012") is None
    assert render.worker_index("job", "other-worker-1") is None
    assert render.worker_index("job", "job-coordinator") is None
