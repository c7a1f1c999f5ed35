"""Interrupting a step and redoing it under a new generation; a dead peer surfaces as CommError.

Workers run as threads of the test process here (gloo works across threads), so the test can set
the failure event and inspect state directly; the dead-peer test kills a real worker process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.distributed import TCPStore

from oobleck.runtime.elastic.worker import Worker
from oobleck.runtime.train.groups import CommError, Interrupted
from oobleck.runtime.train.reference import train_reference
from tests.runtime.drive_worker import run_generation
from tests.runtime.sizes import exact_config

CONFIG = exact_config("interrupt", steps=8, seed=11)


def test_interrupted_step_leaves_state_untouched_and_is_redone(plan_builder):
    make_plan, Spec = plan_builder
    specs = [Spec(stages=[(0, 3, 0, 1), (3, 6, 1, 1)], microbatches=2), Spec(stages=[(0, 6, 0, 1)], microbatches=2)]
    first = make_plan(specs, num_layers=6, job="interrupt")
    second = make_plan(specs, num_layers=6, job="interrupt", generation=1)
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    events = [threading.Event() for _ in range(3)]
    workers = [
        Worker(CONFIG, TCPStore("127.0.0.1", master.port, is_master=False), a.node, a.gpu, failed=events[a.rank])
        for a in first.ranks
    ]
    pool = ThreadPoolExecutor(3)

    def all_of(call):
        return [future.result(timeout=60) for future in [pool.submit(call, w) for w in workers]]

    all_of(lambda w: w.adopt(first))
    losses = {}
    for _ in range(3):
        for outcome in all_of(lambda w: w.train_step()):
            if outcome.loss is not None:
                losses[outcome.step] = outcome.loss
    before = [w.layer_state() for w in workers]
    moments = {key: state.exp_avg.clone() for key, state in workers[0].optimizer.state.items()}
    # Rank 1 (last stage of pipeline 0) never shows up for step 3: ranks 0 and 2 block (in the
    # backward receive and in the gradient sum) until the control side sets their events.
    threading.Timer(0.3, lambda: [e.set() for e in events]).start()
    started = time.monotonic()
    errors = [pool.submit(lambda w=w: pytest.raises(Interrupted, w.train_step)) for w in (workers[0], workers[2])]  # noqa: RUF061
    for error in errors:
        error.result(timeout=10)
    assert time.monotonic() - started < 2.0
    assert [w.step for w in workers] == [3, 3, 3]
    for worker, state in zip(workers, before):
        after = worker.layer_state()
        assert all(
            torch.equal(after[layer][name], value) for layer, params in state.items() for name, value in params.items()
        )
    assert all(torch.equal(workers[0].optimizer.state[key].exp_avg, value) for key, value in moments.items())
    # The control side moves everyone to the next generation; the same step is redone.
    for event in events:
        event.clear()
    all_of(lambda w: (w.abandon(), w.adopt(second)))
    while workers[0].step < CONFIG.steps:
        for outcome in all_of(lambda w: w.train_step()):
            if outcome.loss is not None:
                assert outcome.generation == (0 if outcome.step < 3 else 1)
                losses[outcome.step] = outcome.loss
    labels = {"job": "interrupt", "node": "n0", "gpu": "0"}
    assert workers[0].metrics.registry.get_sample_value("oobleck_worker_reconfigurations_total", labels) == 1
    assert workers[0].metrics.registry.get_sample_value("oobleck_worker_plan_generation", labels) == 1
    reference = train_reference(CONFIG, first.global_microbatches)
    assert sorted(losses) == list(range(CONFIG.steps))
    for step, expected in enumerate(reference.losses):
        assert abs(losses[step] - expected) <= 1e-5 * abs(expected), f"step {step}"
    pool.shutdown()


@pytest.mark.slow
def test_dead_peer_raises_comm_error_quickly(tmp_path, plan_builder):
    """kill -9 of the next stage's process: the survivor's step fails fast instead of hanging."""
    make_plan, Spec = plan_builder
    plan = make_plan([Spec(stages=[(0, 3, 0, 1), (3, 6, 1, 1)], microbatches=2)], num_layers=6, f=0, job="deadpeer")
    config = CONFIG.model_copy(update={"job": "deadpeer", "steps": 1000})
    (tmp_path / "config.json").write_text(config.model_dump_json())
    (tmp_path / "plan.json").write_text(plan.to_json())
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    peer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "oobleck.runtime",
            "worker",
            "--config",
            str(tmp_path / "config.json"),
            "--plan",
            str(tmp_path / "plan.json"),
            "--store",
            f"127.0.0.1:{master.port}",
            "--node",
            "n1",
            "--gpu",
            "0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    try:
        survivor = Worker(config, TCPStore("127.0.0.1", master.port, is_master=False), "n0", 0)
        killed_at = []

        def kill_after_step_three(outcome):
            if outcome.step == 2:
                threading.Timer(0.2, lambda: (peer.kill(), killed_at.append(time.monotonic()))).start()

        status, error = run_generation(survivor, plan, until_step=1000, on_step=kill_after_step_three)
        detected = time.monotonic() - killed_at[0]
        print(f"dead peer noticed {detected * 1e3:.0f} ms after kill -9")
        assert status == "failed" and isinstance(error, CommError)
        assert survivor.step >= 3  # the broken step (not applied) is the one to redo
        assert detected < 2.0
    finally:
        peer.kill()
        peer.wait()
