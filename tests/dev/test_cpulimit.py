"""A CPU quota on running processes (oobleck_dev.cpulimit): the kernel holds a busy process group to it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from oobleck_dev import cpulimit

BUSY = "import os\nos.nice(19)\nos.fork()\nwhile True:\n    pass\n"
"""A spinning parent and a spinning child in one process group (a container's processes), niced: on a
shared host they must not starve anyone while they run unlimited."""


def _rate(pgid: int, seconds: float) -> float:
    before, began = cpulimit.cpu_seconds([pgid]), time.monotonic()
    time.sleep(seconds)
    return (cpulimit.cpu_seconds([pgid]) - before) / (time.monotonic() - began)


def test_a_quota_under_the_kernels_floor_gets_a_longer_period() -> None:
    assert cpulimit.cfs_settings(0.5) == (10_000, 5_000)
    assert cpulimit.cfs_settings(0.1) == (10_000, 1_000)
    assert cpulimit.cfs_settings(0.04) == (25_000, 1_000)
    assert cpulimit.cfs_settings(0.0001) == (1_000_000, 1_000)  # the longest period: the floor again
    with pytest.raises(ValueError, match="cpus"):
        cpulimit.cfs_settings(0)


@pytest.mark.integration  # starts processes (see tests/conftest.py: make test-unit)
def test_a_busy_process_group_is_held_to_its_quota_and_released() -> None:
    if (why := cpulimit.available()) is not None:
        pytest.skip(why)
    quota = cpulimit.CpuQuota.create(f"test-{uuid.uuid4().hex[:8]}")
    assert quota is not None
    busy = subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True)
    try:
        time.sleep(0.5)  # forked
        assert len(cpulimit.process_group(busy.pid)) == 2
        held = quota.throttle([busy.pid], 0.1)
        assert sorted(held) == sorted(cpulimit.process_group(busy.pid))
        # Two spinning processes together: at most the quota (and a little for the measurement's edges).
        assert _rate(busy.pid, 2.0) <= 0.13
        assert quota.throttled_seconds() > 0
        # Under a tenth of a CPU the 10 ms period's quota would be under the kernel's 1 ms floor.
        quota.set_cpus(0.04)
        assert _rate(busy.pid, 2.0) <= 0.055
        quota.set_cpus(None)
        assert (quota.path / "cpu.cfs_quota_us").read_text().strip() == "-1"  # unlimited again
        with pytest.raises(ValueError, match="cpus"):
            quota.set_cpus(0)
    finally:
        os.killpg(busy.pid, signal.SIGKILL)
        busy.wait()
        deadline = time.monotonic() + 10
        while cpulimit.process_group(busy.pid) and time.monotonic() < deadline:
            time.sleep(0.1)  # the forked child, reparented, dies a moment later
        quota.release()
    assert not quota.path.exists()
