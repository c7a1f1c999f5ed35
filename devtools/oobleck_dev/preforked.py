"""Worker processes forked from an interpreter that imported torch and the runtime once (test harness only).

A `python -m oobleck.runtime worker` process spends ~2 s of CPU importing torch before its first step
(~4.5 s with a transformers model): on the shared 2-core CI host that was a third of a short multi-rank
equivalence test. Here one multiprocessing forkserver per test process imports them once; each worker is
a fork of it that runs the same main module as the command line would (`python -m oobleck.runtime ...`,
or a test's driver script) with its own argv, environment and output files. The product never starts workers this way: `oobleck launch` and
pods start fresh interpreters.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import sys
import threading
import time
from pathlib import Path

RUNTIME_PRELOAD = (
    "torch",
    "torch.distributed",
    "oobleck.runtime.cli",
    "oobleck.runtime.elastic.worker",
    "oobleck.runtime.train.config",
    "oobleck.runtime.models.hf",
    # What a transformers model's worker imports (runtime/models/hf.py): ~2.5 s of CPU more per process.
    "transformers",
    "transformers.masking_utils",
    "transformers.pytorch_utils",
)
"""What a worker process imports (oobleck_dev.podzygote preloads these too)."""
PRELOAD = [*RUNTIME_PRELOAD, __name__]  # and the children's entry point itself
"""Modules the forkserver imports before any fork."""
THREADS = "1"
"""OMP_NUM_THREADS of the forkserver: OpenMP reads it once, when torch is loaded (the callers' workers run
one thread each, as the fresh processes they replace did with OMP_NUM_THREADS=1)."""

_starting = threading.Lock()
_started = False


def _context() -> multiprocessing.context.ForkServerContext:
    """The forkserver context, its server started (once per process) with the preloads and one thread."""
    global _started
    context = multiprocessing.get_context("forkserver")
    with _starting:
        if not _started:
            context.set_forkserver_preload(PRELOAD)
            previous = os.environ.get("OMP_NUM_THREADS")
            os.environ["OMP_NUM_THREADS"] = THREADS  # the server inherits the environment it is started with
            try:
                multiprocessing.forkserver.ensure_running()
                _started = True
            finally:
                if previous is None:
                    del os.environ["OMP_NUM_THREADS"]
                else:
                    os.environ["OMP_NUM_THREADS"] = previous
    return context  # type: ignore[return-value]


def _child_main(
    command: list[str], stdout: str, stderr: str | None, env: dict[str, str], new_session: bool = False
) -> None:
    """In the forked child: a session of its own if asked, the output to its files, `env` as the environment,
    then `python *command`'s main module (`-m MODULE ARGS...` or `SCRIPT ARGS...`) as `__main__`."""
    if new_session:
        os.setsid()
    for fd, path in ((1, stdout), (2, stderr or stdout)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
    os.environ.clear()
    os.environ.update(env)
    import torch

    if env.get("OMP_NUM_THREADS", THREADS) != THREADS:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if command[0] == "-m":
        sys.argv = [command[1], *command[2:]]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(command)
        sys.path.insert(0, str(Path(command[0]).resolve().parent))  # as `python SCRIPT` does
        runpy.run_path(command[0], run_name="__main__")


class PreforkedProcess:
    """`python *command` as a forked child of the preloaded server; `wait`, `poll` and `kill` as on a
    `subprocess.Popen` (TimeoutError instead of TimeoutExpired). `new_session`: as Popen's
    `start_new_session`, the child leads a session and process group of its own once this returns (what
    process-group tools such as oobleck_dev.cpulimit act on)."""

    def __init__(
        self,
        command: list[str],
        stdout: Path,
        env: dict[str, str],
        stderr: Path | None = None,
        new_session: bool = False,
    ) -> None:
        for path in (stdout, stderr):
            if path is not None:
                Path(path).write_bytes(b"")  # created (emptied) before the child runs, like a redirection
        args = (list(command), str(stdout), None if stderr is None else str(stderr), dict(env), new_session)
        self._process = _context().Process(target=_child_main, args=args, daemon=False)
        self._process.start()
        if new_session:
            self._wait_for_own_group()

    def _wait_for_own_group(self, timeout: float = 30.0) -> None:
        """Until the child's setsid has run (or it exited): Popen returns only after it, callers rely on it."""
        assert self.pid is not None
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            try:
                if os.getpgid(self.pid) == self.pid:
                    return
            except ProcessLookupError:
                return  # exited meanwhile
            if time.monotonic() > deadline:
                raise TimeoutError(f"process {self.pid} did not start a session of its own in {timeout} s")
            time.sleep(0.001)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code (-N: killed by signal N); TimeoutError if still running after `timeout` seconds."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise TimeoutError(f"process {self.pid} still running after {timeout} s")
        return self._process.exitcode

    def kill(self) -> None:
        if self._process.exitcode is None:
            self._process.kill()
            self._process.join(10)


def start(
    command: list[str], stdout: Path, env: dict[str, str], stderr: Path | None = None, new_session: bool = False
) -> PreforkedProcess:
    """`python *command` (`["-m", "oobleck.runtime", "worker", ...]` or `[script, *args]`) with `env` as
    its whole environment, its output appended to `stdout` (and `stderr`, else `stdout` too); `new_session`:
    in a session and process group of its own, as Popen's `start_new_session`."""
    return PreforkedProcess(command, stdout, env, stderr, new_session)
