"""Worker processes forked from one interpreter that imported torch and the runtime once.

`oobleck launch` starts a worker per (node, GPU), and one more for every replacement and added node. A
fresh interpreter spends ~2 s of CPU importing torch before its first step (~4.5 s with a transformers
model), all of it on the critical path of a replacement and, on a small machine, shared by every worker
starting at once. Instead one multiprocessing forkserver per launcher imports them once, with one OpenMP
thread (OpenMP reads OMP_NUM_THREADS once, when torch loads), and each worker is a fork of it that runs
`python -m MODULE ARGS...` (or `python SCRIPT ARGS...`) as `__main__`, with its own argv, whole environment
and output files, as the command line would.

The server starts no CUDA context (importing torch does not), so each fork initialises its own. It exits
when its owner does (the end of a pipe only the owner holds; a child started with `die_with_server` closes
its copy), and such a child then gets SIGKILL (PR_SET_PDEATHSIG): no worker outlives the launcher, even a
SIGKILLed one.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from oobleck.processes import die_with_parent
from oobleck.runtime.backends.base import WORKER_PRELOAD_BASE

WORKER_PRELOAD = (*WORKER_PRELOAD_BASE, "oobleck.runtime.backends.local.worker")
"""What a local worker imports before its first step."""
TRANSFORMERS_PRELOAD = ("transformers", "transformers.masking_utils", "transformers.pytorch_utils")
"""What a transformers model's worker imports besides (runtime/models/hf.py): ~2.5 s of CPU more per process."""
THREADS = "1"
"""OMP_NUM_THREADS of the server: each worker runs one thread, as `oobleck launch` always ran them."""

_starting = threading.Lock()
_started = False


def _context(preload: Sequence[str]) -> multiprocessing.context.ForkServerContext:
    """The forkserver context, its server started once per process with `preload` (and this module, the
    children's entry point) imported; a later caller's `preload` finds the server running and is ignored."""
    global _started
    context = multiprocessing.get_context("forkserver")
    with _starting:
        if not _started:
            context.set_forkserver_preload([*preload, __name__])
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


def start_server(preload: Sequence[str] = WORKER_PRELOAD) -> None:
    """Start this process's server now (it imports `preload` while the caller goes on); else the first
    `ForkedProcess` does."""
    _context(preload)


def _let_the_server_end_with_its_owner() -> None:
    """Close this child's copy of the pipe whose end-of-file tells the server that its owner is gone.

    multiprocessing hands every forked child that pipe's write end, so that a child could start processes
    of its own through the server, and the server then lives as long as any child does: it would never end
    while a worker lived, and the worker would never get its PDEATHSIG. A worker starts no processes this way.
    The attribute is CPython's (3.4 on); without it the child keeps the pipe and lives on with the server."""
    server = multiprocessing.forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[attr-defined]


def _child_main(
    command: list[str],
    stdout: str,
    stderr: str | None,
    env: dict[str, str],
    new_session: bool,
    die_with_server: bool,
) -> None:
    """In the forked child: a session of its own if asked, SIGKILL when the server ends if asked, the output
    to its files, `env` as the environment, then `python *command`'s main module as `__main__`."""
    if die_with_server:
        _let_the_server_end_with_its_owner()
        die_with_parent(os.getppid())()
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


class ForkedProcess:
    """`python *command` as a fork of the preloaded server; `pid`, `wait`, `poll` and `kill` as on a
    `subprocess.Popen` (exit code -N when killed by signal N; TimeoutError instead of TimeoutExpired).
    `new_session`: as Popen's `start_new_session`, the child leads a session and process group of its own
    once this returns (what `os.killpg` and process-group tools act on)."""

    def __init__(
        self,
        command: Sequence[str],
        stdout: Path,
        env: dict[str, str],
        stderr: Path | None = None,
        new_session: bool = False,
        die_with_server: bool = False,
        preload: Sequence[str] = WORKER_PRELOAD,
    ) -> None:
        for path in (stdout, stderr):
            if path is not None:
                Path(path).touch()  # exists before the child runs, like a redirection (appended to)
        args = (list(command), str(stdout), None if stderr is None else str(stderr), dict(env))
        self._process = _context(preload).Process(
            target=_child_main, args=(*args, new_session, die_with_server), daemon=False
        )
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
    def pid(self) -> int:
        pid = self._process.pid
        assert pid is not None, "started in __init__"
        return pid

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
