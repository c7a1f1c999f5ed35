"""`oobleck operator` as a child process: what the demo and the end-to-end tests run.

A separate process (not a thread) so that it can be SIGKILLed at any moment, as a crashing operator
would be, and restarted; it dies with its parent (PR_SET_PDEATHSIG) and logs to a file per start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from oobleck.processes import die_with_parent
from oobleck_dev.controlplane import PORT_ATTEMPTS, free_port


class OperatorExited(RuntimeError):
    """The operator process ended when it should be running; the message carries its log's tail."""


class OperatorProcess:
    """`python -m oobleck.cli operator` serving `namespaces` of the cluster behind `kubeconfig`.

    `start(*extra, program=)` waits for the liveness probe (`extra`: arguments for this start only;
    `program`: a script to run in place of `-m oobleck.cli`, e.g. one that stages a crash); `metrics()` reads the Prometheus endpoint (a restarted operator's counters start at zero);
    `kill()` is a crash (SIGKILL), `stop()` a clean shutdown, `wait_exit()` waits for one the
    process stages itself. Ports are picked free at every start; `log()` is every start's log.
    """

    def __init__(self, kubeconfig: str, namespaces: list[str], log_dir: Path, *extra: str) -> None:
        self.kubeconfig = kubeconfig
        self.namespaces = list(namespaces)
        self.log_dir = Path(log_dir)
        self.extra = list(extra)
        self.process: subprocess.Popen | None = None
        self.metrics_port = self.liveness_port = 0
        self.starts = 0  # the starts that answered their liveness probe
        self._launches = 0  # every process started, a lost port's retry included: one log file each

    def start(self, *extra: str, program: str | Path | None = None, timeout_s: float = 180.0) -> OperatorProcess:
        """Start the operator: `python -m oobleck.cli operator ...`, or with `program` (a script that
        runs `oobleck.cli.main`, e.g. one wrapping an operator function to inject a fault) in its place.
        A start whose port was taken between picking and binding it is retried on fresh ports."""
        for attempt in range(PORT_ATTEMPTS):
            try:
                return self._start_once(extra, program, timeout_s)
            except OperatorExited:
                lost_port = "address already in use" in self._this_start_log()
                if not lost_port or attempt + 1 == PORT_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    def _this_start_log(self) -> str:
        return (self.log_dir / f"operator-{self._launches}.log").read_text(errors="replace")

    def _start_once(self, extra: tuple[str, ...], program: str | Path | None, timeout_s: float) -> OperatorProcess:
        self.metrics_port, self.liveness_port = free_port(), free_port()
        self._launches += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            *(["-m", "oobleck.cli"] if program is None else [str(program)]),
            "operator",
            "--kubeconfig",
            self.kubeconfig,
            "--metrics-port",
            str(self.metrics_port),
            "--liveness-port",
            str(self.liveness_port),
        ]
        for namespace in self.namespaces:
            command += ["-n", namespace]
        with open(self.log_dir / f"operator-{self._launches}.log", "w") as log:
            self.process = subprocess.Popen(
                command + self.extra + list(extra),
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent(os.getpid()),
            )
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if time.monotonic() > deadline:
                self.kill()
                raise OperatorExited(
                    f"the operator's liveness probe did not answer within {timeout_s:.0f} s:\n{self.log()[-3000:]}"
                )
            time.sleep(0.2)
        self.starts += 1
        return self

    def healthy(self) -> bool:
        """Whether the liveness probe answers 200; raises OperatorExited if the process ended."""
        if self.process is None:
            return False
        if self.process.poll() is not None:
            raise OperatorExited(f"the operator exited with {self.process.returncode}:\n{self.log()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            return response.read().decode()

    def wait_exit(self, timeout_s: float) -> int | None:
        """Wait for the process to end by itself (e.g. a crash the operator was told to stage); its exit
        code, or None if it still runs after `timeout_s`."""
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL: the operator crashes wherever it is."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob("operator-*.log")))

    def __enter__(self) -> OperatorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
