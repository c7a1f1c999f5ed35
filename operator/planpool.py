"""Planning off kopf's event loop: a pool of planner processes, each call bounded in time and memory.

The planner is exact, and its cost grows fast with the spec (measured on this project's 2-core host:
`check_spec` of 1024 nodes x 512 GPT layers 7 s and 280 MB, 1024 x 1024 14 s and 744 MB). Run in the
operator's process it would stall every job's reconcile and the liveness probe alike. Here each call runs
in a separate process, which:

- lives under RLIMIT_AS (`memory_bytes`): an allocation past it raises MemoryError there, never in
  the operator;
- gets `timeout_s` to answer; past that it is killed and replaced (a fresh process is spawned at once);
- is replaced too when it dies or runs out of memory, so the next call always finds a sound process.

What runs here: the check of a new spec and generation 0's planning (planning.check_spec, first_plan),
which generate the templates, the part whose cost explodes. A next generation reuses the templates
stored in the plan and runs in decide's thread: shipping a 1024-node x 8-GPU plan (0.7 MB pickled) to
a process and back cost 0.3-0.5 s against 84 ms of planning (at load 18 on 2 cores), time a failure's
survivors would wait.

`PlannerPool.run` blocks its calling thread (decide runs in a thread of its own, handlers.py), never
the event loop. A call over a limit raises `PlanningLimitExceeded`, whose message names the limit and
the operator flag that sets it: decide ends the job InvalidSpec with it.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import pickle
import queue
import resource
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class PlannerLimits:
    """The planner pool's size and per-call limits (operator settings)."""

    workers: int = 2
    """planner processes: as many jobs can plan at the same time"""
    timeout_s: float = 30.0
    """wall-clock seconds one planning call may take (`--planner-timeout`)"""
    memory_bytes: int = 2 << 30
    """address space of a planner process (RLIMIT_AS), its imports included (`--planner-memory-mib`)"""


class PlanningLimitExceeded(RuntimeError):
    """A planning call went over the operator's time or memory limit: the spec is too large to plan here.

    Not a PlanningError: those say the spec admits no plan, this one that finding out cost too much."""


class Planner(Protocol):
    """Runs a pure planning function: in this process (tests, `InProcess`), or in a bounded one."""

    def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T: ...

    def __hash__(self) -> int: ...  # decide memoises checks per planner


class InProcess:
    """Calls the function here and now (unit tests and tools; no limits)."""

    def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        return fn(*args, **kwargs)


IN_PROCESS = InProcess()


PRELOAD = ("oobleck.operator.planning",)
"""Modules a planner process imports before it says it is ready: what the planning functions need, and no
more. The operator's other modules bring kopf and the Kubernetes client, 2 of a planner process's 2.3 s of
CPU to start (2026-11-27, 2 cores), paid twice per operator start and again per replaced process."""
STARTUP_TIMEOUT_S = 300.0
"""How long a fresh planner process may take to import PRELOAD (not counted against a call's limit)."""


def _serve(conn: Connection, memory_bytes: int, preload: tuple[str, ...]) -> None:
    """A planner process: import `preload`, say ("ready", None), then answer (fn, args, kwargs) requests
    with ("ok", value) or ("error", exception)."""
    for module in preload:
        importlib.import_module(module)
    # After the imports: the limit bounds the planning, not the interpreter.
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    try:
        conn.send(("ready", None))
    except OSError:
        return  # the operator exited while this process was importing
    while True:
        try:
            fn, args, kwargs = conn.recv()
        except (EOFError, OSError):
            return  # the operator is gone
        try:
            answer: tuple[str, Any] = ("ok", fn(*args, **kwargs))
        except MemoryError:
            conn.send(("memory", None))
            return  # the heap may be in pieces: the pool spawns a fresh process
        except Exception as error:  # the caller re-raises it
            answer = ("error", _portable(error))
        try:
            conn.send(answer)
        except MemoryError:
            conn.send(("memory", None))
            return


def _portable(error: Exception) -> Exception:
    """`error` if it survives pickling, else a ValueError with its message (some exceptions take
    constructor arguments that pickle cannot replay, e.g. the planner's LostLayersError)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        from oobleck.planner.errors import PlanningError

        kind = PlanningError if isinstance(error, PlanningError) else ValueError
        return kind(str(error))


class _Process:
    def __init__(self, context: Any, memory_bytes: int, preload: tuple[str, ...]) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child, memory_bytes, preload), daemon=True, name="oobleck-planner"
        )
        self.process.start()
        child.close()
        self.ready = False

    def wait_ready(self) -> None:
        """Wait for the process's imports (once); OSError if it died or hung starting."""
        if self.ready:
            return
        try:
            if not self.conn.poll(STARTUP_TIMEOUT_S):
                raise OSError(f"a planner process did not start within {STARTUP_TIMEOUT_S:g} s")
            self.conn.recv()
        except EOFError:
            raise OSError(f"a planner process died starting (exit code {self.stop()})") from None
        self.ready = True

    def stop(self) -> int | None:
        """Kill the process (if still running) and return its exit code."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()
        return self.process.exitcode


class PlannerPool:
    """`limits.workers` planner processes (spawned, so they inherit none of the operator's threads). Not forked
    from multiprocessing's forkserver: that server is one per process, whose first user's preload wins, and
    `oobleck launch`'s workers (runtime/backends/local/forkserver.py) need it preloaded with torch."""

    def __init__(self, limits: PlannerLimits, preload: tuple[str, ...] = PRELOAD) -> None:
        if limits.workers < 1:
            raise ValueError(f"planner workers must be >= 1, got {limits.workers}")
        self.limits = limits
        self._context = multiprocessing.get_context("spawn")
        self._preload = preload
        self._idle: queue.SimpleQueue[_Process] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self.replaced = 0
        """processes replaced after a limit or a death (for tests and logs)"""
        for _ in range(limits.workers):
            self._idle.put(self._spawn())

    def _spawn(self) -> _Process:
        return _Process(self._context, self.limits.memory_bytes, self._preload)

    def _over_time(self) -> PlanningLimitExceeded:
        return PlanningLimitExceeded(
            f"planning took longer than the operator's limit of {self.limits.timeout_s:g} s per planning call "
            "(operator setting --planner-timeout); reduce nodes.max or the model's layers"
        )

    def _over_memory(self, exit_code: int | None) -> PlanningLimitExceeded:
        how = "ran out of" if exit_code in (None, 0) else f"died (exit code {exit_code}) near"
        return PlanningLimitExceeded(
            f"planning {how} the operator's memory limit of {self.limits.memory_bytes >> 20} MiB per planning "
            "call (operator setting --planner-memory-mib); reduce nodes.max or the model's layers"
        )

    def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in a planner process (fn a module-level function); blocks this thread."""
        worker = self._idle.get()
        keep = False
        try:
            try:
                worker.wait_ready()
                worker.conn.send((fn, args, kwargs))
            except OSError:
                # Died while idle or starting (e.g. killed from outside): once more on a fresh process.
                worker.stop()
                worker = self._spawn()
                worker.wait_ready()
                worker.conn.send((fn, args, kwargs))
            if not worker.conn.poll(self.limits.timeout_s):
                raise self._over_time()
            try:
                kind, value = worker.conn.recv()
            except (EOFError, OSError):
                worker.process.join(timeout=5)
                raise self._over_memory(worker.process.exitcode) from None
            if kind == "memory":
                raise self._over_memory(None)
            keep = True
            if kind == "error":
                raise value
            return value  # type: ignore[no-any-return]
        finally:
            if not keep:
                code = worker.stop()
                self.replaced += 1
                log.warning(f"planner process replaced (exit code {code})")
                worker = self._spawn()
            with self._lock:
                if self._closed:
                    worker.stop()
                else:
                    self._idle.put(worker)

    def close(self) -> None:
        """Stop the idle processes (busy ones are stopped when their call returns)."""
        with self._lock:
            self._closed = True
        while True:
            try:
                self._idle.get_nowait().stop()
            except queue.Empty:
                return
