"""Snapshots beyond f failures: in-memory peer snapshots, a checkpoint directory, and the rollback plan.

Live replicas survive up to f failures. When a failure takes every replica of some layer, the job
rolls back to the newest step s whose state of *every* layer a survivor still has, and replays from
s: data, dropout and the learning rate are pure functions of the step, so the replay is exact.

Tier (a), in memory (GEMINI-style). Every `snapshot.interval_steps` (K) steps, when a worker starts
step t (t % K == 0, the state right after step t - 1 committed), it captures the full state of every
layer it holds (parameters, AdamW moments, step counter: `state.flatten`'s bytes) into host memory
on a background thread, while step t's forward and backward run; the optimizer update of step t
waits for the capture (`Snapshotter.fence`, the only synchronisation). A second thread then pushes
the captured bytes over TCP to its *buddy*, a worker on another node that holds none of its layers
(`buddy_of`: the next such node in plan order, ring-wise), and acknowledges the step in the store
(`snap/gen{g}/step{t}/done`); the rank completing the count marks the step complete
(`snap/complete/{t}`). A snapshot of a layer thus lives on its owner and on a different node, so it
survives its owner's death; a layer is lost to this tier only if all its holders and all their
buddies die. A push failure (the buddy died) is logged and leaves the step incomplete, never stops
training. The buddy connection is plain TCP, not a process group: it must outlive generations and
take no part in their rendezvous or failure handling.

Retention: each worker keeps the newest step it knows complete and the newest one being built
(older steps are dropped when a newer one completes). Pruning is frozen from the moment a worker
leaves a generation until it has adopted the next plan, so what it reported (below) is still there
when the controller's plan arrives. Memory per worker, at most: 2 x (its own layers' state + its
buddy's layers' state) of host memory, i.e. with AdamW in fp32, 2 x 2 x 12 bytes per parameter it
(or its buddy) holds; network: its own state bytes once per K steps.

Tier (b), optional directory (`checkpoint.path`, a PVC in a pod): every `checkpoint.interval_steps`
steps the lowest rank holding a layer writes the captured bytes to `step-{t:08d}/layer-{l:05d}.bin`
(temporary file + fsync + rename: a file present is complete); a step is complete when every layer's
file exists. The writers keep the `checkpoint.keep` newest complete steps, and a finishing worker
waits for its last writes. The capture of a checkpoint step also stays in the worker's own memory
(counted as a step being built): a survivor then restores its own layers from memory, not from disk.

Reports: every worker adds `"snapshots": {step: [layers]}` (own and buddy-held) and its snapshot
server's address to its `held/{worker}` report. The controller (`restore_point`) picks the newest
step s such that every layer at s is held in memory by a survivor or present in the directory, and
`rollback_plan` builds the next generation: the planner's layout for the survivors (priced as if
each survivor held what its snapshots hold), `restore_step = s`, and one LayerCopy for every
(rank, layer) of the new layout naming its source: `snapshot` (from the rank's own host memory when
src == dst, else sent by a snapshot holder over the generation's link group), or `checkpoint` (read
by the rank itself, src == dst). Every worker then resets to step s (all layers from the copies,
step counter s) before it builds its groups, and replays; snapshots newer than s stay valid (the
replay recomputes the same states). The launcher also rolls back when survivors report live states
at different steps. A worker entry point sets `worker.snapshots = snapshotter_for(...)`.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from oobleck.api.plan import LayerCopy, Plan
from oobleck.runtime.coordinator import held_key, is_store_loss
from oobleck.runtime.coordinator import snapshot_complete_key as complete_key
from oobleck.runtime.coordinator import snapshot_done_key as done_key

log = logging.getLogger("oobleck.runtime.snapshot")


# -- placement and the restore choice (pure) -------------------------------------------------------


def buddy_of(plan: Plan, node: str, gpu: int) -> tuple[str, int] | None:
    """The worker that keeps (node, gpu)'s in-memory snapshots: on another node, holding none of its layers.

    Nodes are walked ring-wise in plan order from the owner's node; the first node with a worker whose
    range is disjoint from the owner's wins (its worker with the owner's GPU index if that one is
    disjoint, else its lowest disjoint GPU). Without any disjoint worker: the next node's worker with
    the lowest GPU. None on a one-node plan.
    """
    ranks = plan.ranks
    mine = next((a for a in ranks if a.node == node and a.gpu == gpu), None)
    if mine is None:
        raise ValueError(f"buddy_of: ({node!r}, {gpu}) has no rank in plan generation {plan.generation}")
    nodes = plan.nodes
    at = nodes.index(node)
    others = nodes[at + 1 :] + nodes[:at]
    if not others:
        return None
    by_node: dict[str, list] = {}
    for a in ranks:
        by_node.setdefault(a.node, []).append(a)
    for candidate in others:
        disjoint = sorted(
            (a for a in by_node[candidate] if a.end <= mine.start or mine.end <= a.start),
            key=lambda a: (a.gpu != gpu, a.gpu),
        )
        if disjoint:
            return disjoint[0].node, disjoint[0].gpu
    first = min(by_node[others[0]], key=lambda a: a.gpu)
    return first.node, first.gpu


def restore_point(
    memory: Mapping[str, Mapping[int, Iterable[int]]],
    checkpoint: Mapping[int, Iterable[int]],
    num_layers: int,
    latest: int | None = None,
) -> int | None:
    """The newest step whose every layer is in a survivor's memory (`memory`: worker -> step -> layers)
    or in the checkpoint directory (`checkpoint`: step -> layers); None if there is none.

    `latest`: the job's current step; newer steps (a directory left by an earlier run) are ignored."""
    cover: dict[int, set[int]] = {}
    for steps in memory.values():
        for step, layers in steps.items():
            cover.setdefault(int(step), set()).update(layers)
    for step, layers in checkpoint.items():
        cover.setdefault(int(step), set()).update(layers)
    everything = set(range(num_layers))
    complete = [step for step, layers in cover.items() if everything <= layers and (latest is None or step <= latest)]
    return max(complete, default=None)


def restore_copies(
    plan: Plan, memory: Mapping[str, Iterable[int]], checkpoint: Iterable[int], state_bytes: list[int]
) -> list[LayerCopy]:
    """The source of every (rank, layer) of `plan` at the restore step.

    `memory`: worker ("node:gpu") -> layers whose snapshot at the step it holds; `checkpoint`: the
    layers in the directory at that step. Preference: the rank's own memory (no transfer), then the
    snapshot holder that has sent the fewest bytes so far (ties: the lower rank), then the directory.
    Raises ValueError naming a layer with no source.
    """
    held = {w: set(layers) for w, layers in memory.items()}
    on_disk = set(checkpoint)
    holders: dict[int, list[int]] = {}
    for a in plan.ranks:
        for layer in held.get(f"{a.node}:{a.gpu}", ()):
            holders.setdefault(layer, []).append(a.rank)
    load = [0] * plan.world_size
    copies = []
    for a in plan.ranks:
        mine = held.get(f"{a.node}:{a.gpu}", set())
        for layer in range(a.start, a.end):
            size = state_bytes[layer]
            if layer in mine:
                src, kind = a, "snapshot"
            elif holders.get(layer):
                rank = min(holders[layer], key=lambda r: (load[r], r))
                load[rank] += size
                src, kind = plan.ranks[rank], "snapshot"
            elif layer in on_disk:
                src, kind = a, "checkpoint"
            else:
                raise ValueError(f"restore: layer {layer} is neither in a survivor's snapshots nor in the checkpoint")
            copies.append(
                LayerCopy(
                    layer=layer,
                    src_node=src.node,
                    src_gpu=src.gpu,
                    src_rank=src.rank,
                    dst_node=a.node,
                    dst_gpu=a.gpu,
                    dst_rank=a.rank,
                    bytes=size,
                    source_kind=kind,
                )
            )
    return copies


def snapshots_at(reports: Mapping[str, Mapping[int, Iterable[int]]], step: int) -> dict[str, set[int]]:
    """worker -> layers of its snapshot at `step` (workers without any are left out)."""
    out = {w: set(steps.get(step, ())) for w, steps in reports.items()}
    return {w: layers for w, layers in out.items() if layers}


def rollback_plan(
    previous: Plan,
    profile,
    nodes_lost: list[str],
    nodes_added: list[str],
    memory: Mapping[str, Mapping[int, Iterable[int]]],
    checkpoint: Mapping[int, Iterable[int]],
    *,
    bandwidth: float,
    latest: int | None = None,
) -> Plan | None:
    """The generation after `previous` that restores the newest restorable step, or None if none is.

    `memory`: survivor -> step -> layers of its snapshots; `checkpoint`: step -> layers on disk. The
    layout is the planner's reconfiguration of `previous` with each survivor priced as holding its
    snapshots of that step (layers only on disk as held by every survivor: a read costs the same
    anywhere); the copies are `restore_copies`.
    """
    from oobleck.planner.reconfigure import reconfigure

    step = restore_point(memory, checkpoint, previous.num_layers, latest)
    if step is None:
        return None
    at = snapshots_at(memory, step)
    disk = set(checkpoint.get(step, ()))
    only_disk = disk - set().union(*at.values()) if at else disk
    survivors = [f"{a.node}:{a.gpu}" for a in previous.ranks if a.node not in set(nodes_lost)]
    holdings = {}
    for worker in survivors:
        node, _, gpu = worker.rpartition(":")
        holdings[(node, int(gpu))] = frozenset(at.get(worker, set()) | only_disk)
    plan = reconfigure(
        previous, previous.templates, profile, nodes_lost, nodes_added, bandwidth=bandwidth, holdings=holdings
    )
    state_bytes = [layer.state_bytes for layer in profile.layers] if hasattr(profile, "layers") else list(profile)
    copies = restore_copies(plan, at, disk, state_bytes)
    return plan.model_copy(update={"copies": copies, "restore_step": step, "reason": f"rollback+{plan.reason}"})


# -- the checkpoint directory ----------------------------------------------------------------------


def _step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def _layer_file(root: Path, step: int, layer: int) -> Path:
    return _step_dir(root, step) / f"layer-{layer:05d}.bin"


def write_checkpoint_layer(root: str | Path, step: int, layer: int, data: torch.Tensor) -> Path:
    """Write one layer's state bytes atomically: a file that exists is complete."""
    path = _layer_file(Path(root), step, layer)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as handle:
        handle.write(memoryview(data.contiguous().numpy()))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    return path


def read_checkpoint_layer(root: str | Path, step: int, layer: int) -> torch.Tensor:
    data = bytearray(_layer_file(Path(root), step, layer).read_bytes())
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def checkpoint_holdings(root: str | Path | None) -> dict[int, set[int]]:
    """step -> layers whose file is in the directory (absent directory: nothing)."""
    out: dict[int, set[int]] = {}
    if root is None or not Path(root).is_dir():
        return out
    for step_dir in Path(root).glob("step-*"):
        try:
            step = int(step_dir.name[5:])
            layers = {int(p.name[6:-4]) for p in step_dir.glob("layer-*.bin")}
        except (ValueError, OSError):
            continue  # a foreign name, or a directory being deleted by a writer's pruning
        out[step] = layers
    return out


def prune_checkpoints(root: str | Path, num_layers: int, keep: int) -> None:
    """Delete steps older than the `keep`-th newest complete one (several writers may race: harmless)."""
    held = checkpoint_holdings(root)
    complete = sorted(s for s, layers in held.items() if len(layers) >= num_layers)
    if len(complete) < keep:
        return
    oldest_kept = complete[-keep]
    for step in [s for s in held if s < oldest_kept]:
        directory = _step_dir(Path(root), step)
        for path in directory.glob("*"):
            path.unlink(missing_ok=True)
        try:
            directory.rmdir()
        except OSError:
            pass


# -- host memory -----------------------------------------------------------------------------------


class SnapshotStore:
    """Snapshots this worker holds in host memory, own and buddy-held: step -> layer -> state bytes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: dict[int, dict[int, torch.Tensor]] = {}
        self.complete: set[int] = set()
        """steps this worker knows complete (every rank of a generation captured and pushed them)"""
        self.frozen = False

    def put(self, step: int, layer: int, data: torch.Tensor) -> None:
        with self._lock:
            self._steps.setdefault(step, {})[layer] = data

    def get(self, step: int, layer: int) -> torch.Tensor:
        with self._lock:
            try:
                return self._steps[step][layer]
            except KeyError:
                raise KeyError(
                    f"snapshot of layer {layer} at step {step}: not held here (held: {self._holdings_locked()})"
                ) from None

    def steps(self) -> list[int]:
        with self._lock:
            return sorted(self._steps)

    def holdings(self) -> dict[str, list[int]]:
        """{step: layers} as reported in `held/{worker}` (JSON keys are strings)."""
        with self._lock:
            return self._holdings_locked()

    def _holdings_locked(self) -> dict[str, list[int]]:
        return {str(step): sorted(layers) for step, layers in sorted(self._steps.items())}

    def nbytes(self) -> int:
        with self._lock:
            return sum(t.numel() for layers in self._steps.values() for t in layers.values())

    def mark_complete(self, step: int) -> None:
        with self._lock:
            self.complete.add(step)

    def freeze(self) -> None:
        """No pruning until `thaw`: the controller may be planning a restore from what we reported."""
        with self._lock:
            self.frozen = True

    def thaw(self) -> None:
        with self._lock:
            self.frozen = False

    def prune(self) -> None:
        """Keep the newest complete step and the newest step being built (see the module docstring)."""
        with self._lock:
            if self.frozen:
                return
            steps = sorted(self._steps)
            complete = [s for s in steps if s in self.complete]
            keep = set(steps[-1:])
            if complete:
                keep.add(complete[-1])
            else:
                keep.update(steps[-2:])  # nothing known complete: the two newest
            for step in steps:
                if step not in keep:
                    del self._steps[step]


# -- the buddy transport ---------------------------------------------------------------------------

_HEADER = struct.Struct("!I")


def _send_message(sock: socket.socket, header: dict, payload: torch.Tensor | None = None) -> None:
    data = json.dumps(header).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)
    if payload is not None and payload.numel():
        sock.sendall(memoryview(payload.contiguous().numpy()))


def _receive_exactly(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {size} bytes")
        got += n
    return buffer


def _receive_message(sock: socket.socket) -> dict:
    (size,) = _HEADER.unpack(_receive_exactly(sock, _HEADER.size))
    return json.loads(_receive_exactly(sock, size))


class SnapshotServer:
    """Accepts a peer's pushed snapshots into `store` (one thread per connection, all daemons).

    Protocol per push: messages {"kind": "layer", "step", "layer", "nbytes"} + payload, then
    {"kind": "end"}, answered {"ok": true} once every layer is stored.
    """

    def __init__(self, store: SnapshotStore, host: str = "0.0.0.0", port: int = 0) -> None:
        self.store = store
        self._listener = socket.create_server((host, port))
        self.port = self._listener.getsockname()[1]
        self._closed = False

    def start(self) -> SnapshotServer:
        threading.Thread(target=self._accept, name="snapshot-server", daemon=True).start()
        return self

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), name="snapshot-push", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        received = []
        try:
            with sock:
                while True:
                    header = _receive_message(sock)
                    if header["kind"] == "end":
                        for step, layer, data in received:
                            self.store.put(step, layer, data)
                        _send_message(sock, {"ok": True, "layers": len(received)})
                        received = []
                        return
                    data = _receive_exactly(sock, header["nbytes"])
                    tensor = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
                    received.append((header["step"], header["layer"], tensor))
        except (OSError, ConnectionError, ValueError) as error:
            # The owner died mid-push: what it sent is dropped (a half push is never reported).
            log.warning(json.dumps({"event": "snapshot-push-broken", "error": str(error)[:200]}))


def push(address: str, step: int, layers: dict[int, torch.Tensor], timeout_s: float = 60.0) -> None:
    """Send one step's snapshots to a buddy's server and wait for its acknowledgement."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        for layer, data in sorted(layers.items()):
            _send_message(sock, {"kind": "layer", "step": step, "layer": layer, "nbytes": data.numel()}, data)
        _send_message(sock, {"kind": "end"})
        reply = _receive_message(sock)
        if not reply.get("ok"):
            raise ConnectionError(f"snapshot push of step {step} to {address}: refused: {reply}")


def local_address(peer_host: str) -> str:
    """The address peers reach this worker at: $OOBLECK_POD_IP, else the interface that routes to `peer_host`."""
    if os.environ.get("OOBLECK_POD_IP"):
        return os.environ["OOBLECK_POD_IP"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((peer_host, 9))  # UDP: no packet is sent, the kernel just picks the route
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


# -- the worker's agent ----------------------------------------------------------------------------


@dataclass
class _Job:
    generation: int
    world_size: int
    step: int
    layers: list[tuple[int, nn.Module]]
    optimizer: object
    push: bool
    buddy: str | None
    """the buddy's worker id, or None (no push)"""
    write: list[int] = field(default_factory=list)
    """layers this rank writes to the checkpoint directory at this step"""


class Snapshotter:
    """A worker's snapshot agent: captures off the training thread, pushes to the buddy, writes checkpoints.

    `connect_store` returns a new store client (the agent's own connection: the main thread's is busy
    with commits); it is called again after a lost coordinator.
    """

    def __init__(
        self,
        worker: str,
        interval: int,
        connect_store: Callable[[], object],
        *,
        checkpoint_dir: str | None = None,
        checkpoint_interval: int = 0,
        checkpoint_keep: int = 2,
        num_layers: int = 0,
        advertise: str = "127.0.0.1",
        push_timeout_s: float = 60.0,
        export: Callable[[int, dict[int, torch.Tensor]], None] | None = None,
    ) -> None:
        self.worker = worker
        self.export = export
        """also called with (step, {layer: captured bytes}) for the layers written at a checkpoint step
        (checkpoint.format huggingface: runtime/hfcheckpoint.write_flat_layers)"""
        self.interval = interval
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_interval = checkpoint_interval if checkpoint_dir else 0
        self.checkpoint_keep = checkpoint_keep
        self.num_layers = num_layers
        self.push_timeout_s = push_timeout_s
        self.store = SnapshotStore()
        self.server = SnapshotServer(self.store).start()
        self.address = f"{advertise}:{self.server.port}"
        self._connect_store = connect_store
        self._control = None
        # Two threads: captures (which the optimizer update waits for) never queue behind a slow
        # push or write (which only delays the next snapshot's completion).
        self._captures: queue.SimpleQueue = queue.SimpleQueue()
        self._shipments: queue.SimpleQueue = queue.SimpleQueue()
        self._captured = threading.Event()
        self._captured.set()
        self._outstanding = 0
        self._quiet = threading.Condition()
        self._begun: set[tuple[int, int]] = set()
        self.stats = {"snapshots": 0, "capture_s": 0.0, "push_s": 0.0, "pushed_bytes": 0, "checkpoint_s": 0.0}
        threading.Thread(target=self._capture_loop, name="snapshot-capture", daemon=True).start()
        threading.Thread(target=self._ship_loop, name="snapshot-ship", daemon=True).start()

    # -- training thread ---------------------------------------------------------------------------

    def due(self, generation: int, step: int) -> bool:
        if (generation, step) in self._begun:
            return False
        return bool(
            (self.interval and step % self.interval == 0)
            or (self.checkpoint_interval and step % self.checkpoint_interval == 0)
        )

    def begin(self, plan: Plan, rank: int, step: int, layers: dict[int, nn.Module], optimizer) -> None:
        """Start the snapshot of `step` (the state before it runs); returns at once."""
        self.fence()
        self._begun = {key for key in self._begun if key[0] == plan.generation} | {(plan.generation, step)}
        me = plan.ranks[rank]
        buddy = buddy_of(plan, me.node, me.gpu)
        write = []
        if self.checkpoint_interval and step % self.checkpoint_interval == 0:
            write = [layer for layer in layers if plan.holders(layer)[0] == rank]
        self._captured.clear()
        with self._quiet:
            self._outstanding += 1
        self._captures.put(
            _Job(
                plan.generation,
                plan.world_size,
                step,
                sorted(layers.items()),
                optimizer,
                push=bool(self.interval and step % self.interval == 0),
                buddy=None if buddy is None else f"{buddy[0]}:{buddy[1]}",
                write=write,
            )
        )

    def fence(self) -> None:
        """Block until the capture in flight (if any) is done: state may be modified after this."""
        self._captured.wait()

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Wait until every snapshot begun is captured, pushed and written (tests, orderly exit)."""
        with self._quiet:
            return self._quiet.wait_for(lambda: self._outstanding == 0, timeout_s)

    # -- background threads ------------------------------------------------------------------------

    def _capture_loop(self) -> None:
        from oobleck.runtime.state import capture

        while True:
            job = self._captures.get()
            captured = None
            try:
                started = time.perf_counter()
                captured = {layer: capture(layer, module, job.optimizer) for layer, module in job.layers}
                self.stats["capture_s"] += time.perf_counter() - started
                for layer, data in captured.items():
                    self.store.put(job.step, layer, data)
            except Exception as error:
                self._failed(job, error)
            finally:
                self._captured.set()
                self._shipments.put((job, captured))

    def _ship_loop(self) -> None:
        while True:
            job, captured = self._shipments.get()
            try:
                if captured is not None:
                    self._ship(job, captured)
            except Exception as error:
                self._failed(job, error)
            finally:
                with self._quiet:
                    self._outstanding -= 1
                    self._quiet.notify_all()

    def _failed(self, job: _Job, error: Exception) -> None:
        log.warning(
            json.dumps(
                {
                    "event": "snapshot-failed",
                    "worker": self.worker,
                    "step": job.step,
                    "error": f"{type(error).__name__}: {error}"[:300],
                }
            )
        )

    def _ship(self, job: _Job, captured: dict[int, torch.Tensor]) -> None:
        """Push to the buddy, write the checkpoint files, count the step done, prune."""
        started = time.perf_counter()
        pushed = True
        if job.push and job.buddy is not None:
            try:
                address = self._buddy_address(job.buddy)
                began = time.perf_counter()  # the transfer alone (the address may take a while at start)
                push(address, job.step, captured, self.push_timeout_s)
                self.stats["pushed_bytes"] += sum(t.numel() for t in captured.values())
            except (OSError, ConnectionError, TimeoutError, RuntimeError) as error:
                pushed, began = False, time.perf_counter()
                log.warning(
                    json.dumps(
                        {
                            "event": "snapshot-push-failed",
                            "worker": self.worker,
                            "step": job.step,
                            "buddy": job.buddy,
                            "error": str(error)[:200],
                        }
                    )
                )
            self.stats["push_s"] += time.perf_counter() - began
        if job.write:
            began = time.perf_counter()
            for layer in job.write:
                write_checkpoint_layer(self.checkpoint_dir, job.step, layer, captured[layer])
            if self.export is not None:
                self.export(job.step, {layer: captured[layer] for layer in job.write})
            self.stats["checkpoint_s"] += time.perf_counter() - began
            if not self.store.frozen and self.num_layers > 0:
                prune_checkpoints(self.checkpoint_dir, self.num_layers, self.checkpoint_keep)
        if job.push and pushed:
            count = self._store_call(lambda s: s.add(done_key(job.generation, job.step), 1))
            if count == job.world_size:
                self._store_call(lambda s: s.set(complete_key(job.step), "1"))
        for step in self.store.steps():
            if step not in self.store.complete and self._store_call(lambda s: s.check([complete_key(step)])):
                self.store.mark_complete(step)
        self.store.prune()
        self.stats["snapshots"] += 1
        log.info(
            json.dumps(
                {
                    "event": "snapshot",
                    "worker": self.worker,
                    "step": job.step,
                    "generation": job.generation,
                    "layers": sorted(captured),
                    "buddy": job.buddy if job.push else None,
                    "pushed": pushed if job.push and job.buddy else None,
                    "written": job.write,
                    "held": self.store.holdings(),
                    "seconds": round(time.perf_counter() - started, 4),
                }
            )
        )

    def _buddy_address(self, buddy: str, timeout_s: float = 30.0) -> str:
        """The buddy's server address from its `held/{worker}` report (it may not have published it yet)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self._store_call(lambda s: s.get(held_key(buddy)) if s.check([held_key(buddy)]) else None)
            address = json.loads(value).get("snapshot_address") if value else None
            if address:
                return address
            if time.monotonic() > deadline:
                raise TimeoutError(f"buddy {buddy} published no snapshot address within {timeout_s:.0f} s")
            time.sleep(0.05)

    def _store_call(self, action):
        for attempt in range(2):
            if self._control is None:
                self._control = self._connect_store()
            try:
                return action(self._control)
            except RuntimeError as error:
                if not is_store_loss(error) or attempt:
                    raise
                self._control = None  # a recreated coordinator: reconnect once
        return None


def snapshotter_for(config, worker: str, connect_store: Callable[[], object], store_host: str) -> Snapshotter | None:
    """The worker's Snapshotter as its config asks (None when both tiers are off); every entry point
    that runs `reconfig.run_elastic` sets `worker.snapshots` to this."""
    if not (config.snapshot.interval_steps or config.checkpoint.path):
        return None
    from oobleck.runtime.config import build_model

    model = build_model(config)
    export = None
    if config.checkpoint.path and config.checkpoint.format == "huggingface":
        from oobleck.runtime.hf import TransformersModel
        from oobleck.runtime.hfcheckpoint import write_flat_layers

        if isinstance(model, TransformersModel):
            root = config.checkpoint.path
            export = lambda step, flats: write_flat_layers(model, root, step, flats)  # noqa: E731
    return Snapshotter(
        worker,
        config.snapshot.interval_steps,
        connect_store,
        checkpoint_dir=config.checkpoint.path,
        checkpoint_interval=config.checkpoint.interval_steps,
        checkpoint_keep=config.checkpoint.keep,
        num_layers=model.num_layers,
        advertise=local_address(store_host),
        export=export,
    )
