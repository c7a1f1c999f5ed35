"""The local agent's pod zygote for real (root): a forked container enters its cgroups and root as an exec'd
one does, runs its module with its own argv, environment, working folder and log, and its exit is reported
as a container runtime reports it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from oobleck_dev.mountns import Filesystem, FilesystemError, VolumeMount
from oobleck_dev.podzygote import PodZygote, forkable_module

pytestmark = pytest.mark.integration  # starts processes


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodZygote]:
    zygote = PodZygote(tmp_path_factory.mktemp("zygote") / "zygote.log").start()
    try:
        assert zygote.ready.wait(180), zygote.log.read_text()
        yield zygote
    finally:
        zygote.close()


def _env(**extra: str) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], **extra}


def test_a_forked_container_runs_its_module_in_its_root_with_its_argv_env_and_log(zygote, tmp_path):
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "greeting.json").write_text(json.dumps({"hello": "world"}))
    filesystem = Filesystem.build(
        tmp_path / "root", [VolumeMount("/etc/greeting", volume, read_only=True)], "/etc/greeting"
    )
    log = tmp_path / "logs" / "tool.log"
    container = zygote.spawn("json.tool", ["--indent", "3", "greeting.json"], _env(), filesystem, log, None, None)
    assert asyncio.run(container.wait()) == 0
    assert log.read_text() == '{\n   "hello": "world"\n}\n'  # found relative to its working folder, in its root
    assert not Path("/etc/greeting").exists()  # the mount was the child's alone

    statement = "import os, sys; print(os.environ.get('GREETING'), os.environ.get('HOME'), sys.argv[0])"
    log = tmp_path / "env.log"
    container = zygote.spawn(
        "timeit", ["-n", "1", "-r", "1", statement], _env(GREETING="hi"), filesystem, log, None, None
    )
    assert asyncio.run(container.wait()) == 0
    assert log.read_text().splitlines()[0].split()[:2] == ["hi", "None"]  # its environment, nothing of the zygote's


def test_exit_codes_are_the_interpreters_and_a_killed_container_is_128_plus_the_signal(zygote, tmp_path):
    filesystem = Filesystem.build(tmp_path / "root", [])
    usage = zygote.spawn("oobleck.runtime", ["no-such-command"], _env(), filesystem, tmp_path / "a.log", None, None)
    assert asyncio.run(usage.wait()) == 2 and "invalid choice" in (tmp_path / "a.log").read_text()

    server = zygote.spawn(
        "oobleck.runtime.elastic.coordinator", ["--port", "0"], _env(), filesystem, tmp_path / "b.log", None, None
    )
    assert os.getsid(server.pid) == server.pid  # a session (process group) of its own, as a container
    status = Path(f"/proc/{server.pid}/status").read_text()
    assert f"PPid:\t{zygote.pid}\n" in status
    assert server.returncode is None and server.signal_group(signal.SIGKILL)
    assert asyncio.run(server.wait()) == 128 + signal.SIGKILL and server.returncode == -signal.SIGKILL
    assert not server.signal_group(signal.SIGKILL)


def test_a_filesystem_that_cannot_be_made_is_a_start_error_naming_the_step(zygote, tmp_path):
    volume = tmp_path / "volume"
    volume.mkdir()
    filesystem = Filesystem.build(tmp_path / "root", [VolumeMount("/etc/greeting", volume, where="m")])
    volume.rmdir()  # gone between the plan and the start
    with pytest.raises(FilesystemError) as error:
        zygote.spawn("json.tool", [], _env(), filesystem, tmp_path / "c.log", None, None)
    assert str(error.value) == "container filesystem: bind /etc/greeting: No such file or directory"


def test_only_runtime_modules_run_by_this_interpreter_are_forked():
    import sys

    path = os.path.dirname(sys.executable)
    assert forkable_module(["python", "-m", "oobleck.runtime.backends.pod"], {"PATH": path}) == (
        "oobleck.runtime.backends.pod" if os.path.basename(sys.executable) == "python" else None
    )
    assert forkable_module([sys.executable, "-m", "oobleck.runtime", "worker"], {"PATH": ""}) == "oobleck.runtime"
    assert forkable_module([sys.executable, "-m", "json.tool"], {"PATH": path}) is None
    assert forkable_module(["/usr/bin/env", "-m", "oobleck.runtime"], {"PATH": path}) is None
    assert forkable_module(["sh", "-c", "true"], {"PATH": path}) is None


def test_a_zygote_that_dies_takes_its_containers_with_it_and_refuses_more(tmp_path):
    zygote = PodZygote(tmp_path / "zygote.log").start()
    try:
        assert zygote.wait_ready(180), zygote.log.read_text()
        filesystem = Filesystem.build(tmp_path / "root", [])
        server = zygote.spawn(
            "oobleck.runtime.elastic.coordinator", ["--port", "0"], _env(), filesystem, tmp_path / "a.log", None, None
        )
        assert zygote.pid is not None
        os.kill(zygote.pid, signal.SIGKILL)
        assert asyncio.run(server.wait()) == 128 + signal.SIGKILL  # PR_SET_PDEATHSIG
        assert not zygote.ready.is_set() and not zygote.wait_ready(1)
        with pytest.raises(OSError, match="the pod zygote ended"):
            zygote.spawn("json.tool", [], _env(), filesystem, tmp_path / "b.log", None, None)
    finally:
        zygote.close()
