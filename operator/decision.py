"""What decide.py reads and returns: the job as read, its current plan, and the Decision that apply.py executes
(the order of its fields is apply's order; see decide.py's docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oobleck.api.plan import Plan
from oobleck.api.profile import ModelProfile
from oobleck.api.spec import OobleckJobSpec
from oobleck.api.status import OobleckJobStatus


@dataclass(frozen=True)
class JobContext:
    """The job as read from the API server."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: OobleckJobSpec
    status: OobleckJobStatus


@dataclass(frozen=True)
class CurrentPlan:
    """The plan ConfigMap's content: the generation in force and the failure counter stored with it."""

    plan: Plan
    failures_survived: int = 0


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Decision:
    """Everything to do, in `apply`'s order (see the module docstring)."""

    status: dict[str, Any]
    plan: Plan | None = None
    failures_survived: int = 0
    status_during: dict[str, Any] | None = None  # written while the patches are in flight (Reconfiguring)
    patches: tuple[tuple[str, dict[str, str]], ...] = ()
    delete: tuple[tuple[str, str], ...] = ()  # (pod, why)
    create: tuple[int, ...] = ()  # worker indices
    create_coordinator: bool = False
    events: tuple[Event, ...] = ()
    lost: tuple[str, ...] = ()  # members lost in this decision (for metrics)
    planner_seconds: float = 0.0
    profile: ModelProfile | None = None  # the profile generation 0 was planned with (stored beside the plan)
    slowdowns: dict[str, float] | None = None  # each member's slowdown against the others (operator/stragglers.py)
