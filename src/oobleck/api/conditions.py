"""OobleckJob status conditions: their types and reasons, in one place, and pure helpers.

Conditions are `metav1.Condition`s in `status.conditions` (a list-map keyed by type). A merge patch
replaces lists, so writers always send the whole list that `set_condition` returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from enum import StrEnum
from typing import Literal

from oobleck.api.status import Condition, Phase

ConditionStatus = Literal["True", "False", "Unknown"]


class ConditionType(StrEnum):
    CREATED = "Created"
    """The operator accepted the spec and created the job's objects (coordinator, service, plan)."""
    RUNNING = "Running"
    """Workers are training under the current plan."""
    RECONFIGURING = "Reconfiguring"
    """A new plan generation is being rolled out (node lost or added, scaled)."""
    DEGRADED = "Degraded"
    """Fewer than f + 1 pipelines remain: another failure may need the checkpoint fallback."""
    SUCCEEDED = "Succeeded"
    """All training steps completed."""
    FAILED = "Failed"
    """The job stopped and will not resume by itself."""
    WORKERS_PENDING = "WorkersPending"
    """Worker pods (replacements or a scale-up) cannot be scheduled; the message says why."""
    CHECKPOINT_FAILING = "CheckpointFailing"
    """A worker's last checkpoint write failed (the message names the worker, step and error): a rollback
    beyond f failures may find no checkpoint. False again once the workers' writes succeed."""


class Reason:
    """CamelCase reasons, grouped by the condition they explain."""

    # Created
    OBJECTS_CREATED = "ObjectsCreated"
    # Running
    WAITING_FOR_NODES = "WaitingForNodes"
    PROFILING = "Profiling"
    PROFILE_NOT_MEASURED = "ProfileNotMeasured"
    TRAINING = "Training"
    # Reconfiguring
    NODE_LOST = "NodeLost"
    NODES_ADDED = "NodesAdded"
    SCALED = "Scaled"
    RECONFIGURED = "Reconfigured"
    ROLLING_BACK = "RollingBack"
    """some layer lost every live replica: the workers restore the newest snapshot or checkpoint step"""
    GENERATION_RETRIED = "GenerationRetried"
    """the same nodes start a new generation (the coordinator restarted, or a failure named nobody)"""
    # Degraded
    FEWER_PIPELINES = "FewerThanFPlusOnePipelines"
    FULLY_REDUNDANT = "FullyRedundant"
    # Succeeded
    STEPS_COMPLETED = "StepsCompleted"
    # WorkersPending
    UNSCHEDULABLE = "Unschedulable"
    ALL_SCHEDULED = "AllScheduled"
    # CheckpointFailing (and a Warning event when it turns True)
    CHECKPOINT_WRITE_FAILED = "CheckpointWriteFailed"
    CHECKPOINTS_WRITTEN = "CheckpointsWritten"
    # Failed
    INVALID_SPEC = "InvalidSpec"
    CHILD_REJECTED = "ChildRejected"
    """the API server refused to create one of the job's objects for good (HTTP 400, 403, 413 or 422: a quota,
    a LimitRange, an admission policy, an object too large); the message is the API server's"""
    REPORT_TOO_LARGE = "ReportTooLarge"
    """(an event) a worker's report annotation over the operator's cap was left unread (api.contract)"""
    PLAN_UNREADABLE = "PlanUnreadable"
    """the plan ConfigMap cannot be read (not a plan, or over the decompression cap)"""
    TOO_FEW_NODES = "TooFewNodes"
    LAYERS_LOST = "LayersLost"
    PENDING_TIMEOUT = "PendingTimeout"
    WORKER_ERROR = "WorkerError"
    # ... because of the job itself (oobleck.api.causes: a Cause's kind is its reason)
    MODEL_LOAD_FAILED = "ModelLoadFailed"
    DATA_UNAVAILABLE = "DataUnavailable"
    INVALID_CONFIG = "InvalidConfig"
    OUT_OF_MEMORY = "OutOfMemory"
    NON_FINITE_LOSS = "NonFiniteLoss"
    CUDA_ERROR = "CudaError"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    """more worker pods failed by themselves (a job cause, or exiting before the runtime ran) than
    failurePolicy.backoffLimit allows"""
    WORKER_FAILED = "WorkerFailed"
    """a worker container exited non-zero before its runtime reported anything, on more than one pod"""
    # ... or the pod's own waiting reason held past failurePolicy.startTimeoutSeconds
    # (ImagePullBackOff, ErrImagePull, CrashLoopBackOff, CreateContainerConfigError, ...)
    # Any condition turning False because another took over (e.g. Running after Succeeded).
    NOT_APPLICABLE = "NotApplicable"


def utc_now() -> datetime:
    """Now, at the second precision metav1.Time keeps."""
    return datetime.now(UTC).replace(microsecond=0)


def find_condition(conditions: Sequence[Condition], type_: str) -> Condition | None:
    """The condition of this type, or None."""
    return next((c for c in conditions if c.type == type_), None)


def is_true(conditions: Sequence[Condition], type_: str) -> bool:
    """Whether the condition of this type is present with status True."""
    condition = find_condition(conditions, type_)
    return condition is not None and condition.status == "True"


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    generation: int | None,
    now: datetime,
) -> list[Condition]:
    """A new list with the condition of `type_` set; the input is not modified.

    lastTransitionTime moves only when the status changes, so that it says how long a condition
    has held, not when the operator last looked. Order is kept; a new type is appended.
    """
    old = find_condition(conditions, type_)
    since = old.last_transition_time if old is not None and old.status == status else now.replace(microsecond=0)
    new = Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        observed_generation=generation,
        last_transition_time=since,
    )
    if old is None:
        return [*conditions, new]
    return [new if c.type == type_ else c for c in conditions]


def phase_of(conditions: Sequence[Condition]) -> Phase:
    """The phase the conditions add up to: terminal conditions first, then reconfiguring, running."""
    for type_, phase in (
        (ConditionType.FAILED, Phase.FAILED),
        (ConditionType.SUCCEEDED, Phase.SUCCEEDED),
        (ConditionType.RECONFIGURING, Phase.RECONFIGURING),
        (ConditionType.RUNNING, Phase.RUNNING),
    ):
        if is_true(conditions, type_):
            return phase
    return Phase.PENDING
