"""The local node agent's memory limit (oobleck_dev.memlimit): the kernel OOM-kills a container over it."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from oobleck_dev.memlimit import MemoryCgroup, tail

pytestmark = pytest.mark.integration  # starts processes (see tests/conftest.py: make test-unit)


def _cgroup(limit: int) -> MemoryCgroup:
    cgroup = MemoryCgroup.create(f"test-{uuid.uuid4().hex[:8]}", limit)
    if cgroup is None:
        pytest.skip("no writable cgroup v1 memory hierarchy on this machine (needs root)")
    return cgroup


def _run(cgroup: MemoryCgroup, megabytes: int) -> int:
    code = f"x = bytearray({megabytes} << 20); print('allocated', len(x))"
    return subprocess.run([sys.executable, "-c", code], preexec_fn=cgroup.join(), capture_output=True).returncode


def test_a_process_over_the_limit_is_oom_killed_and_one_under_it_is_not():
    cgroup = _cgroup(200 << 20)
    try:
        assert _run(cgroup, 50) == 0 and not cgroup.oom_killed()
        assert _run(cgroup, 600) == -9  # SIGKILL from the OOM killer
        assert cgroup.oom_killed()
    finally:
        cgroup.remove()
    assert not cgroup.path.exists()


def test_tail_keeps_the_end_of_the_log_as_a_kubelet_does(tmp_path):
    log = tmp_path / "c.log"
    log.write_text("".join(f"line {i}\n" for i in range(1000)))
    text = tail(log)
    assert text.endswith("line 999") and len(text.encode()) <= 2048 and len(text.splitlines()) <= 80
    assert tail(tmp_path / "missing.log") == ""
