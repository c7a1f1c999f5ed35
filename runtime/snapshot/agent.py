"""Snapshots beyond f failures: in-memory peer snapshots, a checkpoint directory, and the rollback plan.

Live replicas survive up to f failures. When a failure takes every replica of some layer, the job
rolls back to the newest step s whose state of *every* layer a survivor still has, and replays from
s: data, dropout and the learning rate are pure functions of the step, so the replay is exact.

Tier (a), in memory (GEMINI-style). Every `snapshot.interval_steps` (K) steps, when a worker starts
step t (t % K == 0, the state right after step t - 1 committed), it captures the full state of every
layer it holds (parameters, AdamW moments, step counter: `state.flatten`'s bytes) into host memory
on a background thread, while step t's forward and backward run; the optimizer update of step t
waits for the capture (`Snapshotter.ordered`, the only synchronisation): on a GPU the copies into
page-locked host memory start from the state before step t on a side stream, overlapping forward and
backward, and only the update's stream waits for their end (on the GPU, not on the host); elsewhere the
update waits until the copies are made. A second thread then pushes
the captured bytes over TCP to its *buddy*, a worker on another node that holds none of its layers
(`buddy_of`: the next such node in plan order, ring-wise; without one, a worker that holds some of the
same layers, which are then not pushed: it captures its own copy of them at the same step, and
replicas are equal after every step, so the push would only overwrite it with the same bytes; in
pure data parallelism no worker pushes anything), and acknowledges the step in the store
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
server's address to its `held/{worker}` report. The controller (`oobleck.planner.nextgen.restore_point`) picks the newest
step s such that every layer at s is held in memory by a survivor or present in the directory, and
`next_generation` builds the next generation: the planner's layout for the survivors (priced as if
each survivor held what its snapshots hold), `restore_step = s`, and one LayerCopy for every
(rank, layer) of the new layout naming its source: `snapshot` (from the rank's own host memory when
src == dst, else sent by a snapshot holder over the generation's link group), or `checkpoint` (read
by the rank itself, src == dst). Every worker then resets to step s (all layers from the copies,
step counter s) before it builds its groups, and replays; snapshots newer than s stay valid (the
replay recomputes the same states). The launcher also rolls back when survivors report live states
at different steps. A worker entry point passes `snapshotter_for(...)` to the Worker's constructor.

Where it lives: this module is the worker's agent (`Snapshotter`: capture, push, checkpoint writes,
retention); `buddy_of` places them; the restore choice and the rollback plan are the planner's
(planner_cy/nextgen.py);
runtime/snapshot/checkpoint_dir.py the directory; runtime/snapshot/holding.py host memory; runtime/snapshot/transport.py
the buddy TCP transport.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from oobleck.api.plan import Plan
from oobleck.runtime.elastic.keys import get_held, mark_snapshot_complete, snapshot_complete
from oobleck.runtime.elastic.keys import snapshot_done_key as done_key
from oobleck.runtime.elastic.signing import NO_KEY, Signer, job_signer
from oobleck.runtime.elastic.store import is_store_loss
from oobleck.runtime.snapshot.checkpoint_dir import newest_complete_step, prune_checkpoints, write_checkpoint_layer
from oobleck.runtime.snapshot.holding import DeferredRelease, SnapshotStore
from oobleck.runtime.snapshot.transport import SnapshotServer, local_address, push
from oobleck.runtime.train.layer_state import PinnedBuffers, capture_layers

log = logging.getLogger("oobleck.runtime.snapshot.agent")


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


def layers_to_push(plan: Plan, rank: int) -> list[int]:
    """The layers of `rank` whose snapshots go to its buddy: those the buddy does not hold itself (none on a
    one-node plan). A buddy holding a layer captures it at the same step, and replicas are equal after every
    step, so pushing it would only overwrite the buddy's copy with the same bytes."""
    me = plan.ranks[rank]
    buddy = buddy_of(plan, me.node, me.gpu)
    if buddy is None:
        return []
    theirs = next(a for a in plan.ranks if (a.node, a.gpu) == buddy)
    return [layer for layer in range(me.start, me.end) if not theirs.start <= layer < theirs.end]


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
    outgoing: frozenset[int] = frozenset()
    """the layers pushed to the buddy (`layers_to_push`)"""
    write: list[int] = field(default_factory=list)
    """layers this rank writes to the checkpoint directory at this step"""
    start: torch.cuda.Event | None = None
    """on a GPU: recorded on the training thread's stream where the state is the one to capture"""


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
        layer_nbytes: dict[int, int] | None = None,
        signer: Signer = NO_KEY,
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
        self._pinned = PinnedBuffers()
        self._release = DeferredRelease(self._pinned.give)
        self.store = SnapshotStore(on_drop=self._release.drop)
        self.signer = signer
        # Bound to the advertised address (the pod IP), not every interface; a buddy's push is bounded by
        # each layer's state size and verified under the job key before it is stored.
        self.server = SnapshotServer(
            self.store,
            advertise,
            layer_nbytes=layer_nbytes,
            key=signer.key,
            on_refused=lambda why: signer.count_rejected("snapshot_push", why),
        ).start()
        self.address = f"{advertise}:{self.server.port}"
        self._connect_store = connect_store
        self._control = None
        self._buddy_addresses: dict[str, str] = {}
        """buddy -> the snapshot address its last verified `held` report gave (ship thread only)"""
        # Two threads: captures (which the optimizer update waits for) never queue behind a slow
        # push or write (which only delays the next snapshot's completion).
        self._captures: queue.SimpleQueue = queue.SimpleQueue()
        self._shipments: queue.SimpleQueue = queue.SimpleQueue()
        self._captured = threading.Event()
        self._captured.set()
        self._ordered = threading.Event()
        self._ordered.set()
        self._copied: torch.cuda.Event | None = None
        self._outstanding = 0
        self._quiet = threading.Condition()
        self._begun: set[tuple[int, int]] = set()
        self.checkpoint_step: int | None = None
        """the newest step complete in the checkpoint directory after this agent's last write (None: none yet)"""
        self.checkpoint_error: str | None = None
        """why the last checkpoint write failed (None: it succeeded, or none was due yet); the worker reports
        it on its progress and the operator raises the job's CheckpointFailing condition and an event"""
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
        device = next((p.device for module in layers.values() for p in module.parameters()), None)
        self._captured.clear()
        self._ordered.clear()
        self._copied = None
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
                outgoing=frozenset(layers_to_push(plan, rank)),
                write=write,
                start=_recorded(device),
            )
        )

    def fence(self) -> None:
        """Block until the capture in flight (if any) is done and held: state may be modified or replaced
        after this, and the snapshot store holds the step."""
        self._captured.wait()

    def ordered(self) -> None:
        """Block until work the training thread queues from now on may update the state: on a GPU, once the
        capture's copies are queued (the current stream is then made to wait for their end on the GPU),
        else once the capture is done."""
        self._ordered.wait()
        copied, self._copied = self._copied, None
        if copied is not None:
            torch.cuda.current_stream(copied.device).wait_event(copied)

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Wait until every snapshot begun is captured, pushed and written (tests, orderly exit)."""
        with self._quiet:
            return self._quiet.wait_for(lambda: self._outstanding == 0, timeout_s)

    # -- background threads ------------------------------------------------------------------------

    def _capture_loop(self) -> None:
        while True:
            job = self._captures.get()
            captured = None
            try:
                started = time.perf_counter()
                captured = capture_layers(
                    job.layers,
                    job.optimizer,
                    start=job.start,
                    ordered=self._order,
                    buffers=self._pinned,
                )
                self.stats["capture_s"] += time.perf_counter() - started
                self._release.reading(captured.values())
                for layer, data in captured.items():
                    self.store.put(job.step, layer, data)
            except Exception as error:
                self._failed(job, error)
            finally:
                self._ordered.set()
                self._captured.set()
                self._shipments.put((job, captured))
            if captured is not None and job.start is not None:
                self._pinned.prepare({layer: data.numel() for layer, data in captured.items()})

    def _order(self, copied: torch.cuda.Event | None) -> None:
        self._copied = copied
        self._ordered.set()

    def _ship_loop(self) -> None:
        while True:
            job, captured = self._shipments.get()
            try:
                if captured is not None:
                    self._ship(job, captured)
            except Exception as error:
                self._failed(job, error)
            finally:
                if captured is not None:
                    self._release.read(captured.values())
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

    def _write_checkpoint(self, job: _Job, captured: dict[int, torch.Tensor]) -> None:
        """Write this worker's layers of `job.step`, export, prune; a failure (a full or read-only volume, a
        claim the worker's uid cannot write) is kept in `checkpoint_error` for the operator, not swallowed."""
        assert self.checkpoint_dir is not None, "writes are planned only with a checkpoint directory"
        began = time.perf_counter()
        try:
            for layer in job.write:
                write_checkpoint_layer(self.checkpoint_dir, job.step, layer, captured[layer])
            if self.export is not None:
                self.export(job.step, {layer: captured[layer] for layer in job.write})
        except OSError as error:
            self.checkpoint_error = f"step {job.step} in {self.checkpoint_dir}: {type(error).__name__}: {error}"[:300]
            log.warning(
                json.dumps({"event": "checkpoint-write-failed", "worker": self.worker, "error": self.checkpoint_error})
            )
            return
        self.checkpoint_error = None
        self.stats["checkpoint_s"] += time.perf_counter() - began
        if not self.store.frozen and self.num_layers > 0:
            prune_checkpoints(self.checkpoint_dir, self.num_layers, self.checkpoint_keep)
        if self.num_layers > 0:
            self.checkpoint_step = newest_complete_step(self.checkpoint_dir, self.num_layers)

    def _ship(self, job: _Job, captured: dict[int, torch.Tensor]) -> None:
        """Push to the buddy, write the checkpoint files, count the step done, prune."""
        started = time.perf_counter()
        pushed = True
        outgoing = {layer: data for layer, data in captured.items() if layer in job.outgoing}
        if job.push and job.buddy is not None and outgoing:
            try:
                address = self._buddy_address(job.buddy)
                began = time.perf_counter()  # the transfer alone (the address may take a while at start)
                push(address, job.step, outgoing, self.push_timeout_s, self.signer.key)
                self.stats["pushed_bytes"] += sum(t.numel() for t in outgoing.values())
            except (OSError, ConnectionError, TimeoutError, RuntimeError) as error:
                self._buddy_addresses.pop(job.buddy, None)  # a replaced buddy publishes a new one
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
            self._write_checkpoint(job, captured)
        if job.push and pushed:
            count = self._store_call(lambda s: s.add(done_key(job.generation, job.step), 1))
            if count == job.world_size:
                self._store_call(lambda s: mark_snapshot_complete(s, job.step, self.signer))
        for step in self.store.steps():
            if step not in self.store.complete and self._store_call(lambda s: snapshot_complete(s, step, self.signer)):
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
                    "pushed_layers": sorted(outgoing) if job.push and job.buddy else None,
                    "written": job.write,
                    "held": self.store.holdings(),
                    "seconds": round(time.perf_counter() - started, 4),
                }
            )
        )

    def _buddy_address(self, buddy: str, timeout_s: float = 30.0) -> str:
        """The buddy's server address from its `held/{worker}` report (it may not have published it yet). While
        that report is refused (a stranger overwrote it until the buddy's next snapshot), the address its last
        verified one gave: a buddy's server keeps its address for its process's life."""
        deadline = time.monotonic() + timeout_s
        while True:
            held = self._store_call(lambda s: get_held(s, buddy, self.signer))
            address = held.get("snapshot_address") if held else None
            if address:
                self._buddy_addresses[buddy] = address
                return address
            if buddy in self._buddy_addresses:
                return self._buddy_addresses[buddy]
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
    that runs `reconfig.run_elastic` passes this to the Worker's constructor."""
    if not (config.snapshot.interval_steps or config.checkpoint.path):
        return None
    from oobleck.runtime.train.config import build_model
    from oobleck.runtime.train.layer_state import state_nbytes

    model = build_model(config)
    layer_nbytes: dict[int, int] | None
    try:
        with torch.device("meta"):  # sizes only: no layer's memory is allocated
            layer_nbytes = {layer: state_nbytes(model.build_layer(layer)) for layer in range(model.num_layers)}
    except Exception as error:  # a user model that cannot be built on the meta device
        layer_nbytes = None  # pushes stay bounded by their headers and verified by their digests
        log.warning(json.dumps({"event": "snapshot-sizes-unknown", "error": f"{type(error).__name__}: {error}"[:300]}))
    export = None
    if config.checkpoint.path and config.checkpoint.format == "huggingface":
        from oobleck.runtime.models.hf import TransformersModel
        from oobleck.runtime.models.hf_checkpoint import write_flat_layers

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
        layer_nbytes=layer_nbytes,
        signer=job_signer(),
    )


def _recorded(device: torch.device | None) -> torch.cuda.Event | None:
    """An event on `device`'s current stream (None off a GPU): the point a capture starts from."""
    if device is None or device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
