"""The pod side of the local node agent: one pod's folder, volumes, processes and reported status.

`PodLifecycle` runs one pod from first sight to deletion, as a kubelet's pod worker does: sandbox
(address, folder, volumes), init containers in order, then the containers under the pod's
restartPolicy, status reports after every change, and on deletion SIGTERM, grace, SIGKILL, a last
report and the final delete. It reaches the API only through its `PodHost` (the agent).

Layout of one pod's folder (`<agent workdir>/pods/<namespace>_<name>_<uid8>/`):

    volumes/<volume>/...          each volume's files (configMap, secret, downwardAPI, projected, emptyDir)
    containers/<container>/root/  the mount point of the container's root (empty on the host: the root
                                  lives in the container's own mount namespace, see mountns.py)
    containers/<container>/tmp/   its TMPDIR

A container runs as one process in a session (process group) of its own, stdout and stderr to one
log file, and dies with the agent's thread (PR_SET_PDEATHSIG), as the control plane's children do.
It sees the host's files with the pod's volumes at their mountPaths, in a mount namespace of its own
(mountns.py): a volume at /etc/config is read at /etc/config, the service-account token at
/var/run/secrets/kubernetes.io/serviceaccount, as in a container.
Exit is observed through a pidfd on the agent's event loop: no thread or polling per process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from oobleck.processes import die_with_parent
from oobleck_dev import netfault, podenv
from oobleck_dev.kwok import GPU_RESOURCE
from oobleck_dev.memlimit import MemoryCgroup, tail
from oobleck_dev.mountns import Filesystem, FilesystemError, VolumeMount
from oobleck_dev.podenv import MountError, VolumeContent

log = logging.getLogger("oobleck_dev.nodeagent")

# The conventional exit code of a process killed by signal N, as container runtimes report it.
SIGNAL_EXIT_BASE = 128
# containerd's exit code for a container whose process could not be started at all.
START_ERROR_EXIT = 128
# The kubelet's exit code for a container it lost track of (ContainerStatusUnknown).
LOST_EXIT = 137


def pod_dir_name(namespace: str, name: str, uid: str) -> str:
    """The folder name of one pod (unique per incarnation: a recreated pod gets a new uid)."""
    return f"{namespace}_{name}_{uid[:8]}"


def exit_code(returncode: int) -> int:
    """A Popen returncode as a container exit code: killed by signal N -> 128 + N."""
    return SIGNAL_EXIT_BASE - returncode if returncode < 0 else returncode


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def write_volumes(pod_dir: Path, contents: Sequence[VolumeContent], claims_dir: Path) -> dict[str, Path]:
    """Materialise volumes under `pod_dir/volumes`; return volume name -> its folder.

    File volumes are rewritten in place on every call (a refreshed token or ConfigMap shows up,
    as the kubelet's sync does); hostPath and persistentVolumeClaim resolve to folders outside.
    """
    folders: dict[str, Path] = {}
    for volume in contents:
        if volume.host_path is not None:
            folders[volume.name] = Path(volume.host_path)
            continue
        if volume.claim is not None:
            # One folder per claim for this agent: every pod mounting the claim shares it (like RWX).
            folder = claims_dir / volume.claim
            folder.mkdir(parents=True, exist_ok=True)
            folders[volume.name] = folder
            continue
        folder = pod_dir / "volumes" / volume.name
        folder.mkdir(parents=True, exist_ok=True)
        for relative, (data, mode) in (volume.files or {}).items():
            _write_atomic(folder / relative, data, mode)
        folders[volume.name] = folder
    return folders


def container_mounts(container: Mapping, volumes: Mapping[str, Path], read_only: set[str]) -> list[VolumeMount]:
    """The container's volumeMounts as host sources (a missing subPath is made a folder, as the kubelet does).

    `read_only`: volumes the kubelet always mounts read-only (configMap, secret, downwardAPI, projected)."""
    name = container["name"]
    mounts = []
    for mount in container.get("volumeMounts") or []:
        volume = mount["name"]
        where = f"containers[{name}].volumeMounts[{volume}]"
        if volume not in volumes:
            raise MountError(f"{where}: no volume {volume!r} in the pod")
        source = volumes[volume]
        sub_path = mount.get("subPath") or ""
        if sub_path:
            if sub_path.startswith("/") or ".." in sub_path.split("/"):
                raise MountError(f"{where}.subPath: must be relative without '..', got {sub_path!r}")
            source = source / sub_path
            if not source.exists():
                source.mkdir(parents=True)
        writable = not mount.get("readOnly") and volume not in read_only
        mounts.append(VolumeMount(mount["mountPath"], source, not writable, where))
    return mounts


def signal_group(leader: int, signum: int) -> bool:
    """Signal a container's whole process group (its process leads it); False if it is already gone."""
    try:
        os.killpg(leader, signum)
        return True
    except ProcessLookupError:
        return False


class Container(Protocol):
    """A running container's process, however it was started (exec'd here, or forked: podzygote.py)."""

    pid: int

    @property
    def returncode(self) -> int | None: ...
    def signal_group(self, signum: int) -> bool: ...
    async def wait(self) -> int: ...
    def close(self) -> None: ...


class ContainerProcess:
    """One running container: a process in its own session, logging to a file, reaped via a pidfd."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        filesystem: Filesystem,
        log: Path,
        net_cgroup: Path | None = None,
        memory: MemoryCgroup | None = None,
    ):
        """`filesystem`: the container's root and working folder, entered before exec (mountns.py);
        `net_cgroup`: the pod's cgroup (v2), joined before exec (netfault.py matches the pod's sockets by
        it); `memory`: this run's memory cgroup (v1, memlimit.py), joined before exec so that every
        allocation of the command counts against the container's limit.
        Raises OSError when the command cannot start (FilesystemError: its filesystem could not be made)."""
        log.parent.mkdir(parents=True, exist_ok=True)
        dies_with_parent, joins = die_with_parent(os.getpid()), netfault.join_cgroup(net_cgroup)
        enter = memory.join() if memory is not None else None
        report, reported = os.pipe()
        chroot = filesystem.preexec(reported)

        def preexec() -> None:
            if enter is not None:
                enter()
            dies_with_parent()
            joins()
            chroot()

        try:
            with open(log, "ab") as out:
                self.popen = subprocess.Popen(
                    list(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=dict(env),
                    start_new_session=True,
                    # Dies with the thread that started it: the agent's event loop thread.
                    preexec_fn=preexec,
                    close_fds=True,
                )
        except subprocess.SubprocessError as error:  # preexec failed: say why, as the container runtime does
            raise Filesystem.start_error(report) or FilesystemError(0, str(error)) from None
        finally:
            os.close(report)
            os.close(reported)
        self.pid = self.popen.pid
        self.pidfd = os.pidfd_open(self.pid)
        self.log = log
        self.cgroup = memory
        self._exited: asyncio.Future[None] | None = None  # one pidfd reader, shared by every waiter

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def signal_group(self, signum: int) -> bool:
        return signal_group(self.pid, signum)

    async def wait(self) -> int:
        """Wait for the process to exit (without blocking the loop); return its container exit code.

        Any number of coroutines may wait at once (the supervisor and a termination).
        """
        if self.popen.poll() is None:
            if self._exited is None:
                loop = asyncio.get_running_loop()
                exited = self._exited = loop.create_future()

                def on_exit() -> None:
                    loop.remove_reader(self.pidfd)
                    if not exited.done():
                        exited.set_result(None)

                loop.add_reader(self.pidfd, on_exit)
            await asyncio.shield(self._exited)
        return exit_code(self.popen.wait())

    def close(self) -> None:
        """Release the pidfd and the memory cgroup (after the process exited)."""
        try:
            os.close(self.pidfd)
        except OSError:
            pass
        if self.cgroup is not None:
            self.cgroup.remove()


async def terminate(processes: Sequence[Container], grace_s: float, on_kill: Callable[[], None] | None = None) -> None:
    """SIGTERM every process group, wait up to `grace_s`, SIGKILL what is left; reap all.

    The groups are SIGKILLed at the end in any case: a child that left its parent behind dies too.
    """
    running = [process for process in processes if process.returncode is None]
    for process in running:
        process.signal_group(signal.SIGTERM)
    if running:
        done, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in running], timeout=max(grace_s, 0))
        if pending:
            if on_kill is not None:
                on_kill()
            for process in running:
                process.signal_group(signal.SIGKILL)
            await asyncio.wait(pending)
    for process in processes:
        process.signal_group(signal.SIGKILL)


def now_rfc3339() -> str:
    """The current time as Kubernetes `Time` (seconds)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- one pod's status ----------------------------------------------------------------------------


@dataclass
class ContainerRun:
    """What the agent knows about one container of a pod."""

    name: str
    image: str
    process: Container | None = None
    started_at: str | None = None
    restart_count: int = 0
    terminated: dict | None = None  # the containerStatus `terminated` of the current/last run
    last_terminated: dict | None = None
    waiting: tuple[str, str] = ("ContainerCreating", "")
    finished: bool = False  # exited and will not be restarted

    def status(self, init: bool = False) -> dict:
        """This container's `containerStatuses` entry."""
        if self.process is not None and self.process.returncode is None and self.started_at:
            state: dict = {"running": {"startedAt": self.started_at}}
        elif self.terminated is not None and (self.finished or not self.waiting[0]):
            state = {"terminated": self.terminated}
        else:
            reason, message = self.waiting
            state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        running = "running" in state
        entry = {
            "name": self.name,
            "image": self.image,
            "imageID": "",
            "ready": running or (init and self.terminated is not None and self.terminated["exitCode"] == 0),
            "started": running,
            "restartCount": self.restart_count,
            "state": state,
            "lastState": {"terminated": self.last_terminated} if self.last_terminated else {},
        }
        if self.process is not None:
            entry["containerID"] = f"oobleck-local://{self.process.pid}"
        return entry


def pod_phase(init: list[ContainerRun], main: list[ContainerRun], init_failed: bool) -> str:
    """The pod phase from its containers, as the kubelet derives it."""
    if init_failed:
        return "Failed"
    if any(not c.finished for c in init) or any(c.started_at is None and c.terminated is None for c in main):
        return "Pending"
    if all(c.finished for c in main):
        return "Succeeded" if all(c.terminated and c.terminated["exitCode"] == 0 for c in main) else "Failed"
    return "Running"


def should_restart(policy: str, exit_code: int) -> bool:
    """Whether a container that exited with `exit_code` restarts under the pod's restartPolicy."""
    return policy == "Always" or (policy == "OnFailure" and exit_code != 0)


# --- one pod's life ------------------------------------------------------------------------------


class PodHost(Protocol):
    """What a PodLifecycle needs from its agent (the API and the node's resources)."""

    workdir: Path
    allocatable: dict[str, str]
    ips: Any  # nodeagent.IpBlock
    gpus: Any  # nodeagent.GpuSlots
    timeouts: Any  # nodeagent.AgentTimeouts
    cgroups: netfault.PodCgroups

    def base_env(self, pod: dict, tmpdir: Path) -> dict[str, str]: ...
    def log_path(self, namespace: str, name: str, uid: str, container: str) -> Path: ...
    async def fetch_sources(self, pod: dict) -> podenv.Sources: ...  # MountError if the API fails
    async def send_pod_status(self, namespace: str, name: str, uid: str, status: dict) -> bool | None: ...
    async def delete_pod(self, namespace: str, name: str, uid: str) -> None: ...
    def forget(self, worker: PodLifecycle) -> None: ...
    def write_status_file(self) -> None: ...
    def start_container(
        self,
        argv: list[str],
        env: dict[str, str],
        filesystem: Filesystem,
        log_path: Path,
        net_cgroup: Path | None,
        memory: MemoryCgroup | None,
    ) -> Container: ...


class PodLifecycle:
    """Runs one pod bound to one of the agent's nodes, from first sight until it is deleted."""

    def __init__(self, agent: PodHost, pod: dict, node_index: int):
        self.agent = agent
        self.pod = pod
        self.node_index = node_index
        metadata = pod["metadata"]
        self.namespace, self.name, self.uid = metadata["namespace"], metadata["name"], metadata["uid"]
        self.runs = 0  # container runs so far (each gets a fresh memory cgroup)
        spec = pod["spec"]
        self.policy = spec.get("restartPolicy", "Always")
        self.init = [ContainerRun(c["name"], c.get("image", "")) for c in spec.get("initContainers") or []]
        self.main = [ContainerRun(c["name"], c.get("image", "")) for c in spec.get("containers") or []]
        self.specs = {c["name"]: c for c in (*(spec.get("initContainers") or []), *(spec.get("containers") or []))}
        self.dir = agent.workdir / "pods" / pod_dir_name(self.namespace, self.name, self.uid)
        self.ip = ""
        self.host_ip = agent.ips.node_ip(node_index)
        self.start_time = now_rfc3339()
        self.sources = podenv.Sources()
        self.filesystems: dict[str, Filesystem] = {}
        self.gpu_slots: list[int] | None = None  # held from sandbox set-up to the end
        self.gpu_plan: dict[str, list[int]] = {}
        self.cgroup: Path | None = None  # the pod's processes' cgroup (None where cgroups are unavailable)
        self.sandbox_ready = False
        self.init_failed = False
        self.node_shutdown = False  # the agent stops: end the processes, leave the pod to the API
        self.shutdown_reason: str | None = None  # why a pod that was still running ended
        self.lost = False  # its processes belonged to an agent that is gone
        self.gone = False  # deleted from the API (no deletion to finish)
        self.changed = asyncio.Event()
        self.stopping = False
        self.transitions: dict[str, tuple[str, str]] = {}
        self._report_lock = asyncio.Lock()
        self._last_status: dict | None = None
        self._retry: asyncio.Task | None = None
        self.task: asyncio.Task | None = None

    # -- inputs --

    def update(self, pod: dict) -> None:
        self.pod = pod
        self.changed.set()

    def stop_for_node_shutdown(self) -> None:
        """The agent stops: end the processes and report a running pod Failed, as graceful node shutdown does."""
        if pod_phase(self.init, self.main, self.init_failed) not in ("Succeeded", "Failed"):
            self.shutdown_reason = "Pod was terminated in response to imminent node shutdown."
        self.node_shutdown = self.stopping = True
        self.changed.set()

    @property
    def deleting(self) -> bool:
        return self.gone or self.pod["metadata"].get("deletionTimestamp") is not None

    def grace_s(self) -> float:
        metadata, spec = self.pod["metadata"], self.pod["spec"]
        grace = metadata.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = spec.get("terminationGracePeriodSeconds", 30)
        return float(grace)

    async def wait_change(self, timeout: float | None = None) -> None:
        self.changed.clear()
        try:
            await asyncio.wait_for(self.changed.wait(), timeout)
        except TimeoutError:
            pass

    # -- status --

    def _condition(self, kind: str, ok: bool, reason: str = "") -> dict:
        status = "True" if ok else "False"
        previous = self.transitions.get(kind)
        if previous is None or previous[0] != status:
            self.transitions[kind] = previous = (status, now_rfc3339())
        entry = {"type": kind, "status": status, "lastProbeTime": None, "lastTransitionTime": previous[1]}
        if reason:
            entry["reason"] = reason
        return entry

    def status(self) -> dict:
        """The pod status as a kubelet would report it now."""
        phase = pod_phase(self.init, self.main, self.init_failed)
        if self.shutdown_reason:
            phase = "Failed"
        initialized = all(c.finished and c.terminated and c.terminated["exitCode"] == 0 for c in self.init)
        ready = phase == "Running" and all(c.status()["ready"] for c in self.main) and not self.deleting
        not_ready = "" if ready else ("PodCompleted" if phase in ("Succeeded", "Failed") else "ContainersNotReady")
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": [
                self._condition("PodReadyToStartContainers", self.sandbox_ready and phase in ("Pending", "Running")),
                self._condition("Initialized", initialized, "" if initialized else "ContainersNotInitialized"),
                self._condition("ContainersReady", ready, not_ready),
                self._condition("Ready", ready, not_ready),
            ],
            "containerStatuses": [c.status() for c in self.main],
        }
        if not self.lost:  # a lost pod keeps the addresses its first agent gave it
            status.update({"hostIP": self.host_ip, "hostIPs": [{"ip": self.host_ip}], "startTime": self.start_time})
        if self.init:
            status["initContainerStatuses"] = [c.status(init=True) for c in self.init]
        if self.ip:
            status["podIP"] = self.ip
            status["podIPs"] = [{"ip": self.ip}]
        if self.shutdown_reason:
            status["reason"], status["message"] = "Terminated", self.shutdown_reason
        return status

    async def report(self) -> None:
        """Send the current status if it changed since the last report (strategic merge, as a kubelet)."""
        async with self._report_lock:
            status = self.status()
            if status == self._last_status or self.gone:
                return
            # The pids first: whoever sees this status in the API server can then find its processes.
            self.agent.write_status_file()
            sent = await self.agent.send_pod_status(self.namespace, self.name, self.uid, status)
            if sent is None:  # gone, or a newer pod of the same name
                self.gone = True
                self.changed.set()
            elif sent:
                self._last_status = status
            elif self._retry is None or self._retry.done():  # a failed report must not be the last word
                self._retry = asyncio.ensure_future(self._report_later(self.agent.timeouts.retry))

    async def _report_later(self, delay: float) -> None:
        await asyncio.sleep(delay)
        await self.report()

    # -- the pod's life --

    async def run(self) -> None:
        try:
            if self.lost:
                await self._report_lost()
            elif not self.deleting:
                await self._run()
            await self._finish()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s/%s: pod worker failed", self.namespace, self.name)
        finally:
            await self.kill_processes(0)
            if self._retry is not None:
                self._retry.cancel()
            if self.ip:
                self.agent.ips.release(self.node_index, self.ip)
            self._release_gpus()
            self.agent.forget(self)

    async def _run(self) -> None:
        self.ip = self.agent.ips.allocate(self.node_index)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sandbox_ready = True
        await self.report()
        if not await self._prepare():
            return
        for container in self.init:
            await self._supervise(container, init=True)
            if self.stopping or self.deleting:
                return
            if container.terminated is None or container.terminated["exitCode"] != 0:
                self.init_failed = True
                for pending in self.main:
                    pending.waiting = ("PodInitializing", "")
                await self.report()
                return
        for container in self.main:
            container.waiting = ("ContainerCreating", "")
        supervisors = [asyncio.ensure_future(self._supervise(c)) for c in self.main]
        for task in supervisors:  # wake the loop below once a supervisor has returned
            task.add_done_callback(lambda _: self.changed.set())
        try:
            while not (self.deleting or self.stopping) and not all(task.done() for task in supervisors):
                await self.wait_change()
        finally:
            self.stopping = True
            self.changed.set()  # wakes supervisors waiting out a back-off
            await self.kill_processes(self._stop_grace())
            # Each supervisor records its container's exit and returns; none should be left after that.
            _, stuck = await asyncio.wait(supervisors, timeout=self.agent.timeouts.request)
            for task in stuck:
                task.cancel()

    def _memory_cgroup(self, name: str) -> MemoryCgroup | None:
        """The container's memory limit as a cgroup (memlimit.py); None without a limit or a cgroup."""
        limit = ((self.specs[name].get("resources") or {}).get("limits") or {}).get("memory")
        if limit is None or not self.agent.enforce_memory:
            return None
        try:
            size = int(podenv.parse_quantity(limit, f"{name}: resources.limits.memory"))
        except podenv.PodConfigError:
            return None
        self.runs += 1
        return MemoryCgroup.create(f"{self.uid}-{name}-{self.runs}", size)

    def _stop_grace(self) -> float:
        grace = self.grace_s()
        return min(grace, self.agent.timeouts.stop_grace) if self.node_shutdown else grace

    async def _prepare(self) -> bool:
        """Fetch what env and volumes need and write the volumes; retry while something is missing."""
        while not (self.deleting or self.stopping):
            try:
                self._allocate_gpus()
                if self.cgroup is None:
                    self.cgroup = self.agent.cgroups.create(self.dir.name)
                self.sources = await self.agent.fetch_sources(self.pod)
                contents = podenv.volume_contents(self._pod_view(), self.sources, self.agent.allocatable)
                folders = write_volumes(self.dir, contents, self.agent.workdir / "claims")
                api_data = {volume.name for volume in contents if volume.files is not None}
                for name, spec in self.specs.items():
                    mounts = container_mounts(spec, folders, api_data)
                    root = self.dir / "containers" / name / "root"
                    (root.parent / "tmp").mkdir(parents=True, exist_ok=True)
                    self.filesystems[name] = Filesystem.build(root, mounts, spec.get("workingDir") or "/")
                return True
            except (podenv.MountError, podenv.PodConfigError, OSError) as error:
                message = f"local node agent: {error}"
                for container in (*self.init, *self.main):
                    container.waiting = ("ContainerCreating", message)
                await self.report()
                await self.wait_change(self.agent.timeouts.retry)
        return False

    def _release_gpus(self) -> None:
        """Give the GPUs back once no process of the pod runs (the scheduler no longer counts it)."""
        if self.gpu_slots:
            self.agent.gpus.release(self.node_index, self.gpu_slots)
        self.gpu_slots = []

    def _allocate_gpus(self) -> None:
        if self.gpu_slots is not None:
            return
        init, main = podenv.device_counts(self.pod, GPU_RESOURCE)
        total = podenv.pod_device_total(init, main)
        slots = self.agent.gpus.allocate(self.node_index, total)
        if slots is None:  # the scheduler counted them, but an earlier pod is still ending
            raise MountError(f"{total} {GPU_RESOURCE} not free on the node yet")
        self.gpu_slots, self.gpu_plan = slots, podenv.device_plan(init, main, slots)

    def _pod_view(self) -> dict:
        """The pod as fieldRefs see it: the status this agent is about to report."""
        return {
            **self.pod,
            "status": {
                **(self.pod.get("status") or {}),
                "podIP": self.ip,
                "podIPs": [{"ip": self.ip}],
                "hostIP": self.host_ip,
                "hostIPs": [{"ip": self.host_ip}],
            },
        }

    def _container_config(self, name: str) -> tuple[list[str], dict[str, str]]:
        spec = self.specs[name]
        base = self.agent.base_env(self.pod, self.dir / "containers" / name / "tmp")
        visible = self.agent.gpus.visible(self.node_index, self.gpu_plan.get(name, []))
        if visible is not None:
            base["CUDA_VISIBLE_DEVICES"] = base["NVIDIA_VISIBLE_DEVICES"] = visible
        env = podenv.container_env(self._pod_view(), spec, self.sources, self.agent.allocatable, base)
        return podenv.container_argv(spec, env), env

    async def _supervise(self, container: ContainerRun, init: bool = False) -> None:
        """Run one container until it exits for good (restartPolicy), or the pod stops."""
        policy = "OnFailure" if init and self.policy == "Always" else self.policy
        failures = 0
        while not (self.stopping or self.deleting):
            try:
                argv, env = self._container_config(container.name)
            except (podenv.PodConfigError, OSError) as error:
                container.waiting = ("CreateContainerConfigError", str(error))
                await self.report()
                await self._sleep_unless_stopping(self.agent.timeouts.retry)
                continue
            log_path = self.agent.log_path(self.namespace, self.name, self.uid, container.name)
            started = now_rfc3339()
            cgroup = self._memory_cgroup(container.name)
            try:
                filesystem = self.filesystems[container.name]
                container.process = self.agent.start_container(argv, env, filesystem, log_path, self.cgroup, cgroup)
            except OSError as error:  # the command is not on PATH, or its filesystem could not be made
                if cgroup is not None:
                    cgroup.remove()
                container.process = None
                code = START_ERROR_EXIT
                container.terminated = {
                    "exitCode": code,
                    "reason": "StartError",
                    "message": str(error) if isinstance(error, FilesystemError) else f"{argv[0]}: {error}",
                    "startedAt": started,
                    "finishedAt": now_rfc3339(),
                }
            else:
                container.started_at, container.waiting = started, ("", "")
                await self.report()
                code = await container.process.wait()
                oom = cgroup is not None and cgroup.oom_killed()
                container.process.close()
                container.terminated = {
                    "exitCode": code,
                    "reason": "OOMKilled" if oom else "Completed" if code == 0 else "Error",
                    "startedAt": started,
                    "finishedAt": now_rfc3339(),
                    "containerID": f"oobleck-local://{container.process.pid}",
                }
                # As a kubelet: the container's last log lines when it failed and its spec asks for them.
                message_policy = self.specs[container.name].get("terminationMessagePolicy")
                if code != 0 and message_policy == "FallbackToLogsOnError" and (last := tail(log_path)):
                    container.terminated["message"] = last
                if code > SIGNAL_EXIT_BASE:
                    container.terminated["signal"] = code - SIGNAL_EXIT_BASE
            if self.stopping or self.deleting or not should_restart(policy, code):
                container.finished = True
                await self.report()
                return
            failures = failures + 1 if code != 0 else 0
            timeouts = self.agent.timeouts
            delay = 0.0
            if failures:
                delay = min(timeouts.restart_backoff * 2 ** (failures - 1), timeouts.restart_backoff_max)
            earlier = container.last_terminated
            container.last_terminated, container.terminated = container.terminated, None
            if delay:
                message = f"back-off {delay:.0f}s restarting failed container={container.name}"
                container.waiting = ("CrashLoopBackOff", message)
                await self.report()
                await self._sleep_unless_stopping(delay)
            if self.stopping or self.deleting:  # stopped during the back-off: the last run stands
                container.terminated, container.last_terminated = container.last_terminated, earlier
                container.finished = True
                return
            container.restart_count += 1

    async def _sleep_unless_stopping(self, delay: float) -> None:
        deadline = time.monotonic() + delay
        while not (self.stopping or self.deleting) and time.monotonic() < deadline:
            await self.wait_change(deadline - time.monotonic())

    async def kill_processes(self, grace_s: float) -> None:
        """SIGTERM, `grace_s`, SIGKILL every process of the pod (see `terminate`)."""
        processes = [c.process for c in (*self.init, *self.main) if c.process is not None]
        await terminate(processes, grace_s)

    async def _report_lost(self) -> None:
        """A pod that was running under a previous agent: its processes are gone (as after a node reboot)."""
        stamp = now_rfc3339()
        message = "The container could not be located when the pod was terminated"  # the kubelet's words
        for container in self.main:
            container.finished = True
            container.terminated = {
                "exitCode": LOST_EXIT,
                "reason": "ContainerStatusUnknown",
                "message": message,
                "startedAt": stamp,
                "finishedAt": stamp,
            }
        for container in self.init:
            container.finished = True
            container.terminated = {"exitCode": 0, "reason": "Completed", "startedAt": stamp, "finishedAt": stamp}
        await self.report()

    async def _finish(self) -> None:
        """Wait for deletion (unless the agent stops first), then delete the pod with grace 0."""
        if not any(c.process is not None and c.process.returncode is None for c in (*self.init, *self.main)):
            self._release_gpus()
        while not (self.deleting or self.node_shutdown):
            await self.wait_change()
        await self.kill_processes(self._stop_grace())
        netfault.PodCgroups.remove(self.cgroup)
        await self.report()
        if self.node_shutdown or self.gone:
            return
        await self.agent.delete_pod(self.namespace, self.name, self.uid)
        shutil.rmtree(self.dir, ignore_errors=True)
