"""`oobleck launch`'s worker processes: starting one per (node, GPU), killing its process group, its last error.

Every child runs in a process group of its own with PR_SET_PDEATHSIG=SIGKILL: it dies with the launcher.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from oobleck.processes import die_with_parent
from oobleck.runtime.elastic.signing import KEY_FILE_ENV


@dataclass
class Child:
    worker: str
    node: str
    gpu: int
    process: subprocess.Popen
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
) -> Child:
    """Start the elastic worker of (`node`, `gpu`) (`python -m oobleck.runtime.backends.local.worker`), logging to `workdir`;
    `key_path`: the job key's file, passed as $OOBLECK_JOB_KEY_FILE (signing.py)."""
    worker = f"{node}:{gpu}"
    stem = workdir / f"{node}-gpu{gpu}"
    log_path, losses, dump = stem.with_suffix(".log"), stem.with_suffix(".losses.jsonl"), stem.with_suffix(".pt")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR")
    env.pop(KEY_FILE_ENV, None)
    if key_path is not None:
        env[KEY_FILE_ENV] = str(key_path)
    command = [
        sys.executable,
        "-m",
        "oobleck.runtime.backends.local.worker",
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
    with open(log_path, "ab") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=die_with_parent(os.getpid()),
            process_group=0,
        )
    return Child(worker, node, gpu, process, log_path, losses, dump)
