"""`oobleck dev`: a local control plane by hand.

    oobleck dev up [--kwok-nodes N --gpus-per-node G]   start in the background, print KUBECONFIG
    oobleck dev status                                   what runs, and whether the API is ready
    oobleck dev down                                     stop everything, remove the state (idempotent)
    oobleck dev serve [...]                              the same control plane in the foreground

`up` starts `serve` detached; `serve` owns the control plane (its children die with it, even on
SIGKILL) and records pids, ports and the kubeconfig in the state folder (default `.state/dev/` of
the checkout), writing `state.json` last, once everything is ready.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STATE_ENV = "OOBLECK_DEV_STATE"
STATE_FILE = "state.json"
SUPERVISOR_FILE = "serve.pid"
LOG_FILE = "serve.log"
LOCK_FILE = "lock"
KUBECONFIG_FILE = "kubeconfig"
# `up` waits this long for `serve` to report ready (cold start, kwok nodes included).
UP_TIMEOUT_S = 600.0
# `down` waits this long for `serve` to stop its children before SIGKILLing it.
DOWN_GRACE_S = 60.0


def default_state_dir() -> Path:
    """`$OOBLECK_DEV_STATE`, else `.state/dev` of the source checkout, else of the current folder."""
    from oobleck.dev.tools import repo_root

    if os.environ.get(STATE_ENV):
        return Path(os.environ[STATE_ENV]).absolute()
    return (repo_root() or Path.cwd()) / ".state" / "dev"


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `oobleck dev {up,down,status,serve}`."""
    dev = subparsers.add_parser("dev", help="local Kubernetes control plane (etcd, apiserver, controllers, kwok)")
    commands = dev.add_subparsers(dest="dev_command", required=True, metavar="ACTION")

    def add(name: str, help: str, func) -> argparse.ArgumentParser:
        parser = commands.add_parser(name, help=help)
        parser.add_argument("--state-dir", type=Path, default=None, help=f"default: ${STATE_ENV} or .state/dev")
        parser.set_defaults(func=func)
        return parser

    for name, help, func in (
        ("up", "start in the background and print the kubeconfig", _up),
        ("serve", "run in the foreground until Ctrl-C", _serve),
    ):
        parser = add(name, help, func)
        parser.add_argument("--kwok-nodes", type=_non_negative, default=0, help="fake GPU nodes to register")
        parser.add_argument("--gpus-per-node", type=_non_negative, default=8, help="nvidia.com/gpu per fake node")
        parser.add_argument("--build", action="store_true", help="build the k8s tools first if they are missing")
    add("down", "stop everything started by `up` and remove the state", _down)
    add("status", "show what runs; exit 0 if ready, 3 if not running, 1 if unhealthy", _status)


# --- process identity ----------------------------------------------------------------------------


def _stamp(pid: int) -> str:
    from oobleck.dev.controlplane import process_start_time

    return f"{pid} {process_start_time(pid)}"


def _alive(stamp: str) -> bool:
    """Whether the process recorded as `"<pid> <start time>"` still runs (not a reused pid)."""
    from oobleck.dev.controlplane import process_start_time

    try:
        pid, started = stamp.split()
        return process_start_time(int(pid)) == started
    except ValueError:
        return False


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _state_dir(args: argparse.Namespace) -> Path:
    return (args.state_dir or default_state_dir()).absolute()


# --- serve (foreground) --------------------------------------------------------------------------


class _StopRequested(BaseException):
    """SIGTERM/SIGINT/SIGHUP arrived: unwind and stop the control plane."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _StopRequested(signal.Signals(signum).name)


def _serve(args: argparse.Namespace) -> int:
    from oobleck.dev import kwok
    from oobleck.dev.controlplane import ControlPlane, ControlPlaneError, KubectlError
    from oobleck.dev.tools import ToolsNotFound, find_tools

    state = _state_dir(args)
    state.mkdir(parents=True, exist_ok=True)
    lock = open(state / LOCK_FILE, "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"oobleck dev: already running for {state} (see `oobleck dev status`)", file=sys.stderr)
        return 1
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _raise_stop)
    (state / SUPERVISOR_FILE).write_text(_stamp(os.getpid()))
    try:
        tools = find_tools(build=args.build)
    except ToolsNotFound as error:
        (state / SUPERVISOR_FILE).unlink(missing_ok=True)
        print(f"oobleck dev: {error}", file=sys.stderr)
        return 1
    control_plane = ControlPlane(tools, kubeconfig=state / KUBECONFIG_FILE)
    try:
        control_plane.start()
        nodes: list[str] = []
        began = time.monotonic()
        if args.kwok_nodes:
            control_plane.start_kwok()
            nodes = kwok.add_fake_nodes(control_plane.kubeconfig, args.kwok_nodes, gpus=args.gpus_per_node, group="dev")
        record = {
            "supervisor": _stamp(os.getpid()),
            "server": control_plane.server,
            "kubeconfig": str(control_plane.kubeconfig),
            "workdir": str(control_plane.workdir),
            "processes": {p.name: _stamp(p.pid) for p in control_plane.processes},
            "ports": control_plane.ports,
            "kwok_nodes": len(nodes),
            "gpus_per_node": args.gpus_per_node,
            "started_in_s": round(control_plane.started_in_s or 0, 2),
            "phases_s": control_plane.phase_s,
            "kwok_nodes_in_s": round(time.monotonic() - began, 2) if nodes else None,
        }
        tmp = state / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=2))
        os.replace(tmp, state / STATE_FILE)  # written last: its presence means "ready"
        print(f"ready: {control_plane.server} in {record['started_in_s']} s; KUBECONFIG={control_plane.kubeconfig}", flush=True)
        while True:
            signal.pause()
    except _StopRequested as stop:
        print(f"stopping ({stop})", flush=True)
        return 0
    except (ControlPlaneError, KubectlError, RuntimeError) as error:
        print(f"oobleck dev: {error}", file=sys.stderr)
        return 1
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        control_plane.stop()
        for name in (STATE_FILE, SUPERVISOR_FILE):
            (state / name).unlink(missing_ok=True)


# --- up / down / status --------------------------------------------------------------------------


def _up(args: argparse.Namespace) -> int:
    from oobleck.dev.tools import ToolsNotFound, find_tools

    if not args.build:  # fail fast here rather than in the background
        try:
            find_tools()
        except ToolsNotFound as error:
            print(f"oobleck dev up: {error} (or pass --build)", file=sys.stderr)
            return 1
    state = _state_dir(args)
    record = _read_json(state / STATE_FILE)
    if record and _alive(record["supervisor"]):
        print(f"already up: {record['server']}")
        _print_kubeconfig(record["kubeconfig"])
        return 0
    supervisor_file = state / SUPERVISOR_FILE
    if supervisor_file.exists() and _alive(supervisor_file.read_text().strip()):
        print(f"oobleck dev up: already starting (pid {supervisor_file.read_text().split()[0]}); see `oobleck dev status`")
        return 1
    _cleanup(state, quiet=True)  # leftovers of a crashed run
    state.mkdir(parents=True, exist_ok=True)
    command = [
        # This module's own entry point: the supervisor needs none of the other subcommands.
        sys.executable, "-m", "oobleck.dev.cli", "serve", "--state-dir", str(state),
        "--kwok-nodes", str(args.kwok_nodes), "--gpus-per-node", str(args.gpus_per_node),
        *(["--build"] if args.build else []),
    ]  # fmt: skip
    with open(state / LOG_FILE, "w") as log:
        # A session of its own: it outlives this command and the terminal's Ctrl-C.
        supervisor = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + UP_TIMEOUT_S
    try:
        while (record := _read_json(state / STATE_FILE)) is None:
            if supervisor.poll() is not None:
                print(f"oobleck dev up: failed (exit {supervisor.returncode}); log {state / LOG_FILE}:", file=sys.stderr)
                print((state / LOG_FILE).read_text()[-6000:], file=sys.stderr)
                return 1
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {UP_TIMEOUT_S:.0f} s (UP_TIMEOUT_S); log: {state / LOG_FILE}")
            time.sleep(0.2)
    except BaseException:  # Ctrl-C or timeout: take the half-started control plane down too
        supervisor.terminate()
        supervisor.wait(DOWN_GRACE_S)
        raise
    print(f"up: {record['server']} (control plane ready in {record['started_in_s']} s)")
    if record["kwok_nodes"]:
        print(f"kwok: {record['kwok_nodes']} fake nodes with nvidia.com/gpu={record['gpus_per_node']}")
    _print_kubeconfig(record["kubeconfig"])
    return 0


def _print_kubeconfig(path: str) -> None:
    print(f"kubeconfig: {path}")
    print(f"export KUBECONFIG={path}")


def _cleanup(state: Path, quiet: bool) -> bool:
    """Stop whatever the state folder records; return whether anything was running."""
    record = _read_json(state / STATE_FILE) or {}
    supervisor_stamps = {record.get("supervisor")}
    if (state / SUPERVISOR_FILE).exists():
        supervisor_stamps.add((state / SUPERVISOR_FILE).read_text().strip())
    running = False
    for stamp in filter(None, supervisor_stamps):
        if not _alive(stamp):
            continue
        running = True
        pid = int(stamp.split()[0])
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + DOWN_GRACE_S
        while _alive(stamp) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(stamp):  # its children die with it (PR_SET_PDEATHSIG)
            os.kill(pid, signal.SIGKILL)
    # Children outliving their supervisor should be impossible; make sure anyway.
    for name, stamp in (record.get("processes") or {}).items():
        if _alive(stamp):
            running = True
            os.killpg(int(stamp.split()[0]), signal.SIGKILL)
            if not quiet:
                print(f"killed leftover {name} ({stamp.split()[0]})")
    if record.get("workdir"):
        import shutil

        shutil.rmtree(record["workdir"], ignore_errors=True)
    for name in (STATE_FILE, SUPERVISOR_FILE, KUBECONFIG_FILE, LOG_FILE, STATE_FILE + ".tmp", KUBECONFIG_FILE + ".tmp"):
        (state / name).unlink(missing_ok=True)
    return running


def _down(args: argparse.Namespace) -> int:
    state = _state_dir(args)
    stale = (state / STATE_FILE).exists() or (state / SUPERVISOR_FILE).exists()
    was_running = _cleanup(state, quiet=False)
    (state / LOCK_FILE).unlink(missing_ok=True)
    if state.is_dir() and not any(state.iterdir()):
        state.rmdir()
    print("down" if was_running else "not running" + (" (removed stale state)" if stale else ""))
    return 0


def _status(args: argparse.Namespace) -> int:
    from oobleck.dev.controlplane import run_kubectl
    from oobleck.dev.tools import find_tools

    state = _state_dir(args)
    record = _read_json(state / STATE_FILE)
    if not record or not _alive(record["supervisor"]):
        starting = (state / SUPERVISOR_FILE).exists() and _alive((state / SUPERVISOR_FILE).read_text().strip())
        print("starting" if starting else "not running")
        return 3
    print(f"server:     {record['server']}")
    print(f"kubeconfig: {record['kubeconfig']}")
    print(f"supervisor: pid {record['supervisor'].split()[0]}")
    healthy = True
    for name, stamp in record["processes"].items():
        alive = _alive(stamp)
        healthy &= alive
        print(f"  {name:<24} pid {stamp.split()[0]:<8} {'running' if alive else 'GONE'}")
    ready = run_kubectl(find_tools(), record["kubeconfig"], ["get", "--raw", "/readyz"], check=False, timeout=30)
    healthy &= ready.returncode == 0
    print(f"readyz:     {ready.stdout.strip() or ready.stderr.strip()}")
    if record["kwok_nodes"]:
        print(f"kwok nodes: {record['kwok_nodes']} x nvidia.com/gpu={record['gpus_per_node']}")
    return 0 if healthy else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m oobleck.dev.cli ACTION ...`, the same as `oobleck dev ACTION ...`."""
    parser = argparse.ArgumentParser(prog="python -m oobleck.dev.cli")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["dev", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
