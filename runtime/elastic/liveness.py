"""Liveness probes: a responder every worker runs, and the probe its peers send when its heartbeats stop.

The responder is a TCPStore server of its own, answered by C++ threads without Python's GIL: a worker
starved of CPU or of the GIL still answers, while a dead process refuses the connection, a stopped one
(or a frozen host) accepts in the kernel but never answers, and a partitioned one is not reached.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time

import torch.distributed as dist

from oobleck.api.addresses import host_port, parse_host_port
from oobleck.runtime.elastic.coordinator import _listen_fd


class LivenessResponder:
    """Answers liveness probes from C++ threads: a TCPStore server of its own, which needs no GIL.

    It lives exactly as long as the worker's process runs: a dead process refuses the connection, a
    stopped one (or a frozen host) accepts in the kernel but never answers, a partitioned one is not
    reached. It listens on `advertise` alone (the pod IP: peers reach it there, nothing else should).
    """

    def __init__(self, advertise: str) -> None:
        fd, port = _listen_fd(advertise, 0)
        self._server = dist.TCPStore(advertise, port, is_master=True, wait_for_workers=False, master_listen_fd=fd)
        self.address = host_port(advertise, self._server.port)


def advertised_host(coordinator_host: str) -> str:
    """The address peers reach this worker at: $OOBLECK_POD_IP, else the interface that routes to the coordinator."""
    if os.environ.get("OOBLECK_POD_IP"):
        return os.environ["OOBLECK_POD_IP"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        try:
            udp.connect((coordinator_host, 9))  # UDP: nothing is sent, the kernel only picks the route
            return udp.getsockname()[0]
        except OSError:
            return "127.0.0.1"


NO_ANSWER = "accepted but did not answer"
"""probe_liveness's words for a peer whose kernel accepted the connection but whose responder said nothing."""


def runnable_now(loadavg: str) -> int:
    """Tasks runnable at the instant /proc/loadavg (`loadavg`, "0.52 0.58 0.59 7/345 12345") was read: its
    fourth field's numerator, less the reading thread itself."""
    return max(0, int(loadavg.split()[3].split("/")[0]) - 1)


def host_overloaded(per_core: float) -> bool:
    """Whether this host has more than `per_core` runnable tasks per core, by its 1-minute load average or
    at this instant: a load that began seconds ago reaches the average only over a minute, but already
    holds a peer off the CPU (seen: two busy processes started beside a 4-worker job on 2 cores made a
    probe go unanswered while the average still read under 2 per core)."""
    limit = per_core * (os.cpu_count() or 1)
    try:
        if os.getloadavg()[0] > limit:
            return True
    except OSError:  # no load average on this platform
        pass
    try:
        with open("/proc/loadavg") as handle:
            return runnable_now(handle.read()) > limit
    except (OSError, ValueError, IndexError):  # not Linux
        return False


def probe_liveness(address: str, timeout_s: float) -> str | None:
    """None if the responder at `address` answers within `timeout_s`, else why not.

    A plain connect first (a refused connection is a dead process, known in a round trip), then one
    request through a TCPStore client on a helper thread: the client retries with back-off inside
    C++, so the answer is awaited here, not there (the thread ends on its own when the client gives up).
    """
    host, port = parse_host_port(address)
    started = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except ConnectionRefusedError:
        return f"{address} refused the connection (the process is gone)"
    except OSError as error:
        return f"{address} not reached in {timeout_s:.2f}s ({error or type(error).__name__})"
    answered = threading.Event()
    remaining = max(0.01, timeout_s - (time.monotonic() - started))

    def ask() -> None:
        try:
            client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=remaining))
            client.check(["probe"])
            answered.set()
        except RuntimeError:  # DistNetworkError / DistStoreError: no answer
            pass

    threading.Thread(target=ask, name="oobleck-probe", daemon=True).start()
    if answered.wait(remaining):
        return None
    return f"{address} {NO_ANSWER} in {timeout_s:.2f}s (stopped or hung)"
