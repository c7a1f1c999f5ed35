"""The runtime's Kubernetes access: the official `kubernetes` client, synchronous, in the worker's threads.

A worker pod makes a handful of calls (get the coordinator pod, merge-patch annotations onto its own
pod, watch its job's plan ConfigMap); the client does configuration, authentication, token refresh
and errors. What is ours:

- `Kube.in_cluster()`: the client's in-cluster loader (KUBERNETES_SERVICE_HOST/PORT, the ServiceAccount
  token and CA at /var/run/secrets/kubernetes.io/serviceaccount, the token re-read every minute as
  projected tokens rotate). `Kube.from_kubeconfig()` for use outside a pod.
- `api_error_text`: an ApiException as one line, `403 Forbidden: <the API server's message>`.
- `watch_object`: one named object followed with `watch.Watch().stream(...)`, resumed from the last
  resourceVersion when the server ends a watch, and re-read after 410 Gone or any error, so that no
  change is ever missed (only possibly delivered twice).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config, watch
from kubernetes.client import ApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.config.incluster_config import InClusterConfigLoader

log = logging.getLogger("oobleck.runtime.backends.pod.kube")

SERVICEACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
MERGE_PATCH = "application/merge-patch+json"
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (urllib3.exceptions.HTTPError, OSError)
"""errors of the connection, not answers of the API server: a retry may succeed"""

_WATCH_RETRIED: tuple[type[BaseException], ...] = (*TRANSPORT_ERRORS, KeyError, ValueError)
"""a dropped connection, or an answer that is not the expected JSON: list again"""

__all__ = ["TRANSPORT_ERRORS", "ApiException", "Kube", "KubeConfigError", "WatchTimeouts", "watch_object"]


class KubeConfigError(ValueError):
    """The pod's Kubernetes configuration is missing or unusable (the message names what)."""


def api_error_text(error: ApiException) -> str:
    """`STATUS Reason: message` of an API server's refusal."""
    message = ""
    try:
        message = json.loads(error.body or "{}").get("message", "")
    except (ValueError, AttributeError):
        message = str(error.body or "")[:300]
    return f"{error.status} {error.reason}: {message}".rstrip(": ")


class Kube:
    """A CoreV1Api and the pod's namespace (from the ServiceAccount folder; "default" outside a pod)."""

    def __init__(self, core: client.CoreV1Api, namespace: str = "default", request_timeout_s: float = 15.0) -> None:
        self.core, self.namespace, self.request_timeout_s = core, namespace, request_timeout_s

    @classmethod
    def in_cluster(cls, env: Mapping[str, str] | None = None, folder: str = SERVICEACCOUNT_DIR) -> Kube:
        """The pod's client: `env` (default os.environ) names the API server, `folder` holds the
        ServiceAccount's token, ca.crt and namespace (the kubelet mounts them there)."""
        env = os.environ if env is None else env
        if not env.get("KUBERNETES_SERVICE_HOST"):
            raise KubeConfigError("KUBERNETES_SERVICE_HOST: not set (not running in a pod?)")
        path = Path(folder)
        for name in ("token", "ca.crt"):
            if not (path / name).is_file():
                raise KubeConfigError(f"{path / name}: missing (the pod's service-account token is not mounted?)")
        configuration = client.Configuration()
        try:
            # What config.load_incluster_config does, with the environment passed in.
            loader = InClusterConfigLoader(str(path / "token"), str(path / "ca.crt"), environ=env)
            loader.load_and_set(configuration)
        except ConfigException as error:
            raise KubeConfigError(f"in-cluster configuration: {error}") from error
        namespace_file = path / "namespace"
        namespace = namespace_file.read_text().strip() if namespace_file.is_file() else "default"
        return cls(client.CoreV1Api(client.ApiClient(configuration)), namespace)

    @classmethod
    def from_kubeconfig(cls, path: str | None = None, namespace: str = "default") -> Kube:
        configuration = client.Configuration()
        try:
            config.load_kube_config(config_file=path, client_configuration=configuration)
        except (ConfigException, OSError) as error:
            raise KubeConfigError(f"kubeconfig {path or '$KUBECONFIG'}: {error}") from error
        return cls(client.CoreV1Api(client.ApiClient(configuration)), namespace)

    def read_pod(self, namespace: str, name: str) -> dict[str, Any]:
        """The pod as the API server's JSON (camelCase keys). Raises ApiException (404, 403, ...)."""
        pod = self.core.read_namespaced_pod(name, namespace, _request_timeout=self.request_timeout_s)
        return self.core.api_client.sanitize_for_serialization(pod)

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        """Merge `annotations` into the pod's (a JSON merge patch)."""
        self.core.patch_namespaced_pod(
            name,
            namespace,
            {"metadata": {"annotations": dict(annotations)}},
            _content_type=MERGE_PATCH,
            _request_timeout=self.request_timeout_s,
        )


@dataclass(frozen=True)
class WatchTimeouts:
    server_s: float = 60.0
    """How long one watch request lasts before the server ends it (then it is resumed)."""
    retry_s: float = 0.2
    """First pause after an error; doubles up to `max_retry_s`."""
    max_retry_s: float = 5.0


def watch_object(
    kube: Kube,
    namespace: str,
    name: str,
    on_object: Callable[[dict[str, Any] | None], None],
    stop: threading.Event,
    timeouts: WatchTimeouts = WatchTimeouts(),
    on_error: Callable[[BaseException], None] | None = None,
) -> None:
    """Follow the ConfigMap `namespace/name` until `stop`: `on_object(obj)` with its current state, then
    every change (None when it does not exist or was deleted); objects are the API server's JSON.
    Blocks; run it in a thread. A stop takes effect at the next event or server timeout at the latest.

    Lists first (its resourceVersion is where the watch begins), resumes a watch the server ended from
    the last resourceVersion seen (bookmarks included), and after 410 Gone or any error lists again."""
    core = kube.core
    selector = f"metadata.name={name}"
    resource_version: str | None = None
    backoff = timeouts.retry_s
    while not stop.is_set():
        try:
            if resource_version is None:
                listing = core.list_namespaced_config_map(
                    namespace, field_selector=selector, _preload_content=False, _request_timeout=kube.request_timeout_s
                )
                body = json.loads(listing.data)
                items = body.get("items") or []
                on_object(items[0] if items else None)
                resource_version = body["metadata"]["resourceVersion"]
            watcher = watch.Watch()
            for event in watcher.stream(
                core.list_namespaced_config_map,
                namespace,
                field_selector=selector,
                resource_version=resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=max(1, int(timeouts.server_s)),
                deserialize=False,  # the JSON is what we pass on: no model objects built per event
            ):
                if stop.is_set():
                    watcher.stop()
                    return
                obj = event["object"]
                resource_version = (obj.get("metadata") or {}).get("resourceVersion") or resource_version
                if event["type"] in ("ADDED", "MODIFIED"):
                    on_object(obj)
                elif event["type"] == "DELETED":
                    on_object(None)
                backoff = timeouts.retry_s
        except ApiException as error:
            if error.status == 410:
                resource_version = None  # too old: list again
                continue
            backoff = _pause(error, api_error_text(error), namespace, name, stop, on_error, backoff, timeouts)
            resource_version = None
        except _WATCH_RETRIED as error:
            backoff = _pause(error, str(error), namespace, name, stop, on_error, backoff, timeouts)
            resource_version = None


def _pause(
    error: BaseException,
    text: str,
    namespace: str,
    name: str,
    stop: threading.Event,
    on_error: Callable[[BaseException], None] | None,
    backoff: float,
    timeouts: WatchTimeouts,
) -> float:
    """Report a watch error and wait before the next attempt; the next backoff."""
    if stop.is_set():
        return backoff
    if on_error is not None:
        on_error(error)
    log.warning("watch configmap %s/%s: %s; retrying in %.1f s", namespace, name, text, backoff)
    stop.wait(backoff)
    return min(backoff * 2, timeouts.max_retry_s)
