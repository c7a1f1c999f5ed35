"""A worker pod's entry point: `python -m oobleck.runtime.backends.pod` (the operator's default worker command).

The pod runs the elastic worker (runtime/elastic/loop.py `run_elastic`) against the Kubernetes API,
following the operator <-> pod contract, oobleck.api.contract:

    env (PodContract: OOBLECK_JOB, _NAMESPACE, _NODE, _PLAN_CONFIGMAP, _STORE, _GPUS_PER_NODE, _DEVICE, ...)
      -> the plan ConfigMap (ConfigMapPlanSource): plans, and job.json -> WorkerConfig (config_from_spec)
      -> the coordinator: its pod's status.podIP read through the API (DNS names of the headless
         Service do not resolve on local nodes), else OOBLECK_STORE's host; re-read on reconnects
      -> one elastic worker per local GPU (inline when OOBLECK_GPUS_PER_NODE is 1, else one forked
         child process each, runtime/backends/pod/supervise.py; the pod fails as a whole when one of
         them fails: a node is the unit of loss)
      -> reports on its own pod: FAILURE_ANNOTATION (PodFailureReporter) and PROGRESS_ANNOTATION
         (ProgressReporter: `{"generation", "step", "loss", "samplesPerSecond"}`, rate-limited, the
         final step always), from which the operator marks the job Succeeded
      -> a snapshot agent (runtime/snapshot/agent.py `snapshotter_for`, as reconfig.py's main() sets one up):
         in-memory snapshots pushed to a buddy on another node, advertised at the pod IP, and the
         spec's checkpoint directory.

gloo and the /metrics endpoint (port WORKER_PORT + local GPU) bind to the pod IP: on local nodes
several pods share one host. Logs are JSON lines carrying job, node, gpu, generation and step.
Before its first plan a worker writes the progress annotation `{"generation": -1, "step": 0}`: "up and
waiting", the operator's cue to fold a replacement pod in, or to count it as a warm spare (spec.nodes.spares),
which waits, in no plan, until a loss or a scale-up folds it in or the operator deletes it.
Exit codes: oobleck.api.contract.ExitCode (an unrecoverable loss is also reported to the operator,
which fails the job with it).
A failure caused by the job itself (runtime/causes.py: model import, data, config, memory, non-finite
loss, CUDA) is put on the pod as CAUSE_ANNOTATION first and exits with oobleck.api.causes.EXIT_CODES (10-15).

Tunables a job can set through `spec.pod.env` (OOBLECK_* names are reserved for the operator; parsed
with the contract by runtime/backends/pod/config.py PodEnv): WORKER_DEAD_AFTER_S (seconds of heartbeat silence
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
import os
import sys
import time
from typing import Any

from oobleck.api import planmap
from oobleck.api.addresses import host_port, worker_id
from oobleck.api.causes import CAUSE_ANNOTATION, make_cause
from oobleck.api.contract import MEASURED_PROFILE_ANNOTATION, ExitCode
from oobleck.runtime.backends.pod.config import PodEnv, config_from_spec
from oobleck.runtime.backends.pod.coordinator_link import CoordinatorAddress
from oobleck.runtime.backends.pod.kube import TRANSPORT_ERRORS, ApiException, Kube, KubeConfigError, api_error_text
from oobleck.runtime.backends.pod.report import PodFailureReporter, ProgressReporter, annotate
from oobleck.runtime.backends.pod.supervise import supervise
from oobleck.runtime.causes import JobFault, blame, classify, model_field

__all__ = ["PodEnv", "config_from_spec", "main", "run_worker"]

PLAN_READ_WAIT_S = 10.0
"""How long a starting pod waits for the plan ConfigMap's first read before deciding to measure the profile."""
JOIN_WAIT_S = 30 * 24 * 3600.0
"""How long a pod's runtime waits to be in a plan once a plan exists: unbounded in practice (a month,
within the lock timeouts the plan source waits with)."""

log = logging.getLogger("oobleck.runtime.backends.pod.main")


def _log(event: str, env: PodEnv, **fields) -> None:
    log.info(json.dumps({"event": event, "job": env.job, "node": env.node, **fields}))


def _report_final(progress: ProgressReporter, worker) -> None:
    """The last step on the pod, which the operator marks the job Succeeded by: it must arrive."""
    progress.update(
        worker.plan.generation if worker.plan else -1,
        worker.step,
        checkpoint_step=worker.checkpoint_step,
        checkpoint_error=worker.checkpoint_error,
    )
    if not progress.flush():
        raise PodFailure(ExitCode.ERROR, f"the final step {worker.step} could not be reported: {progress.error}")


class PodFailure(RuntimeError):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def job_spec_config(env: PodEnv):
    """The job's spec (OOBLECK_JOB_SPEC) and this worker's config from it; an unusable one is InvalidConfig
    (the message carries the validation error, which names the field)."""
    from oobleck.api.spec import parse_spec

    try:
        spec = parse_spec(json.loads(env.job_spec or "null"))
        config = config_from_spec(spec, env.job, compute_device=env.compute_device)
    except ValueError as error:
        raise JobFault(make_cause("InvalidConfig", f"OOBLECK_JOB_SPEC: {error}")) from error
    return spec, config


def measure_profile(env: PodEnv, kube: Kube, source) -> bool:
    """For a `profile: measure` job without a plan yet: profile the model on this pod's device and put
    the result on the pod (MEASURED_PROFILE_ANNOTATION), which the operator plans generation 0 with.
    Returns whether it measured."""
    import torch

    from oobleck.runtime.elastic.worker import choose_device
    from oobleck.runtime.train.config import build_model
    from oobleck.runtime.train.profiler import profile_model

    # A replacement or a spare joins a job that has a plan: it must not spend seconds measuring (6.7 s at
    # load 9 on 2 cores) because the watch had not delivered the ConfigMap yet.
    source.wait_read(PLAN_READ_WAIT_S)
    if env.job_spec is None or source.current() is not None:
        return False
    spec, config = job_spec_config(env)
    if spec.profile.source != "measure":
        return False
    torch.set_num_threads(config.threads)
    began = time.monotonic()
    with blame("ModelLoadFailed", field=model_field(config)):
        model = build_model(config)
        with torch.device("meta"):
            model.build_layer(model.num_layers - 1)  # an entry point's errors, before measuring
    device = choose_device(config, 0)  # no CUDA on a cuda job: CudaError naming spec.device
    # Running out of memory names the memory (runtime/causes.py); anything else while measuring is the model's.
    with blame("ModelLoadFailed", field=model_field(config)):
        profile = profile_model(model, config.microbatch_size, device, 1, 3, config.precision, config.recompute)
    annotate(kube, env.namespace, env.node, {MEASURED_PROFILE_ANNOTATION: profile.model_dump_json()})
    _log("profiled", env, layers=len(profile.layers), seconds=round(time.monotonic() - began, 3))
    return True


def first_config_map(source, env: PodEnv, timeout_s: float) -> dict[str, Any]:
    """The plan ConfigMap once it holds a plan (the operator writes it when enough pods run)."""
    if source.wait_newer(-1, timeout_s) is None:
        detail = f" (last API error: {source.last_error})" if source.last_error else ""
        raise PodFailure(
            ExitCode.NO_PLAN,
            f"configmap {env.namespace}/{env.plan_config_map}: no plan after {timeout_s:.0f} s{detail}",
        )
    body = source.config_map()
    assert body is not None
    return body


def _announce(env: PodEnv, gpu: int, worker, config, progress: ProgressReporter | None) -> None:
    """Log the snapshot agent, serve /metrics, and tell the operator this worker is up and waiting."""
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
        host, wanted = env.pod_ip or "0.0.0.0", env.metrics_port + gpu if env.metrics_port else 0
        try:
            port = worker.metrics.serve(wanted, address=host)
        except OSError as error:
            # Its own words: main() would otherwise name an OSError a Kubernetes API transport error.
            raise PodFailure(
                ExitCode.ERROR,
                f"{worker_id(env.node, gpu)}: cannot serve /metrics on {host}:{wanted} ({error.strerror or error}); "
                "WORKER_METRICS_PORT picks the port (0: any free one, -1: off)",
            ) from error
        _log("metrics", env, gpu=gpu, url=f"http://{host}:{port}/metrics")
    if progress is not None:
        # "Up and waiting for a plan": the operator folds a replacement in only after this, so the
        # survivors never wait for a newcomer that is still importing torch (operator/decide.py).
        progress.update(-1, 0)
        progress.flush(10.0)


def run_worker(env: PodEnv, gpu: int, kube: Kube | None = None, first_plan_s: float = 600.0) -> int:
    """One elastic worker process (local GPU `gpu`) of this pod, to the job's last step; the exit code."""
    from oobleck.api.reports import FailureKind
    from oobleck.api.spec import parse_spec
    from oobleck.runtime.backends.base import build_worker, finish
    from oobleck.runtime.backends.pod.plan_configmap import ConfigMapPlanSource
    from oobleck.runtime.backends.pod.pod_worker import PodWorker
    from oobleck.runtime.backends.pod.siblings import PodSiblings
    from oobleck.runtime.elastic.health import FailureDetector, HealthTimeouts
    from oobleck.runtime.elastic.loop import ElasticTimeouts, run_elastic
    from oobleck.runtime.elastic.sources import Unrecoverable
    from oobleck.runtime.elastic.store import StoreTimeouts
    from oobleck.runtime.train import groups

    groups.bind_to(env.pod_ip)
    kube = kube or Kube.in_cluster()
    source = ConfigMapPlanSource(kube, env.namespace, env.plan_config_map).start()
    if gpu == 0:
        measure_profile(env, kube, source)
    body = first_config_map(source, env, first_plan_s)
    try:
        spec = parse_spec(planmap.read_job_spec(body))
        config = config_from_spec(spec, env.job, compute_device=env.compute_device)
        health = HealthTimeouts(heartbeat_period_s=env.heartbeat_period_s, dead_after_s=env.dead_after_s)
    except ValueError as error:  # pydantic's ValidationError is a ValueError
        raise JobFault(make_cause("InvalidConfig", f"configmap {env.plan_config_map}: {error}")) from error
    me = worker_id(env.node, gpu)
    _log("config", env, gpu=gpu, steps=config.steps, model=config.model.model_dump(), device=config.device)
    store_timeouts = StoreTimeouts()
    address = CoordinatorAddress(kube, env.namespace, env.coordinator_pod, env.store_host, env.store_port)
    reporter = PodFailureReporter(kube, env.namespace, env.node)
    detector = FailureDetector(
        config.job, me, address, store_timeouts=store_timeouts, reporter=reporter, timeouts=health
    ).start()
    progress = ProgressReporter(kube, env.namespace, env.node, env.progress_interval_s) if gpu == 0 else None
    try:
        reporting = {"progress": progress, "siblings": PodSiblings.from_env(os.environ, gpu, env.gpus_per_node)}
        built = build_worker(config, env.node, gpu, address, detector, store_timeouts, PodWorker, **reporting)
        worker, control = built.worker, built.control
        _log("coordinator", env, gpu=gpu, address=host_port(*control.address), epoch=control.epoch)
        _announce(env, gpu, worker, config, progress)
        try:
            # Once a plan exists a pod waits to be in one as long as the operator keeps it: a warm spare
            # (spec.nodes.spares) may wait for hours, and the operator deletes the pods it no longer wants.
            result = run_elastic(
                worker, source, detector, control, config.steps, ElasticTimeouts(first_plan_s=JOIN_WAIT_S)
            )
        except Unrecoverable as error:
            # The operator fails the job with these words (FailureReport kind "unrecoverable").
            detector.trigger(FailureKind.UNRECOVERABLE, (), str(error))
            raise PodFailure(ExitCode.UNRECOVERABLE, f"{me}: {error}") from error
        finish(worker, result, report_final=None if progress is None else lambda: _report_final(progress, worker))
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
        if result.exit_code == ExitCode.DROPPED:
            raise PodFailure(ExitCode.DROPPED, f"{me}: a newer plan left this worker out (declared dead or scaled in)")
        if result.exit_code == ExitCode.NO_PLAN:
            raise PodFailure(ExitCode.NO_PLAN, f"{me}: no next plan arrived after generation {result.generations[-1:]}")
        return result.exit_code
    finally:
        if progress is not None:
            progress.stop()
        detector.stop()
        source.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m oobleck.runtime.backends.pod",
        description="the elastic training worker of an OobleckJob pod (configured by the operator's environment)",
    )
    parser.add_argument("--gpu", type=int, default=None, help="run only this local GPU's worker")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    # c10d warns on every timed-out slice of the health threads' blocking waits (several lines a
    # second); errors still show. Set before torch is imported.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        env = PodEnv.from_env(os.environ)
    except ValueError as error:
        print(f"oobleck pod: {error}", file=sys.stderr)
        return ExitCode.CONFIG
    if args.gpu is None and env.gpus_per_node > 1:
        return supervise(env, lambda gpu: run_gpu(env, gpu))
    return run_gpu(env, args.gpu or 0)


def run_gpu(env: PodEnv, gpu: int) -> int:
    """Local GPU `gpu`'s worker, its failures mapped to the exit code (and cause) the operator reads."""
    try:
        use_job_key(env)
    except ValueError as error:
        print(f"oobleck pod {env.node} gpu {gpu}: {error}", file=sys.stderr)
        return ExitCode.CONFIG
    try:
        return run_worker(env, gpu)
    except PodFailure as error:
        print(f"oobleck pod {env.node} gpu {gpu}: {error}", file=sys.stderr)
        return error.code
    except Exception as error:
        cause = classify(error)
        if cause is not None:
            return report_cause(env, gpu, cause)
        if isinstance(error, KubeConfigError):
            print(f"oobleck pod {env.node} gpu {gpu}: {error}", file=sys.stderr)
            return ExitCode.CONFIG
        if isinstance(error, ApiException):
            print(f"oobleck pod {env.node} gpu {gpu}: Kubernetes API: {api_error_text(error)}", file=sys.stderr)
            return ExitCode.ERROR
        if isinstance(error, TRANSPORT_ERRORS):
            print(f"oobleck pod {env.node} gpu {gpu}: Kubernetes API: {error}", file=sys.stderr)
            return ExitCode.ERROR
        log.exception(json.dumps({"event": "crashed", "job": env.job, "node": env.node, "gpu": gpu}))
        return ExitCode.ERROR


def use_job_key(env: PodEnv) -> None:
    """Point this process's signer (oobleck.runtime.elastic.signing.job_signer) at the job key's file and
    read it now: a missing or unreadable key is a configuration
    error (the operator mounts the job's key Secret in every worker pod: a pod never runs unauthenticated)."""
    from oobleck.runtime.elastic.signing import KEY_FILE_ENV, job_signer

    if env.job_key_file is None:
        raise ValueError(f"{KEY_FILE_ENV}: not set (the operator sets it to the job's mounted key Secret)")
    os.environ[KEY_FILE_ENV] = env.job_key_file
    job_signer()


def report_cause(env: PodEnv, gpu: int, cause, kube: Kube | None = None) -> int:
    """Put a job cause on the pod (CAUSE_ANNOTATION) for the operator, log it, and return its exit code."""
    print(f"oobleck pod {env.node} gpu {gpu}: {cause.kind}: {cause.describe()}", file=sys.stderr)
    _log("cause", env, gpu=gpu, cause=cause.model_dump(exclude_none=True))
    try:
        kube = kube or Kube.in_cluster()
        annotate(kube, env.namespace, env.node, {CAUSE_ANNOTATION: cause.model_dump_json(exclude_none=True)})
    except (ApiException, KubeConfigError, *TRANSPORT_ERRORS) as error:  # the exit code still names the kind
        print(f"oobleck pod {env.node}: could not report the cause: {error}", file=sys.stderr)
    return cause.exit_code


def run_main() -> None:
    """The process entry: main(), then leave without running destructors. Abandoned generations may leave
    gloo threads blocked on dead peers, and a normal interpreter teardown would abort on them
    ("terminate called without an active exception"); everything owed is written by then."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_main()
