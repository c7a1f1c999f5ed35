"""Plans from a file that the local plan controller replaces atomically (`write_plan`), so a reader never
sees half a plan."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

from pydantic import ValidationError

from oobleck.api.plan import Plan
from oobleck.runtime.elastic.plans import PlanSourceError


def write_plan(path: str | Path, plan: Plan) -> None:
    """Atomically replace the plan file: write a temporary file beside it, fsync, rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(plan.to_json())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class FilePlanSource:
    """Plans from a JSON file that a controller replaces atomically.

    Polls the file's identity (inode, size, mtime) every `poll_s` (default 10 ms: a new generation
    is seen within ~10-20 ms) and parses it only when that changes. Polling a `stat` is cheaper than
    it sounds and works on every filesystem a pod may mount (inotify does not on network ones).
    """

    def __init__(self, path: str | Path, poll_s: float = 0.01) -> None:
        if poll_s <= 0:
            raise ValueError(f"poll_s: must be > 0, got {poll_s}")
        self.path = Path(path)
        self.poll_s = poll_s
        self._identity: tuple[int, int, int] | None = None
        self._plan: Plan | None = None
        self._lock = threading.Lock()  # a PlanWatcher thread and the worker may share one source

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def current(self) -> Plan | None:
        with self._lock:
            return self._read()

    def _read(self) -> Plan | None:
        identity = self._stat()
        if identity is None or identity == self._identity:
            return self._plan
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return self._plan  # replaced between stat and open: the next poll sees the new one
        try:
            plan = Plan.model_validate_json(text)
        except ValidationError as error:
            raise PlanSourceError(f"{self.path}: not a valid plan: {error}") from error
        self._identity = identity
        # Never go back: a stale writer cannot undo a newer generation.
        if self._plan is None or plan.generation >= self._plan.generation:
            self._plan = plan
        return self._plan

    def wait_newer(self, generation: int, timeout_s: float, stop: threading.Event | None = None) -> Plan | None:
        deadline = time.monotonic() + timeout_s
        while True:
            plan = self.current()
            if plan is not None and plan.generation > generation:
                return plan
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (stop is not None and stop.is_set()):
                return None
            if stop is not None:
                stop.wait(min(self.poll_s, remaining))
            else:
                time.sleep(min(self.poll_s, remaining))
