"""operator/faults.py: whose fault a worker's failure is, from the pods alone (pure)."""

from __future__ import annotations

from dataclasses import replace

from oobleck.api.causes import CAUSE_ANNOTATION, EXIT_CODES, make_cause
from oobleck.api.spec import FailurePolicy
from oobleck.api.status import WorkerFailure
from oobleck.operator.faults import assess, counted_so_far, pod_fault
from oobleck.operator.observe import summarize_pod

POLICY = FailurePolicy()


def _cause(kind: str, message: str, **about) -> str:
    return make_cause(kind, message, **about).model_dump_json(exclude_none=True)


def failed(h, index: int, code: int = 1, reason: str = "Error", message: str = "", **fields):
    return h.worker(index, phase="Failed", terminated=(code, reason), terminated_message=message, **fields)


def test_a_reported_cause_is_the_fault_with_the_workers_words(h):
    pod = failed(
        h,
        0,
        EXIT_CODES["ModelLoadFailed"],
        cause=_cause("ModelLoadFailed", "ModuleNotFoundError: No module named 'nope'", field="spec.model.entryPoint"),
    )
    fault = pod_fault(pod)
    assert fault.kind == "ModelLoadFailed" and not fault.certain
    assert "No module named 'nope'" in fault.message and "field spec.model.entryPoint" in fault.message


def test_signals_drops_and_pods_that_trained_are_not_the_jobs_fault(h):
    assert pod_fault(failed(h, 0, 137, progress='{"generation": 0, "step": 3}')) is None  # a SIGKILLed worker
    assert pod_fault(failed(h, 0, 137)) is None  # killed before it reported: a node's loss looks the same
    assert pod_fault(failed(h, 0, 3)) is None  # dropped from the plan
    assert pod_fault(failed(h, 0, 1, progress='{"generation": 0, "step": 3}')) is None  # crashed while training
    assert pod_fault(h.worker(0)) is None


def test_a_container_that_never_ran_the_runtime_and_an_oom_kill(h):
    fault = pod_fault(failed(h, 0, 127, message="exec: nope: not found"))
    assert fault.kind == "WorkerFailed" and "code 127" in fault.message and "nope: not found" in fault.message
    assert "fields spec.image, spec.command" in fault.message  # what the user changes (the cause audit)
    oom = pod_fault(failed(h, 1, 137, "OOMKilled", progress='{"generation": 0, "step": 3}'))
    assert oom.kind == "OutOfMemory" and "OOMKilled" in oom.message and "field spec.resources.memory" in oom.message
    # A cause the worker could not write on its pod still shows in its exit code.
    assert pod_fault(failed(h, 2, EXIT_CODES["DataUnavailable"], message="FileNotFoundError")).kind == "DataUnavailable"


def test_one_unconfirmed_cause_is_counted_and_suspected_two_fail_the_job(h):
    one = failed(h, 0, 11, cause=_cause("DataUnavailable", "FileNotFoundError: /data/x.bin"))
    verdict = assess(h.UID, [one, h.worker(1)], 0, [], POLICY, h.NOW.timestamp())
    assert verdict.fail is None and verdict.suspect[0] == "DataUnavailable"
    assert verdict.worker_failures == 1 and verdict.last_worker_failures[0].pod == one.name
    # Counted once: the same pod seen again adds nothing.
    again = assess(h.UID, [one], verdict.worker_failures, verdict.last_worker_failures, POLICY, h.NOW.timestamp())
    assert again.worker_failures == 1 and again.new == ()
    two = failed(h, 1, 11, cause=_cause("DataUnavailable", "FileNotFoundError: /data/x.bin"))
    verdict = assess(h.UID, [one, two], 0, [], POLICY, h.NOW.timestamp())
    reason, message = verdict.fail
    assert reason == "DataUnavailable" and "/data/x.bin" in message and "the same on" in message


def test_a_replacement_failing_the_same_way_fails_the_job(h):
    history = [WorkerFailure(pod="tiny-worker-0", uid="gone", reason="OutOfMemory", message="tiny-worker-0: OOM")]
    replacement = failed(h, 4, 137, "OOMKilled")
    reason, message = assess(h.UID, [replacement], 1, history, POLICY, h.NOW.timestamp()).fail
    assert reason == "OutOfMemory" and "tiny-worker-0" in message


def test_certain_causes_fail_at_once_and_the_budget_bounds_the_rest(h):
    nan = failed(h, 0, 14, cause=_cause("NonFiniteLoss", "step 7: the loss is nan", step=7))
    assert assess(h.UID, [nan], 0, [], POLICY, 0).fail[0] == "NonFiniteLoss"
    kinds = ["OutOfMemory", "DataUnavailable", "ModelLoadFailed", "CudaError"]
    history = [WorkerFailure(pod=f"p{i}", uid=f"u{i}", reason=k, message=k) for i, k in enumerate(kinds[:3])]
    last = failed(h, 9, 15, cause=_cause("CudaError", "CUDA error: an illegal memory access"))
    reason, message = assess(h.UID, [last], 3, history, POLICY, 0).fail
    assert reason == "BackoffLimitExceeded" and "4 worker pods" in message and "backoffLimit 3" in message
    assert "illegal memory access" in message


def test_a_start_failure_fails_after_the_timeout_with_the_pods_own_reason(h):
    pod = h.worker(0, phase="Pending", waiting=("ImagePullBackOff", 'Back-off pulling image "nope:1"'))
    now = pod.created + 30
    assert assess(h.UID, [pod], 0, [], POLICY, now).fail is None
    reason, message = assess(h.UID, [pod], 0, [], POLICY, pod.created + POLICY.start_timeout_seconds).fail
    assert reason == "ImagePullBackOff" and 'pulling image "nope:1"' in message and "startTimeoutSeconds 120" in message
    assert "fields spec.image, spec.command" in message


def test_pods_of_another_owner_or_the_coordinator_are_not_judged(h):
    foreign = replace(failed(h, 0, 12, cause=_cause("InvalidConfig", "x")), owner_uid="other")
    assert assess(h.UID, [foreign], 0, [], POLICY, 0).fail is None


def test_summarize_pod_reads_the_cause_the_termination_message_and_a_waiting_reason():
    body = {
        "metadata": {
            "name": "tiny-worker-0",
            "uid": "u",
            "annotations": {CAUSE_ANNOTATION: _cause("OutOfMemory", "x")},
        },
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {
                    "state": {
                        "terminated": {"exitCode": 1, "reason": "Error", "message": "Traceback ...\nValueError: x"}
                    }
                },
                {"state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}}},
            ],
        },
    }
    pod = summarize_pod(body)
    assert pod.terminated == (1, "Error") and pod.terminated_message.endswith("ValueError: x")
    assert pod.waiting == ("CrashLoopBackOff", "back-off 10s") and '"OutOfMemory"' in pod.cause


def test_two_different_early_exits_are_not_taken_for_one_cause(h):
    a = failed(h, 0, 1, message="ConnectionRefusedError: coordinator")
    b = failed(h, 1, 1, message="exec: python: not found")
    verdict = assess(h.UID, [a, b], 0, [], POLICY, 0)
    assert verdict.fail is None and verdict.worker_failures == 2
    c = failed(h, 2, 1, message="exec: python: not found")
    assert assess(h.UID, [a, b, c], 0, [], POLICY, 0).fail[0] == "WorkerFailed"


def test_a_status_read_before_the_last_write_does_not_forget_a_counted_failure(h):
    """worker-0 OOM-killed and counted, its pod gone with its replacement; worker-1's OOM kill wakes a pass
    whose copy of the job still shows no failure: counted from that copy, worker-1 would be the first
    (and its record would overwrite worker-0's); counted from what was written, it is the second."""
    first = assess(h.UID, [failed(h, 0, 137, "OOMKilled"), h.worker(1)], 0, [], POLICY, h.NOW.timestamp())
    assert first.fail is None and first.worker_failures == 1
    written = (first.worker_failures, first.last_worker_failures)
    second_pods = [failed(h, 1, 137, "OOMKilled"), h.worker(2)]

    stale = assess(h.UID, second_pods, 0, [], POLICY, h.NOW.timestamp())
    assert stale.fail is None, "the stale read was expected to miss the first failure"
    assert counted_so_far((0, ()), written) == written
    count, records = counted_so_far((0, ()), written)
    verdict = assess(h.UID, second_pods, count, records, POLICY, h.NOW.timestamp())
    assert verdict.fail is not None and verdict.fail[0] == "OutOfMemory", verdict
    assert verdict.worker_failures == 2 and [r.pod for r in verdict.last_worker_failures] == [
        r.pod for r in (*first.last_worker_failures, *verdict.new)
    ]
    # A status further than this process's memory (written by a previous operator process) is kept.
    assert counted_so_far((3, records), written) == (3, records)
