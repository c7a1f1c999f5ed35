"""The OobleckJob's status: what the operator observed, written through the status subresource only."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import Field

from oobleck.api.schema import MAX_NODES, CrdModel


class Phase(StrEnum):
    """The job's phase: a one-word summary of its conditions (see oobleck.api.conditions.phase_of)."""

    PENDING = "Pending"
    RUNNING = "Running"
    RECONFIGURING = "Reconfiguring"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class Condition(CrdModel):
    """A status condition, shaped like metav1.Condition."""

    type: str = Field(
        max_length=316,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
        description="Condition type, e.g. Running.",
    )
    status: Literal["True", "False", "Unknown"] = Field(description="Whether the condition holds.")
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation the condition was set for."
    )
    last_transition_time: datetime = Field(description="When status last changed.")
    reason: str = Field(
        min_length=1,
        max_length=1024,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        description="CamelCase reason, one of oobleck.api.conditions.Reason.",
    )
    message: str = Field(default="", max_length=32768, description="Human-readable details.")


class TemplateUse(CrdModel):
    """A pipeline template of the current plan and how many pipelines instantiate it."""

    nodes: int = Field(ge=1, le=MAX_NODES, description="Nodes per pipeline of this template.")
    pipelines: int = Field(ge=0, le=MAX_NODES, description="Pipelines built from this template.")


class PlanSummary(CrdModel):
    """The current plan in brief; the full plan is in the ConfigMap `configMap`."""

    generation: int = Field(ge=0, description="Plan generation; it increases with every reconfiguration.")
    config_map: str | None = Field(default=None, max_length=253, description="ConfigMap holding the full plan.")
    templates: list[TemplateUse] = Field(
        default_factory=list, max_length=64, description="Templates and their pipeline counts."
    )
    pipelines: int = Field(ge=0, le=MAX_NODES, description="Pipelines (model replicas) training.")
    nodes: int = Field(ge=0, le=MAX_NODES, description="Nodes the plan uses.")
    degraded: bool = Field(default=False, description="True when fewer than f + 1 pipelines remain.")
    iteration_ms: float | None = Field(
        default=None, ge=0, description="The planner's estimate of one step, in milliseconds."
    )


class Progress(CrdModel):
    """Training progress, as the workers last reported it."""

    step: int = Field(default=0, ge=0, description="Optimizer steps completed.")
    samples_per_second: float | None = Field(default=None, ge=0, description="Recent training throughput.")
    loss: float | None = Field(default=None, description="Recent training loss.")
    last_checkpoint_step: int | None = Field(default=None, ge=0, description="Step of the newest complete checkpoint.")


class WorkerFailure(CrdModel):
    """A worker pod that failed by itself, as the operator counted it."""

    pod: str = Field(max_length=253, description="The pod's name.")
    uid: str = Field(max_length=64, description="The pod's uid (names of replacements can repeat).")
    reason: str = Field(max_length=128, description="The cause's kind, or the container's reason.")
    message: str = Field(default="", max_length=4096, description="What the worker or its container said.")


class Straggler(CrdModel):
    """A node slower than spec.stragglers.threshold, as the operator last measured it."""

    node: str = Field(max_length=253, description="The worker pod (plan node).")
    slowdown: float = Field(
        ge=0, description="Its compute against its own starting pace, over the other nodes' median."
    )
    since_step: int = Field(ge=0, description="The step from which it has been over the threshold.")
    confirmed: bool = Field(
        default=False, description="Slow for spec.stragglers.window steps or more (a Straggler event was raised)."
    )


class OobleckJobStatus(CrdModel):
    """What the operator observed: written through the status subresource only."""

    phase: Phase = Field(default=Phase.PENDING, description="One-word summary of the conditions.")
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        description="Created, Running, Reconfiguring, Degraded, Succeeded, Failed (reasons in oobleck.api.conditions).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    observed_generation: int | None = Field(default=None, ge=0, description="metadata.generation the status reflects.")
    nodes: int = Field(
        default=0, ge=0, le=MAX_NODES, description="Nodes in use (the scale subresource's status replicas)."
    )
    selector: str | None = Field(
        default=None, max_length=1024, description="Label selector of the worker pods (for the scale subresource)."
    )
    plan: PlanSummary | None = Field(default=None, description="The current plan in brief.")
    progress: Progress | None = Field(default=None, description="Training progress.")
    failures_survived: int = Field(default=0, ge=0, description="Node failures recovered from without a restart.")
    reconfigurations: int = Field(
        default=0, ge=0, description="Plans after the first (failures, scaling, nodes returning)."
    )
    worker_failures: int = Field(
        default=0,
        ge=0,
        description="Worker pods that failed by themselves (a job cause, or before the runtime started); the job "
        "fails once this exceeds spec.failurePolicy.backoffLimit.",
    )
    last_worker_failures: list[WorkerFailure] = Field(
        default_factory=list, max_length=8, description="The newest worker failures counted, oldest first."
    )
    stragglers: list[Straggler] = Field(
        default_factory=list, max_length=MAX_NODES, description="Nodes now slower than spec.stragglers.threshold."
    )
    spares: int = Field(
        default=0, ge=0, le=MAX_NODES, description="Warm spare worker pods ready to be folded in (spec.nodes.spares)."
    )
    spare_pods: list[str] = Field(
        default_factory=list,
        max_length=MAX_NODES,
        description="Those spares' pod names: running, their runtime up, in no plan (not members).",
    )
    start_time: datetime | None = Field(default=None, description="When the first plan started training.")
    completion_time: datetime | None = Field(default=None, description="When the job succeeded or failed.")


def parse_status(status: dict[str, Any] | None) -> OobleckJobStatus:
    """Validate a job's `status`; an absent status is the initial one."""
    return OobleckJobStatus.model_validate(status or {})
