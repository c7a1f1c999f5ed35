"""What a worker reports and the operator reads: failure reports and progress, as typed models.

The runtime writes them (as FAILURE_ANNOTATION / PROGRESS_ANNOTATION on its own pod, or through the
coordinator's store under `oobleck launch`); the operator and the local launcher parse them here, so a
malformed report is one `None`, never a key-by-key guess.
"""

from __future__ import annotations

import enum
import json
import math
import time
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

_Report = TypeVar("_Report", bound=BaseModel)


class FailureKind(enum.StrEnum):
    """How a worker learned of a failure."""

    HEARTBEAT = "heartbeat"
    """a peer's heartbeats stopped (and its liveness probe failed)"""
    COLLECTIVE = "collective"
    """a collective or send/recv failed (a peer's socket closed)"""
    GPU = "gpu"
    """the worker's own GPU is unhealthy"""
    COORDINATOR_LOST = "coordinator-lost"
    """the connection to the coordinator's store broke"""
    COORDINATOR_RESTART = "coordinator-restart"
    """the coordinator came back as a new incarnation (every key is gone): redo the generation"""
    RENDEZVOUS = "rendezvous"
    """building the generation's process groups failed"""
    UNRECOVERABLE = "unrecoverable"
    """no surviving replica, snapshot or checkpoint holds some layer: the job cannot go on"""
    PROCESS_EXIT = "process-exit"
    """(local launcher) a worker process exited"""
    NEW_GENERATION = "new-generation"
    """(plan controller) a newer plan replaces the generation"""


class FailureReport(BaseModel):
    """What a worker saw: who it thinks is dead (empty when unknown), how, and in which generation."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    job: str
    generation: int
    reporter: str
    """the reporting worker's id (`node:gpu`)"""
    kind: FailureKind
    dead: tuple[str, ...] = ()
    """worker ids in the store; plan node ids on a pod's annotation (the operator's unit)"""
    detail: str = ""
    detected_at: float = Field(default_factory=time.time)

    @classmethod
    def parse(cls, raw: str | bytes | None) -> FailureReport | None:
        """The report in `raw` (JSON), or None when absent or malformed."""
        return _parse(cls, raw)


CHECKPOINT_ERROR_CHARS = 300
"""a progress report carries this much of a checkpoint write error (the report's cap is MAX_REPORT_BYTES)"""


PACE_MIN, PACE_MAX = 1e-6, 1e6
"""Bounds of a pace figure and of the pace it is over: the operator multiplies and divides them across
nodes, and a worker's report is never trusted (outside them, even 1e300 would overflow to infinity)."""


class ProgressReport(BaseModel):
    """A worker's progress: `{"generation": -1, "step": 0}` means up and waiting for its first plan."""

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    generation: int
    step: int = Field(ge=0)
    loss: float | None = None
    """the global mean loss of the newest step whose loss this worker saw"""
    samples_per_second: float | None = Field(default=None, alias="samplesPerSecond")
    """global throughput of the last step"""
    checkpoint_step: int | None = Field(default=None, ge=0, alias="checkpointStep")
    """the newest step complete in the job's checkpoint directory, as this worker last saw it"""
    checkpoint_error: str | None = Field(default=None, alias="checkpointError")
    """why this worker's last checkpoint write failed (None: it succeeded, or none was due yet)"""

    pace: tuple[tuple[int, float], ...] = Field(default=(), max_length=64)
    """(step, slowdown) of this worker's last steps, oldest first: its compute against its own calibrated
    pace on its stage, a median over its last steps (oobleck.runtime.train.pace); the operator lines the
    nodes' up step by step (oobleck.operator.stragglers)"""
    pace_baseline: float | None = Field(default=None, alias="paceBaseline")
    """the calibrated pace those figures are over (its compute per profiled cost when it calibrated): `pace`'s
    figures times this are its compute per profiled cost at those steps, which nodes running the same layers
    compare directly, whenever each calibrated"""

    @field_validator("checkpoint_error")
    @classmethod
    def _short(cls, value: str | None) -> str | None:
        return value[:CHECKPOINT_ERROR_CHARS] if value else None

    @field_validator("loss", "samples_per_second")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        return value if value is None or math.isfinite(value) else None

    @field_validator("pace_baseline", mode="before")
    @classmethod
    def _positive(cls, value: object) -> float | None:
        # Anything but a number within the bounds is no baseline; the rest of the report still counts.
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        return float(value) if PACE_MIN <= value <= PACE_MAX else None

    @field_validator("pace")
    @classmethod
    def _measured(cls, value: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        # Only figures in bounds at known steps: one odd entry never spoils the rest of the report.
        return tuple((step, s) for step, s in value if step >= 0 and PACE_MIN <= s <= PACE_MAX)

    @property
    def slowdown(self) -> float | None:
        """The newest step's slowdown (None: not measured yet)."""
        return self.pace[-1][1] if self.pace else None

    def to_json(self) -> str:
        """Rounded to what a status line needs; absent values left out."""
        body: dict[str, object] = {"generation": self.generation, "step": self.step}
        if self.loss is not None:
            body["loss"] = float(f"{self.loss:.6g}")
        if self.samples_per_second is not None:
            body["samplesPerSecond"] = round(self.samples_per_second, 3)
        if self.checkpoint_step is not None:
            body["checkpointStep"] = self.checkpoint_step
        if self.checkpoint_error:
            body["checkpointError"] = self.checkpoint_error
        if self.pace:
            body["pace"] = [[step, round(s, 3)] for step, s in self.pace]
        if self.pace_baseline is not None:
            body["paceBaseline"] = float(f"{self.pace_baseline:.6g}")
        return json.dumps(body)

    @classmethod
    def parse(cls, raw: str | bytes | None) -> ProgressReport | None:
        """The report in `raw` (JSON), or None when absent or malformed."""
        return _parse(cls, raw)


def _parse(model: type[_Report], raw: str | bytes | None) -> _Report | None:
    """`model` from the JSON in `raw`, or None when absent or malformed (a worker's report is never trusted)."""
    if not raw:
        return None
    try:
        return model.model_validate_json(raw)
    except ValidationError:
        return None
