"""A small synchronous Kubernetes API client for worker pods (standard library only).

The runtime runs in threads (no asyncio), and needs only a handful of calls on a few objects: get
an object, JSON-merge-patch it, and watch one named object. So this is http.client + ssl, with:

- in-cluster configuration: the service-account folder (`$OOBLECK_SERVICEACCOUNT_DIR`, else
  /var/run/secrets/kubernetes.io/serviceaccount: token, ca.crt, namespace) and
  KUBERNETES_SERVICE_HOST / KUBERNETES_SERVICE_PORT;
- errors that say what failed: `KubeApiError` carries the HTTP status, the Status reason and the
  API server's message (e.g. `403 Forbidden: GET /api/v1/...: pods "x" is forbidden: ...`);
- `watch_object`: a watch of one named object that survives everything a long watch meets
  (server timeouts, dropped connections, 410 Gone) by resuming from the last resourceVersion
  or, when that is too old, re-reading the object.

One HTTPS connection per thread, kept alive between calls; a call that finds its connection
dropped is retried once on a fresh one. The token is re-read when it changes on disk (projected
tokens rotate).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import ssl
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

log = logging.getLogger("oobleck.runtime.kube")

SERVICEACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
SERVICEACCOUNT_DIR_ENV = "OOBLECK_SERVICEACCOUNT_DIR"
MERGE_PATCH = "application/merge-patch+json"


class KubeError(RuntimeError):
    """The API could not be reached or answered nonsense (a transport problem, not a refusal)."""


class KubeConfigError(KubeError):
    """No usable in-cluster configuration (missing env, token or CA file)."""


class KubeApiError(KubeError):
    """The API server refused a request: `status` (HTTP code), `reason` and `message` from its Status."""

    def __init__(self, status: int, reason: str, message: str, method: str, path: str) -> None:
        self.status, self.reason, self.message, self.method, self.path = status, reason, message, method, path
        super().__init__(f"{status} {reason}: {method} {path}: {message}")


class Gone(KubeApiError):
    """410 Gone: the resourceVersion a watch resumed from is too old (compacted): re-read the object."""


@dataclass(frozen=True)
class KubeConfig:
    """Where the API server is and how to authenticate to it."""

    host: str
    port: int
    token_file: Path | None
    ca_file: Path | None
    namespace: str = "default"
    request_timeout_s: float = 15.0
    """Timeout of one non-watch call (connect + answer)."""

    @classmethod
    def in_cluster(cls, env: Mapping[str, str] | None = None, request_timeout_s: float = 15.0) -> KubeConfig:
        """From a pod's environment: the service-account folder and KUBERNETES_SERVICE_HOST/PORT."""
        env = os.environ if env is None else env
        folder = Path(env.get(SERVICEACCOUNT_DIR_ENV) or SERVICEACCOUNT_DIR)
        host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise KubeConfigError("KUBERNETES_SERVICE_HOST: not set (not running in a pod?)")
        if not port.isdigit():
            raise KubeConfigError(f"KUBERNETES_SERVICE_PORT: expected a port number, got {port!r}")
        token, ca = folder / "token", folder / "ca.crt"
        for path in (token, ca):
            if not path.is_file():
                raise KubeConfigError(
                    f"{path}: missing (the pod's service-account token; {SERVICEACCOUNT_DIR_ENV} names another folder)"
                )
        namespace_file = folder / "namespace"
        namespace = namespace_file.read_text().strip() if namespace_file.is_file() else "default"
        return cls(host.strip("[]"), int(port), token, ca, namespace, request_timeout_s)


def _status_message(body: bytes) -> tuple[str, str]:
    """(reason, message) of a Status body; the raw text when it is not one."""
    try:
        status = json.loads(body)
        return str(status.get("reason") or ""), str(status.get("message") or "")
    except (ValueError, AttributeError):
        return "", body.decode(errors="replace")[:500]


def api_error(status: int, body: bytes, method: str, path: str) -> KubeApiError:
    reason, message = _status_message(body)
    kind = Gone if status == 410 else KubeApiError
    return kind(status, reason or http.client.responses.get(status, "Error"), message, method, path)


class KubeClient:
    """Synchronous calls to the API server; safe to share between threads (one connection each)."""

    def __init__(self, config: KubeConfig) -> None:
        self.config = config
        self._ssl = ssl.create_default_context(cafile=str(config.ca_file) if config.ca_file else None)
        self._local = threading.local()
        self._token: tuple[float, str] | None = None  # (mtime, token)
        self._token_lock = threading.Lock()

    @classmethod
    def in_cluster(cls, env: Mapping[str, str] | None = None) -> KubeClient:
        return cls(KubeConfig.in_cluster(env))

    @property
    def namespace(self) -> str:
        return self.config.namespace

    # -- transport ---------------------------------------------------------------------------------

    def _bearer(self) -> str:
        path = self.config.token_file
        if path is None:
            return ""
        with self._token_lock:
            mtime = path.stat().st_mtime
            if self._token is None or self._token[0] != mtime:
                self._token = (mtime, path.read_text().strip())
            return self._token[1]

    def _connect(self, timeout: float | None) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(self.config.host, self.config.port, timeout=timeout, context=self._ssl)

    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "oobleck-runtime"}
        token = self._bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """One call; the decoded JSON answer. Raises KubeApiError (the server refused) or KubeError."""
        url = path + (f"?{urlencode(query)}" if query else "")
        payload = None if body is None else json.dumps(body).encode()
        headers = self._headers(content_type if payload is not None else None)
        for attempt in range(2):
            connection: Any = getattr(self._local, "connection", None)
            fresh = connection is None
            if fresh:
                connection = self._local.connection = self._connect(self.config.request_timeout_s)
            try:
                connection.request(method, url, body=payload, headers=headers)
                response = connection.getresponse()
                data = response.read()
            except (OSError, http.client.HTTPException) as error:
                connection.close()
                self._local.connection = None
                # A kept-alive connection the server closed meanwhile: retry once on a new one.
                if fresh or attempt:
                    raise KubeError(f"{method} {path}: {type(error).__name__}: {error}") from error
                continue
            if response.will_close:
                connection.close()
                self._local.connection = None
            if response.status >= 400:
                raise api_error(response.status, data, method, path)
            try:
                return json.loads(data) if data else {}
            except ValueError as error:
                raise KubeError(f"{method} {path}: answer is not JSON: {data[:200]!r}") from error
        raise AssertionError("unreachable")

    def get(self, path: str, query: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return self.request("GET", path, query=query)

    def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A JSON merge patch (RFC 7386): maps merge, `None` deletes a key, lists are replaced."""
        return self.request("PATCH", path, patch, content_type=MERGE_PATCH)

    def watch(
        self,
        path: str,
        query: Mapping[str, Any] | None = None,
        timeout_s: float = 60.0,
        stop: threading.Event | None = None,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Stream (type, object) events of a collection watch until the server ends it.

        `path` is the collection (e.g. /api/v1/namespaces/ns/configmaps); `query` adds the
        fieldSelector and resourceVersion. The server ends the stream after `timeout_s`; `stop`
        ends it from another thread (the socket is shut down). An ERROR event is raised as
        KubeApiError (Gone for 410)."""
        params = {
            **(query or {}),
            "watch": "1",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(max(1, int(timeout_s))),
        }
        url = f"{path}?{urlencode(params)}"
        connection = self._connect(self.config.request_timeout_s)
        watcher = None
        try:
            try:
                connection.request("GET", url, headers=self._headers(None))
                response = connection.getresponse()
            except (OSError, http.client.HTTPException) as error:
                raise KubeError(f"watch {path}: {type(error).__name__}: {error}") from error
            if response.status >= 400:
                raise api_error(response.status, response.read(), "GET", url)
            # Waiting for the next event may take up to the server's timeout; the read timeout must not
            # end a healthy watch first.
            if connection.sock is not None:
                connection.sock.settimeout(timeout_s + 30)
            if stop is not None:
                watcher = threading.Thread(
                    target=_close_on, args=(stop, connection), daemon=True, name="oobleck-kube-watch-stop"
                )
                watcher.start()
            while stop is None or not stop.is_set():
                try:
                    line = response.readline()
                except (OSError, http.client.HTTPException, ValueError) as error:
                    if stop is not None and stop.is_set():
                        return
                    raise KubeError(f"watch {path}: {type(error).__name__}: {error}") from error
                if not line:
                    return  # the server ended the watch (its timeout): the caller resumes
                line = line.strip()
                if not line:
                    continue
                try:
                    event = json.loads(line)
                except ValueError as error:
                    raise KubeError(f"watch {path}: undecodable event {line[:200]!r}") from error
                kind, obj = event.get("type", ""), event.get("object") or {}
                if kind == "ERROR":
                    raise api_error(int(obj.get("code") or 500), json.dumps(obj).encode(), "WATCH", path)
                yield kind, obj
        finally:
            if stop is not None and watcher is not None:
                _done_watching(connection)
            connection.close()


_WATCH_DONE = "_oobleck_watch_done"


def _done_watching(connection: http.client.HTTPSConnection) -> None:
    setattr(connection, _WATCH_DONE, True)


def _close_on(stop: threading.Event, connection: http.client.HTTPSConnection) -> None:
    """Shut a watch's socket down once `stop` is set (unblocks the reader)."""
    while not stop.wait(0.2):
        if getattr(connection, _WATCH_DONE, False):
            return
    sock = connection.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{quote(namespace)}/pods/{quote(name)}"


def configmaps_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{quote(namespace)}/configmaps"


@dataclass(frozen=True)
class WatchTimeouts:
    server_s: float = 60.0
    """How long one watch request lasts before the server ends it (then it is resumed)."""
    retry_s: float = 0.2
    """First pause after an error; doubles up to `max_retry_s`."""
    max_retry_s: float = 5.0


def watch_object(
    client: KubeClient,
    collection: str,
    name: str,
    on_object: Callable[[dict[str, Any] | None], None],
    stop: threading.Event,
    timeouts: WatchTimeouts = WatchTimeouts(),
    on_error: Callable[[BaseException], None] | None = None,
) -> None:
    """Follow one named object until `stop`: `on_object(obj)` with its current state, then every change
    (None when it does not exist or was deleted). Blocks; run it in a thread.

    Starts with a GET (its resourceVersion is where the watch begins), resumes a watch that ended
    from the last resourceVersion seen (bookmarks included), and after 410 Gone or any error
    re-reads the object first, so no change is ever missed, only possibly delivered twice."""
    resource_version: str | None = None
    backoff = timeouts.retry_s
    while not stop.is_set():
        try:
            if resource_version is None:
                try:
                    obj: dict[str, Any] | None = client.get(f"{collection}/{quote(name)}")
                except KubeApiError as error:
                    if error.status != 404:
                        raise
                    obj = None
                on_object(obj)
                if obj is not None:
                    resource_version = obj["metadata"]["resourceVersion"]
                else:
                    # Absent: watch the (empty) collection from its current version for the creation.
                    listing = client.get(collection, {"fieldSelector": f"metadata.name={name}"})
                    resource_version = listing["metadata"]["resourceVersion"]
            query = {"fieldSelector": f"metadata.name={name}", "resourceVersion": resource_version}
            for kind, obj in client.watch(collection, query, timeouts.server_s, stop):
                resource_version = (obj.get("metadata") or {}).get("resourceVersion") or resource_version
                if kind in ("ADDED", "MODIFIED"):
                    on_object(obj)
                elif kind == "DELETED":
                    on_object(None)
                backoff = timeouts.retry_s
        except Gone:
            resource_version = None  # too old: read the object again
        except (KubeError, OSError, KeyError) as error:
            if stop.is_set():
                return
            if on_error is not None:
                on_error(error)
            log.warning("watch %s/%s: %s; retrying in %.1f s", collection, name, error, backoff)
            resource_version = None
            stop.wait(backoff)
            backoff = min(backoff * 2, timeouts.max_retry_s)
