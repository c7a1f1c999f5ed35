"""Typed errors for input the runtime cannot use: a model that does not build or load, data that does not fit.

Each names what is wrong (`field`: the config or spec field; `path`: the file or directory), so the
worker's failure report - and the job's Failed reason - says what to fix. Both are ValueErrors: the
callers that already turn a ValueError into "bad input" keep doing so.
"""

from __future__ import annotations


class InputError(ValueError):
    """Input the job cannot run with; retrying on other nodes would fail the same way."""

    def __init__(self, message: str, *, field: str | None = None, path: str | None = None) -> None:
        self.field, self.path = field, path
        prefix = ": ".join(part for part in (field, path) if part)
        super().__init__(f"{prefix}: {message}" if prefix else message)


class ModelLoadError(InputError):
    """The model cannot be built or its weights cannot be loaded (unknown family, a config that does not
    build, a safetensors directory missing a tensor or holding one of the wrong shape)."""


class DataError(InputError):
    """The training data or tokenizer cannot be used (token ids outside the vocabulary, a tokenizer file
    that does not load)."""
