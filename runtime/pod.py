"""A worker pod's entry point: `python -m oobleck.runtime.pod` (the operator's default worker command).

The pod runs the elastic worker (runtime/reconfig.py `run_elastic`) against the Kubernetes API,
following the contract in the docstring of oobleck.operator.render:

    env (OOBLECK_JOB, _NAMESPACE, _NODE, _PLAN_CONFIGMAP, _STORE, _GPUS_PER_NODE, _DEVICE, _POD_IP)
      -> the plan ConfigMap (ConfigMapPlanSource): plans, and job.json -> WorkerConfig (worker_config)
      -> the coordinator: its pod's status.podIP read through the API (DNS names of the headless
         Service do not resolve on local nodes), else OOBLECK_STORE's host; re-read on reconnects
      -> one elastic worker per local GPU (inline when OOBLECK_GPUS_PER_NODE is 1, else one child
         process each, `--gpu G`; the pod fails as a whole when one of them fails: a node is the
         unit of loss)
      -> reports on its own pod: FAILURE_ANNOTATION (PodFailureReporter) and PROGRESS_ANNOTATION
         (ProgressReporter: `{"generation", "step", "loss", "samplesPerSecond"}`, rate-limited, the
         final step always), from which the operator marks the job Succeeded
      -> a snapshot agent (runtime/snapshot.py `snapshotter_for`, as reconfig.py's main() sets one up):
         in-memory snapshots pushed to a buddy on another node, advertised at the pod IP, and the
         spec's checkpoint directory (under OOBLECK_CONTAINER_ROOT on local nodes).

gloo and the /metrics endpoint (port METRICS_PORT + local GPU) bind to the pod IP: on local nodes
several pods share one host. Logs are JSON lines carrying job, node, gpu, generation and step.
Before its first plan a worker writes the progress annotation `{"generation": -1, "step": 0}`: "up and
waiting", the operator's cue to fold a replacement pod in.
Exit codes: 0 the job's last step is done; 2 bad configuration; 3 dropped from the plan; 4 no plan
arrived in time; 5 some layer's state is gone from every worker, snapshot and checkpoint (reported to
the operator, which fails the job with it); 1 anything else (the message says what).

Tunables a job can set through `spec.pod.env` (OOBLECK_* names are reserved for the operator): WORKER_DEAD_AFTER_S (seconds of heartbeat silence
before a peer is declared dead, default 3: pods on a loaded host starve threads for seconds),
WORKER_HEARTBEAT_PERIOD_S (default 0.1), WORKER_METRICS_PORT (default 29500, -1: off),
WORKER_PROGRESS_INTERVAL_S (seconds between progress annotations, default 1), WORKER_DEVICE (cpu: compute on
the CPU although the spec says cuda; for local nodes whose nvidia.com/gpu is only counted, so that a job
is scheduled and health-checked as a GPU job).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from oobleck.api import planmap
from oobleck.api.job import OobleckJobSpec
from oobleck.runtime.config import CheckpointConfig, DataConfig, ModelConfig, OptimConfig, Timeouts, WorkerConfig
from oobleck.runtime.kube import KubeApiError, KubeClient, KubeConfigError, KubeError, pod_path

log = logging.getLogger("oobleck.runtime.pod")

METRICS_PORT = 29500
"""The worker container's port (operator.render.WORKER_PORT); local GPU g serves on METRICS_PORT + g."""
EXIT_DONE, EXIT_ERROR, EXIT_CONFIG, EXIT_DROPPED, EXIT_NO_PLAN, EXIT_UNRECOVERABLE = 0, 1, 2, 3, 4, 5


# -- the environment contract -------------------------------------------------------------------------


@dataclass(frozen=True)
class PodEnv:
    """What the operator tells a worker pod through its environment (see operator/render.py)."""

    job: str
    namespace: str
    node: str
    plan_config_map: str
    store_host: str
    store_port: int
    gpus_per_node: int = 1
    device: str = "cuda"
    pod_ip: str | None = None
    container_root: str | None = None
    dead_after_s: float = 3.0
    heartbeat_period_s: float = 0.1
    metrics_port: int = METRICS_PORT
    progress_interval_s: float = 1.0
    compute_device: str | None = None
    """WORKER_DEVICE: "cpu" overrides a cuda spec's compute device (see the module docstring)"""
    job_spec: str | None = None
    """OOBLECK_JOB_SPEC: the job's spec as JSON (what to profile before any plan exists)"""

    @property
    def coordinator_pod(self) -> str:
        """The coordinator pod's name: the first label of OOBLECK_STORE (`<job>-coordinator.<service>...`)."""
        return self.store_host.split(".", 1)[0]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> PodEnv:
        """Parse the environment; ValueError names the variable that is missing or malformed."""

        def need(name: str) -> str:
            value = env.get(name, "")
            if not value:
                raise ValueError(f"{name}: not set (the operator sets it on worker pods)")
            return value

        def number(name: str, default: float, kind: type = float) -> Any:
            text = env.get(name, "")
            if not text:
                return default
            try:
                return kind(text)
            except ValueError:
                raise ValueError(f"{name}: expected a {kind.__name__}, got {text!r}") from None

        store = need("OOBLECK_STORE")
        host, _, port = store.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"OOBLECK_STORE: expected HOST:PORT, got {store!r}")
        gpus = number("OOBLECK_GPUS_PER_NODE", 1, int)
        if gpus < 1:
            raise ValueError(f"OOBLECK_GPUS_PER_NODE: must be >= 1, got {gpus}")
        device = env.get("OOBLECK_DEVICE", "cuda")
        if device not in ("cuda", "cpu"):
            raise ValueError(f"OOBLECK_DEVICE: expected cuda or cpu, got {device!r}")
        compute = env.get("WORKER_DEVICE") or None
        if compute not in (None, "cpu"):
            raise ValueError(f"WORKER_DEVICE: expected cpu (or unset), got {compute!r}")
        return cls(
            job=need("OOBLECK_JOB"),
            namespace=need("OOBLECK_NAMESPACE"),
            node=need("OOBLECK_NODE"),
            plan_config_map=need("OOBLECK_PLAN_CONFIGMAP"),
            store_host=host,
            store_port=int(port),
            gpus_per_node=gpus,
            device=device,
            pod_ip=env.get("OOBLECK_POD_IP") or None,
            container_root=env.get("OOBLECK_CONTAINER_ROOT") or None,
            dead_after_s=number("WORKER_DEAD_AFTER_S", 3.0),
            heartbeat_period_s=number("WORKER_HEARTBEAT_PERIOD_S", 0.1),
            metrics_port=number("WORKER_METRICS_PORT", METRICS_PORT, int),
            progress_interval_s=number("WORKER_PROGRESS_INTERVAL_S", 1.0),
            compute_device=compute,
            job_spec=env.get("OOBLECK_JOB_SPEC") or None,
        )


def worker_config(
    spec: OobleckJobSpec,
    job: str,
    *,
    container_root: str | None = None,
    connect_timeout_s: float = 120.0,
    compute_device: str | None = None,
) -> WorkerConfig:
    """The runtime's WorkerConfig for a job spec: model, training, data, seed, device, timeouts, checkpoints.

    `container_root`: where the pod's filesystem starts on local nodes (OOBLECK_CONTAINER_ROOT;
    volumes are mounted below it), prefixed to the token file's and the checkpoint directory's paths.
    `compute_device` "cpu" (WORKER_DEVICE) runs a cuda spec on the CPU. Raises ValueError naming the
    spec field the runtime cannot honour."""

    def in_container(path: str) -> str:
        return (container_root.rstrip("/") + path) if container_root else path

    gpt = spec.model.gpt
    if gpt is not None:
        if gpt.ffn_hidden_size is not None and gpt.ffn_hidden_size != 4 * gpt.hidden_size:
            raise ValueError(
                f"spec.model.gpt.ffnHiddenSize: the built-in GPT's MLP is 4 * hiddenSize = {4 * gpt.hidden_size}, "
                f"got {gpt.ffn_hidden_size}"
            )
        model = ModelConfig(
            name="gpt",
            sizes={
                "blocks": gpt.layers,
                "hidden": gpt.hidden_size,
                "heads": gpt.heads,
                "seq_len": gpt.sequence_length,
                "vocab": gpt.vocab_size,
            },
        )
    else:
        model = ModelConfig(name=str(spec.model.entry_point))
    training = spec.training
    optim = OptimConfig(
        lr=training.learning_rate,
        warmup_steps=training.warmup_steps,
        weight_decay=training.weight_decay,
        # The spec's schedule decays to 10 % of the learning rate at the last step.
        decay_steps=training.steps,
        min_lr_ratio=0.1,
        schedule=training.schedule,
    )
    if spec.data.source == "tokenFile":
        path = str(spec.data.path)
        data = DataConfig(kind="file", path=in_container(path))
    else:
        data = DataConfig(kind="synthetic")
    checkpoint = CheckpointConfig()
    if spec.checkpoint is not None:
        checkpoint = CheckpointConfig(
            path=in_container(spec.checkpoint.path),
            interval_steps=spec.checkpoint.interval_steps,
            keep=spec.checkpoint.keep,
        )
    device = "cpu" if compute_device == "cpu" else spec.device
    return WorkerConfig(
        job=job,
        model=model,
        data=data,
        optim=optim,
        microbatch_size=training.microbatch_size,
        steps=training.steps,
        seed=training.seed,
        precision=training.precision,
        recompute=training.recompute,
        max_grad_norm=training.max_grad_norm,
        gradient_sum_dtype=training.gradient_sum_dtype,
        device=device,
        threads=1,
        timeouts=Timeouts(connect=connect_timeout_s),
        checkpoint=checkpoint,
    )


# -- reporters: annotations on the worker's own pod -----------------------------------------------------


def node_of(worker: str) -> str:
    """The plan node id of a worker id `node:gpu` (coordinator.worker_id)."""
    return worker.rsplit(":", 1)[0] if ":" in worker else worker


def failure_annotation(report) -> str:
    """FAILURE_ANNOTATION's value for a health.FailureReport: `dead` as plan node ids (the operator's unit)."""
    body = report.to_dict()
    body["dead"] = list(dict.fromkeys(node_of(d) for d in report.dead))
    return json.dumps(body, sort_keys=True)


def _annotate(client: KubeClient, namespace: str, pod: str, annotations: dict[str, str], attempts: int = 3) -> None:
    """Merge `annotations` into the pod's; retries transport errors, not refusals (403 stays 403)."""
    for attempt in range(attempts):
        try:
            client.merge_patch(pod_path(namespace, pod), {"metadata": {"annotations": annotations}})
            return
        except KubeApiError as error:
            if error.status < 500 and error.status != 429:
                raise
            if attempt == attempts - 1:
                raise
        except KubeError:
            if attempt == attempts - 1:
                raise
        time.sleep(0.2 * (attempt + 1))


class PodFailureReporter:
    """health.FailureReporter for a pod: writes FAILURE_ANNOTATION on the worker's own pod."""

    def __init__(self, client: KubeClient, namespace: str, pod: str) -> None:
        self.client, self.namespace, self.pod = client, namespace, pod

    def report(self, report) -> None:
        _annotate(self.client, self.namespace, self.pod, {planmap.FAILURE_ANNOTATION: failure_annotation(report)})


def progress_annotation(
    generation: int, step: int, loss: float | None = None, samples_per_second: float | None = None
) -> str:
    """PROGRESS_ANNOTATION's value: `{"generation", "step"}` and, when known, `"loss"` (the global mean
    loss of the newest step whose loss this worker saw) and `"samplesPerSecond"` (global throughput of
    the last step), rounded to what a status line needs."""
    body: dict[str, Any] = {"generation": generation, "step": step}
    if loss is not None and math.isfinite(loss):
        body["loss"] = float(f"{loss:.6g}")
    if samples_per_second is not None and math.isfinite(samples_per_second):
        body["samplesPerSecond"] = round(samples_per_second, 3)
    return json.dumps(body)


class ProgressReporter:
    """PROGRESS_ANNOTATION (`progress_annotation`) on the worker's own pod.

    `update` never blocks the training loop: a daemon thread writes the newest value at most every
    `min_interval_s` (a step of a tiny model takes milliseconds; the API server must not see one
    patch per step). `flush` writes the newest value now and waits for it: the final step is always
    reported, since the operator marks the job Succeeded from it. Values are ordered by (step,
    generation): an older one never overwrites a newer one; loss and throughput ride along."""

    def __init__(self, client: KubeClient, namespace: str, pod: str, min_interval_s: float = 1.0) -> None:
        self.client, self.namespace, self.pod = client, namespace, pod
        self.min_interval_s = min_interval_s
        self._cond = threading.Condition()
        self._write_lock = threading.Lock()
        self._latest: tuple[int, int] | None = None
        self._extra: tuple[float | None, float | None] = (None, None)
        self._written: tuple[int, int] | None = None
        self._last_write = 0.0
        self._stop = False
        self.writes = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="oobleck-progress", daemon=True)
        self._thread.start()

    def update(
        self, generation: int, step: int, loss: float | None = None, samples_per_second: float | None = None
    ) -> None:
        """The newest progress; a None loss or throughput keeps the last known one."""
        with self._cond:
            self._latest = (generation, step)
            last_loss, last_rate = self._extra
            self._extra = (
                last_loss if loss is None else loss,
                last_rate if samples_per_second is None else samples_per_second,
            )
            self._cond.notify_all()

    def _write_if_newer(self, value: tuple[int, int], extra: tuple[float | None, float | None]) -> None:
        """Write `value` (with its loss and throughput, taken with it: they describe the same step) unless
        a later step is already on the pod (the thread and flush never undo each other)."""
        loss, rate = extra
        with self._write_lock:
            with self._cond:
                written = self._written
            if written is not None and (value[1], value[0]) <= (written[1], written[0]):
                return
            text = progress_annotation(value[0], value[1], loss, rate)
            _annotate(self.client, self.namespace, self.pod, {planmap.PROGRESS_ANNOTATION: text})
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
            try:
                self._write_if_newer(value, extra)
            except (KubeError, OSError) as error:  # best effort: the next step's update tries again
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
            except (KubeError, OSError) as error:
                self.error = error
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.5)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=5)


# -- the coordinator's address ------------------------------------------------------------------------


def coordinator_ip(pod: Mapping[str, Any] | None) -> str | None:
    """The pod IP of a Running, not terminating coordinator pod, else None."""
    if not pod or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None
    status = pod.get("status") or {}
    return status.get("podIP") or None if status.get("phase") == "Running" else None


class CoordinatorAddress:
    """Where the coordinator's store listens: its pod's IP (read through the API, waiting until the
    pod runs), else the host of OOBLECK_STORE (the headless Service's DNS name, which resolves on a
    real cluster). `resolve` is called again on every reconnect: a recreated coordinator pod may
    have a new IP."""

    def __init__(
        self, client: KubeClient | None, namespace: str, pod: str, fallback_host: str, port: int, poll_s: float = 0.25
    ) -> None:
        self.client, self.namespace, self.pod = client, namespace, pod
        self.fallback = (fallback_host, port)
        self.port, self.poll_s = port, poll_s
        self.last: tuple[str, int] = self.fallback

    def resolve(self, wait_s: float) -> tuple[str, int]:
        deadline = time.monotonic() + wait_s
        while self.client is not None:
            try:
                ip = coordinator_ip(self.client.get(pod_path(self.namespace, self.pod)))
                if ip is not None:
                    self.last = (ip, self.port)
                    return self.last
            except KubeApiError as error:
                if error.status in (401, 403):
                    log.warning(json.dumps({"event": "coordinator-lookup-forbidden", "error": str(error)[:300]}))
                    break  # no permission: the DNS name is all there is
                if error.status != 404:
                    log.warning(json.dumps({"event": "coordinator-lookup-failed", "error": str(error)[:300]}))
            except KubeError as error:
                log.warning(json.dumps({"event": "coordinator-lookup-failed", "error": str(error)[:300]}))
            if time.monotonic() >= deadline:
                break
            time.sleep(self.poll_s)
        self.last = self.fallback
        return self.last


def connect_resolving(address: CoordinatorAddress, timeouts):
    """coordinator.connect, resolving the address again between short attempts; (store, epoch)."""
    from oobleck.runtime.coordinator import StoreUnavailable, connect

    deadline = time.monotonic() + timeouts.reconnect_s
    attempt = replace(timeouts, reconnect_s=min(5.0, timeouts.reconnect_s))
    while True:
        host, port = address.resolve(max(0.0, deadline - time.monotonic()))
        try:
            return connect(host, port, attempt)
        except StoreUnavailable:
            if time.monotonic() >= deadline:
                raise


def _elastic_classes():
    """ControlStore / FailureDetector / Worker subclasses that resolve the coordinator and report progress
    (built on first use: importing torch takes seconds, and `--help` or env errors need none of it)."""
    from oobleck.runtime.coordinator import StoreUnavailable
    from oobleck.runtime.health import FailureDetector
    from oobleck.runtime.reconfig import ControlStore
    from oobleck.runtime.worker import Worker

    class PodControlStore(ControlStore):
        def __init__(self, address: CoordinatorAddress, timeouts) -> None:
            self.timeouts, self.resolver = timeouts, address
            self.store, self.epoch = connect_resolving(address, timeouts)
            self.address = address.last

        def reconnect(self) -> None:
            self.store, self.epoch = connect_resolving(self.resolver, self.timeouts)
            self.address = self.resolver.last

    class PodFailureDetector(FailureDetector):
        def __init__(self, job: str, worker: str, address: CoordinatorAddress, *, store_timeouts, **kwargs) -> None:
            host, port = address.last
            # One connect attempt is short; _connect resolves again between attempts until the full time.
            super().__init__(job, worker, host, port, store_timeouts=replace(store_timeouts, reconnect_s=5.0), **kwargs)
            self.resolver, self._overall_s = address, store_timeouts.reconnect_s

        def _connect(self):
            deadline = time.monotonic() + self._overall_s
            while True:
                self._address = self.resolver.resolve(max(0.0, deadline - time.monotonic()))
                try:
                    return super()._connect()
                except StoreUnavailable:
                    if time.monotonic() >= deadline:
                        raise

    class PodWorker(Worker):
        progress: ProgressReporter | None = None

        def abandon(self) -> None:
            # run_elastic abandons a generation right after it broke: recovery_seconds runs from here
            # to the first step completed in the next one.
            if self.engine is not None and self.failure_time is None:
                self.failure_time = time.monotonic()
            super().abandon()

        def train_step(self):
            outcome = super().train_step()
            if self.progress is not None and self.plan is not None:
                rate = outcome.samples / outcome.seconds if outcome.seconds > 0 else None
                self.progress.update(self.plan.generation, self.step, outcome.loss, rate)
            return outcome

    return PodControlStore, PodFailureDetector, PodWorker


# -- running ------------------------------------------------------------------------------------------


def _log(event: str, env: PodEnv, **fields) -> None:
    log.info(json.dumps({"event": event, "job": env.job, "node": env.node, **fields}))


class PodFailure(RuntimeError):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def measure_profile(env: PodEnv, client: KubeClient, source) -> bool:
    """For a `profile: measure` job without a plan yet: profile the model on this pod's device and put
    the result on the pod (MEASURED_PROFILE_ANNOTATION), which the operator plans generation 0 with.
    Returns whether it measured."""
    import torch

    from oobleck.api.job import parse_spec
    from oobleck.runtime.config import build_model
    from oobleck.runtime.profiler import profile_model
    from oobleck.runtime.worker import choose_device

    if env.job_spec is None or source.current() is not None:
        return False
    try:
        spec = parse_spec(json.loads(env.job_spec))
        config = worker_config(spec, env.job, container_root=env.container_root, compute_device=env.compute_device)
    except ValueError as error:
        raise PodFailure(EXIT_CONFIG, f"OOBLECK_JOB_SPEC: {error}") from error
    if spec.profile.source != "measure":
        return False
    torch.set_num_threads(config.threads)
    began = time.monotonic()
    device = choose_device(config, 0)
    profile = profile_model(
        build_model(config), config.microbatch_size, device, 1, 3, config.precision, config.recompute
    )
    _annotate(client, env.namespace, env.node, {planmap.MEASURED_PROFILE_ANNOTATION: profile.model_dump_json()})
    _log("profiled", env, layers=len(profile.layers), seconds=round(time.monotonic() - began, 3))
    return True


def first_config_map(source, env: PodEnv, timeout_s: float) -> dict[str, Any]:
    """The plan ConfigMap once it holds a plan (the operator writes it when enough pods run)."""
    if source.wait_newer(-1, timeout_s) is None:
        detail = f" (last API error: {source.last_error})" if source.last_error else ""
        raise PodFailure(
            EXIT_NO_PLAN, f"configmap {env.namespace}/{env.plan_config_map}: no plan after {timeout_s:.0f} s{detail}"
        )
    body = source.config_map()
    assert body is not None
    return body


def run_worker(env: PodEnv, gpu: int, client: KubeClient | None = None, first_plan_s: float = 600.0) -> int:
    """One elastic worker process (local GPU `gpu`) of this pod, to the job's last step; the exit code."""
    import torch.distributed as dist

    from oobleck.api.job import parse_spec
    from oobleck.runtime import coordinator as keys
    from oobleck.runtime import groups
    from oobleck.runtime.coordinator import StoreTimeouts, worker_id
    from oobleck.runtime.health import HealthTimeouts
    from oobleck.runtime.plansource import ConfigMapPlanSource
    from oobleck.runtime.reconfig import CommittingOptimizer, ElasticTimeouts, StepCommit, run_elastic
    from oobleck.runtime.resolve import Unrecoverable
    from oobleck.runtime.snapshot import snapshotter_for

    PodControlStore, PodFailureDetector, PodWorker = _elastic_classes()
    groups.bind_to(env.pod_ip)
    client = client or KubeClient.in_cluster()
    source = ConfigMapPlanSource(client, env.namespace, env.plan_config_map).start()
    if gpu == 0:
        measure_profile(env, client, source)
    body = first_config_map(source, env, first_plan_s)
    try:
        spec = parse_spec(planmap.read_job_spec(body))
        config = worker_config(spec, env.job, container_root=env.container_root, compute_device=env.compute_device)
        health = HealthTimeouts(heartbeat_period_s=env.heartbeat_period_s, dead_after_s=env.dead_after_s)
    except ValueError as error:  # pydantic's ValidationError is a ValueError
        raise PodFailure(EXIT_CONFIG, f"configmap {env.plan_config_map}: {error}") from error
    me = worker_id(env.node, gpu)
    _log("config", env, gpu=gpu, steps=config.steps, model=config.model.model_dump(), device=config.device)
    store_timeouts = StoreTimeouts()
    address = CoordinatorAddress(client, env.namespace, env.coordinator_pod, env.store_host, env.store_port)
    control = PodControlStore(address, store_timeouts)
    _log("coordinator", env, gpu=gpu, address=f"{control.address[0]}:{control.address[1]}", epoch=control.epoch)
    reporter = PodFailureReporter(client, env.namespace, env.node)
    detector = PodFailureDetector(
        config.job, me, address, store_timeouts=store_timeouts, reporter=reporter, timeouts=health
    ).start()
    progress = ProgressReporter(client, env.namespace, env.node, env.progress_interval_s) if gpu == 0 else None
    try:
        worker = PodWorker(
            config,
            dist.PrefixStore(keys.epoch_prefix(control.epoch), control.store),
            env.node,
            gpu,
            failed=detector.failure,
        )
        worker.progress = progress
        worker._epoch = control.epoch
        worker.optimizer = CommittingOptimizer(
            worker.optimizer, worker, StepCommit(control, detector.failure, worker=me)
        )
        # As reconfig.py's main(): the agent has its own store connection (resolved like the others),
        # and advertises the pod IP (local_address reads OOBLECK_POD_IP, else the route to the coordinator).
        worker.snapshots = snapshotter_for(
            config, me, lambda: connect_resolving(address, store_timeouts)[0], control.address[0]
        )
        if worker.snapshots is not None:
            _log(
                "snapshots",
                env,
                gpu=gpu,
                address=worker.snapshots.address,
                interval=config.snapshot.interval_steps,
                checkpoint=config.checkpoint.path,
            )
        if env.metrics_port >= 0:
            port = worker.metrics.serve(
                env.metrics_port + gpu if env.metrics_port else 0, address=env.pod_ip or "0.0.0.0"
            )
            _log("metrics", env, gpu=gpu, url=f"http://{env.pod_ip or '0.0.0.0'}:{port}/metrics")
        if progress is not None:
            # "Up and waiting for a plan": the operator folds a replacement in only after this, so the
            # survivors never wait for a newcomer that is still importing torch (operator/decide.py).
            progress.update(-1, 0)
            progress.flush(10.0)
        try:
            result = run_elastic(
                worker, source, detector, control, config.steps, ElasticTimeouts(first_plan_s=first_plan_s)
            )
        except Unrecoverable as error:
            # The operator fails the job with these words (FailureReport kind "unrecoverable").
            detector.trigger("unrecoverable", (), str(error))
            raise PodFailure(EXIT_UNRECOVERABLE, f"{me}: {error}") from error
        if result.exit_code == EXIT_DONE and progress is not None:
            progress.update(worker.plan.generation if worker.plan else -1, worker.step)
            if not progress.flush():
                raise PodFailure(EXIT_ERROR, f"the final step {worker.step} could not be reported: {progress.error}")
        if result.exit_code == EXIT_DONE and worker.snapshots is not None:
            # After the final report (completion must not wait on the agent): the last checkpoint files.
            # A push to a buddy that finished already fails at once.
            worker.snapshots.wait_idle(30.0)
        _log(
            "exit",
            env,
            gpu=gpu,
            steps=result.steps,
            generations=result.generations,
            interruptions=result.interruptions,
            code=result.exit_code,
            snapshots=worker.snapshots.stats if worker.snapshots is not None else None,
        )
        if result.exit_code == EXIT_DROPPED:
            raise PodFailure(EXIT_DROPPED, f"{me}: a newer plan left this worker out (declared dead or scaled in)")
        if result.exit_code == EXIT_NO_PLAN:
            raise PodFailure(EXIT_NO_PLAN, f"{me}: no next plan arrived after generation {result.generations[-1:]}")
        return result.exit_code
    finally:
        if progress is not None:
            progress.stop()
        detector.stop()
        source.stop()


def supervise(env: PodEnv, argv0: list[str]) -> int:
    """One child process per local GPU; the first to fail takes the others down (the pod is the unit of loss)."""
    children = [
        subprocess.Popen([*argv0, "--gpu", str(gpu)], env={**os.environ, "OOBLECK_GPU": str(gpu)})
        for gpu in range(env.gpus_per_node)
    ]

    def forward(signum, _frame) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    pending = set(range(len(children)))
    try:
        while pending:
            for index in sorted(pending):
                status = children[index].poll()
                if status is None:
                    continue
                pending.discard(index)
                if status != 0 and code == 0:
                    code = status if status > 0 else 128 - status
                    _log("gpu-worker-failed", env, gpu=index, code=code)
                    for other in pending:
                        children[other].terminate()
            time.sleep(0.1)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m oobleck.runtime.pod",
        description="the elastic training worker of an OobleckJob pod (configured by the operator's environment)",
    )
    parser.add_argument("--gpu", type=int, default=None, help="run only this local GPU's worker (the pod's children)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    # c10d warns on every timed-out slice of the health threads' blocking waits (several lines a
    # second); errors still show. Set before torch is imported.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        env = PodEnv.from_env(os.environ)
    except ValueError as error:
        print(f"oobleck pod: {error}", file=sys.stderr)
        return EXIT_CONFIG
    if args.gpu is None and env.gpus_per_node > 1:
        return supervise(env, [sys.executable, "-m", "oobleck.runtime.pod"])
    gpu = args.gpu or 0
    try:
        return run_worker(env, gpu)
    except PodFailure as error:
        print(f"oobleck pod {env.node} gpu {gpu}: {error}", file=sys.stderr)
        return error.code
    except KubeConfigError as error:
        print(f"oobleck pod {env.node} gpu {gpu}: {error}", file=sys.stderr)
        return EXIT_CONFIG
    except KubeError as error:
        print(f"oobleck pod {env.node} gpu {gpu}: Kubernetes API: {error}", file=sys.stderr)
        return EXIT_ERROR
    except Exception:
        log.exception(json.dumps({"event": "crashed", "job": env.job, "node": env.node, "gpu": gpu}))
        return EXIT_ERROR


if __name__ == "__main__":
    code = main()
    # As in reconfig.py: abandoned generations may leave gloo threads blocked on dead peers; a normal
    # interpreter teardown would abort on them. Everything owed is written: leave without destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
