"""What the end-to-end tests share: one OobleckJob per test on the module's local nodes, served by the
operator as a real process (oobleck_dev.operatorproc.OperatorProcess, the one the demo runs), and
reads of what happened: plan generations, progress annotations, worker and operator /metrics parsed
with prometheus_client's parser, and the per-step losses the workers logged, checked against the
single-process reference trainer (runtime/train/reference.py: a no-failure run of the same job).

Every job here is a tiny GPT (the examples/tiny-gpt.yaml model; device cpu unless a test asks
otherwise) pinned to the module's local nodes; the `job_run` fixture gives each test a namespace,
an operator, and cleans up after it (pods gone, nodes uncordoned, GPUs healthy again).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from oobleck.api import contract
from oobleck.api.contract import PROGRESS_ANNOTATION
from oobleck.api.planmap import read_plan
from oobleck.api.resource import GROUP, PLURAL, VERSION, worker_selector
from oobleck.operator import render
from oobleck_dev.operatorproc import OperatorProcess
from oobleck_dev.poll import wait_until
from oobleck_dev.references import REFERENCE_SOURCES, ReferenceCache

JOB = "tiny"
TIMEOUT_S = 150.0
LOSS_RTOL = 1e-5
"""The runtime's documented tolerance: every layout's losses match single-process training to 1e-5 relative."""
EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny-gpt.yaml"
STEPS = 200
"""Steps of the failure tests' jobs: only what a kill needs. A killed worker stalls the survivors (a step's
all-reduce needs every pipeline) until the generation without it, so the job cannot end during the recovery:
the steps need only outlast the moment from 10 trained steps to the kill (a few API calls; 190 steps is ~4 s at
the unloaded host's 50 steps/s). A fault that leaves every worker training (a node's GPUs marked unhealthy) or a
recovery that must see a replacement start first asks for FAULT_TRAINS_ON_STEPS."""
FAULT_TRAINS_ON_STEPS = 600
"""Steps of a job that must still train while a fault is detected with every worker up, or while a
replacement pod starts and is folded in (seconds of torch import on a loaded host)."""
MODEL = {"layers": 4, "hiddenSize": 32, "heads": 2, "sequenceLength": 16, "vocabSize": 128}
"""Smaller than the example's GPT (a quarter of its hidden size, half its sequence): the reference run
of STEPS steps takes seconds, not a minute, on a loaded host; the plan shapes stay the same."""
RECORD_INTERVAL_S = 1.0
"""How often the recorder lists the job's pods and reads its plan: every pod and plan generation of a story
lives for seconds, and each look is a LIST and a GET to the API server the other tests share."""
GLOBAL_BATCH = 4
"""Four microbatches of one sample per GPU of a node: enough for the four pipelines of f = 2 on four nodes."""


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = TIMEOUT_S, interval: float = 0.2) -> Any:
    """wait_until, printing how long it took (a failing test's output shows where its time went)."""
    began = time.monotonic()
    result = wait_until(predicate, what, timeout, interval, tolerate=(Exception,))
    print(f"waited {time.monotonic() - began:.1f} s for {what}")
    return result


def job_spec(
    node_selector: dict[str, str],
    steps: int = STEPS,
    *,
    nodes: int = 3,
    gpus_per_node: int = 1,
    f: int = 1,
    device: str = "cpu",
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The example's job with the MODEL GPT as `nodes` (min 2) x `gpus_per_node`, tolerating `f`, for
    `steps` steps of GLOBAL_BATCH samples."""
    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    spec["model"] = {"gpt": dict(MODEL)}
    # A stage over g GPUs splits each microbatch g ways (the engine refuses a microbatch it cannot split).
    spec["training"]["globalBatchSize"] = GLOBAL_BATCH * gpus_per_node
    spec["training"]["microbatchSize"] = gpus_per_node
    spec["nodes"] = {"min": 2, "max": nodes}
    spec["gpusPerNode"] = gpus_per_node  # device cpu: processes per pod, no GPU requested
    spec["device"] = device
    spec["f"] = f
    spec["training"]["steps"] = steps
    spec["training"]["gradientSumDtype"] = "float64"  # every layout matches the reference run to 1e-5
    spec["profile"] = {"source": "measure"}
    # Progress at the product's default pace (1 s: tests that read a step count from it pass their own), and
    # heartbeat verdicts lenient on a loaded host.
    variables = {"WORKER_DEAD_AFTER_S": "5", **(env or {})}
    spec["pod"] = {"nodeSelector": node_selector, "env": [{"name": k, "value": v} for k, v in variables.items()]}
    spec["pendingTimeoutSeconds"] = 600
    # Stragglers reported but not re-planned around: on a loaded host a noisy node could earn a re-split
    # generation that these tests' exact generation counts do not expect (test_stragglers.py turns it on).
    spec["stragglers"] = {"mitigation": "none"}
    # Keep the pods when the job succeeds: workers finish on their own (their last log records, e.g.
    # `exit`, are then always written), and the teardown deletes them.
    spec["cleanPodPolicy"] = "None"
    return spec


def manifest(spec: dict[str, Any]) -> str:
    return yaml.safe_dump(
        {"apiVersion": "oobleck.dev/v1alpha1", "kind": "OobleckJob", "metadata": {"name": JOB}, "spec": spec}
    )


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value}; labelled samples also as `name{k="v",...}` (sorted labels)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, sample.value)
            if sample.labels:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


REFERENCES = ReferenceCache()
"""Reference losses kept across runs (a 1500-step reference takes 20-60 s on the 2-core host; recomputing
every reference once made a full run 11 minutes longer)."""


def reference_losses(spec: dict[str, Any], through: int | None = None) -> tuple[float, ...]:
    """Per-step losses of the job trained in one process without failures: all its steps, or the first
    `through` (oobleck_dev.references). For a job that ends early only that prefix is trained, and a later run
    that checks further (a test's own timing sets `through`) trains on from the kept state: retrained from
    step 0, one outage test's longer prefix cost 377 s, over the 3-minute rule."""
    return REFERENCES.for_spec(spec, JOB, through)


def logged(path: Path) -> Iterator[dict[str, Any]]:
    """The JSON-lines records of a worker log (other lines, e.g. c10d's, are skipped)."""
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                yield json.loads(line)
            except ValueError:
                continue


def failed_exit(pod: dict[str, Any]) -> float | None:
    """When a pod's container exited non-zero (its finishedAt, in seconds), or None."""
    for container in pod.get("status", {}).get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated") or {}
        if terminated.get("exitCode") and terminated.get("finishedAt"):
            return datetime.fromisoformat(terminated["finishedAt"].replace("Z", "+00:00")).timestamp()
    return None


class JobRun:
    """One test's job: its namespace on the session cluster, the operator serving it, and reads of its state
    (the test modules reach this file's helpers through it: conftest is not importable under importlib mode).

    A daemon thread records every worker pod it sees (name -> uid) and every plan generation the
    ConfigMap holds, so that a test can check that nothing was created twice."""

    def __init__(self, cluster, agent, namespace: str, operator: OperatorProcess) -> None:
        self.cluster, self.agent, self.ns, self.operator = cluster, agent, namespace, operator
        self.spec: dict[str, Any] | None = None
        self.cordoned: set[str] = set()
        self.gpu_unhealthy: set[str] = set()
        self.pods_seen: dict[str, set[str]] = {}
        self.failed_exits_seen: dict[str, float] = {}
        """pod uid -> when its worker container exited non-zero (the kubelet's finishedAt)"""
        self.generations_seen: list[int] = []
        # Reads polled several times a second go through the cluster's kept connection (oobleck_dev.reads):
        # a kubectl process per read cost about 0.13 s of CPU, a quarter of a core per job's test.
        self._reads = cluster.reads
        self._stop = threading.Event()
        self._looking = threading.Lock()  # the recorder's thread and a check's own look
        self._thread = threading.Thread(target=self._record, name="e2e-recorder", daemon=True)

    STEPS = STEPS
    FAULT_TRAINS_ON_STEPS = FAULT_TRAINS_ON_STEPS
    wait_for = staticmethod(wait_for)

    # -- setup --

    def job_spec(self, steps: int = STEPS, **shape: Any) -> dict[str, Any]:
        """`job_spec` pinned to this module's local nodes."""
        return job_spec(self.agent.node_selector, steps, **shape)

    def apply(self, spec: dict[str, Any]) -> None:
        if self.operator.process is None:
            self.operator.start()
        self.spec = spec
        self.cluster.kubectl("apply", "-n", self.ns, "-f", "-", input=manifest(spec))
        self._thread.start()

    def _record(self) -> None:
        while not self._stop.wait(RECORD_INTERVAL_S):
            try:
                self._look()
            except Exception:
                continue

    def _look(self) -> None:
        """One look of the recorder: the job's worker pods and its plan's generation now."""
        with self._looking:
            for pod in self._worker_pods():
                self.pods_seen.setdefault(pod["metadata"]["name"], set()).add(pod["metadata"]["uid"])
            generation = self.plan().generation
            if not self.generations_seen or self.generations_seen[-1] != generation:
                self.generations_seen.append(generation)

    # -- reads --

    def _worker_pods(self) -> list[dict[str, Any]]:
        pods = self._reads.pods(self.ns, worker_selector(JOB))
        for pod in pods:
            if (finished := failed_exit(pod)) is not None:
                self.failed_exits_seen.setdefault(pod["metadata"]["uid"], finished)
        return pods

    def failed_exits(self) -> dict[str, float]:
        """pod uid -> when its worker container exited non-zero: those recorded (pods since replaced)
        and those of the pods there now (an exit may be newer than the recorder's last look)."""
        self._worker_pods()
        return dict(self.failed_exits_seen)

    def job(self) -> dict[str, Any]:
        return self._reads.custom(GROUP, VERSION, PLURAL, self.ns, JOB)

    def plan(self):
        return read_plan(self._reads.config_map(self.ns, render.plan_name(JOB)))

    def pod(self, name: str) -> dict[str, Any]:
        return self._reads.pod(self.ns, name)

    def node_of(self, pod: str) -> str:
        return self.pod(pod)["spec"]["nodeName"]

    def progress(self, pod: str) -> dict[str, Any]:
        return json.loads(self.pod(pod)["metadata"].get("annotations", {}).get(PROGRESS_ANNOTATION) or "{}")

    def step(self, pod: str) -> int:
        return self.progress(pod).get("step", 0)

    def scrape(self, pod: str, gpu: int = 0) -> dict[str, float]:
        """The worker metrics of a pod's local GPU `gpu`, from http://<pod IP>:29500+gpu/metrics, parsed."""
        ip = self.pod(pod)["status"]["podIP"]
        with urllib.request.urlopen(f"http://{ip}:{contract.WORKER_PORT + gpu}/metrics", timeout=10) as response:
            return parse_metrics(response.read().decode())

    def operator_metrics(self) -> dict[str, float]:
        return parse_metrics(self.operator.metrics())

    def succeeded(self) -> dict[str, Any]:
        body = self.job()
        if body.get("status", {}).get("phase") == "Failed":
            raise AssertionError(f"the job failed: {body['status']}")
        return body if body.get("status", {}).get("phase") == "Succeeded" else {}

    def wait_succeeded(self, stall_s: float = TIMEOUT_S) -> dict[str, Any]:
        """The job's body once Succeeded. Fails at once if it Failed, and once its step (status.progress)
        has not moved for `stall_s` seconds: a hang, not a loaded host that trains slower (a fixed deadline
        failed a 1500-step job at step 1462 under CI's load)."""
        began = time.monotonic()
        step, moved, last = None, began, None
        while True:
            try:
                body = self.job()
            except Exception as error:  # a read timeout under load: not yet
                body, last = {}, error
            status = body.get("status", {})
            if status.get("phase") == "Failed":
                raise AssertionError(f"the job failed: {status}")
            if status.get("phase") == "Succeeded":
                print(f"waited {time.monotonic() - began:.1f} s for the job to succeed")
                return body
            now = time.monotonic()
            current = status.get("progress", {}).get("step", step)
            if current != step:
                step, moved = current, now
            if now - moved > stall_s:
                raise AssertionError(
                    f"the job's step stayed {step} for {stall_s:.0f} s waiting for it to succeed; "
                    f"last: {status or last!r}"
                )
            time.sleep(0.5)

    def wait_within_steps(
        self, predicate: Callable[[], Any], what: str, pods: list[str], steps: int, cap_s: float = 360
    ) -> Any:
        """wait_for, bounded by the job's steps as well as by `cap_s`: fails once `pods` trained `steps` steps
        past where they were when the wait began without `predicate` holding, or after `cap_s` (240 s failed a
        detection on a host loaded enough that steps took 20-50 s; a 900 s cap made each failing straggler test
        cost 15 min of the suite at load ~20)."""
        since = max(self.step(p) for p in pods)

        def held_or_past() -> Any:
            if result := predicate():
                return result
            reached = max(self.step(p) for p in pods)
            return reached > since + steps and f"step {reached}, {steps} past step {since}, without {what}"

        result = self.wait_for(held_or_past, what, cap_s)
        assert not isinstance(result, str), result
        return result

    def events(self, reason: str) -> list[str]:
        """Messages of the namespace's events with `reason` (the operator's NodeLost, Reconfigured, ...)."""
        items = self._reads.events(self.ns, f"reason={reason}")
        return [item.get("message", "") for item in items]

    def logs(self) -> list[Path]:
        return sorted((self.agent.workdir / "logs").glob(f"{self.ns}_*.log"))

    def records(self) -> Iterator[dict[str, Any]]:
        for path in self.logs():
            yield from logged(path)

    # -- faults --

    def cordon(self, node: str) -> None:
        """Keep the replacement off `node` (a node under suspicion): it stays Pending, no generation folds it in."""
        self.cluster.kubectl("cordon", node)
        self.cordoned.add(node)

    def uncordon_all(self) -> None:
        """Let pods onto every node this run cordoned again (a Pending replacement is then scheduled)."""
        for node in sorted(self.cordoned):
            self.cluster.kubectl("uncordon", node)
        self.cordoned.clear()

    def cordon_spare_nodes(self) -> list[str]:
        """Cordon the local nodes that hold none of this job's workers: a replacement has nowhere to go."""
        used = {
            p["spec"].get("nodeName")
            for p in self.cluster.kubectl_json("get", "pods", "-n", self.ns, "-l", worker_selector(JOB))["items"]
        }
        spare = [node for node in self.agent.node_names if node not in used]
        for node in spare:
            self.cordon(node)
        return spare

    def mark_gpus_unhealthy(self, node: str) -> None:
        self.gpu_unhealthy.add(node)
        self.agent.set_gpu_health(node, 0)

    # -- checks --

    def reference(self, through: int | None = None) -> tuple[float, ...]:
        """This job's per-step losses without failures, all or the first `through` (reference_losses)."""
        assert self.spec is not None, "apply a job first"
        return reference_losses(self.spec, through)

    def check_losses(self, through: int | None = None) -> int:
        """Every step's loss, as every worker that knew it logged it (replays included), equals the
        no-failure reference within LOSS_RTOL; returns how many values were compared. With `through`, only
        steps before it are checked (a job still training), and each of them must have been logged."""
        reference = self.reference(through)
        seen: dict[int, list[float]] = {}
        for record in self.records():
            if (
                record.get("event") == "step"
                and record.get("loss") is not None
                and int(record["step"]) < len(reference)
            ):
                seen.setdefault(int(record["step"]), []).append(float(record["loss"]))
        assert sorted(seen) == list(range(len(reference))), (
            f"steps with a logged loss: {len(seen)} of {len(reference)}; missing {sorted(set(range(len(reference))) - set(seen))[:10]}"
        )
        for step, values in seen.items():
            expected = reference[step]
            for value in values:
                assert abs(value - expected) <= LOSS_RTOL * abs(expected), (
                    f"step {step}: loss {value} vs reference {expected}"
                )
        return sum(len(v) for v in seen.values())

    def check_losses_so_far(self, pods: list[str] | None, after: int) -> int:
        """For a job still training whose story is over (its remaining steps would only repeat this check):
        wait until `pods` (None: the current plan's nodes) all report past `after` (capped below the job's
        steps), check every loss before the lowest step they report (`check_losses(through=...)`), print how
        many; returns that step."""
        after = min(after, self.spec["training"]["steps"] - 1) if self.spec is not None else after

        def low() -> int:
            return min(self.step(p) for p in (pods if pods is not None else self.plan().nodes))

        through = self.wait_for(lambda: (step := low()) > after and step, f"{pods or 'the members'} past step {after}")
        print(f"{self.check_losses(through=through)} logged losses of steps 0-{through - 1} match the reference")
        return through

    def exits(self, workers: int) -> list[dict[str, Any]]:
        """The `exit` log records once `workers` worker processes wrote theirs (they end just after the
        final progress report, so a moment after the job turned Succeeded)."""
        return self.wait_for(
            lambda: len(e := [r for r in self.records() if r.get("event") == "exit"]) >= workers and e,
            f"{workers} workers' exit records",
            timeout=90,
        )

    def adopted_generations(self) -> dict[str, list[int]]:
        """worker -> the plan generations it adopted, in order (its `generation-ready` log records)."""
        out: dict[str, list[int]] = {}
        for record in self.records():
            if record.get("event") == "generation-ready":
                out.setdefault(record["worker"], []).append(int(record["generation"]))
        return out

    def check_generations(self, final: int) -> None:
        """Generations 0..final, each adopted by some worker, each worker's strictly increasing; the
        ConfigMap never went back or repeated."""
        adopted = self.adopted_generations()
        for worker, generations in adopted.items():
            assert generations == sorted(set(generations)), f"{worker} adopted {generations}"
        assert set().union(*adopted.values()) == set(range(final + 1)), f"adopted: {adopted}"
        self._look()  # the plan now: the recorder's last look may be a second old
        assert self.generations_seen == sorted(set(self.generations_seen)), f"configmap: {self.generations_seen}"
        assert self.generations_seen[-1:] == [final], f"configmap: {self.generations_seen}"

    def check_no_duplicate_pods(self, expected: int) -> None:
        """Exactly `expected` worker pods existed (originals + replacements), each created once."""
        self._look()
        assert all(len(uids) == 1 for uids in self.pods_seen.values()), (
            f"a pod name was created twice: {self.pods_seen}"
        )
        assert len(self.pods_seen) == expected, f"worker pods seen: {sorted(self.pods_seen)}"

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


@pytest.fixture
def job_run(cluster, local_nodes, tmp_path) -> Iterator[JobRun]:
    namespace = cluster.namespace("e2e")
    # Resync every 2 s: a missed event costs seconds, not the default 10. One job at a time: one planner process
    # (each costs 0.6 CPU-s to start; test_bounded_planning.py asks for two). Started by the job's apply, unless
    # the test started it first with settings of its own.
    operator = OperatorProcess(
        cluster.kubeconfig, [namespace], tmp_path / "operator", "--resync", "2", "--planner-workers", "1"
    )
    run = JobRun(cluster, local_nodes, namespace, operator)
    try:
        yield run
    finally:
        run.close()
        for path in run.logs():
            print(f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}")
        print(f"--- operator\n{operator.log()[-6000:]}")
        # The job's pods must be gone before the next test's job starts (they compete for the CPU).
        cluster.kubectl("delete", "oobleckjob", JOB, "-n", namespace, "--ignore-not-found", "--wait=false", check=False)
        operator.kill()
        cluster.kubectl(
            "delete", "pods", "--all", "-n", namespace, "--grace-period=0", "--wait=true", check=False, timeout=120
        )
        for node in run.cordoned:
            cluster.kubectl("uncordon", node, check=False)
        for node in run.gpu_unhealthy:
            local_nodes.set_gpu_health(node, local_nodes.gpus_per_node)


@pytest.fixture
def reference_keying() -> tuple[dict[str, Any], Path, tuple[str, ...]]:
    """For the check of the reference cache's key: a job spec of these tests, the repository, and the sources
    the key hashes (REFERENCE_SOURCES)."""
    return job_spec({}), REFERENCES.repo, REFERENCE_SOURCES


@pytest.fixture
def empty_reference_cache(tmp_path: Path) -> Callable[..., tuple[float, ...]]:
    """Reference losses over an empty cache in tmp_path, each call reading the files as a later run would (for
    the cache's own test)."""

    def read_or_train(spec: dict[str, Any], through: int | None = None) -> tuple[float, ...]:
        return ReferenceCache(tmp_path).for_spec(spec, JOB, through)

    return read_or_train
