"""The side effects: Kubernetes API calls through one kubernetes_asyncio client.

Every write names its patch type explicitly (merge patch: a dict body would default to strategic
merge) and skips response deserialisation (`_preload_content=False`: turning 1000 pod bodies into
typed models costs more CPU than the calls themselves). Fan-out runs under one semaphore.
Creates are idempotent: 409 AlreadyExists on an object that carries our job's owner uid is success.
A create the API server refuses for good (400, 403, 413, 422: a quota, a LimitRange, an admission
policy, an object too large) raises `Rejected`, which ends the job; other failures are retried with
`retry_delay`'s backoff (5xx, 429, timeouts).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio import config as kube_config

from oobleck.api import planmap
from oobleck.api.plan import Plan
from oobleck.api.profile import ModelProfile
from oobleck.api.resource import GROUP, PLURAL, VERSION
from oobleck.api.spec import OobleckJobSpec
from oobleck.api.status import Phase
from oobleck.operator import render
from oobleck.operator.decision import Decision, Event
from oobleck.operator.metrics import Metrics

log = logging.getLogger(__name__)
MERGE = "application/merge-patch+json"
TERMINAL_PHASES = (Phase.SUCCEEDED.value, Phase.FAILED.value)


def ends_job(status: Mapping[str, Any], before: Mapping[str, Any]) -> bool:
    """Whether the status `status` ends a job whose status was `before` (both as written to the API)."""
    return status.get("phase") in TERMINAL_PHASES and before.get("phase") not in TERMINAL_PHASES


class ApiError(RuntimeError):
    """A failed API call: HTTP status and the server's message."""

    def __init__(self, verb: str, what: str, status: int, body: str) -> None:
        self.status = status
        try:
            message = json.loads(body).get("message", body)
        except (ValueError, AttributeError):
            message = body
        super().__init__(f"{verb} {what}: HTTP {status}: {message}")


REJECTED_STATUSES = (400, 403, 413, 422)
"""Answers to a create that retrying cannot change (409 and 404 mean something else: see create_owned)."""


class Rejected(ApiError):
    """The API server refused to create a child for good: the job cannot run as specified."""


def _error(verb: str, what: str, status: int, body: str) -> ApiError:
    kind = Rejected if verb == "create" and status in REJECTED_STATUSES else ApiError
    return kind(verb, what, status, body)


def retry_delay(failures: int, base_s: float, cap_s: float) -> float:
    """Seconds to wait after `failures` (>= 1) failed reconciles in a row: base, 2 base, 4 base ... up to cap."""
    return min(cap_s, base_s * 2 ** min(failures - 1, 30))


class ForeignObject(RuntimeError):
    """A child's name is taken by an object another owner controls (e.g. a deleted job's leftover)."""


@dataclass
class Api:
    """The operator's client. One per process; `concurrency` bounds in-flight writes."""

    api: client.ApiClient
    metrics: Metrics
    concurrency: int = 128
    timeout_s: float = 15.0

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.rbac = client.RbacAuthorizationV1Api(self.api)
        self.networking = client.NetworkingV1Api(self.api)
        self.limit = asyncio.Semaphore(self.concurrency)

    @classmethod
    async def connect(cls, kubeconfig: str | None, metrics: Metrics, concurrency: int, timeout_s: float) -> Api:
        """A client from `kubeconfig`, the in-cluster account, or the default kubeconfig, in that order."""
        configuration = client.Configuration()
        if kubeconfig:
            await kube_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        else:
            try:
                kube_config.load_incluster_config(client_configuration=configuration)
            except kube_config.ConfigException:
                await kube_config.load_kube_config(client_configuration=configuration)
        configuration.connection_pool_maxsize = concurrency
        return cls(client.ApiClient(configuration), metrics, concurrency, timeout_s)

    async def close(self) -> None:
        await self.api.close()

    async def _call(
        self, verb: str, what: str, method: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        async with self.limit:
            try:
                response = await method(*args, _preload_content=False, _request_timeout=self.timeout_s, **kwargs)
                body = await response.read()
            except (TimeoutError, OSError) as error:
                self.metrics.api_errors.labels(verb=verb).inc()
                raise ApiError(verb, what, 0, f"{type(error).__name__}: {error}") from error
            except client.ApiException as error:  # raised for some transport-level answers
                self.metrics.api_errors.labels(verb=verb).inc()
                raise _error(verb, what, error.status or 0, str(error.body or error.reason)) from error
        if not 200 <= response.status < 300:
            if response.status not in (404, 409):  # expected answers of idempotent calls, not errors
                self.metrics.api_errors.labels(verb=verb).inc()
            raise _error(verb, what, response.status, body.decode(errors="replace"))
        return json.loads(body) if body else {}

    # -- reads --

    async def read_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The OobleckJob as etcd has it now (a quorum read, not kopf's cache); None if it is gone."""
        try:
            return await self._call(
                "get",
                f"{PLURAL} {namespace}/{name}",
                self.custom.get_namespaced_custom_object,
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                name,
            )
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    async def read_config_map(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._call(
                "get", f"configmap {namespace}/{name}", self.core.read_namespaced_config_map, name, namespace
            )
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    # -- creates --

    async def create_owned(self, body: dict[str, Any], owner_uid: str) -> bool:
        """Create a child; True if created, False if it already existed with our owner uid."""
        kind, meta = body["kind"], body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        create, read = {
            "Pod": (self.core.create_namespaced_pod, self.core.read_namespaced_pod),
            "Service": (self.core.create_namespaced_service, self.core.read_namespaced_service),
            "ServiceAccount": (self.core.create_namespaced_service_account, self.core.read_namespaced_service_account),
            "ConfigMap": (self.core.create_namespaced_config_map, self.core.read_namespaced_config_map),
            "Role": (self.rbac.create_namespaced_role, self.rbac.read_namespaced_role),
            "RoleBinding": (self.rbac.create_namespaced_role_binding, self.rbac.read_namespaced_role_binding),
            "Secret": (self.core.create_namespaced_secret, self.core.read_namespaced_secret),
            "NetworkPolicy": (
                self.networking.create_namespaced_network_policy,
                self.networking.read_namespaced_network_policy,
            ),
        }[kind]
        what = f"{kind.lower()} {namespace}/{name}"
        try:
            await self._call("create", what, create, namespace, body)
            return True
        except ApiError as error:
            if error.status != 409:
                raise
        existing = await self._call("get", what, read, name, namespace)
        owners = {o.get("uid") for o in existing.get("metadata", {}).get("ownerReferences") or []}
        if owner_uid not in owners:
            raise ForeignObject(f"{what} exists but is not owned by this job (uid {owner_uid}); waiting for it to go")
        return False

    # -- writes --

    async def _unless_gone(self, *call: Any, **kwargs: Any) -> bool:
        """`_call(*call, **kwargs)`; False if the object is gone (404), True otherwise."""
        try:
            await self._call(*call, **kwargs)
            return True
        except ApiError as error:
            if error.status == 404:
                return False
            raise

    async def patch_pod(self, namespace: str, name: str, annotations: dict[str, str]) -> bool:
        """Merge annotations into a pod; False if the pod is gone."""
        return await self._unless_gone(
            "patch",
            f"pod {namespace}/{name}",
            self.core.patch_namespaced_pod,
            name,
            namespace,
            {"metadata": {"annotations": annotations}},
            _content_type=MERGE,
        )

    async def delete_pod(self, namespace: str, name: str) -> bool:
        """Delete a pod at once (grace 0: its node may be gone); False if already gone."""
        return await self._unless_gone(
            "delete",
            f"pod {namespace}/{name}",
            self.core.delete_namespaced_pod,
            name,
            namespace,
            grace_period_seconds=0,
        )

    async def write_plan(self, body: dict[str, Any], owner_uid: str, resource_version: str | None) -> str:
        """Create the plan ConfigMap (generation 0, `resource_version` None) or replace its content with
        the next generation, only if it is still at `resource_version` (a 409 Conflict otherwise: another
        writer, e.g. a replica that took over, moved it on). Returns the new resourceVersion."""
        meta = body["metadata"]
        what = f"configmap {meta['namespace']}/{meta['name']}"
        if resource_version is None:
            created = await self._call("create", what, self.core.create_namespaced_config_map, meta["namespace"], body)
            return created["metadata"]["resourceVersion"]
        patch = render.plan_patch(body)
        patch["metadata"]["resourceVersion"] = resource_version
        patched = await self._call(
            "patch",
            what,
            self.core.patch_namespaced_config_map,
            meta["name"],
            meta["namespace"],
            patch,
            _content_type=MERGE,
        )
        return patched["metadata"]["resourceVersion"]

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        await self._call(
            "patch",
            f"{PLURAL} {namespace}/{name} status",
            self.custom.patch_namespaced_custom_object_status,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            {"status": status},
            _content_type=MERGE,
        )


class GcPause:
    """Holds off Python's cyclic garbage collector over a latency-critical section: deciding on and
    applying a new plan generation (failure -> survivors patched).

    At 1000 pods the operator holds about a million objects (kopf's bodies and indexes), so one full
    collection takes 0.3-0.5 s, and the planner's allocations trigger one every few plans. Pauses nest
    (jobs reconcile concurrently); the collector is back, and catches up, when the last one ends.
    `end()` ends a pause early (nothing urgent after all); ending twice is harmless.
    """

    _depth = 0
    _restore = False  # whether the collector was enabled when the outermost pause began

    def __init__(self) -> None:
        self._open = False

    def __enter__(self) -> GcPause:
        if GcPause._depth == 0:
            GcPause._restore = gc.isenabled()
            gc.disable()
        GcPause._depth += 1
        self._open = True
        return self

    def end(self) -> None:
        if not self._open:
            return
        self._open = False
        GcPause._depth -= 1
        if GcPause._depth == 0 and GcPause._restore:
            gc.enable()

    def __exit__(self, *_: object) -> None:
        self.end()


async def gather_all(calls: Iterable[Awaitable[Any]]) -> list[Any]:
    """Run calls concurrently; wait for all of them, then raise the first error, if any."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


@dataclass(frozen=True)
class Applied:
    """What applying a Decision did (for metrics and logs)."""

    patched_at: float | None  # monotonic time the last renumbered survivor was patched, when a plan was written
    created: int
    deleted: int
    plan_version: str | None  # resourceVersion of the plan ConfigMap after this write (None: not written)


async def apply_decision(
    api: Api,
    *,
    namespace: str,
    job: str,
    uid: str,
    spec: OobleckJobSpec,
    profile: ModelProfile | None,
    decision: Decision,
    plan_version: str | None,
    default_image: str,
    default_command: list[str],
    status_before: dict[str, Any],
    post_event: Callable[[Event], None],
) -> Applied:
    """Execute a Decision in the order decide.py's docstring gives. `post_event` queues an Event on the
    job without waiting for it (kopf's poster writes it in the background: kopf.event)."""
    patched_at = written = None
    if decision.plan is not None:
        assert profile is not None, "a plan is written with the profile it was planned with"
        body = render.plan_config_map(job, namespace, uid, decision.plan, profile, spec, decision.failures_survived)
        written = await api.write_plan(body, uid, plan_version)

    async def patch_pods() -> float:
        await gather_all(api.patch_pod(namespace, name, annotations) for name, annotations in decision.patches)
        return time.monotonic()

    # The Reconfiguring status goes out beside the pod patches; the survivors are told when the patches
    # are done (with no pod to renumber, as soon as the plan is written).
    calls: list[Awaitable[Any]] = [patch_pods()]
    if decision.status_during is not None and decision.status_during != status_before:
        calls.append(api.patch_status(namespace, job, decision.status_during))
    done = await gather_all(calls)
    if decision.plan is not None:
        patched_at = done[0]
    ends = ends_job(decision.status, status_before)
    if ends:
        # The end is recorded before the cleanup deletes pods: were it the other way round and the status
        # patch failed (an API-server or etcd restart), the next pass would find the workers gone and
        # take them for lost nodes.
        await api.patch_status(namespace, job, decision.status)
    deletions = [api.delete_pod(namespace, name) for name, _ in decision.delete]
    pods = [
        render.worker_pod(
            job, namespace, uid, spec, index, default_image=default_image, default_command=default_command
        )
        for index in decision.create
    ]
    if decision.create_coordinator:
        pods.append(render.coordinator_pod(job, namespace, uid, spec, default_image=default_image))
    results = await gather_all([*deletions, *(api.create_owned(pod, uid) for pod in pods)])
    deleted = sum(1 for r in results[: len(deletions)] if r)
    created = sum(1 for r in results[len(deletions) :] if r)
    if decision.status != status_before and not ends:
        await api.patch_status(namespace, job, decision.status)
    for event in decision.events:
        post_event(event)
    return Applied(patched_at=patched_at, created=created, deleted=deleted, plan_version=written)


async def ensure_static_children(
    api: Api, namespace: str, job: str, uid: str, scrape_namespace: str | None = None
) -> None:
    """ServiceAccount, Role, RoleBinding, Service, NetworkPolicy and the job's key Secret (created once; 409
    with our uid is fine: an existing key is kept, so a restarted operator never changes it)."""
    for body in render.static_children(job, namespace, uid, scrape_namespace):
        await api.create_owned(body, uid)
    key = secrets.token_hex(32).encode()  # 256 random bits, as text: the file a worker reads is printable
    await api.create_owned(render.job_key_secret(job, namespace, uid, key), uid)


def read_current(config_map: dict[str, Any] | None) -> tuple[Plan, int, ModelProfile | None, str] | None:
    """The plan ConfigMap's plan, failure counter, profile and resourceVersion; None when there is no plan yet."""
    if config_map is None:
        return None
    return (
        planmap.read_plan(config_map),
        planmap.read_failures_survived(config_map),
        planmap.read_profile(config_map),
        config_map["metadata"]["resourceVersion"],
    )
