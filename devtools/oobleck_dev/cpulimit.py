"""A running pod's CPU held to a quota by the kernel: a cgroup (v1) `cpu` controller, for straggler tests.

A kubelet turns `resources.limits.cpu` into a CFS quota (`cpu.cfs_quota_us` per `cpu.cfs_period_us`);
a process over it waits for the next period, so a compute-bound worker held to half a CPU computes
at most at half the pace it has on a whole one. `CpuQuota.throttle` does that to processes already
running (a node turned slow mid-job: a throttling GPU, a noisy neighbour), and `set_cpus(None)` lifts
it. Where this machine has no writable v1 cpu hierarchy at /sys/fs/cgroup/cpu, `create` returns None.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

log = logging.getLogger("oobleck_dev.cpulimit")

ROOT = Path("/sys/fs/cgroup/cpu")
PARENT = "oobleck-local"
PERIOD_US = 10_000
"""Shorter than a kubelet's default 100 ms (its --cpu-cfs-quota-period can be set so too): a step of a
tiny test model lasts milliseconds, and at 100 ms a half quota would leave most steps untouched and stall
a few for 50 ms, where a slow node slows every step."""
MIN_QUOTA_US = 1_000
"""The kernel's floor for cpu.cfs_quota_us."""
MAX_PERIOD_US = 1_000_000
"""The kernel's ceiling for cpu.cfs_period_us."""


def cfs_settings(cpus: float) -> tuple[int, int]:
    """(period, quota) in microseconds that hold a cgroup to `cpus` CPUs: PERIOD_US, or a longer period where
    `cpus` of it would be under the kernel's 1 ms floor (at 10 ms, anything under 0.1 CPU would silently be
    0.1: a pod using 0.6 CPU held to a tenth would run at a sixth)."""
    if cpus <= 0:
        raise ValueError(f"cpus: must be positive, got {cpus}")
    period = min(MAX_PERIOD_US, max(PERIOD_US, math.ceil(MIN_QUOTA_US / cpus)))
    return period, max(MIN_QUOTA_US, round(cpus * period))


def process_group(pgid: int, proc: Path = Path("/proc")) -> list[int]:
    """The pids of the processes in process group `pgid` (a container's processes: the agent starts each
    container as a group leader)."""
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses, so split after its last ')'.
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def cpu_seconds(pgids: list[int], proc: Path = Path("/proc")) -> float:
    """CPU time (user + system) used so far by the live processes of the process groups `pgids`."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pgid in pgids:
        for pid in process_group(pgid, proc):
            try:
                stat = (proc / str(pid) / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / ticks


class CpuQuota:
    """One cgroup `PARENT/name` of the cpu controller."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, name: str, root: Path = ROOT) -> CpuQuota | None:
        path = root / PARENT / name
        try:
            path.mkdir(parents=True, exist_ok=True)
            (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        except OSError as error:
            log.debug("no cpu cgroup for %s: %s", name, error)
            return None
        return cls(path)

    def set_cpus(self, cpus: float | None) -> None:
        """Hold the cgroup's processes to `cpus` CPUs together (None: unlimited)."""
        if cpus is None:
            (self.path / "cpu.cfs_quota_us").write_text("-1")
            return
        period, quota = cfs_settings(cpus)
        (self.path / "cpu.cfs_quota_us").write_text("-1")  # a period is checked against the quota in force
        (self.path / "cpu.cfs_period_us").write_text(str(period))
        (self.path / "cpu.cfs_quota_us").write_text(str(quota))

    def throttle(self, pgids: list[int], cpus: float | None) -> list[int]:
        """Move every process of the process groups `pgids` in and set the quota; returns the pids moved."""
        self.set_cpus(cpus)
        moved = []
        for pgid in pgids:
            for pid in process_group(pgid):
                try:
                    (self.path / "cgroup.procs").write_text(str(pid))  # its threads move with it
                except OSError:
                    continue  # exited meanwhile
                moved.append(pid)
        return moved

    def throttled_seconds(self) -> float:
        """Total time the kernel held the cgroup's processes back (cpu.stat throttled_time)."""
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "throttled_time":
                return int(value) / 1e9
        return 0.0

    def release(self) -> None:
        """Move the processes back to the root cgroup, unlimited, and remove this one."""
        root_procs = self.path.parent.parent / "cgroup.procs"
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                root_procs.write_text(pid)
            except OSError:
                pass
        try:
            self.path.rmdir()
        except OSError:
            pass


def available(root: Path = ROOT) -> str | None:
    """Why CPU quotas cannot be set on this machine (tests skip with it), or None."""
    if not (root / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {root}"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable (not root?)"
    return None
