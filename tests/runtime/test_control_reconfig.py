"""The pieces of the reconfiguration loop that need no worker: step commits and the copy plan."""

from __future__ import annotations

import random
import threading

import pytest

from oobleck.api.plan import Pipeline, Plan, RankAssignment, Stage, Template, TemplateStage
from oobleck.planner.errors import PlanningError
from oobleck.runtime.coordinator import Coordinator, StoreTimeouts
from oobleck.runtime.launcher import copy_plan, layout_holdings, replan
from oobleck.runtime.reconfig import ControlStore, StepCommit

FAST = StoreTimeouts(connect_s=5.0, op_s=2.0, reconnect_s=30.0, retry_s=0.02)


def _decide_all(
    port: int, world: int, arrive: list[int], failed: threading.Event, delay=lambda r: 0.0
) -> dict[int, bool]:
    """Ranks in `arrive` try to commit step 7 of generation 1; returns each one's decision."""
    decisions: dict[int, bool] = {}
    # Workers are connected long before a step ends: connecting is not part of the race.
    controls = {rank: ControlStore("127.0.0.1", port, FAST) for rank in arrive}

    def run(rank: int) -> None:
        threading.Event().wait(delay(rank))
        decisions[rank] = StepCommit(controls[rank], failed, poll_s=0.01).decide(1, world, 7)

    threads = [threading.Thread(target=run, args=(r,)) for r in arrive]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    return decisions


def test_every_rank_commits_when_all_arrive():
    with Coordinator() as coordinator:
        decisions = _decide_all(coordinator.port, 4, [0, 1, 2, 3], threading.Event())
    assert decisions == {0: True, 1: True, 2: True, 3: True}


def test_a_missing_rank_and_a_failure_abort_the_step_for_everyone():
    failed = threading.Event()
    with Coordinator() as coordinator:
        threading.Timer(0.3, failed.set).start()
        decisions = _decide_all(coordinator.port, 4, [0, 1, 3], failed)
    assert decisions == {0: False, 1: False, 3: False}


@pytest.mark.parametrize("seed", range(5))
def test_commit_and_abort_racing_still_agree(seed):
    """The failure fires around the moment the last rank arrives: whatever wins, all ranks agree."""
    rng = random.Random(seed)
    failed = threading.Event()
    with Coordinator() as coordinator:
        threading.Timer(0.05, failed.set).start()
        decisions = _decide_all(coordinator.port, 4, [0, 1, 2, 3], failed, delay=lambda r: rng.uniform(0, 0.1))
    assert len(decisions) == 4 and len(set(decisions.values())) == 1, decisions


def _plan(generation: int, pipelines: list[list[tuple[str, int, int]]], f: int = 1) -> Plan:
    """Pipelines as lists of (node, start, end) stages, one GPU per node."""
    ranks, out, offset = [], [], 0
    for index, stages in enumerate(pipelines):
        built = []
        for stage_index, (node, start, end) in enumerate(stages):
            ranks.append(RankAssignment(rank=len(ranks), node=node, gpu=0, pipeline=index, stage=stage_index,
                                        start=start, end=end))
            built.append(Stage(start=start, end=end, ranks=[len(ranks) - 1]))
        out.append(Pipeline(index=index, template_nodes=len(stages), nodes=[n for n, _, _ in stages], microbatches=2,
                            microbatch_offset=offset, stages=built, iteration_ms=1))
        offset += 2
    templates = [
        Template(nodes=1, stages=[TemplateStage(start=0, end=4, node=0, gpus=1, gpu_offset=0, forward_ms=4,
                                                backward_ms=8)], iteration_ms=24, m_ref=2),
        Template(nodes=2, stages=[TemplateStage(start=0, end=2, node=0, gpus=1, gpu_offset=0, forward_ms=2,
                                                backward_ms=4),
                                  TemplateStage(start=2, end=4, node=1, gpus=1, gpu_offset=0, forward_ms=2,
                                                backward_ms=4)], iteration_ms=18, m_ref=2),
    ]
    return Plan(job="j", generation=generation, num_layers=4, gpus_per_node=1, f=f, global_microbatches=offset,
                templates=templates, pipelines=out, ranks=ranks, iteration_ms=1)


def test_copy_plan_sends_every_missing_layer_from_a_holder_spreading_the_load():
    new = _plan(1, [[("a", 0, 4)], [("b", 0, 4)], [("c", 0, 4)]])
    holdings = {"a:0": {0, 1, 2, 3}, "b:0": {0, 1}, "c:0": {2, 3}}
    copies = copy_plan(new, holdings, [10, 10, 10, 10])
    assert sorted((c.layer, c.dst_node) for c in copies) == [(0, "c"), (1, "c"), (2, "b"), (3, "b")]
    sources = [c.src_node for c in copies]
    assert all(holdings[f"{c.src_node}:0"] >= {c.layer} for c in copies)
    assert sources.count("a") < len(copies), "every copy from one holder: the load is not spread"
    for copy in copies:
        assert new.ranks[copy.src_rank].node == copy.src_node and new.ranks[copy.dst_rank].node == copy.dst_node
        assert copy.bytes == 10


def test_copy_plan_refuses_a_layer_nobody_holds():
    new = _plan(1, [[("a", 0, 4)]])
    with pytest.raises(PlanningError, match="layer 3: no surviving worker holds it"):
        copy_plan(new, {"a:0": {0, 1, 2}}, [1, 1, 1, 1])


def test_replan_after_losing_a_node_keeps_the_batch_and_moves_layers():
    previous = _plan(4, [[("a", 0, 2), ("b", 2, 4)], [("c", 0, 2), ("d", 2, 4)]])
    holdings = {w: layers for w, layers in layout_holdings(previous).items() if not w.startswith("b")}
    plan = replan(previous, ["a", "c", "d"], holdings, [5, 5, 5, 5], lost=["b"], reason="shrink")
    assert plan.generation == 5 and plan.lost_nodes == ["b"] and plan.reason == "shrink"
    assert plan.global_microbatches == previous.global_microbatches
    assert sorted(plan.nodes) == ["a", "c", "d"]
    for assignment in plan.ranks:  # after the copies, every rank holds what the plan assigns it
        me = f"{assignment.node}:{assignment.gpu}"
        after = holdings[me] | {c.layer for c in plan.copies if c.dst_rank == assignment.rank}
        assert set(range(assignment.start, assignment.end)) <= after
