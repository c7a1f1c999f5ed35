"""The worker of a pod: an elastic Worker that reports its progress on the pod and times its recovery."""

from __future__ import annotations

import time

from oobleck.runtime.backends.pod.report import ProgressReporter
from oobleck.runtime.backends.pod.siblings import PodSiblings
from oobleck.runtime.elastic.worker import Worker
from oobleck.runtime.train.engine import StepOutcome


class PodWorker(Worker):
    def __init__(
        self, *args, progress: ProgressReporter | None = None, siblings: PodSiblings | None = None, **kwargs
    ) -> None:
        """`progress`: GPU 0's reporter for the pod (None on the pod's other GPUs); `siblings`: the pod's GPU
        workers' shared checkpoint errors (None on a single-GPU pod)."""
        super().__init__(*args, **kwargs)
        self.progress, self.siblings = progress, siblings

    @property
    def checkpoint_step(self) -> int | None:
        """The newest complete checkpoint step this worker's snapshot agent saw (status.progress.lastCheckpointStep)."""
        return self.snapshots.checkpoint_step if self.snapshots is not None else None

    @property
    def checkpoint_error(self) -> str | None:
        """Why the last checkpoint write failed (None: it succeeded, or none was due): this worker's snapshot
        agent's, or on the reporting GPU 0 of a multi-GPU pod, another GPU's when its own is fine."""
        own = self.snapshots.checkpoint_error if self.snapshots is not None else None
        if self.siblings is None or self.progress is None:
            return own
        return self.siblings.pod_error(own)

    def abandon(self) -> None:
        # run_elastic abandons a generation right after it broke: recovery_seconds runs from here to the
        # first step completed in the next one.
        if self.engine is not None and self.failure_time is None:
            self.failure_time = time.monotonic()
        super().abandon()

    def train_step(self) -> StepOutcome:
        outcome = super().train_step()
        if self.progress is None and self.siblings is not None:  # a non-reporting GPU tells GPU 0
            self.siblings.publish(self.checkpoint_error)
        if self.progress is not None and self.plan is not None:
            rate = outcome.samples / outcome.seconds if outcome.seconds > 0 else None
            # Empty after a stage change (its warm-up): no figure yet, never the old stage's under the new generation.
            pace = tuple(self.pace.history)
            self.progress.update(
                self.plan.generation,
                self.step,
                outcome.loss,
                rate,
                checkpoint_step=self.checkpoint_step,
                checkpoint_error=self.checkpoint_error,
                pace=pace,
                pace_baseline=self.pace.baseline,
            )
        return outcome
