"""`make demo` runs `oobleck demo`: it must work end to end and leave nothing behind."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_applies_the_example_and_cleans_up() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "oobleck.cli", "demo"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "oobleckjob.oobleck.dev/tiny-gpt created" in out
    header = next(line for line in out.splitlines() if line.startswith("NAME"))
    assert header.split() == ["NAME", "PHASE", "NODES", "PIPELINES", "STEP", "AGE"]
    assert "done: nothing left running" in out
    # The API server's port is free again: its process is gone.
    port = int(re.search(r"at https://127\.0\.0\.1:(\d+)", out).group(1))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))


def test_demo_rejects_a_missing_manifest(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "oobleck.cli", "demo", "--job", str(tmp_path / "none.yaml")],
        capture_output=True, text=True,
    )
    assert result.returncode != 0
    assert "--job" in result.stderr and "no such file" in result.stderr
