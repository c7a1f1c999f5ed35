"""Where a worker reads its plans: a file locally (`FilePlanSource`); the plan ConfigMap in a pod
(`ConfigMapPlanSource`, a watch through the Kubernetes API).

A source answers two questions: "what is the newest plan?" and "wake me when a plan newer than
generation g appears (or when I must stop waiting)". Writers replace the whole document atomically
(`write_plan`), so a reader never sees half a plan.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError

from oobleck.api import planmap
from oobleck.api.plan import Plan


class PlanSourceError(RuntimeError):
    """The plan document exists but is not a valid plan."""


class PlanSource(Protocol):
    """What the worker needs from wherever plans come from.

    A Kubernetes implementation watches the object the operator writes (the plan's generation is
    the resourceVersion-independent ordering key) and implements the same two calls.
    """

    def current(self) -> Plan | None:
        """The newest valid plan, or None if none has been published yet."""
        ...

    def wait_newer(self, generation: int, timeout_s: float, stop: threading.Event | None = None) -> Plan | None:
        """The newest plan with a generation > `generation`, waiting up to `timeout_s`.

        Returns None on timeout or when `stop` is set. Never returns an older plan.
        """
        ...


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


class ConfigMapPlanSource:
    """Plans from the job's plan ConfigMap (`<job>-plan`), followed by a watch in a daemon thread.

    The operator replaces the whole ConfigMap (plan.json or gzipped plan.json.gz, see
    oobleck.api.planmap) and only ever raises its generation; a new generation reaches
    `wait_newer` as soon as the watch event arrives (milliseconds after the write). The watch resumes
    after errors and 410 Gone (kube.watch_object: the official client's watch, relisted on 410). Never returns an older generation than one it
    returned before. `config_map()` is the newest raw object (the worker reads job.json from it).
    """

    def __init__(self, kube, namespace: str, name: str, watch_timeouts=None) -> None:
        from oobleck.runtime.kube import WatchTimeouts

        self.kube, self.namespace, self.name = kube, namespace, name
        self._timeouts = watch_timeouts or WatchTimeouts()
        self._changed = threading.Condition()
        self._plan: Plan | None = None
        self._object: dict[str, Any] | None = None
        self._error: PlanSourceError | None = None
        self.last_error: BaseException | None = None
        """the last transport error of the watch (it keeps retrying), for diagnostics"""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ConfigMapPlanSource:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="oobleck-plan-configmap", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        # The watch notices the stop at its next event or server timeout (the client's stream cannot be
        # interrupted from outside): a daemon thread, not waited for long.
        if self._thread is not None:
            self._thread.join(timeout=0.2)

    def _run(self) -> None:
        from oobleck.runtime.kube import watch_object

        def error(exc: BaseException) -> None:
            self.last_error = exc

        watch_object(self.kube, self.namespace, self.name, self._on_object, self._stop, self._timeouts, error)

    def _on_object(self, obj: dict[str, Any] | None) -> None:
        if obj is None:
            return  # not created yet, or deleted with its job: keep what we had
        with self._changed:
            known = self._plan.generation if self._plan is not None else -1
            annotated = planmap.read_generation(obj)
            if annotated is not None and annotated <= known and self._object is not None:
                return  # an update that does not raise the generation (or a replayed event): no decoding
            try:
                plan = planmap.read_plan(obj)
            except ValueError as exc:
                self._error = PlanSourceError(str(exc))
                self._changed.notify_all()
                return
            self._error = None
            if plan.generation > known:
                self._plan, self._object = plan, obj
            elif self._object is None:
                self._object = obj
            self._changed.notify_all()

    def config_map(self) -> dict[str, Any] | None:
        """The ConfigMap holding the newest plan seen (None before the first)."""
        with self._changed:
            return self._object

    def current(self) -> Plan | None:
        self.start()
        with self._changed:
            if self._error is not None and self._plan is None:
                raise self._error
            return self._plan

    def wait_newer(self, generation: int, timeout_s: float, stop: threading.Event | None = None) -> Plan | None:
        self.start()
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                if self._plan is not None and self._plan.generation > generation:
                    return self._plan
                if self._error is not None:
                    raise self._error
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stop.is_set() or (stop is not None and stop.is_set()):
                    return None
                # Bounded waits: an outside `stop` has no hook into this condition.
                self._changed.wait(min(remaining, 0.05 if stop is not None else remaining))


class PlanWatcher:
    """Runs `source.wait_newer` in a thread and sets `newer` when a generation above the adopted one appears.

    With `signal` (the worker's failure Event) a newer plan also interrupts the step in flight: all
    ranks then leave the generation after the same (commonly decided) step.
    """

    def __init__(self, source: PlanSource, poll_s: float = 0.05, signal: threading.Event | None = None) -> None:
        self.source = source
        self.newer = threading.Event()
        self._signal = signal  # also set this (e.g. the failure Event that interrupts the engine)
        self._lock = threading.Lock()  # a flag for an adopted generation must never be raised late
        self._adopted = -1
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="oobleck-plan-watch", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> PlanWatcher:
        self._thread.start()
        return self

    def adopt(self, generation: int) -> None:
        """The worker now runs `generation`; only a later one sets `newer`."""
        with self._lock:
            self._adopted = generation
            self.newer.clear()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            adopted = self._adopted
            try:
                plan = self.source.wait_newer(adopted, self._poll_s, self._stop)
            except PlanSourceError as error:
                self.error = error
                self._stop.wait(self._poll_s)
                continue
            with self._lock:
                if plan is not None and plan.generation > self._adopted:
                    self.newer.set()
                    if self._signal is not None:
                        self._signal.set()
                self._stop.wait(self._poll_s)
