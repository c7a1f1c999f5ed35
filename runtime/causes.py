"""Turning a worker's exceptions into the job-caused failures of oobleck.api.causes.

Where an exception comes from decides whose fault it is: an ImportError while building the model is
the entry point's, an OSError while opening the data is the data's. The runtime wraps those places in
`blame(kind, field=..., path=...)`, which re-raises any error as a `JobFault` carrying its Cause. Some
errors say what they are wherever they happen: running out of host or device memory, and CUDA errors
(`classify`). Everything else (a lost peer, a bug) is not a job cause: the operator treats the exit as
a lost node.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from oobleck.api.causes import Cause, CauseKind, make_cause
from oobleck.runtime.errors import InputError

_OOM_TEXT = (
    "out of memory",  # CUDA: "CUDA out of memory. Tried to allocate ..."
    "can't allocate memory",  # the CPU allocator: "DefaultCPUAllocator: can't allocate memory: you tried ..."
    "cannot allocate memory",  # ENOMEM from the OS
)


class JobFault(Exception):
    """A failure caused by the job itself. Not a RuntimeError: the elastic loop treats those as the end of a
    generation (a peer died) and would retry; a JobFault ends the worker, which reports its cause."""

    def __init__(self, cause: Cause) -> None:
        super().__init__(cause.describe())
        self.cause = cause


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


HOST_MEMORY_FIELD = "spec.resources.memory"
"""the pod's memory limit: what a worker that ran out of host memory needs more of"""
GPU_MEMORY_FIELD = "spec.gpuMemory"
"""the memory per GPU the planner fills: set it to what the GPUs really offer, and plans spread wider"""


def spec_field(field: str) -> str:
    """An InputError's field as the spec names it (`data.path` -> `spec.data.path`); CLI flags stay."""
    return f"spec.{field}" if field.split(".")[0] in ("model", "data", "training", "checkpoint") else field


def classify(error: BaseException) -> Cause | None:
    """The job cause an exception shows by itself (memory exhausted, a CUDA error), or None. Running out
    of memory names the memory to raise: a GPU's (CUDA's words) or the pod's."""
    if isinstance(error, JobFault):
        return error.cause
    text = str(error)
    if isinstance(error, MemoryError) or (
        isinstance(error, RuntimeError) and any(t in text.lower() for t in _OOM_TEXT)
    ):
        field = GPU_MEMORY_FIELD if "cuda" in text.lower() else HOST_MEMORY_FIELD
        return make_cause("OutOfMemory", _describe(error), field=field)
    if isinstance(error, RuntimeError) and ("CUDA error" in text or type(error).__name__ == "AcceleratorError"):
        return make_cause("CudaError", _describe(error))
    return None


@contextmanager
def blame(kind: CauseKind, **about: object) -> Iterator[None]:
    """Re-raise any error of the block as a JobFault of `kind` (or of what the error shows by itself, e.g.
    OutOfMemory, with its own field), naming `about` (field=, path=, layer=); an InputError that names
    its own field and path (a missing initFrom directory) keeps them: they are more precise."""
    try:
        yield
    except JobFault:
        raise
    except Exception as error:
        cause = classify(error)
        if cause is not None:
            cause = cause.model_copy(update={k: v for k, v in about.items() if k != "field"})
        else:
            if isinstance(error, InputError) and error.field:
                about = {**about, "field": spec_field(error.field), "path": error.path or about.get("path")}
            cause = make_cause(kind, _describe(error), **about)
        raise JobFault(cause) from error


def model_field(config) -> str:
    """The spec field a model error concerns: the built-in GPT's sizes, the transformers model, or the entry point."""
    if config.model.transformers is not None:
        return "spec.model.transformers"
    return "spec.model.gpt" if config.model.name == "gpt" else "spec.model.entryPoint"
