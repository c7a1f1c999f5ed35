"""Why a worker exited because of the job itself: the structured cause both sides share.

A worker whose failure follows the job (its model does not import, its data cannot be read, its
config is invalid, it runs out of memory, its loss is not finite, a CUDA error) writes a `Cause` as
JSON on its own pod (CAUSE_ANNOTATION) and exits with the kind's own code (EXIT_CODES), so that
the operator can tell it from a lost node: oobleck.operator.faults fails the job with the kind as the
`Failed` condition's reason and the worker's message, instead of re-planning around a "lost" node.
The exit code alone (the annotation could not be written) still names the kind.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from oobleck.api.contract import ExitCode
from oobleck.api.resource import GROUP

CAUSE_ANNOTATION = f"{GROUP}/cause"
"""On a worker pod, written by the worker about itself just before it exits: a Cause as JSON."""

CauseKind = Literal["ModelLoadFailed", "DataUnavailable", "InvalidConfig", "OutOfMemory", "NonFiniteLoss", "CudaError"]
"""The kind is also the reason of the job's Failed condition (oobleck.api.conditions.Reason)."""

EXIT_CODES: dict[str, ExitCode] = {
    "ModelLoadFailed": ExitCode.MODEL_LOAD_FAILED,
    "DataUnavailable": ExitCode.DATA_UNAVAILABLE,
    "InvalidConfig": ExitCode.INVALID_CONFIG,
    "OutOfMemory": ExitCode.OUT_OF_MEMORY,
    "NonFiniteLoss": ExitCode.NON_FINITE_LOSS,
    "CudaError": ExitCode.CUDA_ERROR,
}
"""The worker's exit code per kind (oobleck.api.contract.ExitCode holds every exit code)."""

KIND_OF_EXIT: dict[int, str] = {int(code): kind for kind, code in EXIT_CODES.items()}
"""The cause kind an exit code names (a worker that could not put its cause on the pod)."""

CERTAIN: frozenset[str] = frozenset({"InvalidConfig", "NonFiniteLoss"})
"""Kinds that are the job's fault from one report: the config is the spec's, and every rank agreed on a
non-finite step before any reported it. The others could be one node's (a broken image cache, a
missing mount, a bad GPU) and count as the job's once a second pod reports the same kind."""

MESSAGE_LIMIT = 2000


class Cause(BaseModel):
    """A job-caused worker failure: what kind, what the worker said, and what it concerns."""

    model_config = ConfigDict(
        frozen=True, extra="ignore", alias_generator=to_camel, validate_by_name=True, serialize_by_alias=True
    )

    kind: CauseKind
    message: str = Field(max_length=MESSAGE_LIMIT)
    field: str | None = None
    """the spec field it concerns (e.g. spec.model.entryPoint, spec.data.path)"""
    path: str | None = None
    """a file it concerns (as the worker container sees it)"""
    layer: int | None = None
    """a model layer it concerns (a non-finite gradient, an allocation)"""
    step: int | None = None
    """the training step it happened at, if training had started"""

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.kind]

    def describe(self) -> str:
        """One line for a condition message: the worker's message and what it concerns."""
        about = [
            f"{name} {value}"
            for name, value in (("field", self.field), ("path", self.path), ("layer", self.layer), ("step", self.step))
            if value is not None
        ]
        return self.message + (f" ({', '.join(about)})" if about else "")


def make_cause(kind: CauseKind, message: str, **about: object) -> Cause:
    """A Cause whose message is cut to what an annotation and a condition can carry."""
    if len(message) > MESSAGE_LIMIT:
        message = message[: MESSAGE_LIMIT - 3] + "..."
    return Cause(kind=kind, message=message, **about)  # type: ignore[arg-type]


def parse_cause(raw: str | None) -> Cause | None:
    """CAUSE_ANNOTATION's value, or None when absent or not a Cause (an older or foreign writer)."""
    if not raw:
        return None
    try:
        return Cause.model_validate_json(raw)
    except ValueError:
        return None
