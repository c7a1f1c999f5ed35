"""What a multi-GPU pod's GPU workers tell the one that reports for the pod.

Only GPU 0 writes the pod's progress annotation (one writer per pod: the operator reads one report per node).
A checkpoint write failing on another GPU (its layers on a full or read-only volume) must still reach the
operator's CheckpointFailing condition. So each other GPU leaves its current checkpoint error in a file of a
folder the pod's supervisor makes private to its children (mode 0700), and GPU 0 reports the first one it finds
beside its own. Files, not a socket: the supervisor already owns the children's lifetime, and a file left by a
child that died is read the same way until the pod goes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SHARED_DIR_ENV = "OOBLECK_POD_SHARED_DIR"
"""The supervisor's private folder for its GPU children (unset: a single-GPU pod, nothing to share)."""
READ_INTERVAL_S = 0.5
"""How often GPU 0 re-reads its siblings' files (a tiny model steps every few milliseconds)."""
ERROR_CHARS = 300
"""A sibling's error is cut to this many characters on read, whatever its file holds (the report's own bound)."""


def _error_file(folder: Path, gpu: int) -> Path:
    return folder / f"gpu-{gpu}.checkpoint-error"


class PodSiblings:
    """One GPU worker's view of its pod's other GPU workers' checkpoint errors."""

    def __init__(self, folder: Path, gpu: int, gpus: int, clock=time.monotonic) -> None:
        self.folder, self.gpu, self.gpus, self.clock = folder, gpu, gpus, clock
        self._published: str | None = None
        self._read_at = float("-inf")
        self._siblings_error: str | None = None

    @classmethod
    def from_env(cls, environ: dict[str, str] | os._Environ, gpu: int, gpus: int) -> PodSiblings | None:
        folder = environ.get(SHARED_DIR_ENV)
        return cls(Path(folder), gpu, gpus) if folder and gpus > 1 else None

    def publish(self, error: str | None) -> None:
        """This (non-zero) GPU's current checkpoint error; written only when it changes, atomically."""
        if error == self._published:
            return
        path = _error_file(self.folder, self.gpu)
        partial = path.with_suffix(".partial")
        partial.write_text(error or "")
        os.replace(partial, path)
        self._published = error

    def pod_error(self, own: str | None) -> str | None:
        """GPU 0's report for the pod: its own error, else the first sibling's (named by its GPU)."""
        if own is not None:
            return own
        now = self.clock()
        if now - self._read_at >= READ_INTERVAL_S:
            self._read_at, self._siblings_error = now, self._read_siblings()
        return self._siblings_error

    def _read_siblings(self) -> str | None:
        for gpu in range(self.gpus):
            if gpu == self.gpu:
                continue
            try:
                with _error_file(self.folder, gpu).open() as file:
                    text = file.read(ERROR_CHARS)
            except FileNotFoundError:
                continue
            if text:
                return f"gpu {gpu}: {text}"[:ERROR_CHARS]
        return None
