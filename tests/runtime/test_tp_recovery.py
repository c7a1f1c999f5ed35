"""Recovery with tensor-parallel stages: a new plan generation moves layers held as TP shards.

Real Worker processes (tests/runtime/drive_worker.py) go from generation 0 to generation 1 in place, as the
control side drives them after a node is lost: shards are copied between ranks of the same t, a t = 2
group's shards are glued whole for a t = 1 stage, and a whole layer is cut into a t = 2 group's shards,
parameters and AdamW moments alike. Training then continues to the single-process reference's losses.
Which copies a generation makes from the members' reported shards: tests/runtime/test_shard_sources.py.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from torch.distributed import TCPStore

from oobleck.runtime.train.config import build_model
from oobleck.runtime.train.reference import train_reference
from oobleck_dev import preforked
from tests.runtime.test_tp_engine import CONFIG, whole_layers
from tests.runtime.test_transfer import DRIVER

pytestmark = pytest.mark.slow  # real worker processes
STEPS, SWITCH = 8, 4


def copy(layer: int, src: tuple[str, int], dst: tuple[str, int], plan, shard: tuple[int, int] = (1, 0)) -> dict:
    """A LayerCopy's fields; `shard`: the (t, k) the source holds the layer in."""
    return {
        "src_tensor_parallel": shard[0],
        "src_tp_index": shard[1],
        "layer": layer,
        "src_node": src[0],
        "src_gpu": src[1],
        "src_rank": plan.rank_of(*src),
        "dst_node": dst[0],
        "dst_gpu": dst[1],
        "dst_rank": plan.rank_of(*dst),
        "bytes": 0,
    }


def test_shards_move_and_reshard_across_a_change_of_t(tmp_path, plan_builder):
    make_plan, Spec = plan_builder
    config = CONFIG.model_copy(update={"job": "tp-recovery", "steps": STEPS})
    # Generation 0: n0's two GPUs hold every layer at t = 2; n1 -> n2 hold layers 0-2 | 3-5 whole.
    first = make_plan(
        [Spec(stages=[(0, 6, 0, 2, 2)], microbatches=3), Spec(stages=[(0, 3, 0, 1), (3, 6, 1, 1)], microbatches=5)],
        num_layers=6,
        gpus_per_node=2,
        job="tp-recovery",
        node_names=[["n0"], ["n1", "n2"]],
    )
    # Generation 1: n1 is gone. n2 runs every layer whole (layers 0-2 glued from n0's two shards); a new
    # node n3 runs every layer at t = 2 (layers 0-2 shard-copied from n0, layers 3-5 cut from n2's whole ones).
    layout = [Spec(stages=[(0, 6, 0, 2, 2)], microbatches=3), Spec(stages=[(0, 6, 0, 1)], microbatches=3)]
    layout.append(Spec(stages=[(0, 6, 0, 2, 2)], microbatches=2))
    names = [["n0"], ["n2"], ["n3"]]
    bare = make_plan(layout, num_layers=6, gpus_per_node=2, job="tp-recovery", generation=1, node_names=names)
    copies = [copy(layer, ("n0", gpu), ("n2", 0), bare, (2, gpu)) for layer in range(3) for gpu in (0, 1)]
    copies += [copy(layer, ("n0", gpu), ("n3", gpu), bare, (2, gpu)) for layer in range(3) for gpu in (0, 1)]
    copies += [copy(layer, ("n2", 0), ("n3", gpu), bare) for layer in range(3, 6) for gpu in (0, 1)]
    second = make_plan(
        layout, num_layers=6, gpus_per_node=2, job="tp-recovery", generation=1, node_names=names, copies=copies
    )
    (tmp_path / "config.json").write_text(config.model_dump_json())
    (tmp_path / "gen0.json").write_text(first.to_json())
    (tmp_path / "gen1.json").write_text(second.to_json())
    phases = {
        ("n0", 0): [f"gen0.json:{SWITCH}", f"gen1.json:{STEPS}"],
        ("n0", 1): [f"gen0.json:{SWITCH}", f"gen1.json:{STEPS}"],
        ("n1", 0): [f"gen0.json:{SWITCH}"],
        ("n2", 0): [f"gen0.json:{SWITCH}", f"gen1.json:{STEPS}"],
        ("n3", 0): [f"gen1.json:{STEPS}"],
        ("n3", 1): [f"gen1.json:{STEPS}"],
    }
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    losses = tmp_path / "losses.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # drive_worker.py processes forked from one that imported torch already (oobleck_dev.preforked).
    processes = {
        (node, gpu): preforked.start(
            [str(DRIVER), str(tmp_path / "config.json"), str(store.port), node, str(gpu), str(losses)]
            + [str(tmp_path / f"{node}-{gpu}.pt"), *[f"{tmp_path}/{phase}" for phase in phase_list]],
            tmp_path / f"{node}-{gpu}.log",
            env,
        )
        for (node, gpu), phase_list in phases.items()
    }
    deadline = time.monotonic() + 400
    for key, process in processes.items():
        try:
            code = process.wait(timeout=max(1, deadline - time.monotonic()))
        except TimeoutError:
            for other in processes.values():
                other.kill()
            pytest.fail(f"{key} timed out")
        assert code == 0, f"{key} failed:\n{(tmp_path / f'{key[0]}-{key[1]}.log').read_text()[-3000:]}"
    records = [json.loads(line) for line in losses.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    assert [r["generation"] for r in records] == [0] * SWITCH + [1] * (STEPS - SWITCH)
    reference = train_reference(config, 8)
    for record, expected in zip(records, reference.losses):
        assert abs(record["loss"] - expected) <= 1e-5 * abs(expected), f"step {record['step']}"
    # Every holder of generation 1 ends with the reference's weights (shards glued whole to compare).
    per_rank = {
        second.rank_of(node, gpu): torch.load(tmp_path / f"{node}-{gpu}.pt") for node, gpu in phases if node != "n1"
    }
    for layer, wholes in whole_layers(per_rank, second, build_model(config)).items():
        for whole in wholes:
            for name, want in reference.layers[layer].items():
                difference = (whole[name] - want).abs().max().item()
                assert difference <= 1e-5, f"layer {layer} {name}: {difference}"


def test_snapshots_roll_back_exactly_across_a_change_of_t(plan_builder):
    """Two real Workers (threads, gloo) at t = 2 snapshot every 2 steps: the TP group glues each layer whole
    (parameters and moments), so a rollback generation to step 2 restores the layers, from each worker's own
    memory, into a t = 1 layout of two stages; steps 2-5 then train like one process."""
    import threading

    from oobleck.runtime.elastic.keys import held_key
    from oobleck.runtime.elastic.worker import Worker
    from oobleck.runtime.snapshot.agent import Snapshotter

    make_plan, Spec = plan_builder
    config = CONFIG.model_copy(update={"job": "tp-rollback", "steps": 6, "device": "cpu"})
    plans = {"job": "tp-rollback", "num_layers": 6, "gpus_per_node": 2, "node_names": [["n0"]]}
    first = make_plan([Spec(stages=[(0, 6, 0, 2, 2)], microbatches=2)], **plans)
    layout = [Spec(stages=[(0, 3, 0, 1), (3, 6, 0, 1)], microbatches=2)]
    own = [
        {**copy(layer, ("n0", gpu), ("n0", gpu), make_plan(layout, **plans)), "source_kind": "snapshot"}
        for gpu, layers in ((0, range(3)), (1, range(3, 6)))
        for layer in layers
    ]
    rollback = make_plan(layout, generation=1, copies=own, **plans)
    rollback = type(rollback).model_validate(rollback.model_dump() | {"restore_step": 2, "reason": "rollback"})
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = lambda: TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False)  # noqa: E731
    workers = {}
    for gpu in (0, 1):
        worker = Worker(config, client(), "n0", gpu, snapshots=Snapshotter(f"n0:{gpu}", 2, client))
        master.set(held_key(f"n0:{gpu}"), json.dumps({"snapshot_address": worker.snapshots.address}))
        workers[gpu] = worker

    def run(plan, until) -> dict[int, list]:
        losses, errors = {}, []

        def one(gpu):
            try:
                worker = workers[gpu]
                worker.abandon()
                worker.adopt(plan)
                losses[gpu] = [worker.train_step().loss for _ in range(worker.step, until)]
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=one, args=(gpu,)) for gpu in workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert not errors, errors
        return losses

    try:
        before = run(first, 4)[1]
        for worker in workers.values():
            assert worker.snapshots.wait_idle(30)
            assert worker.snapshots.store.holdings()["2"] == list(range(6)), "every TP rank holds every layer whole"
        after = run(rollback, 6)[1]
    finally:
        for worker in workers.values():
            worker.snapshots.server.close()
    reference = train_reference(config, 2).losses
    assert len(before) == 4 and len(after) == 4
    for got, want in zip(before + after[2:], reference):
        assert abs(got - want) <= 1e-5 * abs(want)
    for got, want in zip(after[:2], before[2:4]):  # the replayed steps, now at t = 1
        assert abs(got - want) <= 1e-5 * abs(want)
    assert all(int(state.step) == 6 for worker in workers.values() for state in worker.optimizer.state.values())


def test_tp_shards_are_reported_and_a_tp_stage_is_served_from_them_before_a_whole_replica(plan_builder):
    """Workers report their shards beside their whole layers (Worker.live_shards): a t = 2 group that lost
    its layers takes them from a surviving t = 2 group's shards, though a whole replica survives too; with
    no complete shard set and no whole replica, the members roll back to the snapshots (whole, see the
    rollback test above)."""
    from oobleck.runtime.elastic.sources import Holding, resolve

    make_plan, Spec = plan_builder
    common = {"num_layers": 6, "gpus_per_node": 2, "generation": 1}
    plan = make_plan(
        [Spec(stages=[(0, 6, 0, 2, 2)], microbatches=2)] * 2 + [Spec(stages=[(0, 6, 0, 1)], microbatches=2)],
        node_names=[["n0"], ["n2"], ["n1"]],
        **common,
    )
    state = [100] * 6
    holdings = {f"n0:{k}": Holding(step=4, started=True, shards={i: (2, k) for i in range(6)}) for k in (0, 1)}
    holdings |= {"n1:0": Holding(step=4, layers=tuple(range(6)), started=True)}
    holdings |= {f"n2:{k}": Holding(step=0) for k in (0, 1)}
    settled = resolve(plan, holdings, state)
    assert settled.restore_step is None
    assert {(c.src_node, c.src_gpu, c.dst_node, c.dst_gpu, c.src_shard) for c in settled.copies} == {
        ("n0", k, "n2", k, (2, k)) for k in (0, 1)
    }
    assert len(settled.copies) == 12
    only_tp = make_plan([Spec(stages=[(0, 6, 0, 2, 2)], microbatches=4)], node_names=[["n0"]], **common)
    half = {
        "n0:0": Holding(step=4, started=True, shards={i: (2, 0) for i in range(6)}, snapshots={2: tuple(range(6))}),
        "n0:1": Holding(step=0, snapshots={2: tuple(range(6))}),  # restarted: shard 1 is gone
    }
    assert resolve(only_tp, half, state).restore_step == 2
