"""Render the OobleckJob CustomResourceDefinition from the pydantic models in `oobleck.api.spec` and `.status`.

Pydantic emits JSON Schema (draft 2020-12); the API server wants a *structural* OpenAPI v3 schema:
every node typed, no `$ref`, no `anyOf` except the int-or-string form, no `additionalProperties:
false`, boolean `exclusiveMinimum`. `structural()` does that translation; the CEL rules, list types
and defaults the models declare pass through as they are. Everything here is pure: `crds/` is the
output of `render_crd()`, and a test fails when the two differ.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml
from pydantic import BaseModel

from oobleck.api import resource
from oobleck.api.spec import OobleckJobSpec
from oobleck.api.status import OobleckJobStatus

CRD_NAME = f"{resource.PLURAL}.{resource.GROUP}"
CRD_FILE = f"{CRD_NAME}.yaml"
HEADER = "# Generated from src/oobleck/api/ by `make crds` (oobleck crds --write crds/). Do not edit.\n"

_INT32_MAX = 2**31 - 1
# JSON Schema keywords that mean nothing to the API server (or are rejected by it).
_DROPPED = {"title", "$defs", "additionalProperties"}

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {
        "name": "Phase",
        "type": "string",
        "jsonPath": ".status.phase",
        "description": "One-word summary of the conditions.",
    },
    {"name": "Nodes", "type": "integer", "jsonPath": ".status.nodes", "description": "Nodes in use."},
    {
        "name": "Target",
        "type": "integer",
        "jsonPath": ".spec.nodes.target",
        "description": "Nodes asked for (absent: max).",
        "priority": 1,
    },
    {
        "name": "Max",
        "type": "integer",
        "jsonPath": ".spec.nodes.max",
        "description": "Most nodes the job uses.",
        "priority": 1,
    },
    {
        "name": "Spares",
        "type": "integer",
        "jsonPath": ".status.spares",
        "description": "Warm spare worker pods ready to replace a lost node.",
        "priority": 1,
    },
    {
        "name": "Pipelines",
        "type": "integer",
        "jsonPath": ".status.plan.pipelines",
        "description": "Pipelines training.",
    },
    {
        "name": "Step",
        "type": "integer",
        "jsonPath": ".status.progress.step",
        "description": "Optimizer steps completed.",
    },
    {
        "name": "Steps",
        "type": "integer",
        "jsonPath": ".spec.training.steps",
        "description": "Optimizer steps to run.",
        "priority": 1,
    },
    {
        "name": "Samples/s",
        "type": "number",
        "jsonPath": ".status.progress.samplesPerSecond",
        "description": "Recent throughput.",
        "priority": 1,
    },
    {
        "name": "Failures",
        "type": "integer",
        "jsonPath": ".status.failuresSurvived",
        "description": "Node failures survived.",
        "priority": 1,
    },
    {
        "name": "Plan",
        "type": "integer",
        "jsonPath": ".status.plan.generation",
        "description": "Plan generation.",
        "priority": 1,
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

# `kubectl scale oj/NAME --replicas=N` sets spec.nodes.target; status.nodes and status.selector let
# `kubectl get --subresource=scale` (and autoscalers) see what is in use.
SCALE = {
    "specReplicasPath": ".spec.nodes.target",
    "statusReplicasPath": ".status.nodes",
    "labelSelectorPath": ".status.selector",
}

# metadata may only constrain name and generateName. Children are named `<job>-<suffix>` and
# Services need DNS-1035 labels, hence a shorter, stricter name than Kubernetes requires.
METADATA = {
    "type": "object",
    "properties": {
        "name": {
            "type": "string",
            "maxLength": resource.MAX_NAME_LENGTH,
            "pattern": resource.NAME_PATTERN,
        }
    },
}


def _merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """`overlay` (a field's own keywords) over `base` (its type's schema); CEL rules accumulate."""
    merged = {**base, **overlay}
    rules = base.get("x-kubernetes-validations", []) + overlay.get("x-kubernetes-validations", [])
    if rules:
        merged["x-kubernetes-validations"] = rules
    return merged


def _strip_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_none(v) for v in value]
    return value


def structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Translate one pydantic JSON-schema node (with its `$defs`) into a structural OpenAPI v3 schema."""
    node = dict(schema)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        return structural(_merge(target, node), defs)
    if "allOf" in node and len(node["allOf"]) == 1:
        return structural(_merge(node.pop("allOf")[0], node), defs)
    if "anyOf" in node:
        branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
        if node.get("default", ...) is None:  # Optional: absent rather than null
            del node["default"]
        if len(branches) == 1:
            return structural(_merge(branches[0], node), defs)
        types = sorted(b.get("type", "") for b in branches)
        if types != ["integer", "string"]:
            raise ValueError(f"cannot express anyOf {types} structurally: only int-or-string is allowed")
        # int-or-string: value checks of the string branch apply to strings only, so hoist them.
        for branch in branches:
            for keyword, value in branch.items():
                if keyword != "type":
                    node.setdefault(keyword, value)
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        node["x-kubernetes-int-or-string"] = True
        return _finish(node, defs)
    return _finish(node, defs)


def _finish(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for keyword, value in node.items():
        if keyword in _DROPPED:
            continue
        if keyword == "const":
            out["enum"] = [value]
        elif keyword == "properties":
            out["properties"] = {name: structural(prop, defs) for name, prop in value.items()}
        elif keyword == "items":
            out["items"] = structural(value, defs)
        elif keyword in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            out["minimum" if keyword == "exclusiveMinimum" else "maximum"] = value
            out[keyword] = True
        elif keyword == "default":
            out["default"] = _strip_none(value)
        elif keyword == "x-kubernetes-validations":
            out[keyword] = [dict(sorted(rule.items(), key=lambda kv: _RULE_ORDER.index(kv[0]))) for rule in value]
        elif keyword == "description":
            out["description"] = " ".join(value.split())  # docstrings wrap; `kubectl explain` rewraps
        else:
            out[keyword] = copy.deepcopy(value)
    if isinstance(node.get("additionalProperties"), dict):  # a map: dict[str, X]
        out["additionalProperties"] = structural(node["additionalProperties"], defs)
    if out.get("type") == "integer":
        out["format"] = "int32" if out.get("maximum", _INT32_MAX + 1) <= _INT32_MAX else "int64"
    return dict(sorted(out.items(), key=_keyword_rank))


_RULE_ORDER = ("rule", "message", "messageExpression", "fieldPath", "reason", "optionalOldSelf")
# Readable, stable order: what a node is first, its children next, its rules last.
_FIRST = ("type", "format", "description", "enum", "default")
_LAST = ("properties", "required", "items", "additionalProperties", "anyOf")


def _keyword_rank(item: tuple[str, Any]) -> tuple[int, int, str]:
    keyword = item[0]
    if keyword in _FIRST:
        return (0, _FIRST.index(keyword), "")
    if keyword in _LAST:
        return (2, _LAST.index(keyword), "")
    if keyword.startswith("x-kubernetes-"):
        return (3, 0, keyword)
    return (1, 0, keyword)


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural schema of one model class (its Kubernetes field names)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return structural(raw, raw.get("$defs", {}))


def render_crd() -> dict[str, Any]:
    """The OobleckJob CRD as a plain dict (apiextensions.k8s.io/v1)."""
    spec = model_schema(OobleckJobSpec)
    status = model_schema(OobleckJobStatus)
    root = {
        "type": "object",
        "description": f"{resource.KIND}: {spec.get('description', '')}",
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion of this object."},
            "kind": {"type": "string", "description": "Kind of this object."},
            "metadata": METADATA,
            "spec": spec,
            "status": status,
        },
        "required": ["spec"],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": resource.GROUP,
            "names": {
                "kind": resource.KIND,
                "listKind": f"{resource.KIND}List",
                "plural": resource.PLURAL,
                "singular": resource.SINGULAR,
                "shortNames": list(resource.SHORT_NAMES),
                "categories": ["oobleck"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": resource.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {"status": {}, "scale": dict(SCALE)},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def yaml_dump(document: dict[str, Any]) -> str:
    """Deterministic YAML: keys in the order the renderer built them, long lines left unwrapped."""
    return yaml.safe_dump(document, sort_keys=False, default_flow_style=False, width=10_000, allow_unicode=True)


def render_files() -> dict[str, str]:
    """Every file `crds/` should contain, by name."""
    return {CRD_FILE: HEADER + yaml_dump(render_crd())}
