"""The in-pod Kubernetes client without a cluster: configuration, error messages, and how a watch of
one object resumes (after the server ends it, after 410 Gone, after a dropped connection).

The resume logic is driven by a scripted client (what each GET and watch request answers); the same
code against a real API server is in test_kube_cluster.py.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from oobleck.runtime.kube import (
    Gone,
    KubeApiError,
    KubeConfig,
    KubeConfigError,
    KubeError,
    WatchTimeouts,
    api_error,
    watch_object,
)


def test_in_cluster_config_reads_the_serviceaccount_folder(tmp_path):
    (tmp_path / "token").write_text("abc\n")
    (tmp_path / "ca.crt").write_text("---")
    (tmp_path / "namespace").write_text("team-a")
    config = KubeConfig.in_cluster(
        {
            "OOBLECK_SERVICEACCOUNT_DIR": str(tmp_path),
            "KUBERNETES_SERVICE_HOST": "[fd00::1]",
            "KUBERNETES_SERVICE_PORT": "6443",
        }
    )
    assert (config.host, config.port, config.namespace) == ("fd00::1", 6443, "team-a")
    assert config.token_file == tmp_path / "token" and config.ca_file == tmp_path / "ca.crt"


def test_in_cluster_config_names_what_is_missing(tmp_path):
    with pytest.raises(KubeConfigError, match="KUBERNETES_SERVICE_HOST"):
        KubeConfig.in_cluster({"OOBLECK_SERVICEACCOUNT_DIR": str(tmp_path)})
    with pytest.raises(KubeConfigError, match="token: missing"):
        KubeConfig.in_cluster({"OOBLECK_SERVICEACCOUNT_DIR": str(tmp_path), "KUBERNETES_SERVICE_HOST": "10.0.0.1"})


def test_api_errors_carry_status_reason_and_message():
    body = b'{"kind":"Status","status":"Failure","message":"pods \\"x\\" is forbidden: no","reason":"Forbidden","code":403}'
    error = api_error(403, body, "PATCH", "/api/v1/namespaces/n/pods/x")
    assert isinstance(error, KubeApiError) and not isinstance(error, Gone)
    assert str(error) == '403 Forbidden: PATCH /api/v1/namespaces/n/pods/x: pods "x" is forbidden: no'
    assert isinstance(api_error(410, b'{"reason":"Expired","message":"too old"}', "WATCH", "/p"), Gone)
    assert "not json at all" in str(api_error(500, b"not json at all", "GET", "/p"))


def cm(rv: str, value: str) -> dict[str, Any]:
    return {"metadata": {"name": "x", "resourceVersion": rv}, "data": {"v": value}}


class ScriptedClient:
    """Answers GETs with `objects` (in order, the last repeated) and watch requests with `watches`:
    each a list of events, or an exception raised after them. Records every watch's resourceVersion."""

    def __init__(self, objects: list[Any], watches: list[list[Any]], stop: threading.Event) -> None:
        self.objects, self.watches, self.stop = objects, watches, stop
        self.gets = 0
        self.watched_from: list[str] = []

    def get(self, path: str, query=None) -> dict[str, Any]:
        self.gets += 1
        item = self.objects[min(self.gets - 1, len(self.objects) - 1)]
        if isinstance(item, BaseException):
            raise item
        return item

    def watch(self, path, query, timeout_s, stop):
        self.watched_from.append(query["resourceVersion"])
        if not self.watches:
            self.stop.set()
            return
        for event in self.watches.pop(0):
            if isinstance(event, BaseException):
                raise event
            yield event


def follow(client: ScriptedClient, stop: threading.Event) -> list[str | None]:
    seen: list[str | None] = []
    watch_object(
        client,
        "/api/v1/namespaces/n/configmaps",
        "x",
        lambda obj: seen.append(None if obj is None else obj["data"]["v"]),
        stop,
        WatchTimeouts(retry_s=0.001, max_retry_s=0.001),
    )
    return seen


def test_watch_resumes_from_the_last_resource_version_and_bookmarks():
    stop = threading.Event()
    client = ScriptedClient(
        [cm("10", "a")],
        [
            [("MODIFIED", cm("11", "b"))],  # the server ends the watch (its timeout)
            [("BOOKMARK", {"metadata": {"resourceVersion": "15"}})],
            [("MODIFIED", cm("16", "c")), ("DELETED", cm("17", "c"))],
        ],
        stop,
    )
    assert follow(client, stop) == ["a", "b", "c", None]
    assert client.watched_from == ["10", "11", "15", "17"]
    assert client.gets == 1  # never re-read: every resume had a version


def test_watch_rereads_after_gone_and_after_errors():
    stop = threading.Event()
    client = ScriptedClient(
        [cm("10", "a"), cm("30", "b"), cm("40", "c")],
        [
            [Gone(410, "Expired", "too old resource version", "WATCH", "/p")],
            [("MODIFIED", cm("31", "b2")), KubeError("connection reset")],
        ],
        stop,
    )
    assert follow(client, stop) == ["a", "b", "b2", "c"]
    assert client.watched_from == ["10", "30", "40"]


def test_watch_of_a_missing_object_waits_for_its_creation():
    stop = threading.Event()

    class Missing(ScriptedClient):
        def get(self, path, query=None):
            if query is not None:  # the collection: its version is where the watch starts
                return {"metadata": {"resourceVersion": "5"}, "items": []}
            raise KubeApiError(404, "NotFound", 'configmaps "x" not found', "GET", path)

    client = Missing([], [[("ADDED", cm("6", "new"))]], stop)
    assert follow(client, stop) == [None, "new"]
    assert client.watched_from == ["5", "6"]
