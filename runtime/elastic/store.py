"""Connections to the coordinator's store: timeouts, connecting (with the store's epoch), telling a lost
connection from a timeout, and the main thread's reconnecting handle."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

import torch.distributed as dist

T = TypeVar("T")

EPOCH_KEY = "epoch"
"""The store's incarnation: a fresh token every time a server starts (see coordinator.py)."""


@dataclass(frozen=True)
class StoreTimeouts:
    """Every store timeout in one place; all overridable."""

    connect_s: float = 5.0
    """How long one connection attempt may take (c10d's connect + validation has ~1 s tails on a
    loaded host: ~1 % of attempts exceeded 1 s in our measurements)."""
    op_s: float = 5.0
    """Default timeout of a store operation (get / wait / queue_pop) on a client."""
    reconnect_s: float = 60.0
    """How long a client keeps trying to reach a (recreated) server before giving up."""
    retry_s: float = 0.05
    """Pause between connection attempts."""


class StoreUnavailable(RuntimeError):
    """The coordinator could not be reached within `StoreTimeouts.reconnect_s`."""


def connect(host: str, port: int, timeouts: StoreTimeouts = StoreTimeouts()) -> tuple[dist.Store, str]:
    """Connect to the coordinator, retrying until `timeouts.reconnect_s`; returns (store, epoch).

    Used at start and after a store loss: the returned epoch tells whether the server is a new
    incarnation (then every key is gone and rendezvous prefixes change).
    """
    deadline = time.monotonic() + timeouts.reconnect_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            store = dist.TCPStore(
                host, port, None, False, datetime.timedelta(seconds=timeouts.connect_s), wait_for_workers=False
            )
            # The epoch is written right after the server starts; wait for it briefly.
            store.wait([EPOCH_KEY], datetime.timedelta(seconds=timeouts.connect_s))
            epoch = store.get(EPOCH_KEY).decode()
            store.set_timeout(datetime.timedelta(seconds=timeouts.op_s))
            return store, epoch
        except (RuntimeError, OSError) as error:  # DistNetworkError / DistStoreError are RuntimeErrors
            last_error = error
            time.sleep(timeouts.retry_s)
    raise StoreUnavailable(f"coordinator {host}:{port} unreachable for {timeouts.reconnect_s:.1f} s: {last_error}")


class Endpoint(Protocol):
    """Where the coordinator's store listens, asked again on every (re)connect: a recreated coordinator
    may come back elsewhere (a new pod IP)."""

    def resolve(self, wait_s: float) -> tuple[str, int]:
        """(host, port), waiting up to `wait_s` for the coordinator to be findable."""
        ...


@dataclass(frozen=True)
class FixedEndpoint:
    """A coordinator at a known address (`oobleck launch`, tests)."""

    host: str
    port: int

    def resolve(self, wait_s: float) -> tuple[str, int]:
        return self.host, self.port


def connect_endpoint(
    endpoint: Endpoint, timeouts: StoreTimeouts = StoreTimeouts()
) -> tuple[dist.Store, str, tuple[str, int]]:
    """`connect`, resolving `endpoint` again between short attempts until `timeouts.reconnect_s`;
    returns (store, epoch, the address connected to)."""
    deadline = time.monotonic() + timeouts.reconnect_s
    attempt = replace(timeouts, reconnect_s=min(5.0, timeouts.reconnect_s))
    while True:
        address = endpoint.resolve(max(0.0, deadline - time.monotonic()))
        try:
            return (*connect(*address, attempt), address)
        except StoreUnavailable:
            if time.monotonic() >= deadline:
                raise


def is_store_loss(error: BaseException) -> bool:
    """Whether `error` means the connection to the store is gone (not a timeout on a key)."""
    return isinstance(error, dist.DistNetworkError) or (
        isinstance(error, RuntimeError)
        and any(text in str(error) for text in ("Broken pipe", "Connection reset", "Connection was likely closed"))
    )


class ControlStore:
    """The main thread's connection to the coordinator; replaced after a coordinator restart."""

    def __init__(self, endpoint: Endpoint, timeouts: StoreTimeouts = StoreTimeouts()) -> None:
        self.endpoint = endpoint
        self.timeouts = timeouts
        self.store, self.epoch, self.address = connect_endpoint(endpoint, timeouts)

    def reconnect(self) -> None:
        self.store, self.epoch, self.address = connect_endpoint(self.endpoint, self.timeouts)


class KeptConnection:
    """A connection kept for a critical path (connecting takes ~0.2 s on a busy host), connected on first
    use and once more when the coordinator restarted under it. The caller serialises its use."""

    def __init__(self, connect: Callable[[], dist.Store], store: dist.Store | None = None) -> None:
        self._connect = connect
        self._store = store

    def run(self, action: Callable[[dist.Store], T]) -> T:
        """`action(store)`; on a lost connection, reconnect and run it once more."""
        for attempt in range(2):
            if self._store is None:
                self._store = self._connect()
            try:
                return action(self._store)
            except RuntimeError as error:
                self._store = None
                if not is_store_loss(error) or attempt:
                    raise
        raise AssertionError("unreachable: the second attempt returns or raises")
