"""The container filesystem's plan (mountns.plan) against a made-up host tree; local node pods run it for real
(tests/dev/test_nodeagent.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from oobleck_dev.mountns import Filesystem, HostTree, Step, VolumeMount, plan
from oobleck_dev.podenv import MountError


class FakeHost(HostTree):
    """A host tree from {path: "dir" | "file" | "-> target"}."""

    def __init__(self, tree: dict[str, str]):
        self.tree = {"/": "dir", **tree}

    def kind(self, path: str):
        entry = self.tree.get(path)
        return None if entry is None else "symlink" if entry.startswith("->") else entry  # type: ignore[return-value]

    def readlink(self, path: str) -> str:
        return self.tree[path][2:].strip()

    def entries(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/"
        return sorted({p[len(prefix) :] for p in self.tree if p.startswith(prefix) and "/" not in p[len(prefix) :]})


HOST = FakeHost(
    {
        "/etc": "dir",
        "/etc/hosts": "file",
        "/run": "dir",
        "/run/lock": "dir",
        "/var": "dir",
        "/var/run": "-> /run",
        "/usr": "dir",
        "/bin": "-> usr/bin",
        "/vol/config": "dir",
        "/vol/key": "file",
        "/vol": "dir",
    }
)


def test_the_host_tree_is_bound_and_folders_on_the_way_to_a_mount_are_rebuilt():
    steps = plan(
        [
            VolumeMount("/var/run/secrets/sa", Path("/vol/config"), read_only=True, where="m[sa]"),
            VolumeMount("/etc/key", Path("/vol/key"), where="m[key]"),
        ],
        HOST,
    )
    # /var/run is the host's symlink to /run: the mount lands under /run, /var stays the host's folder.
    assert Step("host", "/var", "/var") in steps and Step("symlink", "/bin", "usr/bin") in steps
    # /etc and /run are rebuilt entry by entry; the mount points are made in the tmpfs, never on the host.
    assert [s for s in steps if s.path.startswith("/etc")] == [
        Step("dir", "/etc"),
        Step("file", "/etc/hosts"),
        Step("host", "/etc/hosts", "/etc/hosts"),
        Step("file", "/etc/key"),
        Step("bind", "/etc/key", "/vol/key"),
    ]
    assert Step("host", "/run/lock", "/run/lock") in steps
    assert steps[-1] == Step("readonly", "/run/secrets/sa")  # read-only after every mount is made
    assert Step("bind", "/run/secrets/sa", "/vol/config") in steps and Step("dir", "/run/secrets") in steps
    assert not [s for s in steps if s.action in ("bind", "host") and s.path in ("/etc", "/run")]


def test_a_mount_inside_a_volume_makes_its_folder_in_the_volume():
    steps = plan(
        [
            VolumeMount("/data/deep/key", Path("/vol/key"), where="b"),
            VolumeMount("/data", Path("/vol/config"), where="a"),
        ],
        HOST,
    )
    at = steps.index(Step("bind", "/data", "/vol/config"))
    assert steps[at + 1 : at + 4] == [
        Step("makedirs", "/data/deep"),
        Step("file", "/data/deep/key"),
        Step("bind", "/data/deep/key", "/vol/key"),
    ]


def test_bad_mounts_name_the_field():
    with pytest.raises(MountError, match=r"m\[a\].mountPath: cannot mount at '/'"):
        plan([VolumeMount("/", Path("/vol/config"), where="m[a]")], HOST)
    with pytest.raises(MountError, match=r"m\[b\].mountPath: /etc/hosts is not a folder on this node"):
        plan([VolumeMount("/etc/hosts/x", Path("/vol/config"), where="m[b]")], HOST)
    with pytest.raises(MountError, match=r"m\[d\].mountPath: /run/x is already mounted by m\[c\]"):
        plan(
            [
                VolumeMount("/run/x", Path("/vol/key"), where="m[c]"),
                VolumeMount("/var/run/x", Path("/vol/key"), where="m[d]"),
            ],
            HOST,
        )
    with pytest.raises(MountError, match=r"m\[e\]: /vol/absent does not exist on this node"):
        plan([VolumeMount("/data", Path("/vol/absent"), where="m[e]")], HOST)


@pytest.mark.integration  # starts a process
def test_a_process_sees_its_mounts_and_a_step_that_fails_is_a_start_error(tmp_path):
    """For real (root): the child enters its filesystem before exec; a failure says which step, as a runtime does."""
    import shutil

    from oobleck_dev.mountns import FilesystemError
    from oobleck_dev.podrunner import ContainerProcess

    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "greeting").write_text("hello")
    filesystem = Filesystem.build(tmp_path / "root", [VolumeMount("/etc/greeting", volume, read_only=True, where="m")])
    process = ContainerProcess(["cat", "/etc/greeting/greeting"], dict(os.environ), filesystem, tmp_path / "log")
    assert process.popen.wait(30) == 0 and (tmp_path / "log").read_text() == "hello"
    assert not Path("/etc/greeting").exists()
    shutil.rmtree(volume)  # gone between the plan and the start
    with pytest.raises(FilesystemError) as error:
        ContainerProcess(["true"], dict(os.environ), filesystem, tmp_path / "log")
    assert str(error.value) == "container filesystem: bind /etc/greeting: No such file or directory"


@pytest.mark.integration  # starts a process
def test_a_host_entry_removed_since_the_plan_is_left_out(tmp_path):
    """A host entry (not a volume) gone between the plan and a start, as another tool's /run/containerd between
    a pod's restarts: the process starts without it (it once failed 6 restarts in a row with StartError)."""
    from oobleck_dev.podrunner import ContainerProcess

    entry = Path(f"/run/oobleck-test-{os.getpid()}")
    entry.mkdir()
    try:
        volume = tmp_path / "volume"
        volume.mkdir()
        # A volume below /run, as a pod's service-account token is (/var/run/secrets/...): /run is rebuilt
        # entry by entry, each host entry bound at its own path.
        mounts = [VolumeMount(f"/run/oobleck-volume-{os.getpid()}", volume, where="m")]
        filesystem = Filesystem.build(tmp_path / "root", mounts)
        assert Step("host", str(entry), str(entry)) in filesystem.steps
    finally:
        entry.rmdir()
    process = ContainerProcess(["ls", "/run"], dict(os.environ), filesystem, tmp_path / "log")
    assert process.popen.wait(30) == 0, (tmp_path / "log").read_text()
    assert entry.name in (tmp_path / "log").read_text()  # its (empty) mount point, made in the tmpfs
