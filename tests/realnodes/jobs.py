"""What the real-node job tests share: the job spec (examples/llama-tiny.yaml on the real nodes), `RealJob` (one
job's namespace and the operator serving it, read through kubectl and the API), the reference losses."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

from oobleck.api.plan import Plan
from oobleck.api.planmap import read_plan
from oobleck.api.resource import worker_selector
from oobleck.operator import render
from oobleck_dev.controlplane import Cluster
from oobleck_dev.operatorproc import OperatorProcess
from oobleck_dev.poll import wait_until
from oobleck_dev.realnodes import RealNodes
from oobleck_dev.references import ReferenceCache

JOB = "llama"
EXAMPLE = Path(__file__).parents[2] / "examples" / "llama-tiny.yaml"
LOSS_RTOL = 1e-5
"""The runtime's documented tolerance: every layout's losses match single-process training to 1e-5 relative."""
START_TIMEOUT_S = 600.0
"""Pods pulled from the node's own store, torch imported and the model profiled, on a loaded 2-core host."""
RUN_TIMEOUT_S = 900.0
LOST_WITHIN_S = 30.0
"""A frozen node's workers, from the freeze to the operator's NodeLost event as this test sees it: the README's
verdict (no probe answer within 0.25 s, 0.45 s after the last beat: 1.2-1.6 s alone), then the operator's batch
window and this test's 1 s poll. Beside the local suite everything here runs at nice 19: at load 12-19 it took
21.3 s (2026-11-29). Still under the node lifecycle controller's grace (50 s): the peers' verdict found the node,
not its NotReady."""
OPEN_ENDED_STEPS = 3000
"""A job's steps where the test ends it while it trains (about 0.2 s a step here): the test checks what it is
about (the failure handled, the survivors trained past it, every loss so far exact); ending at the exact step
after a failure is test_worker_container_killed_through_the_runtime_recovers_in_place's check."""
HOOKS = ("OOBLECK_CONTAINER_ROOT", "OOBLECK_SERVICEACCOUNT_DIR")
"""Variables the local node agent once set for the product: a real node sets none of them (the pod's IP comes
through the downward API, as OOBLECK_POD_IP)."""


def wait_for(predicate: Callable[[], Any], what: str, timeout: float) -> Any:
    return wait_until(predicate, what, timeout, 1.0, tolerate=(Exception,))


def job_spec(image: str, steps: int, min_nodes: int, node_selector: dict[str, str], spares: int = 0) -> dict[str, Any]:
    """examples/llama-tiny.yaml on the real nodes (two workers at most, and `spares` warm spares: one pod per
    node), float64 gradient sums so that any layout's losses match the reference run to LOSS_RTOL."""
    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    spec["image"] = image
    spec["nodes"] = {"min": min_nodes, "max": 2, "spares": spares}
    spec["training"]["steps"] = steps
    spec["training"]["gradientSumDtype"] = "float64"
    variables = {"WORKER_PROGRESS_INTERVAL_S": "0.5", "WORKER_DEAD_AFTER_S": "10"}
    spec["pod"] = {"nodeSelector": node_selector, "env": [{"name": k, "value": v} for k, v in variables.items()]}
    spec["pendingTimeoutSeconds"] = 900
    spec["cleanPodPolicy"] = "None"  # keep the pods: their logs are read afterwards
    return spec


REFERENCES = ReferenceCache()
"""Kept across runs with the e2e tests' (oobleck_dev.references)."""


class RealJob:
    """One job on the real nodes: its namespace, the operator serving it, and reads through kubectl."""

    def __init__(self, cluster, nodes, namespace: str, operator: OperatorProcess) -> None:
        self.cluster, self.nodes, self.ns, self.operator = cluster, nodes, namespace, operator
        self.spec: dict[str, Any] | None = None

    def apply(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        manifest = {"apiVersion": "oobleck.dev/v1alpha1", "kind": "OobleckJob", "metadata": {"name": JOB}, "spec": spec}
        self.cluster.kubectl("apply", "-n", self.ns, "-f", "-", input=yaml.safe_dump(manifest))

    def job(self) -> dict[str, Any]:
        return self.cluster.kubectl_json("get", "oobleckjob", JOB, "-n", self.ns)

    def pods(self, selector: str = "") -> list[dict[str, Any]]:
        args = ["get", "pods", "-n", self.ns] + (["-l", selector] if selector else [])
        return self.cluster.kubectl_json(*args)["items"]

    def workers(self) -> list[dict[str, Any]]:
        return self.pods(worker_selector(JOB))

    def running_worker_steps(self) -> dict[str, int]:
        """worker pod -> the step its progress annotation reports (Running workers that reported one)."""
        return self.worker_steps(self.workers())

    @staticmethod
    def worker_steps(pods: Iterable[dict[str, Any]]) -> dict[str, int]:
        """Of these worker pods, the Running ones that reported a step: pod -> that step."""
        from oobleck.api.contract import PROGRESS_ANNOTATION

        steps = {}
        for pod in pods:
            report = (pod["metadata"].get("annotations") or {}).get(PROGRESS_ANNOTATION)
            if pod.get("status", {}).get("phase") == "Running" and report:
                steps[pod["metadata"]["name"]] = int(json.loads(report)["step"])
        return steps

    def plan(self) -> Plan:
        """The plan in force (the plan ConfigMap), read through the API without a kubectl process."""
        return read_plan(self.cluster.reads.config_map(self.ns, render.plan_name(JOB)))

    def succeeded(self) -> dict[str, Any]:
        body = self.job()
        phase = body.get("status", {}).get("phase")
        if phase == "Failed":
            raise AssertionError(f"the job failed: {json.dumps(body['status'])[:3000]}")
        return body if phase == "Succeeded" else {}

    def wait_succeeded(self) -> dict[str, Any]:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline:
            body = self.succeeded()
            if body:
                return body
            time.sleep(2)
        raise AssertionError(
            f"not Succeeded after {RUN_TIMEOUT_S:.0f} s: {json.dumps(self.job().get('status'))[:3000]}"
        )

    def records(self, pod: str) -> Iterator[dict[str, Any]]:
        """The JSON-lines records of a pod's worker log, as `kubectl logs` returns it."""
        # A pod whose node lost its kubelet has no logs to give: the survivors' logs must cover every step.
        text = self.cluster.kubectl("logs", pod, "-n", self.ns, "-c", "worker", timeout=120, check=False).stdout
        for line in text.splitlines():
            if line.startswith("{"):
                try:
                    yield json.loads(line)
                except ValueError:
                    continue

    def check_losses(self, through: int | None = None) -> int:
        """Every step's loss, as the remaining workers logged it, equals the no-failure reference within
        LOSS_RTOL; every step has one (of a job still training, every step before `through`); returns how
        many values were compared."""
        assert self.spec is not None
        reference = REFERENCES.for_spec(self.spec, JOB, through=through)
        seen: dict[int, list[float]] = {}
        for pod in self.workers():
            for record in self.records(pod["metadata"]["name"]):
                if (
                    record.get("event") == "step"
                    and record.get("loss") is not None
                    and int(record["step"]) < len(reference)
                ):
                    seen.setdefault(int(record["step"]), []).append(float(record["loss"]))
        missing = sorted(set(range(len(reference))) - set(seen))
        assert not missing, f"steps without a logged loss: {missing[:20]} ({len(missing)} of {len(reference)})"
        for step, values in seen.items():
            for value in values:
                assert abs(value - reference[step]) <= LOSS_RTOL * abs(reference[step]), (
                    f"step {step}: loss {value} vs reference {reference[step]}"
                )
        return sum(len(v) for v in seen.values())

    def check_trains_past(self, pod: str, step: int) -> int:
        """Wait until worker `pod` has trained two steps past `step` (the step cut short, redone, and one more),
        then check every loss logged before then (check_losses); returns how many were compared."""
        through = wait_for(
            lambda: (s := self.running_worker_steps().get(pod, -1)) > step + 1 and s, f"{pod} past step {step}", 180
        )
        return self.check_losses(through=through)

    def events(self, reason: str) -> list[str]:
        """Messages of the namespace's events with `reason` (the operator's NodeLost, Reconfigured, ...)."""
        listing = self.cluster.kubectl_json("get", "events", "-n", self.ns, "--field-selector", f"reason={reason}")
        return [item.get("message", "") for item in listing["items"]]

    def dump(self) -> None:
        """What a failing test needs to see: pods, events, the operator's log tail."""
        print(self.cluster.kubectl("get", "pods", "-n", self.ns, "-o", "wide", check=False).stdout)
        print(
            self.cluster.kubectl("get", "events", "-n", self.ns, "--sort-by=.lastTimestamp", check=False).stdout[-5000:]
        )
        for pod in self.pods():
            name = pod["metadata"]["name"]
            print(
                f"--- {name}\n{self.cluster.kubectl('logs', name, '-n', self.ns, '--all-containers', check=False).stdout[-3000:]}"
            )
        print(f"--- operator\n{self.operator.log()[-5000:]}")


@contextlib.contextmanager
def job_served(cluster: Cluster, nodes: RealNodes, workdir: Path) -> Iterator[RealJob]:
    """A namespace and an operator (a host process, its log read directly) for one job; afterwards what a
    failing test needs to see, and the job and its pods gone (they would compete with the next test's)."""
    namespace = cluster.namespace("real")
    operator = OperatorProcess(cluster.kubeconfig, [namespace], workdir / "operator", "--resync", "2").start()
    job = RealJob(cluster, nodes, namespace, operator)
    try:
        yield job
    finally:
        job.dump()
        cluster.kubectl("delete", "oobleckjob", JOB, "-n", namespace, "--ignore-not-found", "--wait=false", check=False)
        operator.kill()
        # Not the namespace: the job's finalizer would hold it, with no operator left to remove it.
        cluster.kubectl(
            "delete", "pods", "--all", "-n", namespace, "--grace-period=0", "--wait=true", check=False, timeout=120
        )
