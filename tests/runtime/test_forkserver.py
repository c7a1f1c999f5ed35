"""Processes forked from the preloaded forkserver (runtime/backends/local/forkserver.py: `oobleck launch`'s
workers; oobleck_dev.preforked: the tests') behave as `python *command` would: the argv, the whole environment
given, one OpenMP thread, output to the files named, the exit code, and `python -m oobleck.runtime` exactly as
the command line runs it; a child that must die with the server does, when the server's owner is SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oobleck_dev import preforked

pytestmark = pytest.mark.integration  # starts processes (see tests/conftest.py: make test-unit)

SCRIPT = """
import json, os, sys
import torch
print(json.dumps({"argv": sys.argv, "env": dict(os.environ), "threads": torch.get_num_threads(),
                  "main": __name__, "path0": sys.path[0]}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_a_script_gets_its_argv_its_environment_one_thread_and_its_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    out, err = tmp_path / "out", tmp_path / "err"
    monkeypatch.setenv("OOBLECK_TEST_PARENT_ONLY", "1")  # not in the child's environment: it gets `env` only
    process = preforked.start([str(script), "3", "x"], out, {"ONLY": "this", "OMP_NUM_THREADS": "1"}, stderr=err)
    assert process.wait(timeout=120) == 3
    seen = json.loads(out.read_text())
    assert seen["argv"] == [str(script), "3", "x"] and seen["main"] == "__main__"
    assert seen["env"] == {"ONLY": "this", "OMP_NUM_THREADS": "1"}
    assert seen["threads"] == 1 and Path(seen["path0"]) == tmp_path.resolve()
    assert err.read_text() == "to stderr\n"


def test_the_runtime_module_runs_as_its_command_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "plan.json").write_text('{"job": "x"}')
    log = tmp_path / "log"
    argv = ["-m", "oobleck.runtime", "worker", "--config", str(tmp_path / "config.json")]
    process = preforked.start([*argv, "--plan", str(tmp_path / "plan.json"), "--store", "nonsense"], log, {})
    assert process.wait(timeout=120) == 2  # argparse's exit, as `python -m oobleck.runtime` gives it
    assert "--store: expected HOST:PORT" in log.read_text()


def test_a_process_still_running_times_out_and_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    process = preforked.start([str(script)], tmp_path / "out", {})
    with pytest.raises(TimeoutError):
        process.wait(timeout=0.5)
    assert process.poll() is None
    process.kill()
    assert process.wait(timeout=10) == -signal.SIGKILL


def test_a_new_session_is_the_childs_own_process_group_once_start_returns(tmp_path: Path) -> None:
    script = tmp_path / "leader.py"
    script.write_text("import time\ntime.sleep(600)\n")
    alone = preforked.start([str(script)], tmp_path / "alone", {}, new_session=True)
    shared = preforked.start([str(script)], tmp_path / "shared", {})
    try:
        assert alone.pid is not None and shared.pid is not None
        # At once, as after Popen(start_new_session=True): what process-group tools (cpulimit) act on.
        assert os.getpgid(alone.pid) == alone.pid and os.getsid(alone.pid) == alone.pid
        assert os.getpgid(shared.pid) != shared.pid
    finally:
        alone.kill()
        shared.kill()


OWNER = """
import sys, time
from pathlib import Path
from oobleck.runtime.backends.local.forkserver import ForkedProcess
child = ForkedProcess([sys.argv[1]], Path(sys.argv[2]), {}, new_session=True, die_with_server=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_child_that_dies_with_the_server_ends_when_its_owner_is_sigkilled(kit, tmp_path: Path) -> None:
    """The owner (a launcher) SIGKILLed: its server sees its pipe close and exits, and the child, in a session
    of its own (no signal to its group reaches it), gets SIGKILL from PR_SET_PDEATHSIG."""
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\ntime.sleep(600)\n")
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(sleeper), str(tmp_path / "out")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        pid = int(owner.stdout.readline())
        assert os.getsid(pid) == pid  # its own session: the owner's group is not its group
        owner.kill()
        owner.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not kit.descendants_left({pid}):
                return
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"process {pid} outlived its server's owner by 30 s")
    finally:
        owner.kill()
