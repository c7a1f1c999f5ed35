"""The job's worker pod settings: `spec.resources` and the overrides of `spec.pod`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from oobleck.api.resource import RESERVED_ENV_PREFIX, RESERVED_LABEL_PREFIX
from oobleck.api.schema import (
    ENV_NAME_PATTERN,
    QUALIFIED_NAME_PATTERN,
    AnnotationValue,
    CrdModel,
    DnsName,
    LabelValue,
    Quantity,
    Rule,
)


class PodResources(CrdModel):
    """CPU and memory each worker pod requests. Memory is also its limit; CPU is not limited (a CPU
    limit throttles the data loader and collectives). GPUs are requested separately (`gpusPerNode`)."""

    cpu: Quantity = Field(default="1", description="CPU per worker pod, a Kubernetes quantity (e.g. 2, 500m).")
    memory: Quantity = Field(default="2Gi", description="Memory per worker pod, a Kubernetes quantity (e.g. 8Gi).")


class Toleration(CrdModel):
    """A pod toleration (the Kubernetes fields, typed)."""

    key: str | None = Field(
        default=None,
        max_length=317,
        pattern=QUALIFIED_NAME_PATTERN,
        description="Taint key; absent with operator Exists tolerates every taint.",
    )
    operator: Literal["Exists", "Equal"] = Field(
        default="Equal", description="Exists matches any value; Equal matches `value`."
    )
    value: str | None = Field(default=None, max_length=63, description="Taint value, for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate; absent means all effects."
    )
    toleration_seconds: int | None = Field(
        default=None,
        ge=0,
        le=2**31 - 1,
        description="For NoExecute: how long the pod stays bound after the taint appears.",
    )

    _RULES = (
        Rule(
            cel="self.operator != 'Exists' || !has(self.value)",
            message="value must be empty when operator is Exists",
            check=lambda m: m.operator != "Exists" or m.value is None,
            field_path=".value",
            reason="FieldValueForbidden",
        ),
        Rule(
            cel="has(self.key) || self.operator == 'Exists'",
            message="a toleration without key must use operator Exists",
            check=lambda m: m.key is not None or m.operator == "Exists",
            field_path=".operator",
        ),
    )


class KeySelector(CrdModel):
    """A key of a Secret or ConfigMap in the job's namespace (the kubelet reads it; the operator never does)."""

    name: DnsName = Field(description="The Secret's or ConfigMap's name.")
    key: str = Field(
        min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$", description="The key whose value to use."
    )
    optional: bool | None = Field(default=None, description="Start the container even if the key is missing.")


class EnvVarSource(CrdModel):
    """Where a variable's value comes from, read by the kubelet when it starts the container: the value
    never passes through the operator, the plan ConfigMap or the pod's annotations."""

    secret_key_ref: KeySelector | None = Field(default=None, description="A key of a Secret.")
    config_map_key_ref: KeySelector | None = Field(default=None, description="A key of a ConfigMap.")

    _RULES = (
        Rule(
            cel="has(self.secretKeyRef) != has(self.configMapKeyRef)",
            message="valueFrom: set exactly one of secretKeyRef and configMapKeyRef",
            check=lambda m: (m.secret_key_ref is None) != (m.config_map_key_ref is None),
        ),
    )


class EnvVar(CrdModel):
    """An environment variable for the worker container: a literal `value`, or `valueFrom` a Secret or
    ConfigMap key (use this for tokens and passwords)."""

    name: str = Field(min_length=1, max_length=128, pattern=ENV_NAME_PATTERN, description="Variable name.")
    value: str | None = Field(
        default=None,
        max_length=32768,
        description="Variable value (stored in the job, its plan ConfigMap and the pods: never a secret).",
    )
    value_from: EnvVarSource | None = Field(default=None, description="The value from a Secret or ConfigMap key.")

    _RULES = (
        Rule(
            cel="!has(self.value) || !has(self.valueFrom)",
            message="name %s: set value or valueFrom, not both",
            cel_args=("self.name",),
            args=lambda m: (m.name,),
            check=lambda m: m.value is None or m.value_from is None,
            field_path=".valueFrom",
            reason="FieldValueForbidden",
        ),
        Rule(
            cel=f"!self.name.startsWith('{RESERVED_ENV_PREFIX}')",
            message=f"name %s: names starting with {RESERVED_ENV_PREFIX} are set by the runtime",
            cel_args=("self.name",),
            args=lambda m: (m.name,),
            check=lambda m: not m.name.startswith(RESERVED_ENV_PREFIX),
            field_path=".name",
            reason="FieldValueForbidden",
        ),
    )


class PodOverrides(CrdModel):
    """The few pod settings a job may change. Everything else about worker pods is the operator's."""

    node_selector: dict[str, LabelValue] = Field(
        default_factory=dict, max_length=32, description="Node labels a worker's node must have."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Taints worker pods tolerate."
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=64,
        description="Extra environment variables for the worker container (not OOBLECK_*).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    priority_class_name: DnsName | None = Field(default=None, description="PriorityClass of the worker pods.")
    labels: dict[str, LabelValue] = Field(
        default_factory=dict,
        max_length=32,
        description=f"Extra labels on worker pods (not {RESERVED_LABEL_PREFIX}*, which the operator selects on).",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"self.all(k, !k.startsWith('{RESERVED_LABEL_PREFIX}'))",
                    "message": f"label keys starting with {RESERVED_LABEL_PREFIX} are set by the operator",
                    "reason": "FieldValueForbidden",
                }
            ]
        },
    )
    annotations: dict[str, AnnotationValue] = Field(
        default_factory=dict,
        max_length=32,
        description=f"Extra annotations on worker pods (not {RESERVED_LABEL_PREFIX}*, which the operator and the "
        "workers write).",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"self.all(k, !k.startsWith('{RESERVED_LABEL_PREFIX}'))",
                    "message": f"annotation keys starting with {RESERVED_LABEL_PREFIX} are set by the operator and "
                    "the workers",
                    "reason": "FieldValueForbidden",
                }
            ]
        },
    )

    _RULES = (
        Rule(
            cel=None,  # the API server rejects it through the env list's map type (Duplicate value)
            message="env: a name appears twice",
            check=lambda m: len({e.name for e in m.env}) == len(m.env),
        ),
        Rule(
            cel=None,  # the API server applies the rule on the labels field itself
            message=f"labels: label keys starting with {RESERVED_LABEL_PREFIX} are set by the operator",
            check=lambda m: not any(k.startswith(RESERVED_LABEL_PREFIX) for k in m.labels),
        ),
        Rule(
            cel=None,  # the API server applies the rule on the annotations field itself
            message=f"annotations: annotation keys starting with {RESERVED_LABEL_PREFIX} are set by the operator and "
            "the workers",
            check=lambda m: not any(k.startswith(RESERVED_LABEL_PREFIX) for k in m.annotations),
        ),
    )
