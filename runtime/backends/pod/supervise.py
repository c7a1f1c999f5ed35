"""A multi-GPU pod's process supervision: one child per local GPU, the pod failing as a whole.

The children are forks of the supervisor, which imports torch and the worker's modules once before forking
(`WORKER_PRELOAD`): a fresh interpreter per GPU imported them again, ~2 s of CPU each, all of it on the path of
a replacement pod to its first step and contending for the node's CPUs and disk at once. Measured on the
2-core test host, a 2-GPU pod's two fresh children cost 45 and 44 CPU-s over two e2e tests against 23 for the
single-GPU pods forked from a process that had imported torch. Forking is safe here because the supervisor
starts no CUDA context (importing torch does not: each child initialises its own) and runs no OpenMP work
before it forks. A child gets SIGKILL when the supervisor dies (PR_SET_PDEATHSIG): none outlives the pod's
main process.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence

from oobleck.api.contract import ExitCode
from oobleck.processes import die_with_parent
from oobleck.runtime.backends.base import WORKER_PRELOAD_BASE
from oobleck.runtime.backends.pod.config import PodEnv
from oobleck.runtime.backends.pod.siblings import SHARED_DIR_ENV

log = logging.getLogger("oobleck.runtime.backends.pod.main")

WORKER_PRELOAD = (
    *WORKER_PRELOAD_BASE,
    "oobleck.runtime.elastic.loop",
    "oobleck.runtime.backends.pod.pod_worker",
    "oobleck.runtime.backends.pod.plan_configmap",
)
"""What a pod's GPU worker imports before its first step (runtime/backends/pod/main.py `run_worker`)."""


def _log(event: str, env: PodEnv, **fields) -> None:
    log.info(json.dumps({"event": event, "job": env.job, "node": env.node, **fields}))


class ForkedChild:
    """One GPU's worker: a fork of the supervisor running `run_gpu(gpu)`, its return value the exit code."""

    def __init__(self, gpu: int, run_gpu: Callable[[int], int], shared: str) -> None:
        self.returncode: int | None = None
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            code = int(ExitCode.ERROR)
            try:
                die_with_parent(parent)()
                os.environ.update({"OOBLECK_GPU": str(gpu), SHARED_DIR_ENV: shared})
                code = int(run_gpu(gpu))
            except BaseException:  # the child never returns into the supervisor's code
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    def poll(self) -> int | None:
        """The exit code once the child ended (negative: killed by that signal), else None."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def supervise(env: PodEnv, run_gpu: Callable[[int], int], preload: Sequence[str] = WORKER_PRELOAD) -> int:
    """One forked child per local GPU running `run_gpu(gpu)`, after importing `preload` once here; the first
    to fail takes the others down (the pod is the unit of loss)."""
    for module in preload:
        importlib.import_module(module)
    shared = tempfile.mkdtemp(prefix="oobleck-pod-")  # 0700: the children's checkpoint errors (siblings.py)
    children = [ForkedChild(gpu, run_gpu, shared) for gpu in range(env.gpus_per_node)]

    def forward(signum, _frame) -> None:
        for child in children:
            child.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    pending = set(range(len(children)))
    try:
        while pending:
            for index in sorted(pending):
                status = children[index].poll()
                if status is None:
                    continue
                pending.discard(index)
                if status != 0 and code == 0:
                    code = status if status > 0 else 128 - status
                    _log("gpu-worker-failed", env, gpu=index, code=code)
                    for other in pending:
                        children[other].terminate()
            time.sleep(0.1)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        shutil.rmtree(shared, ignore_errors=True)
    return code
