"""Jobs that cannot run, end to end: `kubectl apply` -> the operator (a real process) -> worker pods on
local nodes (real processes) -> the job ends `Failed` with a reason naming the cause, fast, without a
pod recreation loop (issue 10, the three jobs from its "Why", and training.onNonFinite).

- an entry point naming a module that does not exist: ModelLoadFailed, the module named;
- a token file path that does not exist: DataUnavailable, the path named;
- a model far larger than the pod's memory: the built-in GPT is refused before any pod exists
  (InvalidSpec, both numbers named: operator/admission.py); an entry-point model (known only once a
  worker builds it) is OOM-killed by the local node's memory cgroup (the pod's limit, enforced by the
  kernel as a kubelet does): OutOfMemory;
- a loss that turns NaN at step 5 (oobleck_dev.faultmodels.nonfinite_gpt): onNonFinite fail ends the
  job NonFiniteLoss; skipStep trains on to the exact step count.
Each checks the final phase and reason, that the failure came within 60 s of the first report, and
that no more worker pods were created than the nodes plus failurePolicy.backoffLimit.
"""

from __future__ import annotations

import re
import time
from datetime import datetime
from typing import Any

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.xdist_group("local-node-jobs-1")]
# Memory limits held as a kubelet holds them (a cgroup per container): the OOM test needs the kill.
LOCAL_NODES = {"nodes": 3, "gpus_per_node": 1, "cpu": "4", "memory": "16Gi", "enforce_memory": True, "preforked": True}
REPORT_BOUND_S = 60.0


def failed(run) -> dict[str, Any]:
    body = run.job()
    status = body.get("status") or {}
    if status.get("phase") == "Succeeded":
        raise AssertionError(f"the job succeeded: {status}")
    return body if status.get("phase") == "Failed" else {}


def wait_failed(run, reason: str, timeout: float = 240.0) -> tuple[dict[str, Any], dict[str, Any]]:
    body = run.wait_for(lambda: failed(run), "the job to fail", timeout=timeout)
    condition = next(c for c in body["status"]["conditions"] if c["type"] == "Failed")
    assert condition["reason"] == reason, condition
    assert condition["status"] == "True" and body["status"]["completionTime"]
    # The operator posts the event after the status patch that failed the job.
    run.wait_for(lambda: run.events(reason), f"a {reason} event", timeout=30)
    return body, condition


def first_cause_report(run) -> float:
    """When the first worker reported its cause: its last log line (the `cause` record it writes before it
    exits), or for a worker killed before it wrote anything (the OOM kill), its container's exit."""
    stamps = [path.stat().st_mtime for path in run.logs() if "worker" in path.name and path.stat().st_size]
    stamps += run.failed_exits().values()
    assert stamps, "no worker reported anything"
    return min(stamps)


def check_fast_and_bounded(run, body: dict[str, Any], nodes: int) -> None:
    ended = datetime.fromisoformat(body["status"]["completionTime"].replace("Z", "+00:00")).timestamp()
    first = first_cause_report(run)
    assert ended - first <= REPORT_BOUND_S, (
        f"failed {ended - first:.0f} s after the first worker's report; exits seen: {run.failed_exits()}; "
        f"counted: {body['status'].get('lastWorkerFailures')}"
    )
    backoff = run.spec.get("failurePolicy", {}).get("backoffLimit", 3)
    time.sleep(3)  # nothing more is created after the failure
    assert len(run.pods_seen) <= nodes + backoff, f"worker pods: {sorted(run.pods_seen)}"
    assert all(len(uids) == 1 for uids in run.pods_seen.values()), run.pods_seen


def test_an_entry_point_whose_module_does_not_exist_fails_model_load(job_run):
    run = job_run
    spec = run.job_spec(50, nodes=2)
    spec["model"] = {"entryPoint": "no_such_module.models:build"}
    run.apply(spec)
    body, condition = wait_failed(run, "ModelLoadFailed")
    assert "no_such_module" in condition["message"] and "spec.model.entryPoint" in condition["message"]
    check_fast_and_bounded(run, body, 2)
    assert body["status"]["workerFailures"] >= 1
    assert body["status"]["lastWorkerFailures"][0]["reason"] == "ModelLoadFailed"


def test_a_token_file_that_does_not_exist_fails_data_unavailable(job_run):
    run = job_run
    spec = run.job_spec(50, nodes=2)
    spec["data"] = {"source": "tokenFile", "path": "/data/missing/train.bin"}
    run.apply(spec)
    body, condition = wait_failed(run, "DataUnavailable")
    # The path as the pod sees it, not a folder of the node's (local nodes give pods a container's filesystem).
    assert re.search(r"(^|[\s'\"=:(])/data/missing/train\.bin", condition["message"]), condition
    check_fast_and_bounded(run, body, 2)


def test_a_gpt_far_larger_than_the_pods_memory_is_refused_before_any_pod(job_run):
    run = job_run
    spec = run.job_spec(50, nodes=2)
    spec["model"] = {"gpt": {"layers": 8, "hiddenSize": 4096, "heads": 8, "sequenceLength": 64, "vocabSize": 512}}
    spec["resources"] = {"cpu": "1", "memory": "1Gi"}
    run.apply(spec)
    body, condition = wait_failed(run, "InvalidSpec", timeout=60)
    message = condition["message"]
    assert "spec.resources.memory" in message and "1073741824 bytes" in message and "needs" in message, message
    assert run.pods_seen == {}


def test_an_entry_point_model_far_larger_than_the_pods_memory_is_oom_killed(job_run):
    run = job_run
    spec = run.job_spec(50, nodes=2, env={"HUGE_GPT_HIDDEN": "8192"})
    spec["model"] = {"entryPoint": "oobleck_dev.faultmodels:huge_gpt"}
    spec["resources"] = {"cpu": "1", "memory": "1Gi"}
    run.apply(spec)
    body, condition = wait_failed(run, "OutOfMemory")
    assert "OOMKilled" in condition["message"] or "memory" in condition["message"], condition
    check_fast_and_bounded(run, body, 2)


def nonfinite_job(run, policy: str, steps: int = 30) -> dict[str, Any]:
    spec = run.job_spec(steps, nodes=2, env={"NONFINITE_AT_STEPS": "5"})
    spec["model"] = {"entryPoint": "oobleck_dev.faultmodels:nonfinite_gpt"}
    spec["training"]["onNonFinite"] = policy
    return spec


def test_a_nan_loss_fails_the_job_with_non_finite_loss(job_run):
    run = job_run
    run.apply(nonfinite_job(run, "fail"))
    body, condition = wait_failed(run, "NonFiniteLoss")
    assert "step 5" in condition["message"] and "nan" in condition["message"], condition
    check_fast_and_bounded(run, body, 2)
    assert body["status"].get("progress", {}).get("step", 0) <= 5  # steps 0-4 committed at most, 5 never


def test_a_nan_loss_with_skip_step_trains_to_the_exact_step(job_run):
    run = job_run
    run.apply(nonfinite_job(run, "skipStep"))
    body = run.wait_succeeded()
    assert body["status"]["progress"]["step"] == 30 and run.plan().generation == 0
    skipped = [r for r in run.records() if r.get("event") == "non-finite"]
    assert len(skipped) == 2 and {r["step"] for r in skipped} == {5}  # both workers, the same step
