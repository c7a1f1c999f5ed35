"""The buddy transport of snapshots: plain TCP (not a process group: it must outlive generations and
take no part in their rendezvous or failure handling). A server stores what a buddy pushes."""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading

import torch

from oobleck.runtime.snapshot.holding import SnapshotStore

log = logging.getLogger("oobleck.runtime.snapshot.agent")


_HEADER = struct.Struct("!I")


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


def _receive_message(sock: socket.socket) -> dict:
    (size,) = _HEADER.unpack(_receive_exactly(sock, _HEADER.size))
    return json.loads(_receive_exactly(sock, size))


class SnapshotServer:
    """Accepts a peer's pushed snapshots into `store` (one thread per connection, all daemons).

    Protocol per push: messages {"kind": "layer", "step", "layer", "nbytes"} + payload, then
    {"kind": "end"}, answered {"ok": true} once every layer is stored.
    """

    def __init__(self, store: SnapshotStore, host: str = "0.0.0.0", port: int = 0) -> None:
        self.store = store
        self._listener = socket.create_server((host, port))
        self.port = self._listener.getsockname()[1]
        self._closed = False

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
            threading.Thread(target=self._serve, args=(sock,), name="snapshot-push", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        received = []
        try:
            with sock:
                while True:
                    header = _receive_message(sock)
                    if header["kind"] == "end":
                        for step, layer, data in received:
                            self.store.put(step, layer, data)
                        _send_message(sock, {"ok": True, "layers": len(received)})
                        received = []
                        return
                    data = _receive_exactly(sock, header["nbytes"])
                    tensor = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
                    received.append((header["step"], header["layer"], tensor))
        except (OSError, ConnectionError, ValueError) as error:
            # The owner died mid-push: what it sent is dropped (a half push is never reported).
            log.warning(json.dumps({"event": "snapshot-push-broken", "error": str(error)[:200]}))


def push(address: str, step: int, layers: dict[int, torch.Tensor], timeout_s: float = 60.0) -> None:
    """Send one step's snapshots to a buddy's server and wait for its acknowledgement."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        for layer, data in sorted(layers.items()):
            _send_message(sock, {"kind": "layer", "step": step, "layer": layer, "nbytes": data.numel()}, data)
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
