"""The buddy transport of snapshots: plain TCP (not a process group: it must outlive generations and
take no part in their rendezvous or failure handling). A server stores what a buddy pushes."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable, Mapping

import torch

from oobleck.api.addresses import parse_host_port
from oobleck.runtime.snapshot.holding import SnapshotStore

log = logging.getLogger("oobleck.runtime.snapshot.agent")


_HEADER = struct.Struct("!I")
MAX_HEADER_BYTES = 4096
"""Largest header a peer may announce: a header is a few small fields; a longer claim is refused unread."""


class PushRefused(ConnectionError):
    """A push that breaks the protocol's bounds or whose checksum does not verify (nothing of it is stored)."""


def payload_digest(key: bytes | None, step: int, layer: int, payload: bytes | bytearray | memoryview) -> str:
    """The checksum a push carries for one layer: HMAC-SHA256 under the job key over (step, layer, bytes),
    or plain SHA-256 over the bytes without a key (corruption, not forgery, is caught then)."""
    if key is None:
        return hashlib.sha256(payload).hexdigest()
    mac = hmac.new(key, f"snapshot:{step}:{layer}:".encode(), hashlib.sha256)
    mac.update(payload)
    return mac.hexdigest()


def _send_message(sock: socket.socket, header: dict, payload: torch.Tensor | None = None) -> None:
    data = json.dumps(header).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)
    if payload is not None and payload.numel():
        sock.sendall(memoryview(payload.contiguous().numpy()))


def _receive_exactly(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {size} bytes")
        got += n
    return buffer


def _receive_message(sock: socket.socket, limit: int = MAX_HEADER_BYTES) -> dict:
    (size,) = _HEADER.unpack(_receive_exactly(sock, _HEADER.size))
    if size > limit:
        raise PushRefused(f"header of {size} bytes announced, at most {limit} accepted")
    header = json.loads(_receive_exactly(sock, size))
    if not isinstance(header, dict):
        raise PushRefused(f"header is a {type(header).__name__}, not an object")
    return header


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _layer_header(header: dict, layer_nbytes: Mapping[int, int] | None) -> tuple[int, int, int, str]:
    """(step, layer, nbytes, digest) of a layer header, refused unless within the layer's known state size."""
    step, layer, nbytes, digest = (header.get(k) for k in ("step", "layer", "nbytes", "digest"))
    if not (_is_count(step) and _is_count(layer) and _is_count(nbytes)):
        raise PushRefused(f"layer header {str(header)[:200]}: step, layer and nbytes must be integers >= 0")
    assert isinstance(step, int) and isinstance(layer, int) and isinstance(nbytes, int)
    if not isinstance(digest, str):
        raise PushRefused(f"layer header of layer {layer}: no digest")
    if layer_nbytes is not None:
        if layer not in layer_nbytes:
            raise PushRefused(f"layer {layer}: not a layer of this model")
        if nbytes != layer_nbytes[layer]:
            raise PushRefused(f"layer {layer}: {nbytes} bytes announced, its state has {layer_nbytes[layer]}")
    return step, layer, nbytes, digest


class SnapshotServer:
    """Accepts a peer's pushed snapshots into `store` (one daemon thread per connection, at most
    `max_connections` at once: more are closed at once).

    Protocol per push: messages {"kind": "layer", "step", "layer", "nbytes", "digest"} + payload, then
    {"kind": "end"}, answered {"ok": true} once every layer is verified and stored. Bounds: a header of at
    most MAX_HEADER_BYTES, a payload of exactly the layer's state size (`layer_nbytes`, when known), a
    digest (`payload_digest` under `key`) that must match before anything is stored, and `timeout_s` on
    every receive, so a slow or silent client is dropped.
    """

    def __init__(
        self,
        store: SnapshotStore,
        host: str = "0.0.0.0",
        port: int = 0,
        *,
        layer_nbytes: Mapping[int, int] | None = None,
        key: bytes | None = None,
        timeout_s: float = 30.0,
        max_connections: int = 8,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.layer_nbytes = dict(layer_nbytes) if layer_nbytes is not None else None
        self.key = key
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._on_refused = on_refused
        self._listener = socket.create_server((host, port))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self.refused = 0
        """pushes refused for breaking a bound or failing verification"""

    def start(self) -> SnapshotServer:
        threading.Thread(target=self._accept, name="snapshot-server", daemon=True).start()
        return self

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                sock.close()  # too many pushes at once: a buddy retries at its next snapshot
                continue
            sock.settimeout(self.timeout_s)
            threading.Thread(target=self._serve, args=(sock,), name="snapshot-push", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        received = []
        try:
            while True:
                header = _receive_message(sock)
                if header.get("kind") == "end":
                    for step, layer, data in received:
                        self.store.put(step, layer, data)
                    _send_message(sock, {"ok": True, "layers": len(received)})
                    received = []
                    return
                step, layer, nbytes, digest = _layer_header(header, self.layer_nbytes)
                data = _receive_exactly(sock, nbytes)
                if not hmac.compare_digest(digest, payload_digest(self.key, step, layer, data)):
                    raise PushRefused(f"layer {layer} of step {step}: digest does not match its bytes")
                tensor = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
                received.append((step, layer, tensor))
        except PushRefused as error:
            self.refused += 1
            log.warning(json.dumps({"event": "snapshot-push-refused", "error": str(error)[:200]}))
            if self._on_refused is not None:
                self._on_refused(str(error))
        except (OSError, ConnectionError, ValueError) as error:
            # The owner died mid-push or went silent: what it sent is dropped (a half push is never reported).
            log.warning(json.dumps({"event": "snapshot-push-broken", "error": str(error)[:200]}))
        finally:
            # The slot is free before the client sees its connection closed: it may connect again at once.
            self._slots.release()
            sock.close()


def push(
    address: str, step: int, layers: dict[int, torch.Tensor], timeout_s: float = 60.0, key: bytes | None = None
) -> None:
    """Send one step's snapshots to a buddy's server and wait for its acknowledgement (each layer with its
    `payload_digest` under the job's `key`)."""
    with socket.create_connection(parse_host_port(address), timeout=timeout_s) as sock:
        for layer, data in sorted(layers.items()):
            digest = payload_digest(key, step, layer, memoryview(data.contiguous().numpy()))
            header = {"kind": "layer", "step": step, "layer": layer, "nbytes": data.numel(), "digest": digest}
            _send_message(sock, header, data)
        _send_message(sock, {"kind": "end"})
        reply = _receive_message(sock)
        if not reply.get("ok"):
            raise ConnectionError(f"snapshot push of step {step} to {address}: refused: {reply}")


def local_address(peer_host: str) -> str:
    """The address peers reach this worker at: $OOBLECK_POD_IP, else the interface that routes to `peer_host`."""
    if os.environ.get("OOBLECK_POD_IP"):
        return os.environ["OOBLECK_POD_IP"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((peer_host, 9))  # UDP: no packet is sent, the kernel just picks the route
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"
