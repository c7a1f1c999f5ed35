"""LayerCopy execution across generations: ranks receive layers' parameters AND optimizer state
(and a new node its step counter) and training continues exactly like the reference."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

from oobleck.runtime.train.config import OptimConfig, WorkerConfig
from oobleck.runtime.train.reference import train_reference
from oobleck_dev import preforked

pytestmark = pytest.mark.slow  # real worker processes
DRIVER = Path(__file__).with_name("drive_worker.py")
STEPS = 12
SWITCH = 5
CONFIG = WorkerConfig(
    job="transfer",
    gradient_sum_dtype="float64",  # compared with the single-process reference to 1e-5
    model={"name": "tiny-gpt"},
    microbatch_size=2,
    steps=STEPS,
    seed=3,
    optim=OptimConfig(lr=3e-3, warmup_steps=2, decay_steps=STEPS),
)


def copy(layer, src, dst, plan_nodes):
    (src_node, src_rank), (dst_node, dst_rank) = plan_nodes[src], plan_nodes[dst]
    return {
        "layer": layer,
        "src_node": src_node,
        "src_gpu": 0,
        "src_rank": src_rank,
        "dst_node": dst_node,
        "dst_gpu": 0,
        "dst_rank": dst_rank,
        "bytes": 0,
    }


def test_relayout_and_joining_node_continue_exactly(tmp_path, plan_builder):
    make_plan, Spec = plan_builder
    # Generation 0: n0 runs everything; n1 -> n2 split 3 | 3.
    first = make_plan(
        [Spec(stages=[(0, 6, 0, 1)], microbatches=3), Spec(stages=[(0, 3, 0, 1), (3, 6, 1, 1)], microbatches=5)],
        num_layers=6,
        job="transfer",
        node_names=[["n0"], ["n1", "n2"]],
    )
    # Generation 1: n1 -> n2 split 2 | 4 (n2 receives layer 2 from n1), and a new node n3 runs a
    # whole pipeline (receives all six layers from n0). Global batch unchanged: 8 microbatches.
    where = {"n0": ("n0", 0), "n1": ("n1", 1), "n2": ("n2", 2), "n3": ("n3", 3)}
    copies = [copy(2, "n1", "n2", where)] + [copy(layer, "n0", "n3", where) for layer in range(6)]
    second = make_plan(
        [
            Spec(stages=[(0, 6, 0, 1)], microbatches=3),
            Spec(stages=[(0, 2, 0, 1), (2, 6, 1, 1)], microbatches=3),
            Spec(stages=[(0, 6, 0, 1)], microbatches=2),
        ],
        num_layers=6,
        job="transfer",
        generation=1,
        node_names=[["n0"], ["n1", "n2"], ["n3"]],
        copies=copies,
    )
    assert [second.rank_of(n, 0) for n in ("n0", "n1", "n2", "n3")] == [0, 1, 2, 3]
    (tmp_path / "config.json").write_text(CONFIG.model_dump_json())
    (tmp_path / "gen0.json").write_text(first.to_json())
    (tmp_path / "gen1.json").write_text(second.to_json())
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    losses = tmp_path / "losses.jsonl"
    phases = {
        "n0": [f"{tmp_path}/gen0.json:{SWITCH}", f"{tmp_path}/gen1.json:{STEPS}"],
        "n1": [f"{tmp_path}/gen0.json:{SWITCH}", f"{tmp_path}/gen1.json:{STEPS}"],
        "n2": [f"{tmp_path}/gen0.json:{SWITCH}", f"{tmp_path}/gen1.json:{STEPS}"],
        "n3": [f"{tmp_path}/gen1.json:{STEPS}"],
    }
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # drive_worker.py processes forked from one that imported torch already (oobleck_dev.preforked).
    processes = {
        node: preforked.start(
            [str(DRIVER), str(tmp_path / "config.json"), str(store.port), node, "0", str(losses)]
            + [str(tmp_path / f"{node}.pt"), *phase],
            tmp_path / f"{node}.log",
            env,
        )
        for node, phase in phases.items()
    }
    deadline = time.monotonic() + 120
    for node, process in processes.items():
        try:
            code = process.wait(timeout=max(1, deadline - time.monotonic()))
        except TimeoutError:
            for p in processes.values():
                p.kill()
            pytest.fail(f"{node} timed out")
        assert code == 0, f"{node} failed:\n{(tmp_path / f'{node}.log').read_text()[-3000:]}"
    records = [json.loads(line) for line in losses.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    assert [r["generation"] for r in records] == [0] * SWITCH + [1] * (STEPS - SWITCH)
    reference = train_reference(CONFIG, 8)
    for record, expected in zip(records, reference.losses):
        assert abs(record["loss"] - expected) <= 1e-5 * abs(expected), f"step {record['step']}"
    # n3 joined at step SWITCH with nothing but copied state and ends with the reference's weights.
    joined = torch.load(tmp_path / "n3.pt")
    assert sorted(joined) == list(range(6))
    for layer, params in joined.items():
        for name, value in params.items():
            assert torch.allclose(value, reference.layers[layer][name], rtol=0, atol=1e-5), f"layer {layer} {name}"
    # n2 now holds layers 2..5 (layer 2 received), n1 freed layer 2.
    assert sorted(torch.load(tmp_path / "n2.pt")) == [2, 3, 4, 5]
    assert sorted(torch.load(tmp_path / "n1.pt")) == [0, 1]
    assert '"event": "adopted"' in (tmp_path / "n3.log").read_text()
