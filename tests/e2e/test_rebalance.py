"""Layers moved off a slow node for real (issue 22, mitigation b): a job of four local nodes in two 2-node
pipelines (the GPU memory the spec allows fits the model on no single node) with
`stragglers.mitigation: rebalance`. One worker pod's processes are held by a CFS quota to half the CPU they
were using (oobleck_dev.cpulimit), then released.

Checked: once the node is a confirmed straggler, a new generation moves layers off it to the other stage of
its pipeline (the layers copied from a rank that held them, no node lost) with a LayersRebalanced event; on
its smaller stage the node still reports a pace (the stage carries its profiled cost) and still reads slow
(its calibration carried over), so it stays confirmed and the layout stays; released, the template's layout
comes back (the layers copied back) and stays; no oscillation: at most a handful of generations in all; the
job ends Succeeded with every step's loss equal to the single-process reference, through both layout changes.
"""

from __future__ import annotations

import time

import pytest

from oobleck_dev import cpulimit

from .test_stragglers import paced_steps, stragglers

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.xdist_group("local-node-jobs-2")]
LOCAL_NODES = {"nodes": 4, "gpus_per_node": 1, "cpu": "4", "memory": "16Gi"}
NODES = 4
STEPS = 400
WINDOW = 10
THRESHOLD = 1.5
CARRIED_SLOW = 1.2
"""The moved node's own median slowdown must stay over this: its calibration carried, it reads slow (on this
loaded host the figures of a balanced node wobble around 1.5-2)."""
HELD_S = 20
"""Seconds the moved layout must hold while the node stays slow (several operator reads, many steps)."""
MAX_GENERATIONS = 5
"""Generation 0, the move (perhaps a re-split before it, if the price chose one first, and one more for a
neighbour the loaded host slowed too), the way back: more would be a mitigation undone and redone."""


def bounds(plan) -> list[list[tuple[str, int, int]]]:
    return [[(s.node, s.start, s.end) for s in p.stages] for p in plan.pipelines]


def test_a_straggler_s_layers_move_to_its_pipeline_peer_and_back_with_exact_losses(job_run) -> None:
    if (why := cpulimit.available()) is not None:
        pytest.skip(why)
    run = job_run
    spec = run.job_spec(STEPS, nodes=NODES)
    spec["nodes"]["min"] = NODES
    spec["training"]["globalBatchSize"] = 16  # 8 microbatches per pipeline
    spec["model"]["gpt"].update({"hiddenSize": 128, "sequenceLength": 64})  # compute, not noise, per step
    # ~13 MB of state and ~1.3 MB of activations per block and microbatch: two stages per pipeline, and
    # room for one more block on a stage.
    spec["gpuMemory"] = "15Mi"
    spec["stragglers"] = {"threshold": THRESHOLD, "window": WINDOW, "mitigation": "rebalance"}
    run.apply(spec)
    pods = run.wait_for(
        lambda: len(p := [w["metadata"]["name"] for w in run._worker_pods()]) == NODES and sorted(p),
        "four worker pods",
    )
    first = run.wait_for(run.plan, "generation 0")
    assert all(len(p.stages) == 2 for p in first.pipelines), bounds(first)
    run.wait_for(lambda: paced_steps(run, pods) >= 20, "every node's pace")
    assert run.plan().generation == first.generation, f"a generation with nothing slow: {run.plan().reason}"

    # The stage with the most layers (the measured profile, and so the template, varies from run to run):
    # the one with layers to spare.
    pipeline, heaviest = max(
        ((p, s) for p in first.pipelines for s in p.stages), key=lambda ps: (ps[1].end - ps[1].start, ps[0].index)
    )
    slow, held = heaviest.node, heaviest.end - heaviest.start
    before, began = run.agent.pod_cpu_seconds(run.ns, slow), time.monotonic()
    time.sleep(3)
    rate = (run.agent.pod_cpu_seconds(run.ns, slow) - before) / (time.monotonic() - began)
    assert run.agent.throttle_cpu(run.ns, slow, rate / 2), f"no process of {slow} held"

    moved = run.wait_for(
        lambda: (plan := run.plan()).reason.startswith("layers moved") and plan, "layers moved off the slow node", 300
    )
    stage = next(s for p in moved.pipelines for s in p.stages if s.node == slow)
    print(f"{slow} held to {rate / 2:.3f} CPUs; generation {moved.generation}: {bounds(moved)}; {moved.reason}")
    assert stage.end - stage.start < held, bounds(moved)
    assert stage.forward_ms is not None  # its profiled cost, for its pace
    assert moved.copies and not moved.lost_nodes and {c.dst_node for c in moved.copies} <= set(pipeline.nodes)
    assert run.events("LayersRebalanced")

    # Still slow on its smaller stage: it reports a pace there (figures of steps it ran on that stage only)
    # and reads slow (a node that recalibrated there would read 1); the layout holds.
    moved_at = run.progress(slow).get("step", 0)

    def slow_on_the_moved_stage() -> list[list[float]] | None:
        progress = run.progress(slow)
        pace = [p for p in progress.get("pace") or () if p[0] > moved_at]
        return pace if progress.get("generation") == moved.generation and len(pace) >= WINDOW else None

    pace = run.wait_for(slow_on_the_moved_stage, f"{slow}'s pace on its moved stage", 240)
    print(f"{slow}'s own slowdown on its moved stage: {[figure for _, figure in pace]}")
    assert sorted(figure for _, figure in pace)[len(pace) // 2] >= CARRIED_SLOW, pace
    assert slow in [s["node"] for s in stragglers(run)], stragglers(run)
    time.sleep(HELD_S)
    # Kept: the layers stay off the node (its figure on the smaller stage may differ enough, REPLAN_FACTOR,
    # for one more plan around it; measured: 3.4x before the move, 6.9x after).
    still = run.plan()
    kept = next(s for p in still.pipelines for s in p.stages if s.node == slow)
    assert still.generation <= moved.generation + 1 and kept.end - kept.start < held, (still.reason, bounds(still))

    run.agent.throttle_cpu(run.ns, slow, None)
    back = run.wait_for(
        lambda: "(all at pace)" in (plan := run.plan()).reason and plan, "the template's layout again", 300
    )
    print(f"back at generation {back.generation}: {bounds(back)}; generations seen {run.generations_seen}")
    assert bounds(back) == bounds(first) and {c.dst_node for c in back.copies} == {slow}
    run.wait_succeeded()
    assert run.plan().generation == back.generation, f"a generation after the way back: {run.plan().reason}"
    assert back.generation - first.generation + 1 <= MAX_GENERATIONS, run.generations_seen
    assert run.check_losses() >= STEPS
