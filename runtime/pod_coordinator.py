"""A worker pod's way to the coordinator: its pod IP through the API, re-resolved on every reconnect."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from oobleck.runtime.kube import KubeApiError, KubeClient, KubeError, pod_path

log = logging.getLogger("oobleck.runtime.pod")


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


def elastic_classes():
    """ControlStore / FailureDetector subclasses that resolve the coordinator's address on every (re)connect
    (built on first use: importing torch takes seconds, and `--help` or env errors need none of it)."""
    from oobleck.runtime.coordinator import StoreUnavailable
    from oobleck.runtime.health import FailureDetector
    from oobleck.runtime.reconfig import ControlStore

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

    return PodControlStore, PodFailureDetector
