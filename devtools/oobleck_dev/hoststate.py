"""What real nodes change on the host, recorded before and undone after (`realnodes.RealNodes.down`).

A kubelet sets kernel sysctls, kubelet and kube-proxy add iptables chains (`KUBE-*`), containerd and the
kubelet mount, the nodes create cgroups and bridges. `HostRecord` is saved as JSON in the nodes' folder
before anything starts, so that a later run can undo what a SIGKILLed owner left behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SYSCTLS = (
    "kernel.panic",
    "kernel.panic_on_oops",
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
    "net.ipv4.ip_forward",
    "net.ipv4.conf.all.route_localnet",
    "net.bridge.bridge-nf-call-iptables",
)
"""Kernel settings the kubelet (protectKernelDefaults off), the CNI bridge and kube-proxy may change."""
CHAIN_PREFIXES = ("KUBE-", "CNI-")
FIXED_PATHS = ("/var/lib/kubelet", "/var/log/containers", "/var/log/pods", "/run/containerd")
"""Folders the kubelet (device plugins, container log links) and containerd (shim sockets) create whatever
their root folders are set to: removed on down when they did not exist before."""
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def read_sysctls() -> dict[str, str]:
    values = {}
    for name in SYSCTLS:
        try:
            values[name] = _sysctl_path(name).read_text().strip()
        except OSError:
            continue  # not on this kernel (e.g. bridge-nf-call-iptables without br_netfilter)
    return values


@dataclass
class HostRecord:
    """The host as the nodes found it, and what they will create (the undo list)."""

    sysctls: dict[str, str] = field(default_factory=dict)
    bridges: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)  # cgroup roots, e.g. /oobleck-real-1
    folders: list[str] = field(default_factory=list)  # node folders: every mount under them goes
    sockets: list[str] = field(default_factory=list)  # containerd sockets: their shims go
    created: list[str] = field(default_factory=list)  # FIXED_PATHS that did not exist before

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> HostRecord:
        return cls(**json.loads(path.read_text()))


def cgroup_hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy (v1 controllers and the unified one)."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        fstype = fields[fields.index("-") + 1]
        if fstype in ("cgroup", "cgroup2"):
            found.append(Path(fields[4]))
    return found


def make_cgroup_root(name: str) -> None:
    """Create `/<name>` in every hierarchy, before the kubelet (it refuses a cgroupRoot that does not exist);
    cpuset needs its cpus and mems filled in before a task may join."""
    for hierarchy in cgroup_hierarchies():
        folder = hierarchy / name.lstrip("/")
        folder.mkdir(exist_ok=True)
        for item in ("cpuset.cpus", "cpuset.mems"):
            if (folder / item).exists() and not (folder / item).read_text().strip():
                (folder / item).write_text((hierarchy / item).read_text())


def kill_cgroup_tree(name: str) -> int:
    """SIGKILL every process in `/<name>` and below, in every hierarchy; the number of signals sent."""
    sent = 0
    for hierarchy in cgroup_hierarchies():
        top = hierarchy / name.lstrip("/")
        if not top.is_dir():
            continue
        # os.walk, not rglob: runc removes a container's cgroup folder while the walk goes on (rglob raises).
        for root, _, files in os.walk(top):
            if "cgroup.procs" not in files:
                continue
            try:
                pids = (Path(root) / "cgroup.procs").read_text().split()
            except OSError:
                continue
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                    sent += 1
                except (ProcessLookupError, ValueError):
                    pass
    return sent


def remove_cgroup_tree(name: str, timeout_s: float = 20.0) -> list[str]:
    """rmdir `/<name>` and everything below it (deepest first) in every hierarchy; the folders left."""
    left: list[str] = []
    deadline = time.monotonic() + timeout_s
    for hierarchy in cgroup_hierarchies():
        top = hierarchy / name.lstrip("/")
        if not top.is_dir():
            continue
        while True:
            # Deepest first, `top` last; os.walk skips a folder removed meanwhile (runc removing its container's).
            folders = [Path(root) for root, _, _ in os.walk(top, topdown=False)] or [top]
            busy = []
            for folder in folders:
                try:
                    folder.rmdir()
                except FileNotFoundError:
                    pass
                except OSError:
                    busy.append(str(folder))
            if not busy or time.monotonic() > deadline:
                left.extend(busy)
                break
            kill_cgroup_tree(name)  # a process that raced into it
            time.sleep(0.2)
    return left


def kill_shims(socket: str) -> None:
    """SIGKILL the containerd shims that serve `socket`'s containerd (they outlive it by design)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"containerd-shim-runc-v2") and socket.encode() in argv:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def unmount_under(folder: str) -> None:
    """Lazily unmount every mount point at or under `folder`, deepest first."""
    prefix = folder.rstrip("/") + "/"
    for _ in range(5):  # a bind mount of a folder may hide mounts beneath it: go again until none remain
        points = []
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            if point == folder or point.startswith(prefix):
                points.append(point)
        if not points:
            return
        for point in sorted(set(points), key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True)


def delete_bridge(name: str) -> None:
    subprocess.run(["ip", "link", "delete", name], capture_output=True)


_CHAIN_REFERENCE = re.compile(r"-[jg] (\S+)")


def remove_iptables_chains(prefixes: tuple[str, ...] = CHAIN_PREFIXES) -> None:
    """Remove every chain named with `prefixes` (and the rules that jump to them) from every table, IPv4
    and IPv6: the kubelet's and kube-proxy's. Other chains and rules (other tools') stay."""
    for save, tool in (("iptables-save", "iptables"), ("ip6tables-save", "ip6tables")):
        try:
            dump = subprocess.run([save], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            continue
        table = ""
        ours: dict[str, list[str]] = {}
        jumps: list[tuple[str, str]] = []
        for line in dump.splitlines():
            if line.startswith("*"):
                table = line[1:]
                ours.setdefault(table, [])
            elif line.startswith(":") and line[1:].split()[0].startswith(prefixes):
                ours[table].append(line[1:].split()[0])
            elif line.startswith("-A "):
                chain = line.split()[1]
                target = _CHAIN_REFERENCE.search(line)
                if not chain.startswith(prefixes) and target and target.group(1).startswith(prefixes):
                    jumps.append((table, line[3:]))
        for table, rule in jumps:
            subprocess.run(f"{tool} -w -t {table} -D {rule}", shell=True, capture_output=True)
        for table, chains in ours.items():
            for chain in chains:
                subprocess.run([tool, "-w", "-t", table, "-F", chain], capture_output=True)
            for chain in chains:
                subprocess.run([tool, "-w", "-t", table, "-X", chain], capture_output=True)


def remove_ipsets(prefixes: tuple[str, ...]) -> None:
    """Destroy every ipset named with `prefixes` (kube-router's); call it after the iptables rules that
    match them are gone (a set in use cannot be destroyed). Other sets stay; no ipset tool, nothing to do."""
    try:
        names = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return
    for name in names:
        if name.startswith(prefixes):
            subprocess.run(["ipset", "destroy", name], capture_output=True)


def absent_fixed_paths() -> list[str]:
    return [path for path in FIXED_PATHS if not os.path.lexists(path)]


def remove_created(paths: list[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def restore_sysctls(original: dict[str, str]) -> None:
    for name, value in original.items():
        path = _sysctl_path(name)
        try:
            if path.read_text().strip() != value:
                path.write_text(value)
        except OSError:
            continue


def remove_container_log_links(folder: str) -> None:
    """The kubelet links /var/log/containers/*.log to its pods' logs: remove the links into `folder`."""
    links = Path("/var/log/containers")
    if not links.is_dir():
        return
    for link in links.iterdir():
        try:
            if link.is_symlink() and os.readlink(link).startswith(folder.rstrip("/") + "/"):
                link.unlink()
        except OSError:
            continue
