"""Issue 20's operator-side bounds as pure functions: env from a Secret stays a reference, oversized
worker reports are left unread, a refused create is told apart from a retryable failure."""

from __future__ import annotations

import json

from oobleck.api import contract, planmap, resource
from oobleck.api.contract import MAX_MEASURED_PROFILE_BYTES, MAX_REPORT_BYTES
from oobleck.operator import render
from oobleck.operator.apply import ApiError, Rejected, _error, retry_delay
from oobleck.operator.observe import observe, summarize_pod
from oobleck.operator.planning import Tuning, cluster_shape, synthetic_profile
from oobleck.planner import plan_job

SECRET_ENV = [
    {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hub", "key": "token"}}},
    {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode", "optional": True}}},
    {"name": "PLAIN", "value": "visible"},
]


def test_env_from_a_secret_is_rendered_as_a_reference_and_written_nowhere_else(h):
    spec = h.spec(pod={"env": SECRET_ENV})
    pod = render.worker_pod(h.JOB, "ns", h.UID, spec, 0, default_image="img", default_command=["run"])
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["HF_TOKEN"] == SECRET_ENV[0]
    assert env["MODE"] == SECRET_ENV[1]
    assert env["PLAIN"] == {"name": "PLAIN", "value": "visible"}
    # What the spec carries into the plan ConfigMap, job.json, OOBLECK_JOB_SPEC and annotations: references.
    profile = synthetic_profile(spec, Tuning())
    names = [render.worker_name(h.JOB, i) for i in range(4)]
    plan = plan_job(profile, cluster_shape(spec, Tuning()), 1, 8, h.JOB, nodes=names)
    config_map = render.plan_config_map(h.JOB, "ns", h.UID, plan, profile, spec, 0)
    stored = json.loads(config_map["data"][planmap.JOB_KEY])
    assert stored["pod"]["env"][0] == SECRET_ENV[0]
    job_spec = json.loads(env["OOBLECK_JOB_SPEC"]["value"])
    assert job_spec["pod"]["env"][0] == SECRET_ENV[0]
    assert "value" not in json.dumps(pod["metadata"].get("annotations", {}))


def test_a_literal_env_without_value_stays_an_empty_variable(h):
    spec = h.spec(pod={"env": [{"name": "EMPTY"}]})
    pod = render.worker_pod(h.JOB, "ns", h.UID, spec, 0, default_image="img", default_command=["run"])
    assert {"name": "EMPTY"} in pod["spec"]["containers"][0]["env"]


def _pod(h, **annotations: str) -> dict:
    return {
        "metadata": {
            "name": f"{h.JOB}-worker-0",
            "uid": "p0",
            "labels": {resource.ROLE_LABEL: resource.WORKER_ROLE},
            "annotations": annotations,
            "ownerReferences": [{"uid": h.UID, "controller": True}],
        },
        "spec": {"nodeName": "node-0"},
        "status": {"phase": "Running"},
    }


def test_oversized_reports_are_left_unread_and_named(h):
    huge_progress = json.dumps({"generation": 0, "step": 10**9, "pad": "x" * MAX_REPORT_BYTES})
    summary = summarize_pod(
        _pod(
            h,
            **{
                contract.PROGRESS_ANNOTATION: huge_progress,
                contract.MEASURED_PROFILE_ANNOTATION: "y" * (MAX_MEASURED_PROFILE_BYTES + 1),
                contract.FAILURE_ANNOTATION: '{"generation": 0}',
            },
        )
    )
    assert summary.progress is None and summary.measured_profile is None
    assert summary.failure_report == '{"generation": 0}'  # within its cap
    assert summary.oversized == (
        f"annotation {contract.PROGRESS_ANNOTATION} is {len(huge_progress)} bytes, over the operator's cap of "
        f"{MAX_REPORT_BYTES}",
        f"annotation {contract.MEASURED_PROFILE_ANNOTATION} is {MAX_MEASURED_PROFILE_BYTES + 1} bytes, over the "
        f"operator's cap of {MAX_MEASURED_PROFILE_BYTES}",
    )
    obs = observe(h.JOB, h.UID, [summary], h.nodes(1), None, gpu_resource="nvidia.com/gpu")
    assert obs.step == 0  # the huge step was not believed
    assert obs.oversized[0].startswith(f"{h.JOB}-worker-0: annotation {contract.PROGRESS_ANNOTATION} is ")


def test_refused_creates_are_rejected_and_the_rest_retried_with_backoff():
    body = json.dumps({"message": 'pods "x" is forbidden: maximum memory usage per Container is 1Gi'})
    for status in (400, 403, 413, 422):
        error = _error("create", "pod ns/x", status, body)
        assert isinstance(error, Rejected), status
        assert (
            str(error)
            == f'create pod ns/x: HTTP {status}: pods "x" is forbidden: maximum memory usage per Container is 1Gi'
        )
    for verb, status in (
        ("create", 409),
        ("create", 404),
        ("create", 429),
        ("create", 500),
        ("create", 503),
        ("patch", 422),
    ):
        error = _error(verb, "pod ns/x", status, body)
        assert type(error) is ApiError, (verb, status)
    assert [retry_delay(n, 1.0, 30.0) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert retry_delay(10**6, 1.0, 30.0) == 30
