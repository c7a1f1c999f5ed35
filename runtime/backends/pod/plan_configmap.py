"""Plans from the job's plan ConfigMap, followed by a watch through the Kubernetes API."""

from __future__ import annotations

import threading
import time
from typing import Any

from oobleck.api import planmap
from oobleck.api.plan import Plan
from oobleck.runtime.elastic.plans import PlanSourceError


class ConfigMapPlanSource:
    """Plans from the job's plan ConfigMap (`<job>-plan`), followed by a watch in a daemon thread.

    The operator replaces the whole ConfigMap (plan.json or gzipped plan.json.gz, see
    oobleck.api.planmap) and only ever raises its generation; a new generation reaches
    `wait_newer` as soon as the watch event arrives (milliseconds after the write). The watch resumes
    after errors and 410 Gone (kube.watch_object: the official client's watch, relisted on 410). Never returns an older generation than one it
    returned before. `config_map()` is the newest raw object (the worker reads job.json from it).
    """

    def __init__(self, kube, namespace: str, name: str, watch_timeouts=None) -> None:
        from oobleck.runtime.backends.pod.kube import WatchTimeouts

        self.kube, self.namespace, self.name = kube, namespace, name
        self._timeouts = watch_timeouts or WatchTimeouts()
        self._changed = threading.Condition()
        self._plan: Plan | None = None
        self._object: dict[str, Any] | None = None
        self._error: PlanSourceError | None = None
        self.last_error: BaseException | None = None
        """the last transport error of the watch (it keeps retrying), for diagnostics"""
        self._stop = threading.Event()
        self._read = threading.Event()  # the watch delivered the ConfigMap's state once (absent included)
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
        from oobleck.runtime.backends.pod.kube import watch_object

        def error(exc: BaseException) -> None:
            self.last_error = exc

        watch_object(self.kube, self.namespace, self.name, self._on_object, self._stop, self._timeouts, error)

    def _on_object(self, obj: dict[str, Any] | None) -> None:
        try:
            self._take(obj)
        finally:
            self._read.set()

    def _take(self, obj: dict[str, Any] | None) -> None:
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

    def wait_read(self, timeout_s: float) -> bool:
        """Whether the ConfigMap's state was read once (present or absent) within `timeout_s`: until then
        `current()` is None whether or not a plan exists."""
        self.start()
        return self._read.wait(timeout_s)

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
