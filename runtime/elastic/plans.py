"""Where a worker reads its plans: the `PlanSource` interface, and `PlanWatcher`, which flags a newer plan.

The backends implement it: a file locally (backends/local/plan_file.py), the plan ConfigMap in a pod
(backends/pod/plan_configmap.py, a watch through the Kubernetes API). A source answers two questions: "what is the newest plan?" and "wake me when a plan newer than
generation g appears (or when I must stop waiting)". Writers replace the whole document atomically
(`write_plan`), so a reader never sees half a plan.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from oobleck.api.plan import Plan

log = logging.getLogger("oobleck.runtime.elastic.plans")


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


class PlanWatcher:
    """Looks at `source.current()` every `poll_s` in a thread and sets `newer` when a generation above the
    adopted one appears.

    With `signal` (the worker's failure Event) a newer plan also interrupts the step in flight: all
    ranks then leave the generation after the same (commonly decided) step. One look per poll, not a
    `wait_newer`: a plan file's source polls every 10 ms inside it (for the worker's own waits between
    generations), and while training that was 5-6 wake-ups of this thread per 100 ms, each taking the
    GIL from the training thread. A look every 0.25 s: a plan that follows a failure reaches the
    training ranks through the generation's abort key (posted by the worker that detected it, and by the
    local launcher with every new generation, so this is a backstop there), and a ConfigMap source's own
    watch keeps `current()` fresh; what is left to this look is a planned change (a node joins, a
    straggler is benched), which takes seconds anyway, while each look is a wake-up taken from training.
    """

    def __init__(self, source: PlanSource, poll_s: float = 0.25, signal: threading.Event | None = None) -> None:
        self.source = source
        self.newer = threading.Event()
        self._signal = signal  # also set this (e.g. the failure Event that interrupts the engine)
        self._lock = threading.Lock()  # a flag for an adopted generation must never be raised late
        self._adopted = -1
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="oobleck-plan-watch", daemon=True)
        self.error: PlanSourceError | None = None
        """why the last look found no valid plan (None once a look succeeds): the worker's own wait for its next
        plan raises it; here it is logged once per distinct message, not every poll"""

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
        while not self._stop.wait(self._poll_s):
            try:
                plan = self.source.current()
            except PlanSourceError as error:
                if self.error is None or str(error) != str(self.error):
                    log.warning("plan watch: %s", error)
                self.error = error
                continue
            self.error = None
            with self._lock:
                if plan is not None and plan.generation > self._adopted:
                    self.newer.set()
                    if self._signal is not None:
                        self._signal.set()
