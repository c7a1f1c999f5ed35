"""A container's memory limit on a local node, enforced by the kernel: a cgroup (v1) memory controller.

A kubelet puts each container in a memory cgroup whose limit is `resources.limits.memory`; a container
that goes over is OOM-killed (SIGKILL) and reported as `terminated: {exitCode: 137, reason: OOMKilled}`.
The local node agent does the same where this machine lets it (root, the v1 memory hierarchy mounted at
/sys/fs/cgroup/memory, as here): `MemoryCgroup.create` returns None where it does not, and the
container then runs unlimited (as before).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("oobleck_dev.memlimit")

ROOT = Path("/sys/fs/cgroup/memory")
PARENT = "oobleck-local"


class MemoryCgroup:
    """One container run's memory cgroup."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, name: str, limit_bytes: int, root: Path = ROOT) -> MemoryCgroup | None:
        """A fresh cgroup `PARENT/name` limited to `limit_bytes` (swap included), or None if unavailable."""
        path = root / PARENT / name
        try:
            path.mkdir(parents=True, exist_ok=True)
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            swap = path / "memory.memsw.limit_in_bytes"
            if swap.exists():  # no swapping past the limit either (a kubelet runs without swap)
                swap.write_text(str(limit_bytes))
        except OSError as error:
            log.debug("no memory cgroup for %s: %s", name, error)
            cls._remove(path)
            return None
        return cls(path)

    def join(self) -> Callable[[], None]:
        """A preexec_fn step that moves the new process into the cgroup before it runs the command."""
        procs = str(self.path / "cgroup.procs")

        def enter() -> None:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)

        return enter

    def oom_killed(self) -> bool:
        """Whether the kernel OOM-killed a process of this cgroup."""
        try:
            for line in (self.path / "memory.oom_control").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value) > 0
        except (OSError, ValueError):
            pass
        return False

    def remove(self) -> None:
        self._remove(self.path)

    @staticmethod
    def _remove(path: Path) -> None:
        try:
            path.rmdir()  # only an empty cgroup (no live process) can go; one that cannot stays harmlessly
        except OSError:
            pass


def tail(path: Path, limit_bytes: int = 2048, limit_lines: int = 80) -> str:
    """The end of a container's log, as a kubelet's FallbackToLogsOnError keeps it (2048 bytes, 80 lines)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - limit_bytes))
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-limit_lines:])
