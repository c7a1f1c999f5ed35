"""`python -m oobleck_dev`: a local control plane by hand (development and test tooling, not the product).

    python -m oobleck_dev up [--kwok-nodes N] [--local-nodes N] [--gpus-per-node G]
                                                         start in the background, print KUBECONFIG
    python -m oobleck_dev status                                   what runs, and whether the API is ready
    python -m oobleck_dev down                                     stop everything, remove the state (idempotent)
    python -m oobleck_dev serve [...]                              the same control plane in the foreground
    python -m oobleck_dev nodes --count N --gpus G                 a local node agent in the foreground
    python -m oobleck_dev kill-pod NS/POD [--signal SIG]           kill a pod's processes on the local nodes
    python -m oobleck_dev gpu-unhealthy NODE [--healthy-gpus N]    a local node loses GPUs (gpu-healthy: back)

`up` starts `serve` detached; `serve` owns the control plane (its children die with it, even on
SIGKILL) and records pids, ports and the kubeconfig in the state folder (default `.state/dev/` of
the checkout), writing `state.json` last, once everything is ready. With `--local-nodes` it also
runs the local node agent (`oobleck_dev.nodeagent`): nodes whose pods run as local processes.
The agent, in `serve` or in `nodes`, keeps `nodeagent/agent.json` in the state folder (pids per
pod) for `kill-pod`; one agent per state folder.
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
NODEAGENT_DIR = "nodeagent"
KUBECONFIG_HELP = "default: the state folder's (from `up`), else $KUBECONFIG"
GPU_DEVICES_HELP = "local nodes: real GPU ids (e.g. 0,1) behind their GPUs, set as CUDA_VISIBLE_DEVICES in pods"


def default_state_dir() -> Path:
    """`$OOBLECK_DEV_STATE`, else `.state/dev` of the source checkout, else of the current folder."""
    from oobleck_dev.tools import repo_root

    if os.environ.get(STATE_ENV):
        return Path(os.environ[STATE_ENV]).absolute()
    return (repo_root() or Path.cwd()) / ".state" / "dev"


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _devices(text: str) -> list[str]:
    devices = [part.strip() for part in text.split(",") if part.strip()]
    if not devices:
        raise argparse.ArgumentTypeError(f"a comma-separated list of GPU ids expected, got {text!r}")
    return devices


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `{up,down,status,serve,nodes,kill-pod,gpu-unhealthy,gpu-healthy}` to `python -m oobleck_dev`."""
    commands = subparsers

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
        parser.add_argument(
            "--local-nodes", type=_non_negative, default=0, help="local nodes running pods as processes"
        )
        parser.add_argument(
            "--gpus-per-node", type=_non_negative, default=8, help="nvidia.com/gpu per kwok or local node"
        )
        parser.add_argument("--gpu-devices", type=_devices, default=None, help=GPU_DEVICES_HELP)
        parser.add_argument("--build", action="store_true", help="build the k8s tools first if they are missing")
    add("down", "stop everything started by `up` and remove the state", _down)
    add("status", "show what runs; exit 0 if ready, 3 if not running, 1 if unhealthy", _status)

    nodes = add("nodes", "run a local node agent in the foreground until Ctrl-C", _nodes)
    nodes.add_argument("--count", type=_positive, default=4, help="nodes to register (default 4)")
    nodes.add_argument("--gpus", type=_non_negative, default=8, help="nvidia.com/gpu per node (default 8)")
    nodes.add_argument("--cpu", default="16", help="cpu capacity per node (default 16)")
    nodes.add_argument("--memory", default="64Gi", help="memory capacity per node (default 64Gi)")
    nodes.add_argument("--name-prefix", default="oobleck-local-", help="node names: <prefix><i>")
    nodes.add_argument("--kubeconfig", default=None, help=KUBECONFIG_HELP)
    nodes.add_argument("--gpu-devices", type=_devices, default=None, help=GPU_DEVICES_HELP)
    real = add(
        "real-nodes", "a control plane and kubelet + containerd nodes running the image, until Ctrl-C", _real_nodes
    )
    real.add_argument(
        "--count",
        type=_positive,
        default=2,
        help="nodes (default 2; each adds ~0.05 GB of disk: the image store is shared)",
    )
    real.add_argument("--kubeconfig", type=Path, default=None, help="where to write the admin kubeconfig")
    real.add_argument("--reap", action="store_true", help="only undo the nodes of an owner that was killed")
    kill = add("kill-pod", "kill the processes of a pod running on the local nodes", _kill_pod)
    kill.add_argument("pod", metavar="NAMESPACE/POD")
    kill.add_argument("--signal", default="KILL", help="signal name or number (default KILL: exit code 137)")
    for name, help, func in (
        ("gpu-unhealthy", "lower a node's allocatable nvidia.com/gpu and set GPUHealthy=False", _gpu_unhealthy),
        ("gpu-healthy", "restore a node's allocatable nvidia.com/gpu to its capacity", _gpu_healthy),
    ):
        parser = add(name, help, func)
        parser.add_argument("node", metavar="NODE")
        parser.add_argument("--kubeconfig", default=None, help=KUBECONFIG_HELP)
        if name == "gpu-unhealthy":
            parser.add_argument(
                "--healthy-gpus", type=_non_negative, default=None, help="default: one fewer than capacity"
            )


# --- process identity ----------------------------------------------------------------------------


def _stamp(pid: int) -> str:
    from oobleck_dev.controlplane import process_start_time

    return f"{pid} {process_start_time(pid)}"


def _alive(stamp: str) -> bool:
    """Whether the process recorded as `"<pid> <start time>"` still runs (not a reused pid)."""
    from oobleck_dev.controlplane import process_start_time

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
    from oobleck_dev import kwok
    from oobleck_dev.controlplane import ControlPlane, ControlPlaneError, KubectlError
    from oobleck_dev.tools import ToolsNotFound, find_tools

    state = _state_dir(args)
    state.mkdir(parents=True, exist_ok=True)
    lock = open(state / LOCK_FILE, "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"oobleck dev: already running for {state} (see `oobleck_dev status`)", file=sys.stderr)
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
    agent = None
    try:
        control_plane.start()
        nodes: list[str] = []
        began = time.monotonic()
        if args.kwok_nodes:
            control_plane.start_kwok()
            nodes = kwok.add_fake_nodes(control_plane.kubeconfig, args.kwok_nodes, gpus=args.gpus_per_node, group="dev")
        local_began = time.monotonic()
        if args.local_nodes:
            agent = _start_agent(
                state, str(control_plane.kubeconfig), args.local_nodes, args.gpus_per_node, gpu_devices=args.gpu_devices
            )
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
            "kwok_nodes_in_s": round(local_began - began, 2) if nodes else None,
            "local_nodes": agent.node_names if agent else [],
            "local_nodes_in_s": round(time.monotonic() - local_began, 2) if agent else None,
        }
        tmp = state / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=2))
        os.replace(tmp, state / STATE_FILE)  # written last: its presence means "ready"
        print(
            f"ready: {control_plane.server} in {record['started_in_s']} s; KUBECONFIG={control_plane.kubeconfig}",
            flush=True,
        )
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
        if agent is not None:
            agent.stop()  # before the API server goes: it deletes its nodes
        control_plane.stop()
        for name in (STATE_FILE, SUPERVISOR_FILE):
            (state / name).unlink(missing_ok=True)


# --- up / down / status --------------------------------------------------------------------------


def _up(args: argparse.Namespace) -> int:
    from oobleck_dev.tools import ToolsNotFound, find_tools

    if not args.build:  # fail fast here rather than in the background
        try:
            find_tools()
        except ToolsNotFound as error:
            print(f"oobleck_dev up: {error} (or pass --build)", file=sys.stderr)
            return 1
    state = _state_dir(args)
    record = _read_json(state / STATE_FILE)
    if record and _alive(record["supervisor"]):
        print(f"already up: {record['server']}")
        _print_kubeconfig(record["kubeconfig"])
        return 0
    supervisor_file = state / SUPERVISOR_FILE
    if supervisor_file.exists() and _alive(supervisor_file.read_text().strip()):
        print(
            f"oobleck_dev up: already starting (pid {supervisor_file.read_text().split()[0]}); see `oobleck_dev status`"
        )
        return 1
    _cleanup(state, quiet=True)  # leftovers of a crashed run
    state.mkdir(parents=True, exist_ok=True)
    command = [
        # This module's own entry point: the supervisor needs none of the other subcommands.
        sys.executable,
        "-m",
        "oobleck_dev.cli",
        "serve",
        "--state-dir",
        str(state),
        "--kwok-nodes",
        str(args.kwok_nodes),
        "--local-nodes",
        str(args.local_nodes),
        "--gpus-per-node",
        str(args.gpus_per_node),
        *(["--build"] if args.build else []),
        *(["--gpu-devices", ",".join(args.gpu_devices)] if args.gpu_devices else []),
    ]
    with open(state / LOG_FILE, "w") as log:
        # A session of its own: it outlives this command and the terminal's Ctrl-C.
        supervisor = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + UP_TIMEOUT_S
    try:
        while (record := _read_json(state / STATE_FILE)) is None:
            if supervisor.poll() is not None:
                print(
                    f"oobleck_dev up: failed (exit {supervisor.returncode}); log {state / LOG_FILE}:", file=sys.stderr
                )
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
    if record.get("local_nodes"):
        print(f"local nodes: {', '.join(record['local_nodes'])} with nvidia.com/gpu={record['gpus_per_node']}")
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
    import shutil

    if record.get("workdir"):
        shutil.rmtree(record["workdir"], ignore_errors=True)
    if not _agent_running(state):  # the agent's pod folders and logs (its processes died with `serve`)
        shutil.rmtree(state / NODEAGENT_DIR, ignore_errors=True)
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
    from oobleck_dev.controlplane import run_kubectl
    from oobleck_dev.tools import find_tools

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
    if record.get("local_nodes"):
        print(f"local nodes: {', '.join(record['local_nodes'])} x nvidia.com/gpu={record['gpus_per_node']}")
    return 0 if healthy else 1


# --- the local node agent ------------------------------------------------------------------------


def _agent_running(state: Path) -> bool:
    """Whether a node agent holds this state folder (its lock)."""
    lock_path = state / NODEAGENT_DIR / LOCK_FILE
    if not lock_path.exists():
        return False
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock, fcntl.LOCK_UN)
    return False


def _start_agent(state: Path, kubeconfig: str, count: int, gpus: int, **options):
    """Start a NodeAgent keeping its pids, pod folders and logs in `<state>/nodeagent` (one per state folder)."""
    from oobleck_dev.nodeagent import NodeAgent, NodeAgentError

    folder = state / NODEAGENT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    lock = open(folder / LOCK_FILE, "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise NodeAgentError(f"a node agent already runs for {state}") from None
    agent = NodeAgent(kubeconfig, count, gpus, workdir=folder / "work", status_dir=folder, **options)
    agent.start()  # stops itself if it fails
    agent._cli_lock = lock  # type: ignore[attr-defined]  # held (open) for the agent's lifetime
    return agent


def _kubeconfig(args: argparse.Namespace) -> str:
    own = _state_dir(args) / KUBECONFIG_FILE
    if args.kubeconfig:
        return args.kubeconfig
    if own.exists():
        return str(own)
    if os.environ.get("KUBECONFIG"):
        return os.environ["KUBECONFIG"].split(os.pathsep)[0]
    raise SystemExit("oobleck dev: no kubeconfig: pass --kubeconfig, run `oobleck_dev up`, or set KUBECONFIG")


def _nodes(args: argparse.Namespace) -> int:
    from oobleck_dev.nodeagent import NodeAgentError
    from oobleck_dev.podenv import PodConfigError

    kubeconfig = _kubeconfig(args)
    state = _state_dir(args)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _raise_stop)
    agent = None
    try:
        agent = _start_agent(
            state,
            kubeconfig,
            args.count,
            args.gpus,
            cpu=args.cpu,
            memory=args.memory,
            name_prefix=args.name_prefix,
            gpu_devices=args.gpu_devices,
        )
        print(
            f"local nodes ready: {', '.join(agent.node_names)} (nvidia.com/gpu={args.gpus}); "
            f"pod logs in {agent.workdir / 'logs'}; Ctrl-C stops them",
            flush=True,
        )
        while True:
            signal.pause()
    except _StopRequested as stop:
        print(f"stopping ({stop})", flush=True)
        return 0
    except (NodeAgentError, PodConfigError, ValueError) as error:
        print(f"oobleck_dev nodes: {error}", file=sys.stderr)
        return 1
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        if agent is not None:
            agent.stop()


def _kill_pod(args: argparse.Namespace) -> int:
    from oobleck_dev.nodeagent import NodeAgentError, kill_from_status_file

    namespace, _, pod = args.pod.partition("/")
    if not namespace or not pod:
        print(f"oobleck_dev kill-pod: NAMESPACE/POD expected, got {args.pod!r}", file=sys.stderr)
        return 2
    try:
        name = args.signal.upper().removeprefix("SIG")
        signum = int(args.signal) if args.signal.isdigit() else signal.Signals["SIG" + name]
    except KeyError:
        print(f"oobleck_dev kill-pod: --signal: unknown signal {args.signal!r}", file=sys.stderr)
        return 2
    try:
        pids = kill_from_status_file(_state_dir(args) / NODEAGENT_DIR, namespace, pod, signum)
    except (NodeAgentError, LookupError) as error:
        print(f"oobleck_dev kill-pod: {error}", file=sys.stderr)
        return 1
    print(f"sent {signal.Signals(signum).name} to {namespace}/{pod} (pids {', '.join(map(str, pids))})")
    return 0


def _real_nodes(args: argparse.Namespace) -> int:
    from oobleck_dev import realnodes

    if args.reap:
        lock = realnodes.host_lock(60.0)
        try:
            print("\n".join(f"undid {folder}" for folder in realnodes.reap_stale()) or "nothing to undo")
        finally:
            os.close(lock)
        return 0
    try:
        return realnodes.serve(args.count, args.kubeconfig)
    except realnodes.RealNodesError as error:
        print(f"oobleck_dev real-nodes: {error}", file=sys.stderr)
        return 1


def _gpu_unhealthy(args: argparse.Namespace) -> int:
    return _gpu_health(args, args.healthy_gpus, restore=False)


def _gpu_healthy(args: argparse.Namespace) -> int:
    return _gpu_health(args, None, restore=True)


def _gpu_health(args: argparse.Namespace, healthy: int | None, restore: bool) -> int:
    from oobleck_dev.nodeagent import GPU_RESOURCE, ApiError, set_gpu_health_sync

    try:
        status = set_gpu_health_sync(_kubeconfig(args), args.node, healthy, restore=restore)["status"]
    except (ApiError, ValueError) as error:
        print(f"oobleck_dev {'gpu-healthy' if restore else 'gpu-unhealthy'}: {error}", file=sys.stderr)
        return 1
    allocatable, capacity = status["allocatable"][GPU_RESOURCE], status["capacity"][GPU_RESOURCE]
    print(f"{args.node}: nvidia.com/gpu allocatable {allocatable} of {capacity}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m oobleck_dev.cli ACTION ...`, the same as `oobleck_dev ACTION ...`."""
    parser = argparse.ArgumentParser(prog="python -m oobleck_dev.cli")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
