"""A worker pod's reports: annotations on its own pod (failures, progress, the measured profile)."""

from __future__ import annotations

import json
import logging
import threading
import time

from oobleck.api.addresses import parse_worker_id
from oobleck.api.contract import FAILURE_ANNOTATION, PROGRESS_ANNOTATION
from oobleck.api.reports import FailureReport, ProgressReport
from oobleck.runtime.backends.pod.kube import TRANSPORT_ERRORS, ApiException, Kube

log = logging.getLogger("oobleck.runtime.backends.pod.main")

_REPORT_ERRORS: tuple[type[BaseException], ...] = (ApiException, *TRANSPORT_ERRORS)


def node_of(worker: str) -> str:
    """The plan node id of a worker id `node:gpu` (a bare node id stays as it is)."""
    try:
        return parse_worker_id(worker)[0]
    except ValueError:
        return worker


def failure_annotation(report: FailureReport) -> str:
    """FAILURE_ANNOTATION's value for a health.FailureReport: `dead` as plan node ids (the operator's unit)."""
    nodes = tuple(dict.fromkeys(node_of(d) for d in report.dead))
    return report.model_copy(update={"dead": nodes}).model_dump_json()


def annotate(kube: Kube, namespace: str, pod: str, annotations: dict[str, str], attempts: int = 3) -> None:
    """Merge `annotations` into the pod's; retries transport errors and 5xx/429, not refusals (403 stays 403)."""
    for attempt in range(attempts):
        try:
            kube.annotate_pod(namespace, pod, annotations)
            return
        except ApiException as error:
            if (error.status < 500 and error.status != 429) or attempt == attempts - 1:
                raise
        except TRANSPORT_ERRORS:
            if attempt == attempts - 1:
                raise
        time.sleep(0.2 * (attempt + 1))


class PodFailureReporter:
    """health.FailureReporter for a pod: writes FAILURE_ANNOTATION on the worker's own pod."""

    def __init__(self, kube: Kube, namespace: str, pod: str) -> None:
        self.kube, self.namespace, self.pod = kube, namespace, pod

    def report(self, report: FailureReport) -> None:
        annotate(self.kube, self.namespace, self.pod, {FAILURE_ANNOTATION: failure_annotation(report)})


def progress_annotation(
    generation: int,
    step: int,
    loss: float | None = None,
    samples_per_second: float | None = None,
    checkpoint_step: int | None = None,
    checkpoint_error: str | None = None,
    pace: tuple[tuple[int, float], ...] | None = None,
    pace_baseline: float | None = None,
) -> str:
    """PROGRESS_ANNOTATION's value (oobleck.api.reports.ProgressReport)."""
    report = ProgressReport(
        generation=generation,
        step=step,
        loss=loss,
        samples_per_second=samples_per_second,
        checkpoint_step=checkpoint_step,
        checkpoint_error=checkpoint_error,
        pace=pace or (),
        pace_baseline=pace_baseline,
    )
    return report.to_json()


_Extra = tuple[float | None, float | None, int | None, str | None, tuple[tuple[int, float], ...] | None, float | None]
"""What rides along with a progress value, in `progress_annotation`'s order after the step."""


class ProgressReporter:
    """PROGRESS_ANNOTATION (`progress_annotation`) on the worker's own pod.

    `update` never blocks the training loop: a daemon thread writes the newest value at most every
    `min_interval_s` (a step of a tiny model takes milliseconds; the API server must not see one
    patch per step). `flush` writes the newest value now and waits for it: the final step is always
    reported, since the operator marks the job Succeeded from it. Values are ordered by (step,
    generation): an older one never overwrites a newer one; loss and throughput ride along."""

    def __init__(self, kube: Kube, namespace: str, pod: str, min_interval_s: float = 1.0) -> None:
        self.kube, self.namespace, self.pod = kube, namespace, pod
        self.min_interval_s = min_interval_s
        self._cond = threading.Condition()
        self._write_lock = threading.Lock()
        self._latest: tuple[int, int] | None = None
        # loss, samples/s, checkpoint step, checkpoint error, pace history, pace baseline (see update).
        self._extra: _Extra = (None, None, None, None, None, None)
        self._written: tuple[int, int] | None = None
        self._last_write = 0.0
        self._stop = False
        self.writes = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="oobleck-progress", daemon=True)
        self._thread.start()

    def update(
        self,
        generation: int,
        step: int,
        loss: float | None = None,
        samples_per_second: float | None = None,
        checkpoint_step: int | None = None,
        checkpoint_error: str | None = None,
        pace: tuple[tuple[int, float], ...] | None = None,
        pace_baseline: float | None = None,
    ) -> None:
        """The newest progress; a None loss, throughput, checkpoint step or pace ((step, slowdown) of the
        last steps, over `pace_baseline`) keeps the last known one. `checkpoint_error` is the current state
        (None: the last write succeeded)."""
        with self._cond:
            self._latest = (generation, step)
            known = self._extra
            self._extra = (
                known[0] if loss is None else loss,
                known[1] if samples_per_second is None else samples_per_second,
                known[2] if checkpoint_step is None else checkpoint_step,
                checkpoint_error,
                known[4] if pace is None else pace,
                known[5] if pace is None else pace_baseline,
            )
            self._cond.notify_all()

    def _write_if_newer(self, value: tuple[int, int], extra: _Extra) -> None:
        """Write `value` (with its loss, throughput and checkpoint step, taken with it: they describe the same
        step) unless a later step is already on the pod (the thread and flush never undo each other)."""
        with self._write_lock:
            with self._cond:
                written = self._written
            if written is not None and (value[1], value[0]) <= (written[1], written[0]):
                return
            text = progress_annotation(value[0], value[1], *extra)
            annotate(self.kube, self.namespace, self.pod, {PROGRESS_ANNOTATION: text})
            self.writes += 1
            with self._cond:
                self._written, self._last_write = value, time.monotonic()
                self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (self._latest is None or self._latest == self._written):
                    self._cond.wait()
                if self._stop:
                    return
                wait = self._last_write + self.min_interval_s - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                value, extra = self._latest, self._extra
            assert value is not None  # the wait above returns only with a value
            try:
                self._write_if_newer(value, extra)
            except _REPORT_ERRORS as error:  # best effort: the next step's update tries again
                self.error = error
                log.warning(json.dumps({"event": "progress-report-failed", "pod": self.pod, "error": str(error)[:300]}))
                with self._cond:
                    self._last_write = time.monotonic()

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Write the newest value now (retrying until `timeout_s`); True once it is on the pod."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._cond:
                value, extra = self._latest, self._extra
            if value is None:
                return True
            try:
                self._write_if_newer(value, extra)
                return True
            except _REPORT_ERRORS as error:
                self.error = error
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.5)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
