"""Runtime containers forked from one interpreter that imported torch once (local node agents only).

A local pod whose command is `python -m oobleck.runtime...` spends 3 s or more of CPU importing torch
before it does anything; the end-to-end tests start about 150 of them on a 2-core host, where that CPU
was a sixth of the whole suite. An agent made with `preforked=True` starts one `PodZygote`: a process
that imports those modules once and then forks a child per such container. The child becomes the
container as an exec would have made it: a session of its own, the pod's cgroups, its own mount
namespace and root (mountns.py), the log file as stdout and stderr, the container's environment and
argv, then the module run as `__main__`, and the interpreter's exit (non-daemon threads joined, exit
handlers run). Any other command, or one that arrives while the zygote is still importing, is exec'd
as before (podrunner.ContainerProcess). The product, `oobleck launch` and real nodes never fork this way.

The agent and the zygote talk over one socketpair in length-prefixed pickled frames:
`StartRequest` one way; `("started", pid)` or `("failed", message)` in answer, and `("exited", pid, code)`
whenever a child ends (the zygote is the children's parent, so it reaps them).
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import os
import pickle
import runpy
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from oobleck.processes import die_with_parent
from oobleck_dev import netfault
from oobleck_dev.memlimit import MemoryCgroup
from oobleck_dev.mountns import Filesystem, FilesystemError
from oobleck_dev.podrunner import exit_code, signal_group
from oobleck_dev.preforked import RUNTIME_PRELOAD

PRELOAD = (*RUNTIME_PRELOAD, "oobleck.runtime.backends.pod.main", "oobleck.runtime.elastic.coordinator")
"""What the zygote imports before its first fork: what a worker and a coordinator pod import."""
MODULE_PREFIX = "oobleck.runtime"
"""Commands `python -m <a module under this>` are forked; everything else is exec'd."""
THREADS = "1"
"""OMP_NUM_THREADS while torch loads in the zygote (OpenMP reads it once; the runtime then sets its own
thread count with torch.set_num_threads, as it does in a fresh process)."""
_HEADER = struct.Struct("!I")


@dataclass(frozen=True)
class StartRequest:
    module: str
    args: tuple[str, ...]
    env: dict[str, str]
    filesystem: Filesystem
    log: Path
    net_cgroup: Path | None
    memory_cgroup: Path | None


def _send(sock: socket.socket, message: object) -> None:
    data = pickle.dumps(message)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _receive(sock: socket.socket) -> object | None:
    """One frame, or None at the end of the stream."""
    header = _read_exactly(sock, _HEADER.size)
    return None if header is None else pickle.loads(_read_exactly(sock, _HEADER.unpack(header)[0]) or b"")


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks = b""
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            return None
        chunks += chunk
    return chunks


def forkable_module(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The module of `python -m oobleck.runtime...` when `python` on the container's PATH is this
    interpreter (the one the zygote runs); else None."""
    if len(argv) < 3 or argv[1] != "-m" or not argv[2].startswith(MODULE_PREFIX):
        return None
    found = shutil.which(argv[0], path=env.get("PATH", ""))
    if found is None or os.path.abspath(found) != os.path.abspath(sys.executable):
        return None
    return argv[2]


class ForkedContainer:
    """A container forked by the zygote: what podrunner.ContainerProcess offers the pod lifecycle."""

    def __init__(self, pid: int, zygote: PodZygote, log: Path, memory: MemoryCgroup | None) -> None:
        self.pid = pid
        self.log = log
        self.cgroup = memory
        self._zygote = zygote

    @property
    def returncode(self) -> int | None:
        return self._zygote.exit_codes.get(self.pid)

    def signal_group(self, signum: int) -> bool:
        return signal_group(self.pid, signum)

    async def wait(self) -> int:
        """The container exit code (128 + N for signal N), without blocking the loop."""
        return exit_code(await self._zygote.exited(self.pid))

    def close(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()


class PodZygote:
    """The agent's side: starts the zygote, asks it for containers, and hears of their exits.

    `start` runs on the agent's loop thread (the zygote dies with that thread, and its children with it);
    the zygote imports in the background and `ready` tells when it forks."""

    def __init__(self, log: Path) -> None:
        """`log`: the zygote's own output (an import error, a crash)."""
        self.log = log
        self.exit_codes: dict[int, int] = {}
        self._running: set[int] = set()
        self.ready = threading.Event()
        self._gone = threading.Event()
        self._answers: list[tuple] = []
        self._answered = threading.Condition()
        self._waiters: dict[int, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[int]]]] = {}
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> PodZygote:
        ours, theirs = socket.socketpair()
        # What the pod entry point sets before it imports torch (c10d reads its log level once, at load).
        env = {**os.environ, "OMP_NUM_THREADS": THREADS, "TORCH_CPP_LOG_LEVEL": "ERROR"}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self._process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                # Dies with the thread that started it (the agent's loop thread), and its children with it.
                preexec_fn=die_with_parent(os.getpid()),
            )
        theirs.close()
        self._sock = ours
        self._reader = threading.Thread(target=self._read, name="oobleck-podzygote", daemon=True)
        self._reader.start()
        return self

    def wait_ready(self, timeout: float) -> bool:
        """Whether the zygote forks within `timeout` seconds (False at once if it ended: see its log)."""
        waited = 0.0
        while not self.ready.wait(0.1) and not self._gone.is_set() and waited < timeout:
            waited += 0.1
        return self.ready.is_set()

    def spawn(
        self,
        module: str,
        args: Sequence[str],
        env: Mapping[str, str],
        filesystem: Filesystem,
        log: Path,
        net_cgroup: Path | None,
        memory: MemoryCgroup | None,
    ) -> ForkedContainer:
        """Fork a container; raises OSError (FilesystemError: its filesystem could not be made) as an exec would."""
        log.parent.mkdir(parents=True, exist_ok=True)
        request = StartRequest(
            module, tuple(args), dict(env), filesystem, log, net_cgroup, memory.path if memory is not None else None
        )
        with self._answered:
            assert self._sock is not None
            try:
                _send(self._sock, request)
            except OSError as error:
                raise OSError(f"the pod zygote ended (see {self.log}): {error}") from None
            if not self._answered.wait_for(lambda: self._answers or self._gone.is_set(), timeout=60):
                raise OSError(f"the pod zygote did not answer a start of {module}")
            if not self._answers:
                raise OSError(f"the pod zygote ended (see {self.log})")
            answer = self._answers.pop(0)
        if answer[0] == "failed":
            raise FilesystemError(0, answer[1])
        return ForkedContainer(answer[1], self, log, memory)

    async def exited(self, pid: int) -> int:
        """The child's returncode (Popen's convention: -N for signal N) once it exited."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        with self._lock:
            if pid in self.exit_codes:
                return self.exit_codes[pid]
            self._waiters.setdefault(pid, []).append((loop, future))
        return await future

    def close(self) -> None:
        if self._sock is not None:
            self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
            self._sock = None
        if self._process is not None:
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None

    def _read(self) -> None:
        assert self._sock is not None
        sock = self._sock
        while True:
            try:
                message = _receive(sock)
            except OSError:
                message = None
            if message is None:
                # The zygote is gone, and its children died with it (PR_SET_PDEATHSIG: SIGKILL).
                self.ready.clear()
                with self._answered:
                    self._gone.set()
                    self._answered.notify_all()
                with self._lock:
                    running = list(self._running)
                for pid in running:
                    self._exited(pid, -signal.SIGKILL)
                return
            assert isinstance(message, tuple)
            if message[0] == "ready":
                self.ready.set()
            elif message[0] == "exited":
                self._exited(message[1], message[2])
            else:
                if message[0] == "started":  # before its exit, which the zygote sends after this
                    with self._lock:
                        self._running.add(message[1])
                with self._answered:
                    self._answers.append(message)
                    self._answered.notify_all()

    def _exited(self, pid: int, code: int) -> None:
        with self._lock:
            self._running.discard(pid)
            self.exit_codes[pid] = code
            waiters = self._waiters.pop(pid, [])
        for loop, future in waiters:
            loop.call_soon_threadsafe(_resolve, future, code)


def _resolve(future: asyncio.Future[int], code: int) -> None:
    if not future.done():
        future.set_result(code)


# --- the zygote process ---------------------------------------------------------------------------


def serve(sock: socket.socket) -> None:
    """Import PRELOAD, then fork a container per request and report every child's exit, until the agent's
    end of the socket closes."""
    for name in PRELOAD:
        importlib.import_module(name)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _send(sock, ("ready",))
    while True:
        readable, _, _ = select.select([sock.fileno(), wake_read], [], [])
        if wake_read in readable:
            os.read(wake_read, 4096)
            _reap(sock)
        if sock.fileno() in readable:
            request = _receive(sock)
            if request is None:
                return
            assert isinstance(request, StartRequest)
            _send(sock, _fork(request, sock))


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, ("exited", pid, os.waitstatus_to_exitcode(status)))


def _fork(request: StartRequest, sock: socket.socket) -> tuple:
    """Fork the container; ("started", pid) once it entered its cgroups and root, else ("failed", why)."""
    report_read, report_write = os.pipe()
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(report_read)
        sock.close()
        _become(request, report_write, zygote)  # never returns
    os.close(report_write)
    report = b""
    while chunk := os.read(report_read, 65536):
        report += chunk
    os.close(report_read)
    if report == b"\0":
        return ("started", pid)
    return ("failed", report.decode(errors="replace") or "the container exited while starting")


def _become(request: StartRequest, report: int, zygote: int) -> None:
    """In the forked child: enter the container as podrunner.ContainerProcess's preexec does, then run the
    module as `python -m` would, and exit as the interpreter would."""
    code = 127
    try:
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            log = os.open(request.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # a host path: before chroot
            null = os.open(os.devnull, os.O_RDONLY)
            if request.memory_cgroup is not None:
                MemoryCgroup(request.memory_cgroup).join()()
            die_with_parent(zygote)()
            netfault.join_cgroup(request.net_cgroup)()
        except OSError as error:
            os.write(report, f"entering the container: {error}".encode())
            return
        try:
            request.filesystem.preexec(report)()
        except FilesystemError:
            return  # the step and the error are written to `report`
        for target, source in ((0, null), (1, log), (2, log)):
            os.dup2(source, target)
        os.write(report, b"\0")
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        code = _run_module(request)
    finally:
        os._exit(code)


def _run_module(request: StartRequest) -> int:
    """`python -m module args` in this process, standard streams on fds 0-2; the exit status."""
    os.environ.clear()
    os.environ.update(request.env)
    unbuffered = bool(request.env.get("PYTHONUNBUFFERED"))
    sys.stdin = open(0, closefd=False)  # the process's own standard streams
    sys.stdout = open(1, "w", buffering=1 if unbuffered else -1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.path[0] = os.getcwd()  # as `python -m` sets it
    sys.argv = ["-m", *request.args]
    code = 1
    try:
        runpy.run_module(request.module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = _exit_status(stop.code)
    except BaseException:  # as the interpreter does: print it, exit 1
        traceback.print_exc()
    threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads, as the interpreter's exit does
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _exit_status(code: object) -> int:
    """SystemExit's code as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    # Through the module's own name: the requests unpickle to its classes, not to __main__'s.
    from oobleck_dev import podzygote

    podzygote.serve(socket.socket(fileno=int(sys.argv[1])))
