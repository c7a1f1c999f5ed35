"""The generated CRD on a real API server: apply, printer columns, scale, explain, validation.

Uses the session `cluster` fixture (tests/conftest.py), which installs crds/ at start.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from oobleck.api.resource import worker_selector
from oobleck.api.spec import parse_spec
from oobleck.api.status import parse_status

pytestmark = pytest.mark.cluster

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-gpt.yaml"


def _apply(cluster: Any, namespace: str, manifest: dict[str, Any], check: bool = False) -> Any:
    return cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest), check=check)


def _get(cluster: Any, namespace: str, name: str = "tiny-gpt") -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", "-n", namespace, f"oj/{name}", "-o", "json").stdout)


def _without_empty(value: Any) -> Any:
    """Drop empty maps and lists: the API server keeps an absent field absent, pydantic dumps {} / []."""
    if isinstance(value, dict):
        cleaned = {k: _without_empty(v) for k, v in value.items()}
        return {k: v for k, v in cleaned.items() if v not in ({}, [])}
    return value


@pytest.fixture(scope="module")
def rejections(cluster: Any) -> str:
    """A namespace for manifests that must be rejected (nothing is ever created in it)."""
    return cluster.namespace("oj-invalid")


def test_example_applies_and_the_stored_spec_is_what_the_models_read(cluster: Any, example: dict[str, Any]) -> None:
    namespace = cluster.namespace("oj-example")
    result = cluster.kubectl("apply", "-n", namespace, "-f", str(EXAMPLE))
    assert "oobleckjob.oobleck.dev/tiny-gpt created" in result.stdout
    stored = _get(cluster, namespace)
    assert parse_spec(stored["spec"]) == parse_spec(example["spec"])
    assert stored["spec"]["pendingTimeoutSeconds"] == 300  # a default the API server filled in
    assert stored["spec"]["stragglers"] == {"threshold": 1.5, "window": 20, "mitigation": "resplit"}  # defaulted whole
    assert stored["metadata"]["generation"] == 1
    # Short name and category both list it.
    assert "tiny-gpt" in cluster.kubectl("get", "-n", namespace, "oobleck", "-o", "name").stdout


@pytest.mark.parametrize("path", sorted(EXAMPLE.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_is_accepted(cluster: Any, rejections: str, path: Path) -> None:
    result = cluster.kubectl("apply", "--dry-run=server", "-n", rejections, "-f", str(path))
    assert "created (server dry run)" in result.stdout


def test_api_server_defaults_equal_the_model_defaults(cluster: Any) -> None:
    namespace = cluster.namespace("oj-defaults")
    minimal = {
        "apiVersion": "oobleck.dev/v1alpha1",
        "kind": "OobleckJob",
        "metadata": {"name": "minimal"},
        "spec": {
            "model": {"entryPoint": "mypkg.models:build_layers"},
            "nodes": {"min": 2, "max": 8},
            "training": {"steps": 100, "globalBatchSize": 64, "microbatchSize": 4},
        },
    }
    _apply(cluster, namespace, minimal, check=True)
    stored = _get(cluster, namespace, "minimal")["spec"]
    expected = parse_spec(minimal["spec"]).to_kubernetes()
    assert _without_empty(stored) == _without_empty(expected)


def test_get_shows_the_printer_columns(cluster: Any) -> None:
    namespace = cluster.namespace("oj-columns")
    cluster.kubectl("apply", "-n", namespace, "-f", str(EXAMPLE))
    status = {
        "phase": "Running",
        "nodes": 4,
        "selector": "oobleck.dev/job=tiny-gpt",
        "plan": {"generation": 1, "pipelines": 2, "nodes": 4, "templates": [{"nodes": 2, "pipelines": 2}]},
        "progress": {"step": 17, "samplesPerSecond": 123.5},
        "conditions": [
            {
                "type": "Running",
                "status": "True",
                "reason": "Training",
                "message": "",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }
        ],
    }
    cluster.kubectl(
        "patch",
        "-n",
        namespace,
        "oj/tiny-gpt",
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )
    header, row = cluster.kubectl("get", "-n", namespace, "oj").stdout.splitlines()
    assert header.split() == ["NAME", "PHASE", "NODES", "PIPELINES", "STEP", "AGE"]
    assert row.split()[:5] == ["tiny-gpt", "Running", "4", "2", "17"]
    wide_header = cluster.kubectl("get", "-n", namespace, "oj", "-o", "wide").stdout.splitlines()[0].split()
    assert {"TARGET", "MAX", "STEPS", "SAMPLES/S", "FAILURES", "PLAN"} <= set(wide_header)


def test_scale_sets_the_target_within_min_and_max(cluster: Any) -> None:
    namespace = cluster.namespace("oj-scale")
    cluster.kubectl("apply", "-n", namespace, "-f", str(EXAMPLE))
    cluster.kubectl(
        "patch",
        "-n",
        namespace,
        "oj/tiny-gpt",
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": {"nodes": 4, "selector": worker_selector("tiny-gpt")}}),
    )
    result = cluster.kubectl("scale", "-n", namespace, "oj/tiny-gpt", "--replicas=3")
    assert "scaled" in result.stdout
    job = _get(cluster, namespace)
    assert job["spec"]["nodes"]["target"] == 3
    assert parse_spec(job["spec"]).nodes.wanted == 3
    scale = json.loads(
        cluster.kubectl("get", "-n", namespace, "oj/tiny-gpt", "--subresource=scale", "-o", "json").stdout
    )
    assert scale["kind"] == "Scale"
    assert scale["spec"]["replicas"] == 3
    assert scale["status"] == {"replicas": 4, "selector": "oobleck.dev/job=tiny-gpt,oobleck.dev/role=worker"}
    for replicas in (9, 1):  # above nodes.max, below nodes.min
        refused = cluster.kubectl("scale", "-n", namespace, "oj/tiny-gpt", f"--replicas={replicas}", check=False)
        assert refused.returncode != 0
        assert (
            f"spec.nodes.target: Invalid value: nodes.target ({replicas}) must be between nodes.min (2) and nodes.max (4)"
            in refused.stderr
        )
    assert _get(cluster, namespace)["spec"]["nodes"]["target"] == 3


def test_explain_shows_the_model_descriptions(cluster: Any) -> None:
    # The API server publishes a new CRD's OpenAPI a moment after it is Established.
    deadline = time.monotonic() + 30
    while True:
        result = cluster.kubectl("explain", "oj.spec.f", check=False)
        if result.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "FIELD: f <integer>" in text
    assert "Fault tolerance: the job keeps f + 1 model replicas (pipelines)" in text
    nodes = " ".join(cluster.kubectl("explain", "oj.spec.nodes.target").stdout.split())
    assert "kubectl scale oj/NAME --replicas=N" in nodes


def test_invalid_manifest_is_rejected_naming_the_field(
    cluster: Any, rejections: str, invalid_case: dict[str, Any]
) -> None:
    expected = invalid_case["apiserver"]
    result = _apply(cluster, rejections, invalid_case["manifest"])
    assert result.returncode != 0, f"accepted: {result.stdout}"
    if expected["reason"] == "unknown field":  # strict field validation: kubectl's default
        assert f'unknown field "{expected["field"]}"' in result.stderr
    else:
        assert f"{expected['field']}: {expected['reason']}" in result.stderr
    assert expected["message"] in result.stderr
    assert cluster.kubectl("get", "-n", rejections, "oj", "-o", "name").stdout == ""


@pytest.mark.parametrize("mitigation", ["none", "resplit", "rebalance", "spare"])
def test_every_straggler_mitigation_is_accepted_and_stored(
    cluster: Any, example: dict[str, Any], mitigation: str
) -> None:
    namespace = cluster.namespace(f"oj-mitigation-{mitigation}")
    example["spec"]["stragglers"] = {"mitigation": mitigation}
    _apply(cluster, namespace, example, check=True)
    stored = _get(cluster, namespace)["spec"]["stragglers"]
    assert stored == {"threshold": 1.5, "window": 20, "mitigation": mitigation}
    assert parse_spec(_get(cluster, namespace)["spec"]).stragglers.mitigation == mitigation


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("model.gpt.layers", 6, "spec.model: Forbidden: model is immutable"),
        ("training.microbatchSize", 4, "spec.training.microbatchSize: Forbidden: training.microbatchSize is immutable"),
        (
            "training.globalBatchSize",
            32,
            "spec.training.globalBatchSize: Forbidden: training.globalBatchSize is immutable",
        ),
        ("gpusPerNode", 2, "spec.gpusPerNode: Forbidden: gpusPerNode is immutable"),
        ("device", "cuda", "spec.device: Forbidden: device is immutable"),
        ("gpuResourceName", "amd.com/gpu", "spec.gpuResourceName: Forbidden: gpuResourceName is immutable"),
    ],
)
def test_immutable_fields_cannot_change(
    cluster: Any, example: dict[str, Any], path: str, value: Any, field: str
) -> None:
    namespace = cluster.namespace("oj-immutable")
    _apply(cluster, namespace, example, check=True)
    changed = json.loads(json.dumps(example))
    node = changed["spec"]
    *parents, last = path.split(".")
    for key in parents:
        node = node[key]
    node[last] = value
    result = _apply(cluster, namespace, changed)
    assert result.returncode != 0
    assert field in result.stderr
    assert "create a new OobleckJob to change it" in result.stderr


def test_mutable_fields_can_change(cluster: Any, example: dict[str, Any]) -> None:
    namespace = cluster.namespace("oj-mutable")
    _apply(cluster, namespace, example, check=True)
    example["spec"]["training"]["steps"] = 80
    example["spec"]["training"]["learningRate"] = 0.002
    example["spec"]["f"] = 2
    example["spec"]["nodes"]["max"] = 6
    example["spec"]["checkpoint"] = {"path": "/checkpoints", "intervalSteps": 10}
    _apply(cluster, namespace, example, check=True)
    job = _get(cluster, namespace)
    assert job["metadata"]["generation"] == 2
    spec = parse_spec(job["spec"])
    assert (spec.training.steps, spec.f, spec.nodes.max) == (80, 2, 6)
    assert spec.checkpoint is not None and spec.checkpoint.keep == 2


def test_status_is_written_through_the_status_subresource_only(cluster: Any) -> None:
    namespace = cluster.namespace("oj-status")
    cluster.kubectl("apply", "-n", namespace, "-f", str(EXAMPLE))
    # Through the main resource, status is ignored (and spec through /status).
    cluster.kubectl("patch", "-n", namespace, "oj/tiny-gpt", "--type=merge", "-p", '{"status": {"phase": "Failed"}}')
    assert "status" not in _get(cluster, namespace)
    cluster.kubectl(
        "patch",
        "-n",
        namespace,
        "oj/tiny-gpt",
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(
            {"spec": {"f": 0}, "status": {"phase": "Succeeded", "observedGeneration": 1, "failuresSurvived": 2}}
        ),
    )
    job = _get(cluster, namespace)
    assert job["spec"]["f"] == 1
    status = parse_status(job["status"])
    assert (status.phase, status.observed_generation, status.failures_survived) == ("Succeeded", 1, 2)
    # The status schema is enforced too.
    bad = {
        "status": {
            "conditions": [
                {
                    "type": "Running",
                    "status": "Maybe",
                    "reason": "Training",
                    "message": "",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
            ]
        }
    }
    refused = cluster.kubectl(
        "patch",
        "-n",
        namespace,
        "oj/tiny-gpt",
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(bad),
        check=False,
    )
    assert refused.returncode != 0
    assert 'status.conditions[0].status: Unsupported value: "Maybe"' in refused.stderr
