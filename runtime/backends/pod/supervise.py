"""A multi-GPU pod's process supervision: one child per local GPU, the pod failing as a whole."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time

from oobleck.runtime.backends.pod.config import PodEnv
from oobleck.runtime.backends.pod.siblings import SHARED_DIR_ENV

log = logging.getLogger("oobleck.runtime.backends.pod.main")


def _log(event: str, env: PodEnv, **fields) -> None:
    log.info(json.dumps({"event": event, "job": env.job, "node": env.node, **fields}))


def supervise(env: PodEnv, argv0: list[str]) -> int:
    """One child process per local GPU; the first to fail takes the others down (the pod is the unit of loss)."""
    shared = tempfile.mkdtemp(prefix="oobleck-pod-")  # 0700: the children's checkpoint errors (siblings.py)
    children = [
        subprocess.Popen(
            [*argv0, "--gpu", str(gpu)], env={**os.environ, "OOBLECK_GPU": str(gpu), SHARED_DIR_ENV: shared}
        )
        for gpu in range(env.gpus_per_node)
    ]

    def forward(signum, _frame) -> None:
        for child in children:
            if child.poll() is None:
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
