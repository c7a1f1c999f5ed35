"""kopf wiring: indexes of pods and nodes, one daemon per OobleckJob, and thin event handlers.

Level-based: the pod and node indexes hold health summaries (observe.py); pod, node and job events
only wake the daemon of the job concerned; the daemon reconciles (observe -> decide -> apply) until
nothing changes. No handler changes Pods, so kopf writes nothing onto them. A daemon gets kopf's
finalizer on its job (kopf's rule for daemons): deleting a job waits for a running operator to stop
the daemon; the children then go by garbage collection (owner references).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes_asyncio import client
from kubernetes_asyncio import config as kube_config
from pydantic import ValidationError

from oobleck.api.conditions import ConditionType, Reason, is_true, phase_of, set_condition
from oobleck.api.contract import MEASURED_PROFILE_ANNOTATION
from oobleck.api.profile import ModelProfile
from oobleck.api.resource import GROUP, JOB_LABEL, PLURAL, VERSION
from oobleck.api.spec import OobleckJobSpec, parse_spec
from oobleck.api.status import parse_status
from oobleck.operator import faults, observe
from oobleck.operator.apply import (
    Api,
    ApiError,
    Applied,
    ForeignObject,
    GcPause,
    Rejected,
    apply_decision,
    ends_job,
    ensure_static_children,
    read_current,
    retry_delay,
)
from oobleck.operator.decide import decide
from oobleck.operator.decision import CurrentPlan, Decision, JobContext
from oobleck.operator.metrics import Metrics
from oobleck.operator.planning import synthetic_profile
from oobleck.operator.planpool import PlannerPool
from oobleck.operator.settings import OperatorConfig, configure_kopf
from oobleck.planner.errors import PlanningError

log = logging.getLogger("oobleck.operator")
JobKey = tuple[str, str]  # (namespace, name)


@dataclass
class Waker:
    """A job's wake-up signal; when the first event since the last reconcile arrived, and the first that may
    be a loss. The batch window counts from that one: workers' progress reports wake a job every second, so a
    window counted from any wake-up would close at an arbitrary moment and split losses seen a moment apart."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    first_at: float | None = None
    loss_at: float | None = None

    def wake(self, at: float, may_be_loss: bool = True) -> None:
        if self.first_at is None:
            self.first_at = at
        if may_be_loss and self.loss_at is None:
            self.loss_at = at
        self.event.set()

    def batch_open_for(self, window_s: float, now: float) -> float:
        """Seconds until the batch window of the first possible loss closes (0 when none waits)."""
        return 0.0 if self.loss_at is None else max(0.0, self.loss_at + window_s - now)

    def take(self) -> float | None:
        """Start a reconcile: clear the signal and return when its first event arrived."""
        self.event.clear()
        first_at, self.first_at, self.loss_at = self.first_at, None, None
        return first_at


@dataclass
class JobRunner:
    """What a job's daemon remembers between reconciles (all of it re-derivable from the cluster)."""

    key: JobKey
    uid: str
    current: CurrentPlan | None = None
    plan_version: str | None = None  # the plan ConfigMap's resourceVersion: writes are conditional on it
    profile: ModelProfile | None = None
    loaded: bool = False  # static children ensured and the plan ConfigMap read
    phase: str = "Pending"
    nodes: frozenset[str] = frozenset()
    failures_written: faults.Counted | None = None  # the worker-failure count of the last status patched
    oversized: tuple[str, ...] = ()  # the oversized reports last warned about
    silent_held: tuple[str, ...] = ()  # the members last logged as kept although their nodes went silent


def _memo_waker(memo: Any, key: JobKey) -> Waker:
    wakers: dict[JobKey, Waker] = memo.wakers
    waker = wakers.get(key)
    if waker is None:
        waker = wakers[key] = Waker()
    return waker


# -- startup and shutdown ---------------------------------------------------------------------------


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    config: OperatorConfig = memo.config
    configure_kopf(settings, config)
    memo.metrics = Metrics()
    memo.wakers = {}
    memo.runners = {}
    memo.node_seen = {}
    memo.pod_seen = {}
    memo.node_jobs = {}
    if config.metrics_port >= 0:
        port = memo.metrics.serve(config.metrics_port)
        logger.info(f"metrics on :{port}/metrics")
    memo.api = await Api.connect(config.kubeconfig, memo.metrics, config.write_concurrency, config.request_timeout_s)
    # decide runs in these threads and plans in these processes: never on the event loop (planpool.py).
    memo.planner = PlannerPool(config.planner)
    memo.decide_threads = ThreadPoolExecutor(config.decide_threads, thread_name_prefix="oobleck-decide")


@kopf.on.login()
async def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """Log kopf in with the same credentials as our own client (the configured kubeconfig)."""
    config: OperatorConfig = memo.config
    configuration = client.Configuration()
    if config.kubeconfig:
        await kube_config.load_kube_config(config_file=config.kubeconfig, client_configuration=configuration)
    else:
        try:
            kube_config.load_incluster_config(client_configuration=configuration)
        except kube_config.ConfigException:
            await kube_config.load_kube_config(client_configuration=configuration)
    header = configuration.get_api_key_with_prefix("BearerToken")
    if asyncio.iscoroutine(header):
        header = await header
    scheme, token = header.split(" ", 1) if header and " " in header else (None, header or None)
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        scheme=scheme,
        token=token,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    api: Api | None = getattr(memo, "api", None)
    if api is not None:
        await api.close()
    threads: ThreadPoolExecutor | None = getattr(memo, "decide_threads", None)
    if threads is not None:
        threads.shutdown(wait=False, cancel_futures=True)
    planner: PlannerPool | None = getattr(memo, "planner", None)
    if planner is not None:
        planner.close()


@kopf.on.probe(id="jobs")
def probe_jobs(memo: kopf.Memo, **_: Any) -> int:
    """Liveness: the number of jobs with a running daemon (the probe answering at all is the signal)."""
    return len(memo.runners)


# -- indexes and wake-ups ---------------------------------------------------------------------------


def _health(summary: observe.PodSummary | None) -> observe.PodSummary | None:
    """A summary without what the operator itself writes (generation, ranks): its echo is not news."""
    return None if summary is None else replace(summary, generation=None, ranks=None)


@kopf.index("pods", labels={JOB_LABEL: kopf.PRESENT})
def job_pods(
    namespace: str, name: str, labels: kopf.Labels, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> dict[JobKey, observe.PodSummary]:
    """Index the job's pods by (namespace, job) and wake the job when something it cares about changed.

    Waking here rather than in an event handler keeps the per-event cost low: every patch the
    operator sends to 1000 pods comes back as 1000 watch events.
    """
    summary = observe.summarize_pod(body)
    key = (namespace, labels[JOB_LABEL])
    seen: dict[tuple[str, str], observe.PodSummary] = memo.pod_seen
    health = _health(summary)
    before = seen.get((namespace, name))
    if before != health:
        seen[(namespace, name)] = health  # type: ignore[assignment]
        _memo_waker(memo, key).wake(time.monotonic(), may_be_loss=not _only_progress_changed(before, health))
    return {key: summary}


def _only_progress_changed(before: observe.PodSummary | None, after: observe.PodSummary | None) -> bool:
    if before is None or after is None:
        return False
    return replace(before, progress=None) == replace(after, progress=None)


@kopf.index("nodes")
def node_health(name: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[str, observe.NodeSummary]:
    summary = observe.summarize_node(body)
    _node_changed(memo, name, summary)
    return {name: summary}


def _node_changed(memo: kopf.Memo, name: str, summary: observe.NodeSummary | None) -> None:
    if memo.node_seen.get(name) == summary:
        return  # e.g. a heartbeat: nothing health-related changed
    memo.node_seen[name] = summary
    now = time.monotonic()
    for key in memo.node_jobs.get(name, ()):
        _memo_waker(memo, key).wake(now)


# Indexers are not called for deletions: these two handlers see only DELETED events.
@kopf.on.event("pods", labels={JOB_LABEL: kopf.PRESENT}, when=lambda type, **_: type == "DELETED")
def pod_deleted(namespace: str, name: str, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    memo.pod_seen.pop((namespace, name), None)
    _memo_waker(memo, (namespace, labels[JOB_LABEL])).wake(time.monotonic())


@kopf.on.event("nodes", when=lambda type, **_: type == "DELETED")
def node_deleted(name: str, memo: kopf.Memo, **_: Any) -> None:
    _node_changed(memo, name, None)


@kopf.on.event(GROUP, VERSION, PLURAL)
def job_event(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    _memo_waker(memo, (namespace, name)).wake(time.monotonic(), may_be_loss=False)


# -- the per-job daemon ------------------------------------------------------------------------------


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0)
async def job_daemon(
    stopped: kopf.DaemonStopped,
    body: kopf.Body,
    namespace: str,
    name: str,
    uid: str,
    memo: kopf.Memo,
    job_pods: kopf.Index,
    node_health: kopf.Index,
    logger: logging.Logger,
    **_: Any,
) -> None:
    """Reconcile one job whenever something about it changes (and every resync_s)."""
    config: OperatorConfig = memo.config
    key = (namespace, name)
    runner = JobRunner(key, uid)
    memo.runners[key] = runner
    waker = _memo_waker(memo, key)
    waker.wake(time.monotonic(), may_be_loss=False)
    failures = 0  # failed reconciles in a row: the retry backs off
    try:
        while not stopped:
            try:
                await asyncio.wait_for(waker.event.wait(), timeout=config.resync_s)
                # Let the other losses of a simultaneous failure arrive, and the index settle.
                await asyncio.sleep(config.batch_window_s)
                while (wait := waker.batch_open_for(config.batch_window_s, time.monotonic())) > 0:
                    await asyncio.sleep(wait)
            except TimeoutError:
                pass
            if stopped:
                break
            first_at = waker.take()
            began = time.perf_counter()
            try:
                await reconcile(runner, body, memo, job_pods, node_health, first_at, logger)
                failures = 0
            except Rejected as error:
                # Retrying cannot help (a quota, a LimitRange, an admission policy, an object too large).
                logger.warning(f"the API server refused a child of this job: {error}")
                runner.phase = await _fail_invalid(memo.api, namespace, name, body, str(error), Reason.CHILD_REJECTED)
                runner.loaded = False
            except (TimeoutError, ApiError, ForeignObject, OSError) as error:
                failures += 1
                delay = retry_delay(failures, config.error_backoff_s, config.max_error_backoff_s)
                logger.warning(f"reconcile failed ({failures} in a row), retrying in {delay:g} s: {error}")
                runner.loaded = False  # re-read the truth (e.g. a plan written before a failed patch)
                waker.wake(first_at or time.monotonic(), may_be_loss=False)
                await stopped.wait(delay)
            memo.metrics.reconcile_seconds.observe(time.perf_counter() - began)
            memo.metrics.set_phases(r.phase for r in memo.runners.values())
    finally:
        memo.runners.pop(key, None)
        memo.wakers.pop(key, None)
        for jobs in memo.node_jobs.values():
            jobs.discard(key)
        memo.metrics.forget_job(namespace, name)
        memo.metrics.set_phases(r.phase for r in memo.runners.values())


def _now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


async def _fail_invalid(
    api: Api, namespace: str, name: str, body: kopf.Body, message: str, reason: str = Reason.INVALID_SPEC
) -> str:
    """Mark a job whose spec the operator cannot use as Failed (once) with `reason`, and a Warning event."""
    status = parse_status(dict(body.get("status") or {}))
    if is_true(status.conditions, ConditionType.FAILED):
        return status.phase.value
    generation = body.metadata.get("generation")
    conditions = set_condition(status.conditions, ConditionType.FAILED, "True", reason, message, generation, _now())
    new = status.model_copy(
        update={
            "conditions": conditions,
            "phase": phase_of(conditions),
            "observed_generation": generation,
            "completion_time": _now(),
        }
    )
    await api.patch_status(namespace, name, new.to_kubernetes())
    kopf.warn(body, reason=reason, message=message)
    return new.phase.value


async def _profile(
    api: Api,
    runner: JobRunner,
    spec: OobleckJobSpec,
    namespace: str,
    config: OperatorConfig,
    measured: str | None,
    oversized: tuple[str, ...] = (),
) -> ModelProfile | None:
    """The profile to plan with: stored beside the plan, from the spec's ConfigMap, or measured by a worker
    (`measured`: its annotation; `oversized`: the observation's reports over their cap); None while a
    `measure` job's workers are still profiling."""
    if runner.profile is not None:
        return runner.profile
    if spec.profile.source == "measure" and runner.current is None:
        if not measured:
            too_long = next((o for o in oversized if MEASURED_PROFILE_ANNOTATION in o), None)
            if too_long is not None:
                raise PlanningError(f"profile: the workers' measured profile is too large to plan with: {too_long}")
            return None
        try:
            runner.profile = ModelProfile.model_validate_json(measured)
        except ValidationError as error:
            raise PlanningError(f"profile: the workers' measured profile is not valid: {error}") from error
        return runner.profile
    if spec.profile.source == "configMap":
        ref = spec.profile.config_map
        assert ref is not None  # the spec rules require it
        config_map = await api.read_config_map(namespace, ref.name)
        text = ((config_map or {}).get("data") or {}).get(ref.key)
        if not text:
            raise PlanningError(f"profile.configMap: configmap {namespace}/{ref.name} has no key {ref.key}")
        try:
            runner.profile = ModelProfile.model_validate_json(text)
        except ValidationError as error:
            raise PlanningError(f"profile.configMap: {ref.name}/{ref.key} is not a valid profile: {error}") from error
    else:
        # A plan stored without its profile (an older operator wrote it): price later generations with
        # the synthetic estimate of the spec's model.
        runner.profile = synthetic_profile(spec, config.tuning)
    return runner.profile


async def reconcile(
    runner: JobRunner,
    body: kopf.Body,
    memo: kopf.Memo,
    job_pods: kopf.Index,
    node_health: kopf.Index,
    first_event_at: float | None,
    logger: logging.Logger,
    fresh: Mapping[str, Any] | None = None,
) -> None:
    """One pass: read (cache or API), observe, decide, apply. `fresh`: the job as just read from the API
    server, to decide on instead of kopf's cached `body` (see `_stale`)."""
    config: OperatorConfig = memo.config
    api: Api = memo.api
    namespace, name = runner.key
    view: Mapping[str, Any] = body if fresh is None else fresh
    raw_spec, raw_status = dict(view.get("spec") or {}), dict(view.get("status") or {})
    try:
        spec = parse_spec(raw_spec)
    except ValidationError as error:
        runner.phase = await _fail_invalid(api, namespace, name, body, f"invalid spec: {error}")
        return
    if not runner.loaded and not await _load(runner, api, config, body):
        return
    obs = _observe(runner, spec, config, job_pods, node_health)
    try:
        profile = await _profile(api, runner, spec, namespace, config, obs.measured_profile, obs.oversized)
    except (PlanningError, ValueError) as error:
        runner.phase = await _fail_invalid(api, namespace, name, body, str(error))
        return
    _track_nodes(runner, memo, obs)
    _warn_oversized(runner, obs, body, logger)
    if obs.silent_held != runner.silent_held and obs.silent_held:
        held = ", ".join(obs.silent_held)
        log.info(f"{namespace}/{name}: kept {held}: their nodes went silent (an outage, or within the grace)")
    runner.silent_held = obs.silent_held
    status = parse_status(raw_status)
    generation = int((view.get("metadata") or {}).get("generation") or 0)
    ctx = JobContext(name, namespace, runner.uid, generation, spec, status)
    with GcPause() as pause:  # no collector pause between a failure and the patches (apply.GcPause)
        counted, records = faults.counted_so_far(
            (status.worker_failures, tuple(status.last_worker_failures)), runner.failures_written
        )
        verdict = faults.assess(
            runner.uid, job_pods.get(runner.key, ()), counted, records, spec.failure_policy, time.time()
        )
        if runner.current is None:
            pause.end()  # before generation 0 nothing is urgent, and a check may take the planner's whole limit
        # In a thread: decide waits there for the planner's processes, the event loop goes on.
        decision = await asyncio.get_running_loop().run_in_executor(
            memo.decide_threads,
            functools.partial(decide, ctx, obs, runner.current, profile, config.tuning, _now(), verdict, memo.planner),
        )
        if fresh is None and ends_job(decision.status, raw_status):
            # Ending is irreversible: confirmed on a quorum read. After an API-server or etcd restart (or
            # an operator restart during one) kopf's cached body can lag behind the job, e.g. miss the
            # Succeeded status an earlier pass wrote before its cleanup deleted the workers, which would
            # then look lost.
            job_now = await api.read_job(namespace, name)
            if job_now is None:
                return  # deleted meanwhile
            if (job_now.get("metadata") or {}).get("resourceVersion") != body.metadata.get("resourceVersion"):
                logger.info("kopf's copy of the job is behind the API server's; deciding on a fresh read")
                await reconcile(runner, body, memo, job_pods, node_health, first_event_at, logger, fresh=job_now)
                return
        if decision.profile is not None:
            profile = runner.profile = decision.profile  # generation 0's: stored beside the plan
        if decision.plan is None:
            pause.end()
        if obs.foreign:
            logger.warning(f"pods {list(obs.foreign)} carry this job's label but another owner; ignored")
        applied = await _apply(runner, api, config, body, spec, profile, decision, raw_status)
    runner.failures_written = (verdict.worker_failures, verdict.last_worker_failures)
    _record(runner, memo.metrics, decision, applied, first_event_at)


async def _apply(
    runner: JobRunner,
    api: Api,
    config: OperatorConfig,
    body: kopf.Body,
    spec: OobleckJobSpec,
    profile: ModelProfile | None,
    decision: Decision,
    raw_status: dict[str, Any],
) -> Applied:
    namespace, name = runner.key
    return await apply_decision(
        api,
        namespace=namespace,
        job=name,
        uid=runner.uid,
        spec=spec,
        profile=profile,
        decision=decision,
        plan_version=runner.plan_version,
        default_image=config.default_image,
        default_command=list(config.default_command),
        status_before=parse_status(raw_status).to_kubernetes(),
        post_event=lambda e: kopf.event(body, type=e.type, reason=e.reason, message=e.message),
    )


async def _load(runner: JobRunner, api: Api, config: OperatorConfig, body: kopf.Body) -> bool:
    """A job's first pass in this operator: its static children, and the plan in force from its ConfigMap.
    False when the job failed (a plan ConfigMap that cannot be read)."""
    namespace, name = runner.key
    await ensure_static_children(api, namespace, name, runner.uid, config.metrics_scrape_namespace)
    config_map = await api.read_config_map(namespace, f"{name}-plan")
    owners = {o.get("uid") for o in ((config_map or {}).get("metadata") or {}).get("ownerReferences") or []}
    if config_map is not None and runner.uid not in owners:
        raise ForeignObject(
            f"configmap {namespace}/{name}-plan belongs to another owner (a deleted job's?); waiting for it to go"
        )
    try:
        current = read_current(config_map)
    except ValueError as error:  # e.g. over the decompression cap (planmap.MAX_PLAN_BYTES)
        runner.phase = await _fail_invalid(api, namespace, name, body, str(error), Reason.PLAN_UNREADABLE)
        return False
    if current is not None:
        plan, failures, stored_profile, runner.plan_version = current
        runner.current = CurrentPlan(plan, failures)
        runner.profile = stored_profile or runner.profile
    else:
        runner.current = runner.plan_version = None
    runner.loaded = True
    return True


def _observe(
    runner: JobRunner, spec: OobleckJobSpec, config: OperatorConfig, job_pods: kopf.Index, node_health: kopf.Index
) -> observe.JobObservation:
    nodes = {node: next(iter(store)) for node, store in node_health.items()}
    return observe.observe(
        runner.key[1],
        runner.uid,
        job_pods.get(runner.key, ()),
        nodes,
        runner.current.plan if runner.current else None,
        gpu_resource=spec.gpu_resource_name if spec.device == "cuda" else None,
        gpu_conditions=config.tuning.gpu_failure_conditions,
        now=time.time(),
        silent_grace_s=config.silent_node_grace_s,
    )


def _track_nodes(runner: JobRunner, memo: kopf.Memo, obs: observe.JobObservation) -> None:
    """Node events wake the jobs with pods on that node."""
    on_nodes = frozenset(w.node_name for w in obs.workers if w.node_name)
    for node in runner.nodes - on_nodes:
        memo.node_jobs.get(node, set()).discard(runner.key)
    for node in on_nodes:
        memo.node_jobs.setdefault(node, set()).add(runner.key)
    runner.nodes = on_nodes


def _warn_oversized(runner: JobRunner, obs: observe.JobObservation, body: kopf.Body, logger: logging.Logger) -> None:
    if obs.oversized and obs.oversized != runner.oversized:
        message = "worker reports ignored: " + "; ".join(obs.oversized)
        logger.warning(message)
        kopf.warn(body, reason=Reason.REPORT_TOO_LARGE, message=message[:1024])
    runner.oversized = obs.oversized


def _record(
    runner: JobRunner, metrics: Metrics, decision: Decision, applied: Applied, first_event_at: float | None
) -> None:
    """After a pass: the runner's plan in force and phase, and the operator's metrics."""
    namespace, name = runner.key
    latency = None
    if decision.lost:
        metrics.pods_lost.inc(len(decision.lost))
        if applied.patched_at is not None and first_event_at is not None:
            latency = applied.patched_at - first_event_at
            metrics.failure_to_patch_seconds.observe(latency)
    if decision.plan is not None:
        plan = decision.plan
        runner.current = CurrentPlan(plan, decision.failures_survived)
        runner.plan_version = applied.plan_version
        metrics.plan_generations.inc()
        metrics.planner_seconds.observe(decision.planner_seconds)
        log.info(
            f"{namespace}/{name}: plan generation {plan.generation} ({plan.reason}) on {len(plan.nodes)} nodes; "
            f"lost {len(plan.lost_nodes)} added {len(plan.added_nodes)}; planner {decision.planner_seconds:.4f} s; "
            f"patched {len(decision.patches)} pods"
            + (f"; failure-to-patch {latency:.4f} s" if latency is not None else "")
            + "".join(f"; lost {e.message}" for e in decision.events if e.reason == Reason.NODE_LOST)
        )
    for pod, why in decision.delete:  # before generation 0 no plan line names them
        log.info(f"{namespace}/{name}: deleting pod {pod}: {why}")
    metrics.pods_created.inc(applied.created)
    if decision.slowdowns is not None:
        metrics.set_slowdowns(namespace, name, decision.slowdowns)
    metrics.spares.labels(namespace=namespace, job=name).set(decision.status.get("spares", 0))
    runner.phase = str(decision.status.get("phase", "Pending"))
