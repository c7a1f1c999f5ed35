"""The per-job coordinator: hosts the rendezvous store that must outlive any training worker.

A worker can die with its node; the store (and with it the "abort generation g" broadcast, the
heartbeats and the failure reports) must not. So a small coordinator process hosts the `TCPStore`
server: a pod of its own in a cluster, the launcher locally (embedded as `Coordinator`), or
`python -m oobleck.runtime.elastic.coordinator`.

See keys.py for the key layout (every key is spelled there).

Losing the coordinator is recoverable: a recreated server on the same address has a new `epoch`.
Established process groups do not need the store, so training continues through the outage (only
heartbeat detection pauses; collective errors still detect deaths). When a worker's client
reconnects and sees the new epoch, it aborts its generation (a rendezvous or a step commit may have
been cut in half); the controller publishes the next generation, and workers rendezvous under the
new `e{epoch}/...` prefix, i.e. under names the new incarnation has never seen.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import signal
import socket
import sys
import threading
import time

import torch.distributed as dist

from oobleck.runtime.elastic.store import EPOCH_KEY

log = logging.getLogger(__name__)


def _listen_fd(host: str, port: int) -> tuple[int | None, int]:
    """A listening socket bound to `host` alone for the store server, and its port (None: every address).

    TCPStore's server otherwise listens on every address: two jobs' coordinators on one machine (local
    nodes give each pod its own loopback address, but the same port) would collide. The store takes
    ownership of the descriptor.
    """
    if host in ("", "0.0.0.0", "::"):
        return None, port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restarts reuse the port at once
        listener.bind((host, port))
        listener.listen(socket.SOMAXCONN)
    except OSError:
        listener.close()
        raise
    port = listener.getsockname()[1]
    return listener.detach(), port


class Coordinator:
    """Hosts the job's `TCPStore` server. One instance per job; `start()` begins a new epoch.

    The server listens on `host` only (any address when it is 0.0.0.0).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, op_timeout_s: float = 5.0) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"port: must be in 0..65535, got {port}")
        self.host = host
        self._requested_port = port
        self._op_timeout = datetime.timedelta(seconds=op_timeout_s)
        self._server: dist.TCPStore | None = None
        self.epoch = ""

    def start(self) -> Coordinator:
        """Start (or restart, on the same port) the server and stamp a new epoch."""
        if self._server is not None:
            raise RuntimeError("coordinator: already started")
        port = self._requested_port
        deadline = time.monotonic() + 20.0
        while True:
            try:
                fd, bound = _listen_fd(self.host, port)
                self._server = dist.TCPStore(
                    self.host, bound, None, True, self._op_timeout, wait_for_workers=False, master_listen_fd=fd
                )
                break
            except (RuntimeError, OSError) as error:
                # A restart on a fixed port can race the old listener's close, and on a loaded machine
                # the server's own first client occasionally times out validating: retry briefly.
                if time.monotonic() > deadline:
                    raise RuntimeError(f"coordinator: cannot listen on {self.host}:{port}: {error}") from error
                time.sleep(0.05)
        # Remember the port so that a restart comes back on the address workers know.
        self._requested_port = self._server.port
        # time_ns is unique per restart on one host and orders incarnations for humans.
        self.epoch = str(time.time_ns())
        self._server.set(EPOCH_KEY, self.epoch)
        log.info("coordinator listening on %s:%d epoch %s", self.host, self.port, self.epoch)
        return self

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("coordinator: not started")
        return self._server.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def store(self) -> dist.Store:
        """A new client connection (one per thread: a client serialises its operations)."""
        if self._server is None:
            raise RuntimeError("coordinator: not started")
        deadline = time.monotonic() + 20.0
        while True:
            try:
                return self._server.clone()
            except dist.DistNetworkError:
                # On a loaded machine a client occasionally times out connecting to its own server
                # (the op timeout also bounds the connect): retry briefly, as start() does.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        """Stop the server: every client sees a network error at its next operation."""
        server, self._server = self._server, None
        # Dropping the last reference to the master store shuts the server down.
        del server

    def __enter__(self) -> Coordinator:
        return self.start() if self._server is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """`python -m oobleck.runtime.elastic.coordinator`: host the store until SIGTERM / SIGINT."""
    parser = argparse.ArgumentParser(
        prog="python -m oobleck.runtime.elastic.coordinator", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--host",
        default=os.environ.get("OOBLECK_POD_IP") or "0.0.0.0",
        help="address to listen on (default: $OOBLECK_POD_IP, else every address)",
    )
    parser.add_argument("--port", type=int, default=29400, help="port to listen on (0: any free port)")
    parser.add_argument("--op-timeout", type=float, default=5.0, help="server-side default op timeout, seconds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s coordinator %(message)s")
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    coordinator = Coordinator(args.host, args.port, op_timeout_s=args.op_timeout).start()
    # One machine-readable line: what a supervisor needs to point workers here.
    line = {"host": args.host, "port": coordinator.port, "epoch": coordinator.epoch, "pid": os.getpid()}
    print(json.dumps(line), flush=True)
    stop.wait()
    coordinator.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
