"""Whose fault is a worker's failure, the job's or its node's: a pure verdict from the pods and the history.

A node's failure is survived by re-planning (operator/decide.py). A failure that follows the job (its
model does not import, its data is missing, it runs out of memory, its loss is NaN) would only repeat
on every node and every replacement, so the job should end `Failed` with the cause instead. A worker
says which it is by the cause it reports (oobleck.api.causes: CAUSE_ANNOTATION, or its exit code); a
container that never ran the runtime says it by its own status (OOMKilled, an exit before any report,
a waiting reason such as ImagePullBackOff).

The verdict (`assess`):
- every such failed pod is counted once (by uid) in status.workerFailures, the newest kept in
  status.lastWorkerFailures;
- the job fails with the cause's kind as the reason and the worker's message when the cause is certain
  by itself (InvalidConfig, NonFiniteLoss: see oobleck.api.causes.CERTAIN), when the same kind shows on
  two different pods (two workers at once, or a replacement again: the job's fault, not a node's; for
  an exit before the runtime reported, the same exit code and last log lines too), or
  when the count exceeds spec.failurePolicy.backoffLimit (BackoffLimitExceeded, naming the last);
- a worker container held in a start failure (ImagePullBackOff, CrashLoopBackOff, ...) for
  failurePolicy.startTimeoutSeconds since its pod was created fails the job with that reason;
- otherwise the newest unconfirmed cause is a `suspect`: if the job must fail anyway (too few nodes
  left), it fails naming the suspect rather than the nodes it lost.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from oobleck.api.causes import CERTAIN, KIND_OF_EXIT, parse_cause
from oobleck.api.conditions import Reason
from oobleck.api.contract import ExitCode
from oobleck.api.resource import WORKER_ROLE
from oobleck.api.spec import FailurePolicy
from oobleck.api.status import WorkerFailure
from oobleck.operator.observe import PodSummary

START_FAILURES = frozenset(
    {
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "CrashLoopBackOff",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
"""Container waiting reasons that do not go away by themselves (the kubelet's own words)."""
NOT_COUNTED_EXITS = frozenset({ExitCode.DROPPED})
"""The plan left the worker out: that is the operator's doing, not the node's failure."""
RECORDS_KEPT = 8
SIGNAL_BASE = 128
"""exit codes above it are 128 + a signal's number"""


@dataclass(frozen=True)
class Fault:
    """One pod's failure that is not (known to be) its node's."""

    pod: str
    uid: str
    kind: str
    message: str

    @property
    def certain(self) -> bool:
        return self.kind in CERTAIN


@dataclass(frozen=True)
class Verdict:
    worker_failures: int
    last_worker_failures: tuple[WorkerFailure, ...]
    fail: tuple[str, str] | None = None
    """(reason, message) the job fails with now"""
    suspect: tuple[str, str] | None = None
    """(reason, message) of the newest unconfirmed job cause, to name if the job fails for another reason"""
    new: tuple[Fault, ...] = ()
    """faults counted for the first time in this verdict (for events)"""


def _exit_text(pod: PodSummary) -> str:
    assert pod.terminated is not None
    code, reason = pod.terminated
    text = f"container exited with code {code}" + (f" ({reason})" if reason else "")
    if pod.terminated_message:
        text += f": {pod.terminated_message.strip()}"
    return text


def pod_fault(pod: PodSummary) -> Fault | None:
    """The job-caused failure this pod shows, or None (running fine, or lost with its node)."""
    cause = parse_cause(pod.cause)
    if cause is not None:
        return Fault(pod.name, pod.uid, cause.kind, f"{pod.name}: {cause.describe()}")
    if pod.terminated is None or pod.terminated[0] == 0 or pod.terminated[0] in NOT_COUNTED_EXITS:
        return None
    code, reason = pod.terminated
    if reason == "OOMKilled":
        return Fault(
            pod.name,
            pod.uid,
            Reason.OUT_OF_MEMORY,
            f"{pod.name}: {_exit_text(pod)} (over its memory limit; field spec.resources.memory)",
        )
    if code in KIND_OF_EXIT:  # the worker exited with a cause it could not put on the pod
        return Fault(pod.name, pod.uid, KIND_OF_EXIT[code], f"{pod.name}: {_exit_text(pod)}")
    # Before the runtime reported anything, not killed by a signal (a node's loss, a test's SIGKILL):
    # the image or the command cannot run the runtime.
    if pod.progress is None and code <= SIGNAL_BASE and reason in ("Error", "StartError", "ContainerCannotRun"):
        return Fault(
            pod.name,
            pod.uid,
            Reason.WORKER_FAILED,
            f"{pod.name}: {_exit_text(pod)}, before its runtime started (fields spec.image, spec.command)",
        )
    return None


def _signature(kind: str, pod: str, message: str) -> str:
    """What makes two failures "the same": the cause's kind; for a container that exited before its
    runtime reported (a kind that says little) also its exit code and last log lines, so that two
    unrelated early exits (a coordinator not reachable yet, a node going away) are not taken for one."""
    if kind != Reason.WORKER_FAILED:
        return kind
    return kind + message.removeprefix(f"{pod}: ")


def _start_failure(pod: PodSummary, timeout_s: float, now: float) -> tuple[str, str] | None:
    if pod.waiting is None or pod.waiting[0] not in START_FAILURES or pod.created is None:
        return None
    if now - pod.created < timeout_s:
        return None
    reason, message = pod.waiting
    return reason, (
        f"{pod.name}: container waiting in {reason} for {now - pod.created:.0f} s "
        f"(failurePolicy.startTimeoutSeconds {timeout_s:.0f}; fields spec.image, spec.command)"
        + (f": {message}" if message else "")
    )


Counted = tuple[int, tuple[WorkerFailure, ...]]
"""status.workerFailures and status.lastWorkerFailures: the worker failures counted so far"""


def counted_so_far(from_status: Counted, written: Counted | None) -> Counted:
    """The further of the count in the job's status as read and the one this process last wrote.

    A pass is woken by a pod's event, and kopf's copy of the job may not show yet the status an earlier
    pass wrote: counting from it would forget that failure (and overwrite its record), so a job's second
    worker with the same cause would look like its first. This process is the only writer of the count."""
    if written is not None and written[0] > from_status[0]:
        return written
    return from_status


def assess(
    uid: str,
    pods: Iterable[PodSummary],
    worker_failures: int,
    last_worker_failures: Sequence[WorkerFailure],
    policy: FailurePolicy,
    now: float,
) -> Verdict:
    """The verdict on a job's worker pods (see the module docstring); `pods` may include other pods."""
    workers = [p for p in pods if p.owner_uid == uid and p.role == WORKER_ROLE]
    faults = [f for p in workers if (f := pod_fault(p)) is not None]
    counted = {r.uid for r in last_worker_failures}
    new = tuple(f for f in faults if f.uid not in counted)
    records = [
        *last_worker_failures,
        *(WorkerFailure(pod=f.pod, uid=f.uid, reason=f.kind, message=f.message[:4096]) for f in new),
    ]
    count = worker_failures + len(new)
    verdict = Verdict(count, tuple(records[-RECORDS_KEPT:]), new=new)

    def failing(reason: str, message: str) -> Verdict:
        return Verdict(verdict.worker_failures, verdict.last_worker_failures, (reason, message), new=new)

    for fault in faults:
        if fault.certain:
            return failing(fault.kind, fault.message)
    pods_of: dict[str, dict[str, str]] = {}  # signature -> uid -> message, oldest first
    for record in records:
        pods_of.setdefault(_signature(record.reason, record.pod, record.message), {}).setdefault(
            record.uid, record.message
        )
    for fault in faults:
        signature = _signature(fault.kind, fault.pod, fault.message)
        seen = pods_of.get(signature, {})
        if len(seen) >= 2:
            others = [
                r.pod for r in records if _signature(r.reason, r.pod, r.message) == signature and r.uid != fault.uid
            ]
            where = ", ".join(dict.fromkeys(others))
            return failing(fault.kind, f"{fault.message}; the same on {where}: the job's fault, not a node's")
    if count > policy.backoff_limit:
        last = records[-1]
        return failing(
            Reason.BACKOFF_LIMIT_EXCEEDED,
            f"{count} worker pods failed by themselves, more than failurePolicy.backoffLimit "
            f"{policy.backoff_limit}; the last: {last.reason}: {last.message}",
        )
    for pod in workers:
        if (stuck := _start_failure(pod, policy.start_timeout_seconds, now)) is not None:
            return failing(*stuck)
    if faults:
        newest = faults[-1]
        return Verdict(
            verdict.worker_failures, verdict.last_worker_failures, suspect=(newest.kind, newest.message), new=new
        )
    return verdict
