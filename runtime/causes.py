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


def classify(error: BaseException) -> Cause | None:
    """The job cause an exception shows by itself (memory exhausted, a CUDA error), or None."""
    if isinstance(error, JobFault):
        return error.cause
    text = str(error)
    if isinstance(error, MemoryError) or (
        isinstance(error, RuntimeError) and any(t in text.lower() for t in _OOM_TEXT)
    ):
        return make_cause("OutOfMemory", _describe(error))
    if isinstance(error, RuntimeError) and ("CUDA error" in text or type(error).__name__ == "AcceleratorError"):
        return make_cause("CudaError", _describe(error))
    return None


@contextmanager
def blame(kind: CauseKind, **about: object) -> Iterator[None]:
    """Re-raise any error of the block as a JobFault of `kind` (or of what the error shows by itself, e.g.
    OutOfMemory), naming `about` (field=, path=, layer=)."""
    try:
        yield
    except JobFault:
        raise
    except Exception as error:
        cause = classify(error)
        if cause is not None:
            cause = cause.model_copy(update={k: v for k, v in about.items() if k != "field"})
        else:
            cause = make_cause(kind, _describe(error), **about)
        raise JobFault(cause) from error


def model_field(config) -> str:
    """The spec field a model error concerns: the entry point, or the built-in GPT's sizes."""
    return "spec.model.gpt" if config.model.name == "gpt" else "spec.model.entryPoint"
