"""The per-job coordinator: hosts the rendezvous store that must outlive any training worker.

A worker can die with its node; the store (and with it the "abort generation g" broadcast, the
heartbeats and the failure reports) must not. So a small coordinator process hosts the `TCPStore`
server: a pod of its own in a cluster, the launcher locally (embedded as `Coordinator`), or
`python -m oobleck.runtime.coordinator`.

Key layout (every name is built by a function below; nothing else spells keys):

    epoch                   the store's incarnation: a fresh token every time a server starts
    generation              the plan generation in force (written by the plan controller)
    gen{g}/abort            present once generation g is aborted; value: the first failure report
    gen{g}/ready/{worker}   present once the worker has adopted generation g
    failures                a queue of failure reports (JSON), consumed by the plan controller
    hb/{worker}             a worker's heartbeat counter (`add`), independent of generations
    progress/{worker}       the worker's last step event: {"generation", "step", "phase"}
    held/{worker}           the layers a worker holds and their step (the controller's copy sources),
                            its snapshots {step: layers} and its snapshot server's address (snapshot.py)
    snap/gen{g}/step{t}/done  ranks of generation g whose snapshot of step t reached their buddy
    snap/complete/{t}       present once some generation's ranks all finished their snapshot of step t
    gen{g}/commit/{step}/   "arrived" counter and "decision" (commit | commit-nonfinite | abort) of a step,
                            "nonfinite": what a rank found NaN/Inf (reconfig.py, nonfinite.py)
    nonfinite/{g}/{step}/{worker}  the newest snapshot step a worker holds, to agree on a rollback (nonfinite.py)
    e{epoch}/{job}/gen{g}/  the rendezvous namespace of generation g (process groups, see groups.py)

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
from dataclasses import dataclass

import torch.distributed as dist

log = logging.getLogger(__name__)

EPOCH_KEY = "epoch"
GENERATION_KEY = "generation"
FAILURES_QUEUE = "failures"


def abort_key(generation: int) -> str:
    """Present once `generation` is aborted: survivors `wait` on it (wakes in ~1.5 ms)."""
    return f"gen{generation}/abort"


def heartbeat_key(worker: str) -> str:
    return f"hb/{worker}"


def progress_key(worker: str) -> str:
    return f"progress/{worker}"


def ready_key(generation: int, worker: str) -> str:
    """Present once `worker` has adopted `generation` (peers then watch its heartbeat strictly)."""
    return f"gen{generation}/ready/{worker}"


def held_key(worker: str) -> str:
    """What a worker holds: {"generation", "step", "layers"} (the controller picks copy sources by it)."""
    return f"held/{worker}"


def snapshot_done_key(generation: int, step: int) -> str:
    """Counter: ranks of `generation` whose snapshot of `step` is captured and held by their buddy."""
    return f"snap/gen{generation}/step{step}/done"


def snapshot_complete_key(step: int) -> str:
    """Present once every rank of some generation finished its snapshot of `step`."""
    return f"snap/complete/{step}"


def commit_prefix(generation: int, step: int) -> str:
    return f"gen{generation}/commit/{step}/"


def epoch_prefix(epoch: str) -> str:
    """Prefix of every rendezvous in store incarnation `epoch` (groups.py adds `{job}/gen{g}/`).

    Group names must never repeat (pytorch#55967), and a recreated store may see a rendezvous that
    the previous incarnation already half-ran: the epoch makes every name new.
    """
    return f"e{epoch}/"


def worker_id(node: str, gpu: int) -> str:
    """A worker's identity across generations (its rank may change, its place does not)."""
    return f"{node}:{gpu}"


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
        return self._server.clone()

    def stop(self) -> None:
        """Stop the server: every client sees a network error at its next operation."""
        server, self._server = self._server, None
        # Dropping the last reference to the master store shuts the server down.
        del server

    def __enter__(self) -> Coordinator:
        return self.start() if self._server is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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


def is_store_loss(error: BaseException) -> bool:
    """Whether `error` means the connection to the store is gone (not a timeout on a key)."""
    return isinstance(error, dist.DistNetworkError) or (
        isinstance(error, RuntimeError)
        and any(text in str(error) for text in ("Broken pipe", "Connection reset", "Connection was likely closed"))
    )


def set_generation(store: dist.Store, generation: int) -> None:
    store.set(GENERATION_KEY, str(generation))


def current_generation(store: dist.Store) -> int | None:
    if not store.check([GENERATION_KEY]):
        return None
    return int(store.get(GENERATION_KEY))


def post_abort(store: dist.Store, generation: int, reason: dict) -> bool:
    """Abort `generation` (idempotent); returns True if this call was the first to abort it."""
    key = abort_key(generation)
    payload = json.dumps(reason, sort_keys=True)
    # compare_set with an empty expected value sets only if absent: the first reason wins.
    stored = store.compare_set(key, "", payload)
    return stored.decode() == payload


def aborted(store: dist.Store, generation: int) -> bool:
    return store.check([abort_key(generation)])


def wait_abort(store: dist.Store, generation: int, timeout_s: float) -> bool:
    """Block until `generation` is aborted or `timeout_s` passes; returns whether it was aborted."""
    try:
        store.wait([abort_key(generation)], datetime.timedelta(seconds=timeout_s))
        return True
    except RuntimeError as error:
        if is_store_loss(error):
            raise
        return False


def push_failure(store: dist.Store, report: dict) -> None:
    store.queue_push(FAILURES_QUEUE, json.dumps(report, sort_keys=True))


def pop_failures(store: dist.Store) -> list[dict]:
    """Every queued failure report, without blocking."""
    reports = []
    while store.queue_len(FAILURES_QUEUE) > 0:
        reports.append(json.loads(store.queue_pop(FAILURES_QUEUE, False)))
    return reports


def set_progress(store: dist.Store, worker: str, generation: int, step: int, phase: str) -> None:
    store.set(progress_key(worker), json.dumps({"generation": generation, "step": step, "phase": phase}))


def get_progress(store: dist.Store, workers: list[str]) -> dict[str, dict]:
    """Last progress event of each worker that reported one."""
    present = [w for w in workers if store.check([progress_key(w)])]
    if not present:
        return {}
    values = store.multi_get([progress_key(w) for w in present])
    return {w: json.loads(v) for w, v in zip(present, values)}


def main(argv: list[str] | None = None) -> int:
    """`python -m oobleck.runtime.coordinator`: host the store until SIGTERM / SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m oobleck.runtime.coordinator", description=__doc__.splitlines()[0])
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
