"""A container's filesystem for a pod process on a local node: the host's files, the pod's volumes at their mountPaths.

In a real container the product reads its volumes where the pod spec mounts them (/etc/config,
/var/run/secrets/kubernetes.io/serviceaccount, ...). A local node runs each container as a host process,
and the host stands in for the image, so the node agent gives that process the same view:

- a mount namespace of its own (CLONE_NEWNS, every mount private: nothing propagates to the host or to
  other pods, and the namespace, with all its mounts, ends with the container's last process);
- whose root is a fresh tmpfs that rebuilds the host's tree: each host entry is bind-mounted (recursively)
  at its own path, except the folders on the way to a mountPath, which are recreated in the tmpfs with
  their entries bound one by one, so that a mount point can be made without touching the host;
- each volume bound at its mountPath (read-only where the mount says so, and for the API-data volumes
  configMap, secret, downwardAPI and projected, as a kubelet mounts them), then chroot into that root.

`plan` is the pure part (it reads the host's folder listings through a `HostTree`), `Filesystem.enter`
the side effect, run in the child between fork and exec (see ContainerProcess in podrunner.py): the
process keeps its PID, cgroups, host network and everything else. Mount paths follow the host's
symlinks as runc follows the image's (/var/run/x is /run/x here).
"""

from __future__ import annotations

import ctypes
import errno
import os
import posixpath
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from oobleck_dev.podenv import MountError

_libc = ctypes.CDLL(None, use_errno=True)  # resolved here, never between fork and exec
_mount, _umount2, _unshare = _libc.mount, _libc.umount2, _libc.unshare
_mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_unshare.argtypes = [ctypes.c_int]

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x1, 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
MAX_SYMLINKS = 40  # the kernel's limit when it follows a path


class FilesystemError(OSError):
    """The container's filesystem could not be made (in the child, before exec); the message says which step."""

    def __str__(self) -> str:
        return str(self.strerror) if self.strerror else super().__str__()


@dataclass(frozen=True)
class VolumeMount:
    """One volume (or its subPath) at a path in the container."""

    path: str
    """the container path (absolute)"""
    source: Path
    """the host folder or file the volume is"""
    read_only: bool = False
    where: str = ""
    """the field it comes from, for errors: `containers[main].volumeMounts[config]`"""


Kind = Literal["dir", "file", "symlink"]


class HostTree:
    """What the plan reads of the host: entry kinds and folder listings (a fake one in tests)."""

    def kind(self, path: str) -> Kind | None:
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            return None
        return "symlink" if stat.S_ISLNK(mode) else "dir" if stat.S_ISDIR(mode) else "file"

    def readlink(self, path: str) -> str:
        return os.readlink(path)

    def entries(self, path: str) -> list[str]:
        return sorted(os.listdir(path))


ACTIONS = ("dir", "file", "symlink", "makedirs", "bind", "host", "readonly")


@dataclass(frozen=True)
class Step:
    """One action of `Filesystem.enter`, on a container path (below the new root)."""

    action: Literal["dir", "file", "symlink", "makedirs", "bind", "host", "readonly"]
    path: str
    source: str = ""
    """bind, host: the host path; symlink: the link's target"""


def canonical(path: str, host: HostTree, stop_at: Sequence[str] = ()) -> str:
    """`path` with the host's symlinks on its way resolved, as runc resolves a mount point in the image.

    Resolution stops at the first component the host lacks, and below any of `stop_at` (other mounts:
    what lies under them is the volume's, not the host's)."""
    parts = [p for p in path.split("/") if p]
    resolved = "/"
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            resolved = posixpath.dirname(resolved)
            continue
        candidate = posixpath.join(resolved, part)
        if candidate in stop_at or host.kind(candidate) != "symlink":
            resolved = candidate
            if candidate in stop_at or host.kind(candidate) is None:
                return posixpath.join(resolved, *parts) if parts else resolved
            continue
        hops += 1
        if hops > MAX_SYMLINKS:
            raise MountError(f"{path}: too many levels of symbolic links on this node")
        target = host.readlink(candidate)
        parts = [p for p in target.split("/") if p] + parts
        resolved = "/" if target.startswith("/") else resolved
    return resolved


def plan(mounts: Sequence[VolumeMount], host: HostTree) -> list[Step]:
    """The steps that build a container root: the host's tree with `mounts` at their (canonical) paths."""
    raw = [posixpath.normpath(m.path) for m in mounts]
    placed: dict[str, VolumeMount] = {}
    for mount, path in zip(mounts, raw, strict=True):
        if not mount.path.startswith("/"):
            raise MountError(f"{mount.where}.mountPath: must be absolute, got {mount.path!r}")
        if path == "/":
            raise MountError(f"{mount.where}.mountPath: cannot mount at '/'")
        path = canonical(path, host, stop_at=[p for p in raw if p != path])
        if path in placed:
            raise MountError(f"{mount.where}.mountPath: {path} is already mounted by {placed[path].where}")
        if host.kind(str(mount.source)) is None:
            raise MountError(f"{mount.where}: {mount.source} does not exist on this node")
        placed[path] = VolumeMount(path, mount.source, mount.read_only, mount.where)
    steps: list[Step] = []
    _rebuild("/", "/", list(placed.values()), host, steps)
    # Read-only last: a read-only volume may hold the mount point of another.
    steps += [Step("readonly", m.path) for m in sorted(placed.values(), key=lambda m: m.path) if m.read_only]
    return steps


def _rebuild(path: str, host_dir: str | None, mounts: list[VolumeMount], host: HostTree, steps: list[Step]) -> None:
    """Fill the tmpfs folder `path` with `host_dir`'s entries and the `mounts` below it."""
    groups: dict[str, list[VolumeMount]] = {}
    for mount in mounts:
        groups.setdefault(posixpath.relpath(mount.path, path).split("/")[0], []).append(mount)
    for name in host.entries(host_dir) if host_dir is not None else []:
        if name in groups:
            continue
        child, source = posixpath.join(path, name), posixpath.join(host_dir, name)  # type: ignore[arg-type]
        kind = host.kind(source)
        if kind == "symlink":
            steps.append(Step("symlink", child, host.readlink(source)))
        elif kind is not None:
            steps += [Step(kind, child), Step("host", child, source)]
    for name, group in sorted(groups.items()):
        child = posixpath.join(path, name)
        exact = next((m for m in group if m.path == child), None)
        below = sorted((m for m in group if m.path != child), key=lambda m: m.path)
        if exact is not None:
            steps += [Step(_source_kind(exact, host), child), Step("bind", child, str(exact.source))]
            for inner in below:  # inside the volume: its folders are made in the volume, as runc does
                steps += [
                    Step("makedirs", posixpath.dirname(inner.path)),
                    Step(_source_kind(inner, host), inner.path),
                    Step("bind", inner.path, str(inner.source)),
                ]
            continue
        host_child = posixpath.join(host_dir, name) if host_dir is not None else None
        kind = host.kind(host_child) if host_child is not None else None
        if kind not in (None, "dir"):
            raise MountError(f"{below[0].where}.mountPath: {host_child} is not a folder on this node")
        steps.append(Step("dir", child))
        _rebuild(child, host_child if kind == "dir" else None, below, host, steps)


def _source_kind(mount: VolumeMount, host: HostTree) -> Literal["dir", "file"]:
    return "dir" if host.kind(str(Path(mount.source).resolve())) == "dir" else "file"


@dataclass(frozen=True)
class Filesystem:
    """A container's root: `steps` run below `root` (an empty host folder: the tmpfs's mount point), then chroot."""

    root: Path
    steps: tuple[Step, ...]
    cwd: str = "/"

    @classmethod
    def build(cls, root: Path, mounts: Sequence[VolumeMount], cwd: str = "/", host: HostTree | None = None):
        root.mkdir(parents=True, exist_ok=True)
        steps = plan(mounts, host or HostTree())
        # Bind the host folder that holds `root` first, while the new root is still empty: every mount made
        # before it would be copied into it (and detached again after the chroot).
        top = "/" + root.resolve().parts[1]
        holder = [Step("dir", top), Step("host", top, top)]
        if all(step in steps for step in holder):
            steps = holder + [step for step in steps if step not in holder]
        return cls(root, tuple(steps), cwd)

    def preexec(self, report_fd: int) -> Callable[[], None]:
        """A preexec_fn step: unshare, build the root, chroot and chdir. On failure the step and the error are
        written to `report_fd` and FilesystemError is raised (subprocess then fails the start)."""
        root = os.fsencode(self.root)
        encoded = [(s.action, root + os.fsencode(s.path), os.fsencode(s.source)) for s in self.steps]
        cwd = os.fsencode(self.cwd)

        def enter() -> None:
            what = "unshare(CLONE_NEWNS)"
            try:
                _check(_unshare(CLONE_NEWNS))
                what = "make / private"
                _check(_mount(None, b"/", None, MS_REC | MS_PRIVATE, None))
                what = "mount a tmpfs as the root"
                _check(_mount(b"tmpfs", root, b"tmpfs", 0, b"mode=755"))
                for action, path, source in encoded:
                    what = action
                    _apply(action, path, source)
                what = "chroot"
                os.chroot(root)
                what = "chdir"
                os.makedirs(cwd, exist_ok=True)
                os.chdir(cwd)
            except OSError as error:
                where = f" {os.fsdecode(path[len(root) :])}" if what in ACTIONS else ""
                message = f"container filesystem: {what}{where}: {error.strerror or error}"
                os.write(report_fd, message.encode())
                raise FilesystemError(error.errno, message) from None
            # The host tree bound above holds a copy of this root at its host path: detach it (absent: fine).
            _umount2(root, MNT_DETACH)

        return enter

    @staticmethod
    def start_error(report_fd: int) -> FilesystemError | None:
        """What a failed `preexec` wrote to its end of the pipe (read after the start failed), or None."""
        os.set_blocking(report_fd, False)
        try:
            message = os.read(report_fd, 65536).decode(errors="replace")
        except BlockingIOError:
            return None
        return FilesystemError(errno.EIO, message) if message else None


def _check(result: int) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _apply(action: str, path: bytes, source: bytes) -> None:
    if action == "dir":
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            pass
    elif action == "file":
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
    elif action == "symlink":
        os.symlink(source, path)
    elif action == "makedirs":
        os.makedirs(path, exist_ok=True)
    elif action == "bind":
        _check(_mount(source, path, None, MS_BIND | MS_REC, None))
    elif action == "host":
        # A host entry at its own path. One removed since the plan (another tool's /run/containerd, taken
        # down between a pod's restarts) is left out, as it would be from a fresh plan; a volume (bind) is not.
        if _mount(source, path, None, MS_BIND | MS_REC, None) != 0 and ctypes.get_errno() != errno.ENOENT:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
    elif action == "readonly":
        _check(_mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY, None))
    else:
        raise OSError(errno.EINVAL, f"unknown step {action}")
