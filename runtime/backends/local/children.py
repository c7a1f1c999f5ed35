"""`oobleck launch`'s worker processes: starting one per (node, GPU), killing its process group, its last error.

Each worker is a fork of the launcher's preloaded server (forkserver.py), in a session and process group of
its own with PR_SET_PDEATHSIG=SIGKILL: it dies with the server, which ends with the launcher.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from oobleck.api.addresses import worker_id
from oobleck.runtime.backends.local.forkserver import WORKER_PRELOAD, ForkedProcess
from oobleck.runtime.elastic.signing import KEY_FILE_ENV

WORKER_MODULE = "oobleck.runtime.backends.local.worker"


@dataclass
class Child:
    worker: str
    node: str
    gpu: int
    process: ForkedProcess
    log_path: Path
    losses_path: Path
    dump_path: Path
    killed_at: float | None = None
    code: int | None = None

    def kill(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def alive(self) -> bool:
        return self.process.poll() is None

    def last_error(self) -> str:
        """The error the worker logged last (its "unrecoverable" event), for the job's failure message."""
        for line in reversed(self.log_path.read_text(errors="replace").splitlines()):
            if line.startswith("{") and '"error"' in line:
                try:
                    return json.loads(line)["error"]
                except (ValueError, KeyError):
                    continue
        return "exited: no layer source left"


def spawn_worker(
    workdir: Path,
    plan_path: Path,
    store_port: int,
    node: str,
    gpu: int,
    heartbeat_period_s: float,
    dead_after_s: float,
    key_path: Path | None = None,
    preload: Sequence[str] = WORKER_PRELOAD,
) -> Child:
    """Start the elastic worker of (`node`, `gpu`) (`python -m oobleck.runtime.backends.local.worker`, forked from
    the server that imported `preload`), logging to `workdir`; `key_path`: the job key's file, passed as
    $OOBLECK_JOB_KEY_FILE (signing.py)."""
    worker = worker_id(node, gpu)
    stem = workdir / f"{node}-gpu{gpu}"
    log_path, losses, dump = stem.with_suffix(".log"), stem.with_suffix(".losses.jsonl"), stem.with_suffix(".pt")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR")
    env.pop(KEY_FILE_ENV, None)
    if key_path is not None:
        env[KEY_FILE_ENV] = str(key_path)
    command = [
        "-m",
        WORKER_MODULE,
        "--config",
        str(workdir / "config.json"),
        "--plan-file",
        str(plan_path),
        "--store",
        f"127.0.0.1:{store_port}",
        "--node",
        node,
        "--gpu",
        str(gpu),
        "--losses",
        str(losses),
        "--dump",
        str(dump),
        "--heartbeat-period",
        str(heartbeat_period_s),
        "--dead-after",
        str(dead_after_s),
    ]
    process = ForkedProcess(command, log_path, env, new_session=True, die_with_server=True, preload=preload)
    return Child(worker, node, gpu, process, log_path, losses, dump)
