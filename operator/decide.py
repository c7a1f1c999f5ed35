"""What to do next for a job: a pure function of its spec, its observation and its current plan.

`decide` is level-based: it compares what is (pods, nodes, the plan ConfigMap) with what should be
and returns every action at once, so that running it again after a crash, or twice in a row,
does no harm. The order in which `apply` executes a Decision is part of the contract:

    1. write `plan` (the next generation) to the plan ConfigMap - the source of truth;
    2. patch `patches` onto the running member pods whose RANKS_ANNOTATION differs from the plan's
       (the patch carries the ranks and the generation, so repeats are no-ops);
    3. delete `delete` (lost pods, after the plan that drops them exists), create `create`;
    4. write `status` and post `events`.

A pod whose ranks did not change is not patched: workers read the generation from the ConfigMap,
and the planner keeps ranks across generations, so a lost node costs a handful of patches, not one
per pod. A crash between 1 and 2 is repaired by the next run: the plan is re-read, the pods whose
ranks changed still carry their old ranks, and step 2 is planned again. No step creates a plan from
a plan it has not read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from oobleck.api.conditions import ConditionType, Reason, is_true
from oobleck.api.plan import Plan
from oobleck.api.profile import ModelProfile
from oobleck.api.spec import OobleckJobSpec
from oobleck.operator.admission import admit
from oobleck.operator.decision import CurrentPlan, Decision, Event, JobContext
from oobleck.operator.faults import Verdict
from oobleck.operator.membership import Membership, cleanup, coordinator_pod, membership, next_indices
from oobleck.operator.observe import JobObservation, Worker, ready_newcomers
from oobleck.operator.planning import Tuning, check_spec, first_plan, synthetic_profile
from oobleck.operator.planpool import IN_PROCESS, Planner, PlanningLimitExceeded
from oobleck.operator.render import ranks_table, worker_annotations
from oobleck.operator.status import StatusBuilder, checkpoint_condition, measured, pending_condition
from oobleck.operator.stragglers import with_stragglers
from oobleck.planner.errors import PlanningError
from oobleck.planner.nextgen import WORKERS_CHOOSE, next_generation


def _finished(
    ctx: JobContext, obs: JobObservation, current: CurrentPlan | None, status: StatusBuilder, events: list[Event]
) -> Decision:
    plan = current.plan if current else None
    failures = current.failures_survived if current else 0
    return Decision(
        status=status.render(plan, failures, obs.step, completed=True),
        delete=cleanup(ctx.spec, obs, plan),
        events=tuple(events),
    )


def _fail(
    ctx: JobContext, obs: JobObservation, current: CurrentPlan | None, status: StatusBuilder, reason: str, message: str
) -> Decision:
    status.failed(reason, message)
    return _finished(ctx, obs, current, status, [Event("Warning", reason, message)])


def _named(verdict: Verdict | None, reason: str, message: str) -> tuple[str, str]:
    """The reason to fail with: a worker's unconfirmed job cause, if one is why nodes were lost."""
    if verdict is not None and verdict.suspect is not None:
        kind, said = verdict.suspect
        return kind, f"{said} ({message})"
    return reason, message


RETRY_AFTER_S = 5.0
"""A failure that names nobody and that no pod or node explains within this long redoes the generation."""


def _retry_reason(obs: JobObservation, wall: float) -> str:
    """Why the current generation must be redone on the same nodes ("" if it need not)."""
    if obs.retry:
        return obs.retry
    if obs.stalled_since is not None and wall - obs.stalled_since >= RETRY_AFTER_S:
        return f"a failure reported {wall - obs.stalled_since:.0f} s ago names no lost worker"
    return ""


def decide(
    ctx: JobContext,
    obs: JobObservation,
    current: CurrentPlan | None,
    profile: ModelProfile | None,
    tuning: Tuning,
    now: datetime,
    verdict: Verdict | None = None,
    planner: Planner = IN_PROCESS,
) -> Decision:
    """The next actions for a job (see the module docstring). `profile` is None only before the first
    plan of a `profile: measure` job whose workers have not reported their measurement yet. `verdict`:
    operator/faults.py's on the worker pods (None: no worker failure is the job's); every worker pod it
    counts for the first time gets a Warning event. `planner` runs the check of a new spec and generation
    0's planning, which generate the templates (the operator's: a pool of processes with time and memory
    limits; a call over them fails the job InvalidSpec). Later generations reuse those templates and are
    planned in the calling thread (the operator's: not the event loop's).

    A pipeline of named steps: a finished job only cleans up; a job whose last step is done succeeds,
    one that lost some layer for good fails; before generation 0 `_first_plan` decides; else the
    members are sorted (`membership`), the next generation planned if any changed or the generation
    must be redone (`_change`), and the pods converged on the plan in force (`_converge`)."""
    try:
        decision = _decide(ctx, obs, current, profile, tuning, now, verdict, planner)
    except PlanningLimitExceeded as error:
        status = StatusBuilder(ctx, now, measured(obs), verdict)
        return _fail(ctx, obs, current, status, Reason.INVALID_SPEC, f"the planner cannot serve this spec: {error}")
    if verdict is not None and verdict.new and verdict.fail is None and decision.status.get("phase") != "Failed":
        counted = tuple(
            Event("Warning", f.kind, f"{f.message} (worker failure {verdict.worker_failures})") for f in verdict.new
        )
        decision = replace(decision, events=(*counted, *decision.events))
    return with_stragglers(ctx, obs, current, decision, profile, tuning)


def _decide(
    ctx: JobContext,
    obs: JobObservation,
    current: CurrentPlan | None,
    profile: ModelProfile | None,
    tuning: Tuning,
    now: datetime,
    verdict: Verdict | None,
    planner: Planner,
) -> Decision:
    plan_read = current.plan if current is not None else None
    status = StatusBuilder(ctx, now, measured(obs), verdict, ready=ready_newcomers(obs, plan_read, reported=True))
    ended = _ended(ctx, obs, current, status)
    if ended is not None:
        return ended
    if verdict is not None and verdict.fail is not None:
        # A failure of the job itself: every node would fail the same way (operator/faults.py).
        return _fail(ctx, obs, current, status, *verdict.fail)
    status.set(
        ConditionType.CREATED, "True", Reason.OBJECTS_CREATED, "service, RBAC, coordinator and worker pods created"
    )
    create_coordinator, delete = coordinator_pod(obs)
    if current is None:
        return _first_plan(ctx, obs, profile, tuning, status, delete, create_coordinator, now.timestamp(), planner)
    members = membership(ctx, obs, current.plan)
    change = _change(ctx, obs, current, profile, tuning, status, members, now.timestamp())
    if isinstance(change, Decision):
        return change
    return _converge(ctx, obs, current, status, members, change, [*delete, *members.delete], create_coordinator, now)


def _ended(ctx: JobContext, obs: JobObservation, current: CurrentPlan | None, status: StatusBuilder) -> Decision | None:
    """The decision for a job that has ended or ends now (succeeded, or some layer lost for good), else None."""
    spec, conditions = ctx.spec, ctx.status.conditions
    if is_true(conditions, ConditionType.FAILED) or is_true(conditions, ConditionType.SUCCEEDED):
        return _finished(ctx, obs, current, status, [])
    # The steps the workers reported: now on their pods, or earlier in the status (pods cleaned up since).
    reported = max(obs.step, ctx.status.progress.step if ctx.status.progress else 0)
    if current is not None and reported >= spec.training.steps:
        status.succeeded(f"{reported} of {spec.training.steps} steps done")
        return _finished(
            ctx,
            obs,
            current,
            status,
            [Event("Normal", Reason.STEPS_COMPLETED, f"all {spec.training.steps} steps done")],
        )
    if current is not None and obs.unrecoverable:
        return _fail(ctx, obs, current, status, Reason.LAYERS_LOST, obs.unrecoverable)
    return None


@dataclass(frozen=True)
class Change:
    """The next generation (None: the plan in force stays) and what goes with it."""

    plan: Plan | None = None
    failures: int = 0
    during: dict[str, Any] | None = None
    """the status written while the patches are in flight"""
    events: tuple[Event, ...] = ()
    delete: tuple[tuple[str, str], ...] = ()
    """members the new generation drops"""
    planner_seconds: float = 0.0


def _change(
    ctx: JobContext,
    obs: JobObservation,
    current: CurrentPlan,
    profile: ModelProfile | None,
    tuning: Tuning,
    status: StatusBuilder,
    members: Membership,
    wall: float,
) -> Change | Decision:
    """The next generation when members are lost, scaled in or added, or when the generation must be
    redone on the same nodes; a failing Decision when the job cannot go on."""
    spec, plan, failures = ctx.spec, current.plan, current.failures_survived
    lost, scaled, added = members.lost, members.scaled, members.added
    if not (lost or scaled or added):
        return _retry(obs, current, profile, tuning, status, wall)
    if len(members.survivors) - len(scaled) + len(added) < spec.nodes.min:
        return _fail(
            ctx,
            obs,
            current,
            status,
            *_named(
                status.verdict,
                Reason.TOO_FEW_NODES,
                f"{len(members.survivors) + len(added)} nodes left after losing {sorted(lost)}; "
                f"nodes.min is {spec.nodes.min}",
            ),
        )
    assert profile is not None, "a plan exists, so does the profile stored beside it"
    began = time.perf_counter()
    try:
        # Every live replica of some layer gone: a fresh layout on the survivors, and the workers
        # restore the newest step their snapshots or the checkpoint directory hold in full
        # (runtime/elastic/sources.py); if none does they report "unrecoverable" and the job fails.
        # Here, not in a planner process: a next generation reuses the plan's templates (the costly part,
        # generated under the planner's limits) and shipping a 1024-node plan there and back cost 0.3-0.5 s
        # of the failure-to-patch time (measured at load 18 on 2 cores; the planning itself 84 ms).
        new_plan = next_generation(
            plan,
            profile,
            [*lost, *scaled],
            added,
            restorable=WORKERS_CHOOSE,
            bandwidth=tuning.inter_node_bandwidth,
            horizon=tuning.horizon,
        )
    except PlanningError as error:
        return _fail(ctx, obs, current, status, *_named(status.verdict, Reason.TOO_FEW_NODES, str(error)))
    restore = new_plan.reason == "rollback"
    planner_s = time.perf_counter() - began
    failures += len(lost)
    moved = sum(c.bytes for c in new_plan.copies)
    events = [Event("Warning", Reason.NODE_LOST, f"{name}: {why}") for name, why in lost.items()]
    what = []
    if lost:
        what.append(f"lost {sorted(lost)}")
    if scaled:
        what.append(f"scaled in {scaled}")
    if added:
        what.append(f"added {added}")
    summary = (
        f"generation {new_plan.generation}: {', '.join(what)}; {len(new_plan.pipelines)} pipelines on "
        f"{len(new_plan.nodes)} nodes ({new_plan.reason}); moved {moved} bytes"
    )
    if restore:
        summary += "; every replica of some layer was lost: rolling back to the newest snapshot or checkpoint"
    events.append(Event("Normal", Reason.RECONFIGURED, summary))
    reason = (
        Reason.ROLLING_BACK
        if restore
        else (Reason.NODE_LOST if lost else Reason.SCALED if scaled else Reason.NODES_ADDED)
    )
    running = f"generation {plan.generation} until the survivors switch"
    during = status.reconfiguring(reason, summary, plan, failures, obs.step, running)
    delete = [(name, why) for name, why in lost.items() if obs.get(name) is not None]
    delete += [(name, f"scaled to {spec.nodes.wanted} nodes") for name in scaled]
    return Change(new_plan, failures, during, tuple(events), tuple(delete), planner_s)


def _retry(
    obs: JobObservation,
    current: CurrentPlan,
    profile: ModelProfile | None,
    tuning: Tuning,
    status: StatusBuilder,
    wall: float,
) -> Change:
    """Nobody is lost, but the generation may not be able to go on (its store is gone, or a failure named
    nobody and no pod or node explains it): then the same nodes start the next generation."""
    plan, failures = current.plan, current.failures_survived
    why = _retry_reason(obs, wall)
    if not why:
        return Change(failures=failures)
    new_plan = next_generation(plan, profile or (), reason="retry", bandwidth=tuning.inter_node_bandwidth)
    summary = f"generation {new_plan.generation}: the same {len(plan.nodes)} nodes again ({why})"
    during = status.reconfiguring(Reason.GENERATION_RETRIED, summary, plan, failures, obs.step)
    return Change(new_plan, failures, during, (Event("Normal", Reason.GENERATION_RETRIED, summary),))


def _converge(
    ctx: JobContext,
    obs: JobObservation,
    current: CurrentPlan,
    status: StatusBuilder,
    members: Membership,
    change: Change,
    delete: list[tuple[str, str]],
    create_coordinator: bool,
    now: datetime,
) -> Decision:
    """Pods onto the plan in force: rank patches, the Running/Degraded/WorkersPending conditions, pods to
    create up to the wanted count, and deletions not already under way."""
    spec, wall = ctx.spec, now.timestamp()
    in_force = change.plan or current.plan
    delete = [*delete, *change.delete]
    table = ranks_table(in_force)
    by_name = {w.name: w for w in obs.workers}
    patches = []
    for name in in_force.nodes:
        worker = by_name.get(name)
        if worker is not None and worker.status == "running" and worker.ranks != table.get(name, ""):
            patches.append((name, worker_annotations(in_force, name, table)))
    status.training(in_force, spec.f, ": another failure may need a checkpoint")
    events = change.events + checkpoint_condition(ctx, obs, status)
    in_force_set = set(in_force.nodes)
    # Pods on their way in: pending, or running but not folded in yet (still starting, see membership.py).
    pending = [w for w in obs.workers if w.status in ("pending", "running") and w.name not in in_force_set]
    doomed = {d for d, _ in delete}
    kept_pending = [w for w in pending if w.name not in doomed]
    pending_condition(status, kept_pending, spec.pending_timeout_seconds, wall)
    # Up to the wanted nodes and the warm spares beyond them.
    create = next_indices(
        obs, in_force, spec.nodes.wanted + spec.nodes.spares - len(in_force.nodes) - len(kept_pending)
    )
    # A pod already being deleted needs no second request (a pod on a dead node can stay terminating).
    delete = [(name, why) for name, why in delete if not ((w := obs.get(name)) is not None and w.deleting)]
    return Decision(
        status=status.render(in_force, change.failures, obs.step),
        plan=change.plan,
        failures_survived=change.failures,
        status_during=change.during,
        patches=tuple(patches),
        delete=tuple(dict(delete).items()),
        create=create,
        create_coordinator=create_coordinator,
        events=events,
        lost=tuple(members.lost),
        planner_seconds=change.planner_seconds,
    )


def _first_plan(
    ctx: JobContext,
    obs: JobObservation,
    profile: ModelProfile | None,
    tuning: Tuning,
    status: StatusBuilder,
    delete: list[tuple[str, str]],
    create_coordinator: bool,
    wall: float,
    planner: Planner,
) -> Decision:
    """Before generation 0: validate, create worker pods, and plan once enough of them run (and, for
    `profile: measure`, once a worker has reported the profile it measured; until then the spec is
    checked against the synthetic estimate of its model)."""
    spec = ctx.spec
    problem = _spec_problem(spec, profile, tuning, planner)
    if problem is not None:
        return _fail(ctx, obs, None, status, Reason.INVALID_SPEC, problem)
    pods = _first_pods(spec, obs, delete)
    create = next_indices(obs, None, spec.nodes.wanted + spec.nodes.spares - len(pods.live))
    attempt = _try_first_plan(ctx, pods, profile, tuning, wall, planner)
    if attempt.plan is None:
        reason = Reason.PROFILING if attempt.profiling else Reason.WAITING_FOR_NODES
        status.set(ConditionType.RUNNING, "False", reason, attempt.waiting)
        pending_condition(status, pods.pending, spec.pending_timeout_seconds, wall)
        return Decision(
            status=status.render(None, 0, 0),
            delete=tuple(dict(delete).items()),
            create=create,
            create_coordinator=create_coordinator,
            planner_seconds=attempt.planner_s,
        )
    plan = attempt.plan
    message = f"generation 0: {len(plan.pipelines)} pipelines on {len(plan.nodes)} nodes"
    events = [*attempt.events, Event("Normal", "Planned", f"{message}, estimated {plan.iteration_ms:.1f} ms per step")]
    status.training(plan, spec.f)
    if any(c.type == ConditionType.WORKERS_PENDING for c in status.conditions):
        status.set(ConditionType.WORKERS_PENDING, "False", Reason.ALL_SCHEDULED, "no worker pod is stuck unschedulable")
    table = ranks_table(plan)
    patches = tuple(
        (w.name, worker_annotations(plan, w.name, table)) for w in pods.running if w.ranks != table.get(w.name, "")
    )
    # Pods still pending stay: once they run they are folded into the next generation.
    return Decision(
        status=status.render(plan, 0, 0),
        plan=plan,
        patches=patches,
        delete=tuple(dict(delete).items()),
        create=create,
        create_coordinator=create_coordinator,
        events=tuple(events),
        planner_seconds=attempt.planner_s,
        profile=attempt.profile,
    )


def _spec_problem(spec: OobleckJobSpec, profile: ModelProfile | None, tuning: Tuning, planner: Planner) -> str | None:
    """Why generation 0 can never be planned (admission, then the planner's check), or None."""
    # An entry point's profile is known only once a worker measured it: nothing to check before.
    basis = profile if profile is not None else synthetic_profile(spec, tuning) if spec.model.gpt else None
    if basis is None:
        return None
    problem = admit(spec, basis, tuning)
    if problem is not None:
        return problem
    problem = check_spec(spec, basis, tuning, planner)
    return None if problem is None else f"the planner cannot serve this spec: {problem}"


@dataclass(frozen=True)
class FirstPods:
    """The worker pods before generation 0: those kept (`live`), and of them the running ones it would take."""

    live: list[Worker]
    running: list[Worker]
    pending: list[Worker]


def _first_pods(spec: OobleckJobSpec, obs: JobObservation, delete: list[tuple[str, str]]) -> FirstPods:
    """Sort the pods before generation 0; finished pods and those beyond the wanted count and spares go to
    `delete`."""
    wanted, pods = spec.nodes.wanted, spec.nodes.wanted + spec.nodes.spares
    for worker in obs.workers:
        if worker.status in ("lost", "succeeded"):
            delete.append((worker.name, worker.reason or "finished before the first plan"))
    live = [w for w in obs.workers if w.status in ("running", "pending")]
    for worker in live[pods:]:  # scaled down before the first plan
        delete.append(
            (
                worker.name,
                f"scaled to {wanted} nodes" + (f" and {spec.nodes.spares} spares" if spec.nodes.spares else ""),
            )
        )
    live = live[:pods]
    # Generation 0 takes the first `wanted` running pods; the others are the spares (membership.py).
    running = [w for w in live if w.status == "running"][:wanted]
    pending = [w for w in live if w.status == "pending"]
    return FirstPods(live, running, pending)


@dataclass(frozen=True)
class FirstAttempt:
    """Generation 0, or why it is not planned yet (`waiting`)."""

    plan: Plan | None
    profile: ModelProfile | None
    """the profile planned with: the measured one, or the synthetic estimate once the measurement is overdue"""
    events: tuple[Event, ...]
    waiting: str
    profiling: bool
    """enough pods run, but their measured profile has not come yet"""
    planner_s: float


def _try_first_plan(
    ctx: JobContext, pods: FirstPods, profile: ModelProfile | None, tuning: Tuning, wall: float, planner: Planner
) -> FirstAttempt:
    """Plan generation 0 once enough pods run: all wanted, or nodes.min of them once a pending pod has
    waited pendingTimeoutSeconds."""
    spec = ctx.spec
    wanted, running, pending = spec.nodes.wanted, pods.running, pods.pending
    oldest = min((w.created for w in pending if w.created is not None), default=None)
    timed_out = oldest is not None and wall - oldest >= spec.pending_timeout_seconds
    plan = None
    planner_s = 0.0
    events: list[Event] = []
    waiting = ""
    enough = bool(running) and (len(running) == wanted or (timed_out and len(running) >= spec.nodes.min))
    started = max((w.created for w in running if w.created is not None), default=wall)
    if enough and profile is None and wall - started >= tuning.measure_timeout_s:
        profile = synthetic_profile(spec, tuning)
        events.append(
            Event(
                "Warning",
                Reason.PROFILE_NOT_MEASURED,
                f"no worker reported a measured profile within {tuning.measure_timeout_s:.0f} s of "
                "running; planning with the synthetic estimate of the model",
            )
        )
    if enough and profile is None:
        waiting = f"{len(running)} worker pods running; waiting for the profile they measure on their devices"
    elif enough and profile is not None:
        began = time.perf_counter()
        try:
            plan = planner.run(first_plan, spec, profile, tuning, [w.name for w in running], ctx.name)
        except PlanningError as error:
            waiting = f"{len(running)} running worker pods cannot be planned yet: {error}"
            plan = None
        planner_s = time.perf_counter() - began
    if plan is None and (not running or len(running) < wanted):
        why = next((w.reason for w in pending if w.reason), "")
        waiting = f"{len(running)} of {wanted} worker pods running" + (f"; {why}" if why else "")
    return FirstAttempt(plan, profile, tuple(events), waiting, enough and profile is None, planner_s)
