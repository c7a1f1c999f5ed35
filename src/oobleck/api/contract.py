"""The operator <-> worker pod contract: one model the operator renders and the pod parses.

What a worker pod may rely on, and what the operator may rely on from it:

- `PodContract`: the worker container's environment. The operator builds one per worker pod
  (operator/render.py `worker_pod`: `contract.to_env()`); the pod parses it back
  (runtime/backends/pod/config.py: `PodContract.from_env(os.environ)`, errors naming the variable).
- Ports: STORE_PORT (the coordinator's TCPStore) and WORKER_PORT (a worker pod's /metrics; local GPU g
  serves on WORKER_PORT + g).
- `ExitCode`: what a worker pod's exit status means.
- Annotations: RANKS_ANNOTATION and GENERATION_ANNOTATION are written by the operator on worker pods;
  FAILURE_ANNOTATION, PROGRESS_ANNOTATION and MEASURED_PROFILE_ANNOTATION by a worker on its own pod;
  GENERATION_ANNOTATION and FAILURES_SURVIVED_ANNOTATION by the operator on the plan ConfigMap. Their
  values are described where each is defined below; the ConfigMap's keys and the plan's encoding are in
  oobleck.api.planmap, the pods' and ConfigMap's roles in operator/render.py's docstring.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from oobleck.api.addresses import parse_host_port
from oobleck.api.resource import GROUP

STORE_PORT = 29400
"""The coordinator pod's TCPStore (`OOBLECK_STORE`'s port)"""
WORKER_PORT = 29500
"""A worker pod's container port: /metrics of local GPU g on WORKER_PORT + g"""
METRICS_PORTS = 64
"""Local GPUs a worker pod's /metrics may serve (WORKER_PORT ..< WORKER_PORT + METRICS_PORTS)."""
FIXED_PORTS = frozenset({STORE_PORT, *range(WORKER_PORT, WORKER_PORT + METRICS_PORTS)})
"""Every port the job's pods listen on at a fixed number (the rest are ephemeral)."""


class ExitCode(enum.IntEnum):
    """Every exit status of a worker pod and of an elastic worker process. 0-5: how the runtime ended;
    10-15: a failure caused by the job itself (oobleck.api.causes: the worker could not run this job
    anywhere), one per cause kind, so that the exit code alone names the kind; 137 is a SIGKILL."""

    DONE = 0
    """the job's last step is done"""
    ERROR = 1
    """anything else (the message says what)"""
    CONFIG = 2
    """bad configuration: the environment, the job spec or the plan ConfigMap"""
    DROPPED = 3
    """a newer plan left this worker out (declared dead, or scaled in)"""
    NO_PLAN = 4
    """no plan arrived in time"""
    UNRECOVERABLE = 5
    """some layer's state is gone from every worker, snapshot and checkpoint (the job fails with it)"""
    MODEL_LOAD_FAILED = 10
    """cause ModelLoadFailed"""
    DATA_UNAVAILABLE = 11
    """cause DataUnavailable"""
    INVALID_CONFIG = 12
    """cause InvalidConfig"""
    OUT_OF_MEMORY = 13
    """cause OutOfMemory"""
    NON_FINITE_LOSS = 14
    """cause NonFiniteLoss"""
    CUDA_ERROR = 15
    """cause CudaError"""


GENERATION_ANNOTATION = f"{GROUP}/plan-generation"
"""On the plan ConfigMap: the plan's generation. On a worker pod (by the operator): the generation its
RANKS_ANNOTATION was written for (the ranks last changed at or before it)"""
RANKS_ANNOTATION = f"{GROUP}/ranks"
"""On a worker pod, by the operator: comma-separated ranks of local GPUs 0..G-1 in the plan in force
(empty: not in it); patched only after the ConfigMap holds the generation, and only when they change"""
FAILURE_ANNOTATION = f"{GROUP}/failure-report"
"""On a worker pod, by its runtime: a oobleck.runtime.elastic.health.FailureReport as JSON (`job`, `generation`,
`reporter`, `kind`, `dead` as plan node ids, `detail`)"""
PROGRESS_ANNOTATION = f"{GROUP}/progress"
"""On a worker pod, by its runtime: `{"generation", "step", "loss", "samplesPerSecond"}` (rate-limited,
the final step always); `{"generation": -1, "step": 0}` before the first plan: "up, waiting for a plan\""""
FAILURES_SURVIVED_ANNOTATION = f"{GROUP}/failures-survived"
"""On the plan ConfigMap, by the operator: the failure counter stored with the plan"""
MEASURED_PROFILE_ANNOTATION = f"{GROUP}/measured-profile"
"""On a worker pod, by its runtime, before the first plan of a `profile: measure` job: the ModelProfile
JSON it measured on its own device (the operator plans generation 0 with it)"""

MAX_REPORT_BYTES = 16 * 1024
"""The most the operator reads of a worker's FAILURE_ANNOTATION, PROGRESS_ANNOTATION or cause annotation
(a runtime's report is a few hundred bytes); a longer one is ignored with a warning event"""
MAX_MEASURED_PROFILE_BYTES = 192 * 1024
"""The most the operator reads of MEASURED_PROFILE_ANNOTATION (about 1000 layers); a longer one fails
the job InvalidSpec. The operator keeps every pod's reports in memory: these caps bound it."""


POD_IP_ENV = "OOBLECK_POD_IP"


def pod_ip_env() -> dict[str, Any]:
    """The `env` entry that gives a container its pod's IP (the downward API's status.podIP)."""
    return {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


class PodContract(BaseModel):
    """The worker container's environment, set by the operator (field aliases are the variable names).

    OOBLECK_POD_IP is the pod's own IP, which only the node knows: the operator renders it as a reference to
    the pod's status.podIP (`pod_ip_env`), which the kubelet fills in. Every listener of the pod binds to it.
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="ignore")

    job: str = Field(alias="OOBLECK_JOB", min_length=1, description="the OobleckJob's name")
    namespace: str = Field(alias="OOBLECK_NAMESPACE", min_length=1)
    node: str = Field(alias="OOBLECK_NODE", min_length=1, description="this pod's name: the plan's node id")
    plan_config_map: str = Field(alias="OOBLECK_PLAN_CONFIGMAP", min_length=1, description="`<job>-plan`")
    store: str = Field(
        alias="OOBLECK_STORE",
        description="HOST:PORT of the coordinator's TCPStore, HOST `<job>-coordinator.<service>...`: its first "
        "label names the coordinator pod, whose status.podIP the worker prefers (Service names do not "
        "resolve on local nodes)",
    )
    gpus_per_node: int = Field(1, alias="OOBLECK_GPUS_PER_NODE", ge=1)
    device: Literal["cuda", "cpu"] = Field("cuda", alias="OOBLECK_DEVICE")
    job_spec: str | None = Field(
        None,
        alias="OOBLECK_JOB_SPEC",
        description="the job's spec as JSON (camelCase): what to profile before any plan exists; afterwards "
        "the plan ConfigMap's job.json is what the worker reads",
    )
    job_key_file: str | None = Field(
        None,
        alias="OOBLECK_JOB_KEY_FILE",
        description="path of the job's key (a mounted Secret, >= 16 bytes): every store value and snapshot push a "
        "worker acts on is authenticated with HMAC-SHA256 under it (oobleck.runtime.elastic.signing); unset: "
        "nothing is authenticated",
    )
    pod_ip: str | None = Field(
        None, alias=POD_IP_ENV, description="the pod's IP (status.podIP, through the downward API): bind here"
    )

    @field_validator("store")
    @classmethod
    def _host_port(cls, value: str) -> str:
        parse_host_port(value)
        return value

    @property
    def store_host(self) -> str:
        return parse_host_port(self.store)[0]

    @property
    def store_port(self) -> int:
        return parse_host_port(self.store)[1]

    @property
    def coordinator_pod(self) -> str:
        """The coordinator pod's name: the first label of OOBLECK_STORE's host."""
        return self.store_host.split(".", 1)[0]

    def to_env(self) -> list[dict[str, str]]:
        """The container's `env` entries (unset optional variables left out)."""
        values = self.model_dump(by_alias=True, exclude_none=True)
        return [{"name": name, "value": str(value)} for name, value in values.items()]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Self:
        """Parse a container's environment; ValueError names the variable that is missing or malformed."""
        names = {field.alias for field in cls.model_fields.values() if field.alias}
        present = {name: env[name] for name in names if env.get(name)}
        try:
            return cls.model_validate(present)
        except ValidationError as error:
            problem = error.errors()[0]
            name = problem["loc"][0] if problem["loc"] else "environment"
            if problem["type"] == "missing":
                raise ValueError(f"{name}: not set (the operator sets it on worker pods)") from None
            if problem["type"] == "value_error":  # our validators name the value themselves
                raise ValueError(f"{name}: {problem['msg'].removeprefix('Value error, ')}") from None
            raise ValueError(f"{name}: {problem['msg']}, got {present.get(str(name), '')!r}") from None
