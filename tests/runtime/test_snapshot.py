"""Snapshots beyond f failures (runtime/snapshot/agent.py): the pure choices, the host store, the buddy
transport over real sockets, the checkpoint directory, and a capture that restores bit for bit.

Plans come from the real planner on tiny-gpt's measured state bytes with uniform layer times, so the
layouts are the ones the launcher tests run: 4 nodes -> node0-node1 and node2-node3, stages [0, 3)
[3, 6); 5 nodes -> node0-node1-node2 [0, 2) [2, 4) [4, 6) and node3-node4 [0, 3) [3, 6).
"""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from oobleck.api.profile import ClusterShape, ModelProfile
from oobleck.planner.instantiate import plan_job
from oobleck.planner.nextgen import NoRestorePoint, Restorable, next_generation, restore_copies, restore_point
from oobleck.runtime.snapshot.agent import buddy_of, layers_to_push
from oobleck.runtime.snapshot.checkpoint_dir import (
    checkpoint_holdings,
    newest_complete_step,
    prune_checkpoints,
    read_checkpoint_layer,
    write_checkpoint_layer,
)
from oobleck.runtime.snapshot.holding import DeferredRelease, SnapshotStore
from oobleck.runtime.snapshot.transport import SnapshotServer, push
from oobleck.runtime.train.config import WorkerConfig, build_model
from oobleck.runtime.train.layer_state import capture, flatten, unflatten
from oobleck.runtime.train.optim import LayerAdamW
from tests.runtime.sizes import PIPELINED_MEMORY


@pytest.fixture(scope="module")
def profile(uniform_profile_model):
    return uniform_profile_model


def plan_for(profile: ModelProfile, nodes: int):
    cluster = ClusterShape(
        nodes=nodes,
        gpus_per_node=1,
        gpu_memory_bytes=PIPELINED_MEMORY,
        intra_node_bandwidth=100e9,
        inter_node_bandwidth=10e9,
    )
    return plan_job(profile, cluster, 1, 8, "test", nodes=[f"node{i}" for i in range(nodes)])


def ranges(plan) -> dict[str, tuple[int, int]]:
    return {f"{a.node}:{a.gpu}": (a.start, a.end) for a in plan.ranks}


# -- placement -----------------------------------------------------------------------------------


def test_a_buddy_is_on_another_node_and_holds_none_of_the_owners_layers(profile):
    for nodes in (4, 5):
        plan = plan_for(profile, nodes)
        held = ranges(plan)
        for a in plan.ranks:
            node, gpu = buddy_of(plan, a.node, a.gpu)
            start, end = held[f"{node}:{gpu}"]
            assert node != a.node
            assert end <= a.start or a.end <= start, f"{a.node} [{a.start}, {a.end}) -> {node} [{start}, {end})"
    plan = plan_for(profile, 4)
    # Ring-wise in plan order: the next disjoint node.
    assert [buddy_of(plan, f"node{i}", 0) for i in range(4)] == [("node1", 0), ("node2", 0), ("node3", 0), ("node0", 0)]


def test_losing_every_replica_of_a_layer_leaves_its_snapshots_on_survivors(profile):
    """The property the placement exists for: kill all holders of any one layer, its snapshot survives."""
    for nodes in (4, 5):
        plan = plan_for(profile, nodes)
        for layer in range(plan.num_layers):
            holders = {plan.ranks[r].node for r in plan.holders(layer)}
            buddies = {
                buddy_of(plan, plan.ranks[r].node, plan.ranks[r].gpu)[0]
                for r in plan.holders(layer)
                if layer in layers_to_push(plan, r)
            }
            assert buddies - holders, f"{nodes} nodes, layer {layer}: pushed to no node but its holders"


def test_a_buddy_is_not_pushed_the_layers_it_holds_itself(plan_builder):
    """A buddy holding a layer captures it at the same step (replicas are equal after every step), so it is not
    pushed that layer: in data parallelism nobody pushes; where every other node overlaps a worker's range,
    its buddy is pushed the layers it lacks."""
    make_plan, Spec = plan_builder
    data_parallel = make_plan([Spec([(0, 6, 0, 1)], 2) for _ in range(3)], 6)
    assert [layers_to_push(data_parallel, a.rank) for a in data_parallel.ranks] == [[], [], []]
    mixed = make_plan([Spec([(0, 6, 0, 1)], 2), Spec([(0, 3, 0, 1), (3, 6, 1, 1)], 2)], 6)
    assert [(a.node, a.start, a.end) for a in mixed.ranks] == [("n0", 0, 6), ("n1", 0, 3), ("n2", 3, 6)]
    assert buddy_of(mixed, "n0", 0) == ("n1", 0), "both other nodes overlap [0, 6): the next node's"
    assert [layers_to_push(mixed, a.rank) for a in mixed.ranks] == [[3, 4, 5], [0, 1, 2], [3, 4, 5]]
    assert layers_to_push(make_plan([Spec([(0, 6, 0, 1)], 2)], 6), 0) == [], "one node: no buddy"


# -- the restore choice --------------------------------------------------------------------------


def test_the_restore_point_is_the_newest_step_every_layer_is_held_at():
    memory = {"a:0": {0: {0, 1, 2, 3}, 4: {0, 1}}, "b:0": {4: {2, 3}, 8: {2, 3}}}
    assert restore_point(memory, {}, 4) == 4
    assert restore_point(memory, {}, 5) is None, "layer 4 is nowhere"
    assert restore_point(memory, {8: {0, 1}}, 4) == 8, "memory and directory complete each other"
    assert restore_point(memory, {8: {0, 1}}, 4, latest=6) == 4, "a step past the job's is an older run's"
    assert restore_point({}, {6: {0, 1, 2, 3}, 9: {0}}, 4) == 6
    assert restore_point({}, {}, 4) is None


def test_restore_copies_take_own_memory_then_the_least_loaded_peer_then_the_directory(profile):
    plan = plan_for(profile, 4)  # node0 [0,3) node1 [3,6) | node2 [0,3) node3 [3,6)
    sizes = [layer.state_bytes for layer in profile.layers]
    memory = {"node1:0": {0, 1, 2, 3, 4}, "node3:0": {0, 1, 2, 3, 4}, "node0:0": {0}}
    copies = restore_copies(plan, memory, {5}, sizes)
    by = {(c.dst_node, c.layer): c for c in copies}
    assert sorted(by) == sorted((a.node, layer) for a in plan.ranks for layer in range(a.start, a.end)), (
        "one source for every (rank, layer)"
    )
    assert by[("node0", 0)].src_node == "node0" and by[("node0", 0)].source_kind == "snapshot"
    assert by[("node1", 3)].src_node == "node1", "own memory first"
    assert by[("node1", 5)].source_kind == "checkpoint" and by[("node1", 5)].src_node == "node1"
    peers = [c for c in copies if c.src_rank != c.dst_rank]
    assert {c.src_node for c in peers if c.dst_node == "node0"} == {"node1", "node3"}, "load spread over holders"
    with pytest.raises(ValueError, match="layer 5"):
        restore_copies(plan, memory, set(), sizes)


def test_rollback_plan_restores_the_newest_step_on_the_survivors(profile):
    previous = plan_for(profile, 4)
    # node0 and node2 (every replica of layers 0-2) are gone; their buddies node1, node3 hold them.
    memory = {
        "node1:0": {0: {0, 1, 2, 3, 4, 5}, 4: {0, 1, 2, 3, 4, 5}, 8: {3, 4, 5}},
        "node3:0": {0: {0, 1, 2, 3, 4, 5}, 4: {0, 1, 2, 3, 4, 5}},
    }
    lost = ["node0", "node2"]
    plan = next_generation(previous, profile, lost, restorable=Restorable(memory, {}), bandwidth=10e9)
    assert plan.generation == 1 and plan.restore_step == 4 and plan.lost_nodes == ["node0", "node2"]
    assert sorted(plan.nodes) == ["node1", "node3"]
    assert all(c.source_kind == "snapshot" for c in plan.copies)
    assert all(c.src_rank == c.dst_rank for c in plan.copies), "each survivor holds its new layers in memory"
    assert len(plan.copies) == sum(a.end - a.start for a in plan.ranks)
    type(plan).model_validate_json(plan.to_json())  # a valid document the workers can read
    # Nothing in memory at any one step: the directory's step 6 is the restore point.
    plan = next_generation(
        previous, profile, lost, restorable=Restorable({"node1:0": {4: {3, 4, 5}}}, {6: set(range(6))}), bandwidth=10e9
    )
    assert plan.restore_step == 6 and {c.source_kind for c in plan.copies} == {"checkpoint"}
    with pytest.raises(NoRestorePoint, match="no in-memory snapshot or checkpoint holds every layer at one step"):
        next_generation(previous, profile, lost, restorable=Restorable({"node1:0": {4: {3, 4, 5}}}, {}), bandwidth=10e9)


# -- host memory and transport ----------------------------------------------------------------------


def test_the_store_keeps_the_newest_complete_step_and_the_one_being_built():
    store = SnapshotStore()
    for step in (0, 4, 8):
        store.put(step, 0, torch.zeros(1, dtype=torch.uint8))
    store.prune()
    assert store.steps() == [4, 8], "nothing known complete: the two newest"
    store.mark_complete(4)
    store.put(12, 0, torch.zeros(1, dtype=torch.uint8))
    store.freeze()
    store.prune()
    assert store.steps() == [4, 8, 12], "frozen: a reported step must stay until the next plan"
    store.thaw()
    store.prune()
    assert store.steps() == [4, 12]
    store.mark_complete(12)
    store.prune()
    assert store.steps() == [12]
    assert store.holdings() == {"12": [0]}


def test_the_store_hands_back_every_buffer_it_lets_go_of_and_no_other():
    """Dropped steps and replaced layers go to `on_drop` (the pinned pool reuses them); held ones never."""
    dropped: list[torch.Tensor] = []
    store = SnapshotStore(on_drop=dropped.append)
    buffers = {step: torch.full((2,), step, dtype=torch.uint8) for step in (0, 4, 8)}
    for step, data in buffers.items():
        store.put(step, 0, data)
    store.mark_complete(4)
    store.prune()
    assert [int(t[0]) for t in dropped] == [0] and dropped[0] is buffers[0]
    again = torch.full((2,), 9, dtype=torch.uint8)
    store.put(8, 0, again)  # a step captured again (a replay) replaces the older bytes
    assert dropped[-1] is buffers[8]
    store.put(8, 0, again)
    assert len(dropped) == 2, "putting the same tensor again lets go of nothing"
    store.freeze()
    store.mark_complete(8)
    store.prune()
    assert len(dropped) == 2, "frozen: nothing is let go of"
    store.thaw()
    store.prune()
    assert dropped[-1] is buffers[4] and store.steps() == [8]


def test_a_buffer_still_being_shipped_is_released_only_after_its_last_reader():
    """A replay captures a step again while the older capture of it may still be pushed: the replaced buffer
    must not go back to the pool (and be captured into) before that push is done."""
    released: list[torch.Tensor] = []
    guard = DeferredRelease(released.append)
    store = SnapshotStore(on_drop=guard.drop)
    first, second, replay = (torch.full((2,), v, dtype=torch.uint8) for v in (1, 2, 3))
    guard.reading([first])  # shipment A reads `first`
    guard.reading([first, second])  # shipment B reads both
    store.put(8, 0, first)
    store.put(8, 0, replay)  # the replay replaces `first` while A and B still read it
    assert released == []
    guard.read([first])
    assert released == [], "B still reads it"
    guard.read([first, second])
    assert released == [first], "released once, after its last reader; `second` was never dropped"
    store.put(8, 1, second)
    store.put(8, 1, replay.clone())  # nobody reads `second` any more: released at once
    assert released == [first, second]


def test_a_push_lands_in_the_buddys_store_and_a_broken_one_does_not():
    store = SnapshotStore()
    server = SnapshotServer(store, "127.0.0.1").start()
    try:
        layers = {1: torch.arange(10, dtype=torch.uint8), 2: torch.arange(300_000, dtype=torch.int32).view(torch.uint8)}
        push(f"127.0.0.1:{server.port}", 8, layers)
        assert store.holdings() == {"8": [1, 2]}
        assert torch.equal(store.get(8, 2), layers[2])
        # An owner that dies mid-push: nothing of that push is reported.
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            from oobleck.runtime.snapshot.transport import _send_message

            _send_message(
                sock, {"kind": "layer", "step": 12, "layer": 1, "nbytes": 1000}, torch.zeros(10, dtype=torch.uint8)
            )
        threading.Event().wait(0.2)
        assert store.holdings() == {"8": [1, 2]}
    finally:
        server.close()


# -- state bytes and the directory -----------------------------------------------------------------


def test_a_capture_is_a_copy_that_restores_the_layer_exactly():
    model = build_model(WorkerConfig())
    optimizer = LayerAdamW(WorkerConfig().optim)
    module = model.build_layer(1)
    optimizer.ensure_layer(1, module)
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step([(1, module)], lr=0.1)
    taken = capture(1, module, optimizer)
    before = flatten(1, module, optimizer).clone()
    optimizer.step([(1, module)], lr=0.1)  # the next update must not change the capture
    assert torch.equal(taken, before) and not torch.equal(taken, flatten(1, module, optimizer))
    fresh, fresh_optimizer = model.build_layer(1), LayerAdamW(WorkerConfig().optim)
    unflatten(taken, 1, fresh, fresh_optimizer)
    assert torch.equal(flatten(1, fresh, fresh_optimizer), before)
    assert int(fresh_optimizer.state[(1, "qkv.weight")].step) == 1


def test_checkpoint_files_are_whole_and_old_steps_are_pruned(tmp_path):
    data = torch.arange(1000, dtype=torch.int32).view(torch.uint8)
    for step in (3, 6, 9):
        for layer in range(3):
            write_checkpoint_layer(tmp_path, step, layer, data)
    write_checkpoint_layer(tmp_path, 12, 0, data)  # a step being written
    assert not list(tmp_path.glob("**/*.tmp")), "temporary files are renamed into place"
    assert torch.equal(read_checkpoint_layer(tmp_path, 6, 2), data)
    prune_checkpoints(tmp_path, num_layers=3, keep=2)
    assert checkpoint_holdings(tmp_path) == {6: {0, 1, 2}, 9: {0, 1, 2}, 12: {0}}
    assert checkpoint_holdings(tmp_path / "absent") == {}
    assert newest_complete_step(tmp_path, num_layers=3) == 9  # 12 is still being written
    assert newest_complete_step(tmp_path / "absent", num_layers=3) is None


# -- a worker's rollback, in process ---------------------------------------------------------------


def snapshotting_workers(config: WorkerConfig, nodes: tuple[str, ...]):
    """A coordinator store and one real Worker per node (GPU 0) with a snapshot agent every 2 steps, each
    agent's address published as its `held` report says it (its buddy pushes there)."""
    import json

    from torch.distributed import TCPStore

    from oobleck.runtime.elastic.keys import held_key
    from oobleck.runtime.elastic.worker import Worker
    from oobleck.runtime.snapshot.agent import Snapshotter

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = lambda: TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False)  # noqa: E731
    workers = {}
    for node in nodes:
        worker = Worker(config, client(), node, 0, snapshots=Snapshotter(f"{node}:0", 2, client))
        master.set(held_key(f"{node}:0"), json.dumps({"snapshot_address": worker.snapshots.address}))
        workers[node] = worker
    return master, workers


def test_workers_roll_back_from_own_and_peer_snapshots_and_replay_exactly(profile):
    """Two real Workers (threads, gloo): snapshots every 2 steps pushed to each other, 4 steps, then a
    rollback generation to step 2 whose copies send layers from the *peer's* host snapshots over the
    generation's links (node0 gets layers 1-2 from node1's memory, node1 layer 3 from node0's), and
    steps 2-5 are trained again: every loss equals the reference's, the replayed ones bit for bit."""
    from oobleck.api.plan import LayerCopy
    from oobleck.runtime.train.reference import train_reference

    config = WorkerConfig(job="rollback", microbatch_size=2, steps=6, device="cpu", gradient_sum_dtype="float64")
    first = plan_job(
        profile,
        ClusterShape(
            nodes=2,
            gpus_per_node=1,
            gpu_memory_bytes=PIPELINED_MEMORY,
            intra_node_bandwidth=100e9,
            inter_node_bandwidth=10e9,
        ),
        0,
        4,
        "rollback",
        nodes=["node0", "node1"],
    )
    assert [(a.node, a.start, a.end) for a in first.ranks] == [("node0", 0, 3), ("node1", 3, 6)]
    master, workers = snapshotting_workers(config, ("node0", "node1"))

    def run(plan, until) -> dict[str, list]:
        losses, errors = {}, []

        def one(node):
            try:
                worker = workers[node]
                worker.abandon()
                worker.adopt(plan)
                losses[node] = [worker.train_step().loss for _ in range(worker.step, until)]
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=one, args=(n,)) for n in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        return losses

    before = run(first, 4)["node1"]
    for worker in workers.values():
        assert worker.snapshots.wait_idle(30)
    assert workers["node0"].snapshots.store.holdings()["2"] == [0, 1, 2, 3, 4, 5], "own [0, 3) + node1's [3, 6)"
    sizes = [layer.state_bytes for layer in profile.layers]

    def source(layer, src, dst):
        s, d = first.ranks[src], first.ranks[dst]
        return LayerCopy(
            layer=layer,
            src_node=s.node,
            src_gpu=0,
            src_rank=src,
            dst_node=d.node,
            dst_gpu=0,
            dst_rank=dst,
            bytes=sizes[layer],
            source_kind="snapshot",
        )

    copies = [source(0, 0, 0), source(1, 1, 0), source(2, 1, 0), source(3, 0, 1), source(4, 1, 1), source(5, 1, 1)]
    rollback = first.model_copy(update={"generation": 1, "restore_step": 2, "copies": copies, "reason": "rollback"})
    rollback = type(first).model_validate_json(rollback.to_json())
    after = run(rollback, 6)["node1"]
    reference = train_reference(config, 4).losses
    assert after[:2] == before[2:4], "the replay is exact"
    assert [abs(a - b) / b for a, b in zip(before + after[2:], reference)] == pytest.approx([0.0] * 6, abs=1e-5)
    assert all(int(s.step) == 6 for w in workers.values() for s in w.optimizer.state.values())
    for worker in workers.values():
        worker.snapshots.server.close()


def test_data_parallel_workers_complete_their_snapshots_without_pushing(plan_builder):
    """Two real Workers (threads, gloo) as two single-stage pipelines, snapshots every 2 steps: each holds every
    layer of its snapshots by its own capture, nothing is pushed to the buddy (which holds the same layers), both
    acknowledgements count (the coordinator marks the steps complete), and the snapshots equal each other."""

    from oobleck.runtime.elastic.keys import snapshot_complete

    make_plan, Spec = plan_builder
    plan = make_plan([Spec([(0, 6, 0, 1)], 2), Spec([(0, 6, 0, 1)], 2)], 6, job="dp")
    config = WorkerConfig(job="dp", microbatch_size=2, steps=4, device="cpu")
    master, workers = snapshotting_workers(config, ("n0", "n1"))
    errors = []

    def train(worker):
        try:
            worker.adopt(plan)
            for _ in range(4):
                worker.train_step()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=train, args=(w,)) for w in workers.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    try:
        for worker in workers.values():
            assert worker.snapshots.wait_idle(30)
            assert worker.snapshots.stats["snapshots"] == 2 and worker.snapshots.stats["pushed_bytes"] == 0
        assert snapshot_complete(master, 0) and snapshot_complete(master, 2)
        stores = [w.snapshots.store for w in workers.values()]
        assert all(store.holdings()["2"] == list(range(6)) for store in stores)
        assert all(torch.equal(stores[0].get(2, layer), stores[1].get(2, layer)) for layer in range(6))
    finally:
        for worker in workers.values():
            worker.snapshots.server.close()


def test_a_failed_checkpoint_write_is_kept_for_the_operator_and_cleared_by_the_next_good_one(profile, tmp_path):
    """A real Worker and its agent: the checkpoint folder cannot be created (its parent is a file), so the
    write at step 2 fails; the error is kept (the progress report carries it), not swallowed. Once the
    folder can be written, the step-4 checkpoint succeeds and the error is cleared."""
    from torch.distributed import TCPStore

    from oobleck.api.reports import ProgressReport
    from oobleck.runtime.backends.pod.report import progress_annotation
    from oobleck.runtime.elastic.worker import Worker
    from oobleck.runtime.snapshot.agent import Snapshotter

    config = WorkerConfig(job="ckpt", microbatch_size=2, steps=6, device="cpu")
    shape = ClusterShape(
        nodes=1, gpus_per_node=1, gpu_memory_bytes=10**12, intra_node_bandwidth=100e9, inter_node_bandwidth=10e9
    )
    plan = plan_job(profile, shape, 0, 4, "ckpt", nodes=["node0"])
    blocker = tmp_path / "volume"
    blocker.write_text("not a folder")  # as a full or read-only volume would, every write fails
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = lambda: TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False)  # noqa: E731
    agent = Snapshotter(
        "node0:0",
        0,
        client,
        checkpoint_dir=str(blocker / "ckpt"),
        checkpoint_interval=2,
        num_layers=len(profile.layers),
    )
    worker = Worker(config, client(), "node0", 0, snapshots=agent)
    worker.adopt(plan)
    for _ in range(3):  # steps 0, 1, 2: the checkpoint of step 2 (the state before it) is due
        worker.train_step()
    assert agent.wait_idle(30)
    assert agent.checkpoint_error is not None and agent.checkpoint_error.startswith("step 2 in ")
    assert agent.checkpoint_step is None
    report = ProgressReport.parse(progress_annotation(0, 3, checkpoint_error=agent.checkpoint_error))
    assert report is not None and report.checkpoint_error == agent.checkpoint_error
    blocker.unlink()
    blocker.mkdir()
    for _ in range(2):  # steps 3, 4: the step-4 checkpoint
        worker.train_step()
    assert agent.wait_idle(30)
    assert agent.checkpoint_error is None and agent.checkpoint_step == 4
