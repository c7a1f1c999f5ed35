"""A worker pod's way to the coordinator: its pod IP through the API, re-resolved on every reconnect."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from oobleck.runtime.backends.pod.kube import TRANSPORT_ERRORS, ApiException, Kube, api_error_text

log = logging.getLogger("oobleck.runtime.backends.pod.main")


def coordinator_ip(pod: Mapping[str, Any] | None) -> str | None:
    """The pod IP of a Running, not terminating coordinator pod, else None."""
    if not pod or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None
    status = pod.get("status") or {}
    return status.get("podIP") or None if status.get("phase") == "Running" else None


class CoordinatorAddress:
    """An `elastic.store.Endpoint`: where the coordinator's store listens, its pod's IP (read through the API, waiting until the
    pod runs), else the host of OOBLECK_STORE (the headless Service's DNS name, which resolves on a
    real cluster). `resolve` is called again on every reconnect: a recreated coordinator pod may
    have a new IP."""

    def __init__(
        self, kube: Kube | None, namespace: str, pod: str, fallback_host: str, port: int, poll_s: float = 0.25
    ) -> None:
        self.kube, self.namespace, self.pod = kube, namespace, pod
        self.fallback = (fallback_host, port)
        self.port, self.poll_s = port, poll_s
        self.last: tuple[str, int] = self.fallback

    def resolve(self, wait_s: float) -> tuple[str, int]:
        deadline = time.monotonic() + wait_s
        while self.kube is not None:
            try:
                ip = coordinator_ip(self.kube.read_pod(self.namespace, self.pod))
                if ip is not None:
                    self.last = (ip, self.port)
                    return self.last
            except ApiException as error:
                if error.status in (401, 403):
                    log.warning(json.dumps({"event": "coordinator-lookup-forbidden", "error": api_error_text(error)}))
                    break  # no permission: the DNS name is all there is
                if error.status != 404:
                    log.warning(json.dumps({"event": "coordinator-lookup-failed", "error": api_error_text(error)}))
            except TRANSPORT_ERRORS as error:
                log.warning(json.dumps({"event": "coordinator-lookup-failed", "error": str(error)[:300]}))
            if time.monotonic() >= deadline:
                break
            time.sleep(self.poll_s)
        self.last = self.fallback
        return self.last
