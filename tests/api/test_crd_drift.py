"""crds/ is generated from the pydantic models: it must match them, and be a structural schema."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from oobleck.api import cli, crd
from oobleck.api.pod_spec import PodResources
from oobleck.api.spec import DataSpec, OobleckJobSpec

CRDS = Path(__file__).resolve().parents[2] / "crds"


def test_committed_crds_match_the_models() -> None:
    expected = crd.render_files()
    assert sorted(p.name for p in CRDS.glob("*.yaml")) == sorted(expected), "crds/ holds files the models do not make"
    for name, text in expected.items():
        assert (CRDS / name).read_text() == text, f"crds/{name} is stale: run `make crds`"


def test_check_reports_drift_and_write_fixes_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(argparse.Namespace(write=None, check=CRDS)) == 0
    assert cli.run(argparse.Namespace(write=None, check=tmp_path)) == 1  # missing file
    assert cli.run(argparse.Namespace(write=tmp_path, check=None)) == 0
    assert cli.run(argparse.Namespace(write=None, check=tmp_path)) == 0
    path = tmp_path / crd.CRD_FILE
    path.write_text(path.read_text().replace("maxLength: 40", "maxLength: 41"))
    assert cli.run(argparse.Namespace(write=None, check=tmp_path)) == 1
    assert "make crds" in capsys.readouterr().err


def test_rendering_is_deterministic() -> None:
    assert crd.render_files() == crd.render_files()
    assert yaml.safe_load(crd.yaml_dump(crd.render_crd())) == crd.render_crd()


def _nodes(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for name, child in schema.get("properties", {}).items():
        yield from _nodes(child, f"{path}.{name}")
    if "items" in schema:
        yield from _nodes(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _nodes(schema["additionalProperties"], f"{path}{{}}")


@pytest.fixture(scope="module")
def root_schema() -> dict[str, Any]:
    return crd.render_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_schema_is_structural(root_schema: dict[str, Any]) -> None:
    for path, node in _nodes(root_schema):
        assert "$ref" not in node and "allOf" not in node and "oneOf" not in node and "title" not in node, path
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        else:
            assert "anyOf" not in node, path
            assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}, path
        assert node.get("additionalProperties") is not False, path
        assert isinstance(node.get("exclusiveMinimum", True), bool), path
        assert node.get("default", 0) is not None, path


def test_every_field_is_documented_for_kubectl_explain(root_schema: dict[str, Any]) -> None:
    for part in ("spec", "status"):
        for path, node in _nodes(root_schema["properties"][part], part):
            if path.endswith(("[]", "{}")):
                continue  # list items and map values are described by their field
            assert node.get("description"), f"{path} has no description"


def test_lists_strings_and_maps_are_bounded_so_cel_costs_are_estimable(root_schema: dict[str, Any]) -> None:
    # The status schema carries no CEL rules, but bounds keep it sane too.
    for path, node in _nodes(root_schema["properties"]["spec"], "spec"):
        kind = node.get("type")
        if kind == "array":
            assert "maxItems" in node, path
        if kind == "object" and "additionalProperties" in node:
            assert "maxProperties" in node, path
        if kind == "string" and "enum" not in node and "format" not in node:
            assert "maxLength" in node, path


def test_scale_and_printer_columns_point_at_real_fields(root_schema: dict[str, Any]) -> None:
    version = crd.render_crd()["spec"]["versions"][0]

    def lookup(json_path: str) -> dict[str, Any]:
        node = root_schema
        for name in json_path.lstrip(".").split("."):
            node = node["properties"][name]
        return node

    scale = version["subresources"]["scale"]
    assert lookup(scale["specReplicasPath"])["type"] == "integer"
    assert lookup(scale["statusReplicasPath"])["type"] == "integer"
    assert lookup(scale["labelSelectorPath"])["type"] == "string"
    names = [column["name"] for column in version["additionalPrinterColumns"] if column.get("priority", 0) == 0]
    assert names == ["Phase", "Nodes", "Pipelines", "Step", "Age"]
    for column in version["additionalPrinterColumns"]:
        if column["jsonPath"].startswith((".spec", ".status")):
            assert lookup(column["jsonPath"])["type"] == column["type"], column["name"]


def test_immutable_fields_carry_transition_rules(root_schema: dict[str, Any]) -> None:
    spec = root_schema["properties"]["spec"]["properties"]
    immutable = {
        path
        for path, node in _nodes(root_schema["properties"]["spec"], "spec")
        if any(rule["rule"] == "self == oldSelf" for rule in node.get("x-kubernetes-validations", []))
    }
    assert immutable == {
        "spec.model",
        "spec.gpusPerNode",
        "spec.maxTensorParallel",
        "spec.gpuResourceName",
        "spec.device",
        "spec.data",
        "spec.training.globalBatchSize",
        "spec.training.microbatchSize",
        "spec.training.seed",
    }
    # Transition rules on optional fields only run when the old object had them: all these are
    # required or defaulted, so a change is always caught.
    for name in ("model", "gpusPerNode", "maxTensorParallel", "gpuResourceName", "device", "data"):
        assert name in root_schema["properties"]["spec"].get("required", []) or "default" in spec[name], name


def test_defaults_in_the_schema_are_the_models_defaults(root_schema: dict[str, Any]) -> None:
    spec = root_schema["properties"]["spec"]["properties"]
    defaults = OobleckJobSpec.model_fields
    assert spec["resources"]["default"] == PodResources().to_kubernetes()
    assert spec["data"]["default"] == DataSpec().to_kubernetes()
    assert spec["f"]["default"] == defaults["f"].default == 1
    assert spec["cleanPodPolicy"]["enum"] == ["None", "Running", "All"]
