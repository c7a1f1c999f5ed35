"""Reads that tests poll several times a second, over one kept connection of the official client.

A kubectl process per read costs about 0.08 s of CPU (a Go binary's start and a TLS handshake; process
accounting of a full suite run, 2026-11-27). Writes and one-off reads stay with kubectl (`Cluster.kubectl`),
which is what a user types."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kubernetes.client import CoreV1Api, CustomObjectsApi
from kubernetes.config import new_client_from_config

READ_TIMEOUT_S = 10.0


class ClusterReads:
    """GETs and LISTs against the cluster behind `kubeconfig`, answered as `kubectl get -o json` prints them."""

    def __init__(self, kubeconfig: str) -> None:
        api = new_client_from_config(config_file=kubeconfig)
        self._core, self._custom = CoreV1Api(api), CustomObjectsApi(api)

    def _read(self, call: Callable[..., Any], *args: Any, **query: Any) -> dict[str, Any]:
        response = call(*args, _preload_content=False, _request_timeout=READ_TIMEOUT_S, **query)
        return json.loads(response.data)

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        return self._read(self._core.read_namespaced_pod, name, namespace)

    def pods(self, namespace: str, label_selector: str = "") -> list[dict[str, Any]]:
        return self._read(self._core.list_namespaced_pod, namespace, label_selector=label_selector)["items"]

    def config_map(self, namespace: str, name: str) -> dict[str, Any]:
        return self._read(self._core.read_namespaced_config_map, name, namespace)

    def events(self, namespace: str, field_selector: str = "") -> list[dict[str, Any]]:
        return self._read(self._core.list_namespaced_event, namespace, field_selector=field_selector)["items"]

    def custom(self, group: str, version: str, plural: str, namespace: str, name: str) -> dict[str, Any]:
        return self._read(self._custom.get_namespaced_custom_object, group, version, namespace, plural, name)
