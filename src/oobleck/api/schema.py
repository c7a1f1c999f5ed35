"""The building blocks of the OobleckJob models (`oobleck.api.spec`, `oobleck.api.status`).

These models are the single source of the CRD schema: `oobleck.api.crd` renders them into the
OpenAPI schema in `crds/`, so every `description` is what `kubectl explain oj.spec...` shows.
Cross-field rules are declared once per model (`_RULES`) and enforced twice: by the API server as
CEL (`x-kubernetes-validations`) and by pydantic when the operator or a test parses a spec, with the
same wording, so an invalid job is rejected with the same message either way.

Field names are snake_case in Python and camelCase in Kubernetes (aliases); both are accepted, and
dumps use the Kubernetes names. Here: `Rule`, the base model `CrdModel`, the field types and
patterns both sides share, and the directories the operator mounts (which user paths must avoid).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from pydantic.alias_generators import to_camel

MAX_NODES = 4096
# An absolute path with no empty, trailing or root-only component: /a, /a/b.
ABSOLUTE_PATH_PATTERN = r"^(/[^/]+)+$"
# Kubernetes resource quantity, unsigned (e.g. "500m", "2", "8Gi", "1e3"): the apimachinery grammar.
QUANTITY_PATTERN = (
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
# A Kubernetes label or annotation key, or a resource name: [prefix/]name.
QUALIFIED_NAME_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ENTRY_POINT_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"

Quantity = Annotated[int, Field(ge=0)] | Annotated[str, StringConstraints(pattern=QUANTITY_PATTERN, max_length=64)]
DnsName = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)]
LabelValue = Annotated[str, StringConstraints(max_length=63)]
AnnotationValue = Annotated[str, StringConstraints(max_length=4096)]


def _no_args(model: Any) -> tuple[Any, ...]:
    return ()


@dataclass(frozen=True)
class Rule:
    """A cross-field rule of one model, enforced by the API server (CEL) and by pydantic (`check`).

    `message` is one printf-style template (%d, %s) for both sides, filled from `cel_args` (CEL
    expressions: the API server runs `'<message>'.format([...])`, whose cost it can bound, unlike
    `string(int)` concatenation) and from `args(model)` in Python. `field_path` is relative to the
    model (".min"); the API server reports the error at that field.
    """

    cel: str | None  # None: the API server enforces it another way (a list-map key, a field's own rule)
    message: str
    check: Callable[[Any], bool]
    cel_args: tuple[str, ...] = ()
    args: Callable[[Any], tuple[Any, ...]] = _no_args
    field_path: str | None = None
    reason: Literal["FieldValueInvalid", "FieldValueForbidden", "FieldValueRequired"] = "FieldValueInvalid"

    def python_message(self, model: Any) -> str:
        return self.message % self.args(model) if self.cel_args else self.message

    def to_cel(self) -> dict[str, str]:
        """The x-kubernetes-validations entry."""
        assert self.cel is not None and "'" not in self.message
        rule = {"rule": self.cel}
        if self.cel_args:
            rule["messageExpression"] = f"'{self.message}'.format([{', '.join(self.cel_args)}])"
        else:
            rule["message"] = self.message
        if self.field_path:
            rule["fieldPath"] = self.field_path
        rule["reason"] = self.reason
        return rule


def immutable(what: str) -> dict[str, Any]:
    """Schema extra that makes a field unchangeable after creation (a CEL transition rule)."""
    message = f"{what} is immutable: create a new OobleckJob to change it"
    return {
        "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": message, "reason": "FieldValueForbidden"}]
    }


def _add_rules(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    # pydantic hook: put the model's CEL rules into its JSON schema, which crd.py keeps.
    rules = [rule.to_cel() for rule in getattr(cls, "_RULES", ()) if rule.cel is not None]
    if rules:
        schema["x-kubernetes-validations"] = rules
    schema.pop("title", None)


class CrdModel(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        json_schema_extra=_add_rules,
    )
    _RULES: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> Any:
        for rule in self._RULES:
            if not rule.check(self):
                raise ValueError(rule.python_message(self))
        return self

    def to_kubernetes(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase names, unset optional fields left out."""
        return self.model_dump(mode="json", exclude_none=True)


def defaulted(model: type[CrdModel]) -> dict[str, Any]:
    """Schema extra for a field whose model has a default for every field: the API server fills the
    whole object in when it is absent, so `kubectl get -o yaml` shows what the job will use. (The
    full object, not `{}`: the API server checks a default against the CEL rules as it is.)"""
    return {"default": model().to_kubernetes()}


MODEL_CONFIG_DIR = "/etc/oobleck/model"
"""Where worker pods see the model's config.json ConfigMap key (model.transformers.configMap)."""
SHM_DIR = "/dev/shm"
"""Where worker pods get a memory-backed emptyDir (NCCL and the data loader need more than 64 MiB)."""
JOB_KEY_DIR = "/var/run/oobleck/job-key"
"""Where a worker pod mounts its job's key Secret (OOBLECK_JOB_KEY_FILE is a file in it)."""
RESERVED_MOUNT_PATHS = (SHM_DIR, MODEL_CONFIG_DIR, JOB_KEY_DIR)
"""Directories the operator mounts volumes at: no user volume may be mounted at one or above one."""
_RESERVED_CEL = "[" + ", ".join(f"'{p}'" for p in RESERVED_MOUNT_PATHS) + "]"


def clear_of_reserved(path: str) -> bool:
    return all(path != r and not r.startswith(path + "/") for r in RESERVED_MOUNT_PATHS)


def clear_of_reserved_cel(path: str) -> str:
    return f"{_RESERVED_CEL}.all(r, {path} != r && !r.startsWith({path} + '/'))"


def mount_rule(field: str, cel_path: str, python_path: Callable[[Any], str | None]) -> Rule:
    """The rule that a user path (`field`) is not a directory the operator mounts, nor above one."""
    return Rule(
        cel=clear_of_reserved_cel(cel_path),
        message=f"{field} %s: the operator mounts volumes at {' and '.join(RESERVED_MOUNT_PATHS)} in worker "
        "containers; use a directory that is neither one of them nor above one",
        cel_args=(cel_path,),
        args=lambda m: (python_path(m),),
        check=lambda m: python_path(m) is None or clear_of_reserved(str(python_path(m))),
        field_path=f".{field.rsplit('.', 1)[-1]}",
    )


def data_directory(path: str) -> str:
    """The directory of a token file, where its claim is mounted ("" for a file at /)."""
    return path.rsplit("/", 1)[0]
