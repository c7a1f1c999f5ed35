"""The job's next status, built from the previous one: conditions keep their transition times, progress
keeps its last known loss, throughput and checkpoint step. Also the conditions each outcome of a pass sets
(failed, succeeded, reconfiguring, training on a plan, checkpoints failing, pods pending). Pure; decide.py
drives it and keeps the planning."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from oobleck.api.conditions import ConditionType, Reason, is_true, phase_of, set_condition
from oobleck.api.plan import Plan
from oobleck.api.resource import worker_selector
from oobleck.api.status import Condition, OobleckJobStatus, PlanSummary, Progress, TemplateUse
from oobleck.operator.decision import Event, JobContext
from oobleck.operator.faults import Verdict
from oobleck.operator.observe import JobObservation, Worker


class StatusBuilder:
    """Builds the next status from the previous one (conditions keep their transition times)."""

    def __init__(
        self,
        ctx: JobContext,
        now: datetime,
        measured: tuple[float | None, float | None, int | None] | None = None,
        verdict: Verdict | None = None,
        ready: Sequence[str] = (),
    ) -> None:
        self.ctx, self.now = ctx, now
        self.verdict = verdict
        """operator/faults.py's: the worker failures counted (status.workerFailures), and whether to fail"""
        self.conditions: list[Condition] = list(ctx.status.conditions)
        self.ready = tuple(ready)
        """running pods in no plan whose runtime is up (observe.ready_newcomers): the spares, once not folded in"""
        self.measured = measured
        """(loss, samples/s) of the newest step the workers reported, and the newest complete checkpoint step"""

    def set(self, type_: str, status: str, reason: str, message: str) -> None:
        self.conditions = set_condition(self.conditions, type_, status, reason, message, self.ctx.generation, self.now)  # type: ignore[arg-type]

    def failed(self, reason: str, message: str) -> None:
        """The job fails: Failed, and neither Running nor Reconfiguring."""
        self.set(ConditionType.FAILED, "True", reason, message)
        self.set(ConditionType.RUNNING, "False", Reason.NOT_APPLICABLE, "the job failed")
        self.set(ConditionType.RECONFIGURING, "False", Reason.NOT_APPLICABLE, "the job failed")

    def succeeded(self, message: str) -> None:
        """The job's last step is done: Succeeded, and neither Running nor Reconfiguring."""
        self.set(ConditionType.SUCCEEDED, "True", Reason.STEPS_COMPLETED, message)
        self.set(ConditionType.RUNNING, "False", Reason.NOT_APPLICABLE, "the job succeeded")
        self.set(ConditionType.RECONFIGURING, "False", Reason.NOT_APPLICABLE, "the job succeeded")

    def training(self, plan: Plan, f: int, degraded_note: str = "") -> None:
        """Running on `plan`, and Degraded while it has fewer than f + 1 pipelines (`degraded_note` says what
        that risks)."""
        pipelines = len(plan.pipelines)
        self.set(
            ConditionType.RUNNING,
            "True",
            Reason.TRAINING,
            f"generation {plan.generation}: {pipelines} pipelines on {len(plan.nodes)} nodes",
        )
        if plan.degraded:
            message = f"{pipelines} pipelines, fewer than f + 1 = {f + 1}{degraded_note}"
            self.set(ConditionType.DEGRADED, "True", Reason.FEWER_PIPELINES, message)
        else:
            self.set(
                ConditionType.DEGRADED, "False", Reason.FULLY_REDUNDANT, f"{pipelines} pipelines >= f + 1 = {f + 1}"
            )

    def reconfiguring(
        self, reason: str, summary: str, plan: Plan, failures: int, step: int, running: str | None = None
    ) -> dict[str, Any]:
        """The status written while a new generation's patches are in flight (Reconfiguring, and Running on
        the old `plan` with the message `running` when given); the builder goes on with Reconfigured."""
        self.set(ConditionType.RECONFIGURING, "True", reason, summary)
        if running is not None:
            self.set(ConditionType.RUNNING, "True", Reason.TRAINING, running)
        during = self.render(plan, failures, step)
        self.set(ConditionType.RECONFIGURING, "False", Reason.RECONFIGURED, summary)
        return during

    def render(self, plan: Plan | None, failures: int, step: int, *, completed: bool = False) -> dict[str, Any]:
        prior = self.ctx.status
        summary = None
        if plan is not None:
            uses: dict[int, int] = {}
            for pipeline in plan.pipelines:
                uses[pipeline.template_nodes] = uses.get(pipeline.template_nodes, 0) + 1
            summary = PlanSummary(
                generation=plan.generation,
                config_map=f"{self.ctx.name}-plan",
                templates=[
                    TemplateUse(nodes=n, pipelines=uses.get(n, 0)) for n in sorted({t.nodes for t in plan.templates})
                ],
                pipelines=len(plan.pipelines),
                nodes=len(plan.nodes),
                degraded=plan.degraded,
                iteration_ms=round(plan.iteration_ms, 3),
            )
        progress = prior.progress
        if step and (progress is None or progress.step != step):
            progress = Progress(step=step) if progress is None else progress.model_copy(update={"step": step})
        if self.measured is not None and self.measured[2] is not None and progress is None:
            progress = Progress()
        if progress is not None and self.measured is not None:
            loss, rate, checkpoint = self.measured
            known = progress.last_checkpoint_step
            progress = progress.model_copy(
                update={
                    "loss": loss if loss is not None else progress.loss,
                    "samples_per_second": rate if rate is not None else progress.samples_per_second,
                    # A pruned directory only moves forward: the newest step any report named.
                    "last_checkpoint_step": known if checkpoint is None else max(known or 0, checkpoint),
                }
            )
        spares = [] if completed or plan is None else [n for n in self.ready if n not in set(plan.nodes)]
        status = OobleckJobStatus(
            spares=len(spares),
            spare_pods=spares,
            phase=phase_of(self.conditions),
            conditions=self.conditions,
            observed_generation=self.ctx.generation,
            nodes=len(plan.nodes) if plan is not None else 0,
            selector=worker_selector(self.ctx.name),
            plan=summary,
            progress=progress,
            failures_survived=failures,
            reconfigurations=plan.generation if plan is not None else 0,
            worker_failures=self.verdict.worker_failures if self.verdict else prior.worker_failures,
            last_worker_failures=list(
                self.verdict.last_worker_failures if self.verdict else prior.last_worker_failures
            ),
            start_time=prior.start_time or (self.now if plan is not None else None),
            completion_time=prior.completion_time or (self.now if completed else None),
        )
        return status.to_kubernetes()


def measured(obs: JobObservation) -> tuple[float | None, float | None, int | None]:
    """What the workers reported for the status: the newest step's loss and throughput, the newest checkpoint."""
    return obs.loss, obs.samples_per_second, obs.checkpoint_step


def pending_condition(status: StatusBuilder, pending: Sequence[Worker], timeout_s: int, now: float) -> None:
    stuck = [w for w in pending if not w.scheduled and w.created is not None and now - w.created >= timeout_s]
    if stuck:
        why = stuck[0].reason or "not scheduled"
        status.set(
            ConditionType.WORKERS_PENDING,
            "True",
            Reason.UNSCHEDULABLE,
            f"{len(stuck)} worker pod(s) unschedulable for over {timeout_s} s (e.g. {stuck[0].name}: {why})",
        )
    elif any(c.type == ConditionType.WORKERS_PENDING for c in status.conditions):
        status.set(ConditionType.WORKERS_PENDING, "False", Reason.ALL_SCHEDULED, "no worker pod is stuck unschedulable")


def checkpoint_condition(ctx: JobContext, obs: JobObservation, status: StatusBuilder) -> tuple[Event, ...]:
    """CheckpointFailing from the members' reports: True (and a Warning event as it turns True) while a
    running member's last checkpoint write failed, False once their writes succeed again."""
    if obs.checkpoint_error:
        status.set(ConditionType.CHECKPOINT_FAILING, "True", Reason.CHECKPOINT_WRITE_FAILED, obs.checkpoint_error)
        if is_true(ctx.status.conditions, ConditionType.CHECKPOINT_FAILING):
            return ()
        return (Event("Warning", Reason.CHECKPOINT_WRITE_FAILED, obs.checkpoint_error),)
    if any(c.type == ConditionType.CHECKPOINT_FAILING for c in status.conditions):
        status.set(
            ConditionType.CHECKPOINT_FAILING,
            "False",
            Reason.CHECKPOINTS_WRITTEN,
            "the members' last checkpoint writes succeeded",
        )
    return ()
