"""Network partitions for local-node pods: a pod's traffic dropped by nftables, on this machine only.

Local-node pods share the host's loopback. Their addresses (127.X.N.P) name their listening sockets but
not the connections they open (the kernel gives those the source 127.0.0.1), so an address rule
cannot cut a pod off. Instead every pod's processes start in a cgroup (v2) of their own
(`PodCgroups`, joined before exec) and nftables matches packets by the cgroup of the local socket
(`socket cgroupv2`): in the output hook the sender's socket, in the input hook the receiver's. A cut
pod's sockets then neither send nor receive anything, and nobody sees an EOF or a refused
connection: TCP retransmits into the void, as across a real partition.

Two kinds of cut (`NetworkCuts.cut`):
- "peers": everything but the pod's traffic with the API server (it still reads its plan);
- "api": only its traffic with the API server (it still trains with its peers).

Rules live in one table per agent (`inet oobleck_<agent>`), rewritten atomically on every change and
deleted when the agent stops; they match only this agent's cgroups, so other work on the machine is
untouched. Needs root, a writable cgroup2 mount under /sys/fs/cgroup and `nft` (the Debian package
`nftables`: `ensure_nft` installs it with apt-get when it is missing and we are root).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("oobleck_dev.netfault")

CGROUP_FS = Path("/sys/fs/cgroup")
"""Where nft resolves `socket cgroupv2` paths (they are relative to it)."""
MODES = ("peers", "api")


class NetFaultUnavailable(RuntimeError):
    """This machine cannot cut pods off (the message says why): tests skip with it."""


def cgroup2_mount(mountinfo: str | None = None) -> Path | None:
    """The cgroup2 mount point under /sys/fs/cgroup (/sys/fs/cgroup itself, or .../unified on a hybrid host)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fstype = line.split(" - ", 1)[1].split()[0]
        mount = Path(fields[4])
        if fstype == "cgroup2" and (mount == CGROUP_FS or CGROUP_FS in mount.parents):
            return mount
    return None


def ensure_nft(install: bool = True) -> str:
    """The `nft` binary; installed with apt-get (Debian package nftables) if missing and we are root."""
    found = shutil.which("nft") or next((p for p in ("/usr/sbin/nft", "/sbin/nft") if os.access(p, os.X_OK)), None)
    if found:
        return found
    if not install or os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise NetFaultUnavailable(
            "nft is not installed (Debian package nftables; installing it needs root and apt-get)"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "-q", "nftables"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if result.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600)
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    found = shutil.which("nft") or ("/usr/sbin/nft" if os.access("/usr/sbin/nft", os.X_OK) else None)
    if result.returncode != 0 or not found:
        raise NetFaultUnavailable(f"apt-get install nftables failed: {result.stderr.strip()[-500:]}")
    return found


class PodCgroups:
    """One cgroup2 folder per pod under `<cgroup2 mount>/oobleck-<agent>/`; `available` False (with
    `reason`) where they cannot be made: pods then run without (and cannot be cut off)."""

    def __init__(self, agent_id: str, mount: Path | None = None) -> None:
        self.reason = ""
        mount = mount if mount is not None else cgroup2_mount()
        self.base: Path | None = None
        if mount is None:
            self.reason = f"no cgroup2 file system mounted under {CGROUP_FS}"
            return
        base = mount / f"oobleck-{agent_id}"
        try:
            base.mkdir(exist_ok=True)
        except OSError as error:
            self.reason = f"cannot create cgroup {base}: {error}"
            return
        self.mount: Path = mount
        self.base = base

    @property
    def available(self) -> bool:
        return self.base is not None

    def create(self, pod_key: str) -> Path | None:
        if self.base is None:
            return None
        path = self.base / pod_key
        try:
            path.mkdir(exist_ok=True)
        except OSError as error:
            log.warning("pod %s runs without a cgroup: %s", pod_key, error)
            return None
        return path

    @staticmethod
    def remove(path: Path | None) -> None:
        """Remove a pod's cgroup once its processes are gone (rmdir fails while one is left: kept then)."""
        if path is not None:
            try:
                path.rmdir()
            except OSError:
                pass

    def close(self) -> None:
        if self.base is None:
            return
        for child in self.base.iterdir() if self.base.exists() else ():
            if child.is_dir():
                self.remove(child)
        self.remove(self.base)


def join_cgroup(path: Path | None) -> Callable[[], None]:
    """A preexec_fn step: move the new process into `path` before it execs (its sockets belong there)."""
    procs = None if path is None else str(path / "cgroup.procs")

    def join() -> None:
        if procs is None:
            return
        try:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, b"0")  # "0": the writing process itself
            finally:
                os.close(fd)
        except OSError:
            pass  # the pod runs without it (nothing to report from here): it only cannot be cut off

    return join


def ruleset(table: str, cuts: dict[Path, str], api: tuple[str, int], mount: Path) -> str:
    """The nft script that makes `table` hold exactly the rules for `cuts` (cgroup -> mode), atomically.

    nft names a cgroup by its path below /sys/fs/cgroup and matches the socket's ancestor at `level`
    (the cgroup's depth below the cgroup2 `mount`)."""
    host, port = api
    out: list[str] = []
    into: list[str] = []
    for path, mode in sorted(cuts.items()):
        if mode not in MODES:
            raise ValueError(f"mode: {mode!r} is not one of {MODES}")
        relative = path.relative_to(CGROUP_FS)
        level = len(path.relative_to(mount).parts)
        match = f'socket cgroupv2 level {level} "{relative}"'
        to_api, from_api = f"ip daddr {host} tcp dport {port}", f"ip saddr {host} tcp sport {port}"
        if mode == "peers":
            out += [f"{match} {to_api} accept", f"{match} drop"]
            into += [f"{match} {from_api} accept", f"{match} drop"]
        else:
            out.append(f"{match} {to_api} drop")
            into.append(f"{match} {from_api} drop")
    body = "\n".join(
        [
            f"add table inet {table}",
            f"delete table inet {table}",
            f"table inet {table} {{",
            "  chain out {",
            "    type filter hook output priority 0; policy accept;",
            *(f"    {rule}" for rule in out),
            "  }",
            "  chain in {",
            "    type filter hook input priority 0; policy accept;",
            *(f"    {rule}" for rule in into),
            "  }",
            "}",
        ]
    )
    return body + "\n"


class NetworkCuts:
    """The nftables table of one agent: which pod cgroups are cut off, and how."""

    def __init__(self, agent_id: str, api: tuple[str, int], mount: Path) -> None:
        self.table = f"oobleck_{agent_id}"
        self.api, self.mount = api, mount
        self.cuts: dict[Path, str] = {}
        self._nft: str | None = None

    def cut(self, cgroup: Path, mode: str = "peers") -> None:
        if mode not in MODES:
            raise ValueError(f"mode: {mode!r} is not one of {MODES}")
        self._apply({**self.cuts, cgroup: mode})

    def heal(self, cgroup: Path) -> None:
        self._apply({k: v for k, v in self.cuts.items() if k != cgroup})

    def close(self) -> None:
        if self._nft is not None:
            subprocess.run([self._nft, "delete", "table", "inet", self.table], capture_output=True, timeout=30)
        self.cuts = {}

    def _apply(self, cuts: dict[Path, str]) -> None:
        if self._nft is None:
            self._nft = ensure_nft()
        script = ruleset(self.table, cuts, self.api, self.mount)
        result = subprocess.run([self._nft, "-f", "-"], input=script, capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            raise NetFaultUnavailable(f"nft -f failed: {result.stderr.strip()}\n{script}")
        self.cuts = cuts
