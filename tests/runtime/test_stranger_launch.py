"""A stranger on the job's network, with a plain TCPStore client, against a real `oobleck launch` job: its
abort, failure report and rewritten snapshot address are ignored (training goes on, nothing is pushed to
it) and its forged snapshot push is refused; every refusal is counted and logged by the worker."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

from oobleck.runtime.elastic import keys
from oobleck.runtime.snapshot.transport import push
from tests.runtime.sizes import PIPELINED_MEMORY

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("control-processes")]

STEPS = 30


def _store_port(launcher: int, deadline: float) -> int:
    """The coordinator's port, as anyone on the host can see it: the TCP port the launcher (which hosts the
    store) listens on, from /proc/net/tcp and its socket descriptors."""
    while time.monotonic() < deadline:
        sockets = set()
        for fd in Path(f"/proc/{launcher}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                sockets.add(target[len("socket:[") : -1])
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in sockets:  # 0A: LISTEN
                return int(fields[1].rsplit(":", 1)[1], 16)
        time.sleep(0.1)
    raise TimeoutError("the launcher listens on no TCP port")


def _step_of(stranger: TCPStore, worker: str) -> int:
    if not stranger.check([keys.progress_key(worker)]):
        return -1
    return json.loads(stranger.get(keys.progress_key(worker)))["step"]


def test_a_strangers_store_writes_and_pushes_are_ignored_and_counted(tmp_path):
    workdir = tmp_path / "job"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "oobleck.cli",
            "launch",
            "--workdir",
            str(workdir),
            "--nodes",
            "2",
            # One 2-node pipeline: each node pushes its snapshots to the other (data-parallel replicas push none).
            "--f",
            "0",
            "--gpu-memory",
            str(PIPELINED_MEMORY),
            "--steps",
            str(STEPS),
            "--snapshot-interval",
            "2",
            "--summary",
            str(tmp_path / "summary.json"),
            "--timeout",
            "300",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    trap = socket.create_server(("127.0.0.1", 0))
    trap.setblocking(False)
    try:
        deadline = time.monotonic() + 200
        stranger = TCPStore("127.0.0.1", _store_port(launcher.pid, deadline), is_master=False, wait_for_workers=False)
        while _step_of(stranger, "node0:0") < 3:
            assert time.monotonic() < deadline and launcher.poll() is None, "the job did not start training"
            time.sleep(0.05)
        generation = int(stranger.get(keys.GENERATION_KEY))
        # The sealed value is readable (not secret), just not forgeable: the stranger finds node0's server.
        sealed = stranger.get(keys.held_key("node0:0"))
        node0_server = json.loads(sealed.split(b":", 2)[2])["snapshot_address"]
        stranger.set(keys.abort_key(generation), json.dumps({"kind": "heartbeat", "dead": ["node1:0"]}))
        stranger.queue_push(keys.FAILURES_QUEUE, json.dumps({"kind": "heartbeat", "dead": ["node1:0"]}))
        trap_address = f"127.0.0.1:{trap.getsockname()[1]}"
        stranger.set(keys.held_key("node1:0"), json.dumps({"snapshot_address": trap_address, "snapshots": {}}))
        with pytest.raises(ConnectionError):
            push(node0_server, 10**6, {0: torch.zeros(8, dtype=torch.uint8)})
        at_attack = _step_of(stranger, "node0:0")
        output, _ = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, output[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and summary["steps"] == STEPS and at_attack < STEPS
    assert summary["reconfigurations"] == [], "the stranger's abort or failure report was acted on"
    with pytest.raises(BlockingIOError):
        trap.accept()  # nobody pushed a snapshot to the stranger's address
    trap.close()
    assert stat.S_IMODE(os.stat(workdir / "job.key").st_mode) == 0o600
    rejected: dict[str, set[str]] = {}
    for log in workdir.glob("node*-gpu0.log"):
        for line in log.read_text().splitlines():
            if '"message-rejected"' in line:
                rejected.setdefault(log.stem, set()).add(json.loads(line)["kind"])
    assert {"abort", "snapshot_push", "held"} <= rejected.get("node0-gpu0", set()), rejected
    assert "abort" in rejected.get("node1-gpu0", set()), rejected
