"""What the operator sees of a job, as typed values: pure functions from Kubernetes objects.

`summarize_pod` / `summarize_node` reduce an object to the few fields health depends on (the kopf
indexes store these, so equal summaries mean "nothing relevant changed"). `observe` turns a job's
pod summaries, the node summaries and the current plan into a `JobObservation`: which workers run,
which are pending (and why), which are lost (and why), and the progress the members agree on (`agreed_step`).

A worker is lost when any of these holds (the first that does is the reason):
pod being deleted; pod Failed (evicted included); worker container terminated with a non-zero
code; pod marked as a disruption target; its node deleted, NotReady or unreachable (Ready
condition or the node-lifecycle taints); the node's allocatable GPUs below its capacity; a node
condition listed as a GPU failure reporting True; the worker reporting its own GPU unhealthy; a
live peer of the current generation reporting it dead. Except for a node that went silent (Ready Unknown:
no lease renewed): that counts only once it stayed silent for the operator's grace (after a control-plane
outage the kubelets come back one by one, up to a lease renewal apart, and the node lifecycle controller
may mark one Unknown after the others are back), and never while every member's node is silent at once
(the control plane was blind, not the nodes dead: `_blind`).

Other reports of the current generation: "unrecoverable" (a layer's state is gone from every worker,
snapshot and checkpoint: the job fails with the worker's words), "coordinator-restart" (the store was
lost: the generation is redone on the same nodes), and failures that name nobody (a broken
collective: the dead worker's pod or node usually shows it within moments; `stalled_since` lets
decide redo the generation if nothing does).

Only the plan's members count in these questions: a running pod in no plan (a replacement not folded in
yet, or a warm spare of spec.nodes.spares: `ready_newcomers`) is never lost to a peer's report, never
holds the agreed step back and is never a straggler.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Literal

from oobleck.api.causes import CAUSE_ANNOTATION
from oobleck.api.contract import (
    FAILURE_ANNOTATION,
    GENERATION_ANNOTATION,
    MAX_MEASURED_PROFILE_BYTES,
    MAX_REPORT_BYTES,
    MEASURED_PROFILE_ANNOTATION,
    PROGRESS_ANNOTATION,
    RANKS_ANNOTATION,
)
from oobleck.api.plan import Plan
from oobleck.api.reports import FailureKind, FailureReport, ProgressReport
from oobleck.api.resource import COORDINATOR_ROLE, ROLE_LABEL, WORKER_ROLE
from oobleck.operator.render import worker_index

SILENT_TAINT = "node.kubernetes.io/unreachable"
UNREACHABLE_TAINTS = (SILENT_TAINT, "node.kubernetes.io/not-ready")


def _time(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _int(value: str | None) -> int | None:
    return int(value) if value is not None and value.lstrip("-").isdigit() else None


@dataclass(frozen=True)
class PodSummary:
    """The health-relevant part of a pod of a job."""

    name: str
    uid: str
    role: str
    node_name: str | None
    phase: str
    created: float | None
    deleting: bool = False
    status_reason: str = ""
    terminated: tuple[int, str] | None = None  # (exit code, reason) of the first terminated container
    disrupted: str | None = None  # reason of a DisruptionTarget=True condition
    unschedulable: str | None = None  # the scheduler's message while PodScheduled=False
    generation: int | None = None  # GENERATION_ANNOTATION and RANKS_ANNOTATION: what the operator wrote
    ranks: str | None = None
    failure_report: str | None = None
    progress: str | None = None
    owner_uid: str | None = None
    measured_profile: str | None = None  # MEASURED_PROFILE_ANNOTATION (profile: measure, before the first plan)
    cause: str | None = None  # CAUSE_ANNOTATION: a job-caused failure the worker reported (operator/faults.py)
    terminated_message: str = ""  # the first terminated container's message (its last log lines)
    waiting: tuple[str, str] | None = None  # (reason, message) of the first container waiting with a reason
    oversized: tuple[str, ...] = ()  # report annotations over their cap (left out above), as messages


@dataclass(frozen=True)
class NodeSummary:
    """The health-relevant part of a node."""

    name: str
    ready: str  # "True" | "False" | "Unknown" (no Ready condition: "Unknown")
    ready_reason: str = ""
    taints: tuple[str, ...] = ()  # keys of NoExecute/NoSchedule taints from UNREACHABLE_TAINTS
    true_conditions: tuple[str, ...] = ()  # condition types other than Ready whose status is True
    capacity: tuple[tuple[str, int], ...] = ()  # extended resources (names with a '/') only
    allocatable: tuple[tuple[str, int], ...] = ()
    silent_since: float | None = None
    """When the node went silent (wall time): Ready turned Unknown, else the unreachable taint was added; None
    when it is not silent or the time is not recorded."""


def _capped(annotations: Mapping[str, Any], key: str, cap: int, oversized: list[str]) -> str | None:
    """A worker's report annotation, or None (and a message in `oversized`) when it is longer than `cap`."""
    value = annotations.get(key)
    if value is None or len(value) <= cap:
        return value
    oversized.append(f"annotation {key} is {len(value)} bytes, over the operator's cap of {cap}")
    return None


def summarize_pod(body: Mapping[str, Any]) -> PodSummary:
    """Reduce a Pod to a PodSummary (the workers' report annotations capped: see oobleck.api.contract)."""
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    oversized: list[str] = []
    terminated = waiting = None
    terminated_message = ""
    for container in status.get("containerStatuses") or []:
        state = (container.get("state") or {}).get("terminated")
        if state:
            terminated = (int(state.get("exitCode", 0)), state.get("reason") or "")
            terminated_message = (state.get("message") or "")[-2000:]
            break
    for container in status.get("containerStatuses") or []:
        state = (container.get("state") or {}).get("waiting")
        if state and state.get("reason") not in (None, "", "ContainerCreating", "PodInitializing"):
            waiting = (state["reason"], (state.get("message") or "")[:1000])
            break
    disrupted = unschedulable = None
    for condition in status.get("conditions") or []:
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            disrupted = condition.get("reason") or "DisruptionTarget"
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            unschedulable = condition.get("message") or condition.get("reason") or "not scheduled"
    owner = next((o.get("uid") for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
    return PodSummary(
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        role=labels.get(ROLE_LABEL, ""),
        node_name=(body.get("spec") or {}).get("nodeName") or None,
        phase=status.get("phase") or "Pending",
        created=_time(meta.get("creationTimestamp")),
        deleting=bool(meta.get("deletionTimestamp")),
        status_reason=status.get("reason") or "",
        terminated=terminated,
        disrupted=disrupted,
        unschedulable=unschedulable,
        generation=_int(annotations.get(GENERATION_ANNOTATION)),
        ranks=annotations.get(RANKS_ANNOTATION),
        failure_report=_capped(annotations, FAILURE_ANNOTATION, MAX_REPORT_BYTES, oversized),
        progress=_capped(annotations, PROGRESS_ANNOTATION, MAX_REPORT_BYTES, oversized),
        owner_uid=owner,
        measured_profile=_capped(annotations, MEASURED_PROFILE_ANNOTATION, MAX_MEASURED_PROFILE_BYTES, oversized),
        cause=_capped(annotations, CAUSE_ANNOTATION, MAX_REPORT_BYTES, oversized),
        terminated_message=terminated_message,
        waiting=waiting,
        oversized=tuple(oversized),
    )


def _extended(resources: Mapping[str, Any] | None) -> tuple[tuple[str, int], ...]:
    out = []
    for name, value in (resources or {}).items():
        if "/" in name and str(value).isdigit():
            out.append((name, int(value)))
    return tuple(sorted(out))


def summarize_node(body: Mapping[str, Any]) -> NodeSummary:
    """Reduce a Node to a NodeSummary."""
    status = body.get("status") or {}
    ready, reason, true_conditions, ready_since = "Unknown", "", [], None
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Ready":
            ready, reason = condition.get("status") or "Unknown", condition.get("reason") or ""
            ready_since = _time(condition.get("lastTransitionTime"))
        elif condition.get("status") == "True":
            true_conditions.append(condition.get("type") or "")
    unreachable = [t for t in (body.get("spec") or {}).get("taints") or [] if t.get("key") in UNREACHABLE_TAINTS]
    taints = tuple(sorted({t.get("key", "") for t in unreachable}))
    # The current silence began when Ready turned Unknown; a taint can outlive an earlier one by a
    # controller pass (it is removed a few seconds after Ready turns True), so it dates only a silence
    # that Ready does not show.
    tainted = [_time(taint.get("timeAdded")) for taint in unreachable if taint.get("key") == SILENT_TAINT]
    silent_since = ready_since if ready == "Unknown" else min((t for t in tainted if t is not None), default=None)
    return NodeSummary(
        name=(body.get("metadata") or {}).get("name", ""),
        ready=ready,
        ready_reason=reason,
        taints=taints,
        true_conditions=tuple(sorted(true_conditions)),
        capacity=_extended(status.get("capacity")),
        allocatable=_extended(status.get("allocatable")),
        silent_since=silent_since,
    )


def node_problem(
    node: NodeSummary | None, name: str, gpu_resource: str | None, gpu_conditions: Iterable[str]
) -> str | None:
    """Why a worker on this node is lost, or None when the node is healthy. gpu_resource None: no GPU check."""
    if node is None:
        return f"node {name} deleted"
    if node.ready != "True":
        kind = "unreachable" if node.ready == "Unknown" else "NotReady"
        return f"node {name} {kind}" + (f" ({node.ready_reason})" if node.ready_reason else "")
    if node.taints:
        return f"node {name} tainted {', '.join(node.taints)}"
    if gpu_resource is not None:
        capacity, allocatable = dict(node.capacity).get(gpu_resource), dict(node.allocatable).get(gpu_resource)
        if capacity is not None and (allocatable or 0) < capacity:
            return f"node {name}: allocatable {gpu_resource} {allocatable or 0} < capacity {capacity} (unhealthy GPU)"
        failing = sorted(set(node.true_conditions) & set(gpu_conditions))
        if failing:
            return f"node {name}: condition {', '.join(failing)} is True (GPU failure)"
    return None


def _silent(node: NodeSummary | None) -> bool:
    """Whether the node is suspected only because its kubelet stopped posting status (Ready Unknown, the
    node lifecycle controller's verdict from an expired lease), not reported unwell by the node itself."""
    return node is not None and (node.ready == "Unknown" or SILENT_TAINT in node.taints)


def _silent_within(node: NodeSummary | None, now: float | None, grace_s: float) -> bool:
    """Whether the node went silent less than `grace_s` before `now` (an unknown time counts as long ago)."""
    since = node.silent_since if node is not None else None
    return now is not None and since is not None and now - since < grace_s


def _blind(plan: Plan | None, workers: Mapping[str, Worker], silent: set[str]) -> tuple[str, ...]:
    """The members to keep although their nodes went silent: all members' nodes did at once (two or more;
    members that failed for a reason of their own aside).

    That is what the control plane's own blindness looks like - an API-server, etcd or controller-manager
    outage during which no node could renew its lease - not that many simultaneous node failures; the
    node lifecycle controller likewise stops evicting in such a "full disruption". The runtime's own
    detector (sub-second, over the data network) still reports a worker that really died, and a node
    that stays silent loses its pods to taint-based eviction, which then counts."""
    if plan is None:
        return ()
    # A member that finished is out of this question: its node is not checked any more (it may have reported the
    # last step before the others could, e.g. while etcd restarted).
    members = [n for n in plan.nodes if n in workers and workers[n].scheduled and workers[n].status != "succeeded"]
    quiet = [n for n in members if n in silent]
    # Every member is silent or failed for a reason of its own (a crash seen once the API server is back).
    if len(quiet) >= 2 and all(n in silent or workers[n].status == "lost" for n in members):
        return tuple(quiet)
    return ()


def pod_problem(pod: PodSummary) -> str | None:
    """Why the pod itself shows its worker lost, or None (a succeeded worker is not lost)."""
    if pod.deleting:
        return f"pod {pod.name} deleted"
    if pod.phase == "Failed":
        return f"pod {pod.name} failed" + (f" ({pod.status_reason})" if pod.status_reason else "")
    if pod.terminated is not None and pod.terminated[0] != 0:
        code, reason = pod.terminated
        return f"pod {pod.name}: worker container exited with code {code}" + (f" ({reason})" if reason else "")
    if pod.disrupted:
        return f"pod {pod.name}: disruption target ({pod.disrupted})"
    return None


WorkerStatus = Literal["running", "pending", "lost", "succeeded"]


@dataclass(frozen=True)
class Worker:
    """One worker pod as observed."""

    name: str
    index: int
    status: WorkerStatus
    reason: str = ""  # why lost, or why pending (the scheduler's message)
    node_name: str | None = None
    generation: int | None = None  # GENERATION_ANNOTATION: the generation its ranks were written for
    ranks: str | None = None  # RANKS_ANNOTATION (None: never annotated)
    created: float | None = None
    scheduled: bool = False
    deleting: bool = False  # already being deleted: no need to ask again
    reported: bool = False  # its runtime wrote a progress annotation (it started and waits for, or runs, a plan)
    progress: ProgressReport | None = None  # that annotation, parsed (its pace: operator/stragglers.py)


@dataclass(frozen=True)
class JobObservation:
    """A job's workers (by index), its coordinator and what the workers reported."""

    workers: tuple[Worker, ...]
    coordinator: PodSummary | None
    step: int = 0  # the step every live member of the current plan reported (`agreed_step`)
    foreign: tuple[str, ...] = ()  # pods with our names but another owner (a previous job's leftovers)
    reports: tuple[str, ...] = field(default=())  # accepted worker reports, for logs and events
    loss: float | None = None  # of the newest step any worker reported
    samples_per_second: float | None = None
    checkpoint_step: int | None = None  # the newest complete checkpoint step, as the members agree (agreed_checkpoint)
    checkpoint_error: str = ""  # "<pod>: why" of a live member whose last checkpoint write failed
    unrecoverable: str = ""  # a member found some layer's state gone everywhere (the job cannot go on)
    retry: str = ""  # why the current generation must be redone on the same nodes now (coordinator restart)
    stalled_since: float | None = None  # earliest report of a failure that names no dead worker (wall time)
    generation_trained: bool | None = None  # a member reported a step in the current generation (None: no reports)
    measured_profile: str | None = None  # the lowest-indexed live worker's measured profile JSON, if any
    silent_held: tuple[str, ...] = ()
    """members kept although their node went silent: not for the grace yet, or every member's at once (`_blind`)"""
    oversized: tuple[str, ...] = ()  # "<pod>: annotation ... over the cap" for reports left unread

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {w.name: w for w in self.workers})

    @property
    def names(self) -> set[str]:
        return {w.name for w in self.workers}

    def get(self, name: str) -> Worker | None:
        return self._by_name.get(name)  # type: ignore[attr-defined]


def ready_newcomers(obs: JobObservation, plan: Plan | None, *, reported: bool = False) -> tuple[str, ...]:
    """Running worker pods in no plan yet whose runtime is up (it reported: torch imported, the store reached;
    unless `reported`, any running one while no member reports, a runtime that reports nothing), oldest first.
    They are the warm spares (spec.nodes.spares) and the replacements to fold in; never members, so no
    progress, agreement or straggler question counts them (those read the plan's nodes only)."""
    members, dropped = (set(plan.nodes), set(plan.lost_nodes)) if plan is not None else (set(), set())
    reporting = reported or obs.generation_trained is not None
    return tuple(
        w.name
        for w in obs.workers
        if w.status == "running" and w.name not in members and w.name not in dropped and (w.reported or not reporting)
    )


def agreed_step(plan: Plan | None, workers: Mapping[str, Worker], summaries: Mapping[str, PodSummary]) -> int:
    """The step the current plan's members agree on: the smallest step reported by the members whose pods
    still run or succeeded (a member that reported nothing counts 0; lost members do not count).

    Members train in lockstep (every step's gradients are all-reduced across pipelines, and each runtime
    always reports its final step), so they agree within a report interval; a pod claiming a step its
    peers have not reached (a bug, or code writing its own annotation) moves nothing, and cannot end
    the job Succeeded. A member still up and waiting for its first plan (generation -1) has trained no step and
    has no say: a newcomer folded in as the others finish the last step would otherwise hold the job below
    its end forever, the finished members gone (seen on real nodes: a replacement added in the generation
    after which the lone survivor trained the last step). 0 before the first plan."""
    if plan is None:
        return 0
    steps = []
    for name in plan.nodes:
        worker = workers.get(name)
        if worker is None or worker.status not in ("running", "succeeded"):
            continue
        progress = ProgressReport.parse(summaries[name].progress)
        if progress is not None and progress.generation < 0:
            continue
        steps.append(progress.step if progress is not None else 0)
    return max(min(steps, default=0), 0)


def agreed_checkpoint(
    plan: Plan | None, workers: Mapping[str, Worker], summaries: Mapping[str, PodSummary]
) -> int | None:
    """The newest complete checkpoint step as the plan's live members report it: the smallest of their reports
    (only the ranks that write a layer report one). One pod cannot move it past what the others read in the
    directory. None when no member reported one."""
    reported = []
    for name in plan.nodes if plan is not None else ():
        worker = workers.get(name)
        if worker is None or worker.status not in ("running", "succeeded"):
            continue
        progress = ProgressReport.parse(summaries[name].progress)
        if progress is not None and progress.checkpoint_step is not None:
            reported.append(progress.checkpoint_step)
    return min(reported, default=None)


def _checkpoint_error(plan: Plan | None, workers: Mapping[str, Worker], summaries: Mapping[str, PodSummary]) -> str:
    """The first running member's report of a failed checkpoint write, as "<pod>: why" ("" when none)."""
    for name in plan.nodes if plan is not None else ():
        worker = workers.get(name)
        if worker is None or worker.status != "running":
            continue
        progress = ProgressReport.parse(summaries[name].progress)
        if progress is not None and progress.checkpoint_error:
            return f"{name}: {progress.checkpoint_error}"
    return ""


def observe(
    job: str,
    uid: str,
    pods: Iterable[PodSummary],
    nodes: Mapping[str, NodeSummary],
    plan: Plan | None,
    *,
    gpu_resource: str | None,
    gpu_conditions: Sequence[str] = (),
    now: float | None = None,
    silent_grace_s: float = 0.0,
) -> JobObservation:
    """Classify a job's pods (see the module docstring). `gpu_resource` None disables the GPU checks (cpu jobs).
    A member whose node went silent less than `silent_grace_s` before `now` (wall time) is kept."""
    workers: dict[str, Worker] = {}
    coordinator = None
    foreign = []
    summaries: dict[str, PodSummary] = {}
    newest = 0  # the highest step any pod claims: only for the loss and throughput shown
    latest: tuple[float | None, float | None] = (None, None)  # loss, samples/s of the newest step
    silent: set[str] = set()  # running workers lost only because their node's status went silent
    recent: set[str] = set()  # those whose node went silent within the grace
    for pod in pods:
        if pod.owner_uid != uid:
            foreign.append(pod.name)
            continue
        if pod.role == COORDINATOR_ROLE:
            coordinator = pod
            continue
        index = worker_index(job, pod.name)
        if pod.role != WORKER_ROLE or index is None:
            continue
        summaries[pod.name] = pod
        worker, node_silent = _classify(pod, index, nodes, gpu_resource, gpu_conditions)
        workers[pod.name] = worker
        if node_silent:
            silent.add(pod.name)
            if _silent_within(nodes.get(pod.node_name or ""), now, silent_grace_s):
                recent.add(pod.name)
        progress = worker.progress
        if progress is not None and progress.step >= newest:
            newest = progress.step
            latest = (progress.loss, progress.samples_per_second)

    # Only members are kept: a newcomer on a silent node is not folded in.
    recent &= set(plan.nodes) if plan is not None else set()
    held = tuple(sorted(set(_blind(plan, workers, silent)) | recent, key=lambda n: workers[n].index))
    for name in held:
        workers[name] = replace(workers[name], status="running", reason="")
    reports = _failure_reports(plan, workers, summaries) if plan is not None else Reports()
    ordered = tuple(sorted(workers.values(), key=lambda w: w.index))
    step = agreed_step(plan, workers, summaries)
    checkpoint_step = agreed_checkpoint(plan, workers, summaries)
    checkpoint_error = _checkpoint_error(plan, workers, summaries)
    measured = next(
        (
            summaries[w.name].measured_profile
            for w in ordered
            if w.status in ("running", "succeeded") and summaries[w.name].measured_profile
        ),
        None,
    )
    return JobObservation(
        oversized=tuple(f"{name}: {why}" for name, pod in sorted(summaries.items()) for why in pod.oversized),
        measured_profile=measured,
        workers=ordered,
        coordinator=coordinator,
        step=step,
        foreign=tuple(sorted(foreign)),
        reports=reports.accepted,
        loss=latest[0],
        samples_per_second=latest[1],
        checkpoint_step=checkpoint_step,
        checkpoint_error=checkpoint_error,
        unrecoverable=reports.unrecoverable,
        retry=reports.retry,
        stalled_since=reports.stalled_since,
        generation_trained=_generation_trained(plan, summaries),
        silent_held=held,
    )


def _classify(
    pod: PodSummary,
    index: int,
    nodes: Mapping[str, NodeSummary],
    gpu_resource: str | None,
    gpu_conditions: Sequence[str],
) -> tuple[Worker, bool]:
    """A worker pod as its own status and its node's show it, and whether it is lost only because its
    node's status went silent while it runs."""
    progress = ProgressReport.parse(pod.progress)
    silent = False
    problem = pod_problem(pod)
    if problem is None and pod.node_name is not None and pod.phase != "Succeeded":
        problem = node_problem(nodes.get(pod.node_name), pod.node_name, gpu_resource, gpu_conditions)
        silent = problem is not None and pod.phase == "Running" and _silent(nodes.get(pod.node_name))
    if problem is not None:
        status: WorkerStatus = "lost"
    elif pod.phase == "Succeeded" or pod.terminated is not None:
        status = "succeeded"
    elif pod.phase == "Running":
        status = "running"
    else:
        status = "pending"
        problem = pod.unschedulable or ""
    worker = Worker(
        name=pod.name,
        index=index,
        status=status,
        reason=problem or "",
        node_name=pod.node_name,
        generation=pod.generation,
        ranks=pod.ranks,
        created=pod.created,
        scheduled=pod.node_name is not None,
        deleting=pod.deleting,
        reported=progress is not None,
        progress=progress,
    )
    return worker, silent


def _generation_trained(plan: Plan | None, summaries: Mapping[str, PodSummary]) -> bool | None:
    """Whether a member reported a step of the current generation (None: no member reported at all)."""
    if plan is None:
        return None
    trained: bool | None = None
    for name in plan.nodes:
        progress = ProgressReport.parse(summaries[name].progress) if name in summaries else None
        if progress is not None:
            trained = bool(trained) or progress.generation == plan.generation
    return trained


@dataclass(frozen=True)
class Reports:
    """What the members' failure reports about the current generation say."""

    accepted: tuple[str, ...] = ()
    """"<worker>: <why>" for each running member a report made lost"""
    unrecoverable: str = ""
    retry: str = ""
    stalled_since: float | None = None


def _failure_reports(plan: Plan, workers: dict[str, Worker], summaries: Mapping[str, PodSummary]) -> Reports:
    """Apply the failure reports to `workers` (the running members they name become lost)."""
    accepted = []
    unrecoverable = retry = ""
    stalled_since: float | None = None
    members = set(plan.nodes)
    # Reports count only from live members about the current generation (older ones are settled).
    for name, pod in summaries.items():
        report = FailureReport.parse(pod.failure_report)
        worker = workers[name]
        if report is None or worker.status != "running" or name not in members:
            continue
        if report.generation != plan.generation:
            continue
        dead = list(report.dead)
        kind, detail = report.kind, report.detail
        if kind == FailureKind.UNRECOVERABLE:
            unrecoverable = unrecoverable or f"{name}: {detail}"
            continue
        if kind == FailureKind.COORDINATOR_RESTART:
            retry = retry or f"{name}: the coordinator restarted ({detail})"
            continue
        if not dead and kind != FailureKind.GPU:
            # Who died is not known yet (a broken collective): the pod or node status usually
            # tells within moments; if nothing does, the generation is redone (decide).
            at = report.detected_at
            stalled_since = at if stalled_since is None else min(stalled_since, at)
            continue
        if kind == FailureKind.GPU and (not dead or name in dead):
            dead = [name]
            why = f"worker {name} reported an unhealthy GPU" + (f": {detail}" if detail else "")
        else:
            why = f"reported dead by {name} ({kind.value})" + (f": {detail}" if detail else "")
        for target in dead:
            peer = workers.get(target)
            if target in members and peer is not None and peer.status == "running":
                workers[target] = Worker(**{**peer.__dict__, "status": "lost", "reason": why})
                accepted.append(f"{target}: {why}")
    return Reports(tuple(accepted), unrecoverable, retry, stalled_since)
