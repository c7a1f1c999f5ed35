"""The pieces of the reconfiguration loop that need no worker: step commits and the copy plan."""

from __future__ import annotations

import random
import threading

import pytest

from oobleck.api.plan import Pipeline, Plan, Stage, Template, TemplateStage
from oobleck.planner.errors import PlanningError
from oobleck.runtime.backends.local.plan_control import copy_plan, layout_holdings, replan
from oobleck.runtime.elastic.commit import StepCommit
from oobleck.runtime.elastic.coordinator import Coordinator
from oobleck.runtime.elastic.store import ControlStore, FixedEndpoint, StoreTimeouts

FAST = StoreTimeouts(connect_s=5.0, op_s=2.0, reconnect_s=30.0, retry_s=0.02)


def _decide_all(
    port: int, world: int, arrive: list[int], failed: threading.Event, delay=lambda r: 0.0
) -> dict[int, bool]:
    """Ranks in `arrive` try to commit step 7 of generation 1; returns each one's decision."""
    decisions: dict[int, bool] = {}
    # Workers are connected long before a step ends: connecting is not part of the race.
    controls = {rank: ControlStore(FixedEndpoint("127.0.0.1", port), FAST) for rank in arrive}

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


def test_peek_reads_a_decision_in_one_round_trip_and_never_writes():
    """The waiting ranks' read of a commit decision (keys.peek): absent, empty and present values, through the
    coordinator's real store, and the key is left exactly as it was."""
    from oobleck.runtime.elastic import keys

    with Coordinator() as coordinator:
        store = ControlStore(FixedEndpoint("127.0.0.1", coordinator.port), FAST).store
        assert keys.peek(store, "k") is None and not store.check(["k"])  # absent: not created either
        store.set("k", "")
        assert keys.peek(store, "k") == b""
        store.set("k", "commit")
        assert keys.peek(store, "k") == b"commit" and store.get("k") == b"commit"
        assert keys.read_decision(store, 1, 7) is None  # not decided yet
        assert keys.propose_decision(store, 1, 7, "abort") == "abort"
        assert keys.read_decision(store, 1, 7) == "abort"


@pytest.mark.parametrize("seed", range(5))
def test_commit_and_abort_racing_still_agree(seed):
    """The failure fires around the moment the last rank arrives: whatever wins, all ranks agree."""
    rng = random.Random(seed)
    failed = threading.Event()
    with Coordinator() as coordinator:
        threading.Timer(0.05, failed.set).start()
        decisions = _decide_all(coordinator.port, 4, [0, 1, 2, 3], failed, delay=lambda r: rng.uniform(0, 0.1))
    assert len(decisions) == 4 and len(set(decisions.values())) == 1, decisions


@pytest.mark.parametrize("world", [1, 3])
def test_consecutive_commits_drop_the_keys_of_steps_every_rank_is_past(world):
    """Steps 0..5 commit; each step's keys go once every rank is past their decision (two steps on),
    so a long job's store stays small; the two newest steps' keys remain."""
    from oobleck.runtime.elastic import keys

    # The test's own reads connect with the coordinator's op timeout: 5 s was once too short under CI's load.
    with Coordinator(op_timeout_s=30.0) as coordinator:
        controls = [ControlStore(FixedEndpoint("127.0.0.1", coordinator.port), FAST) for _ in range(world)]
        decisions: dict[int, list[bool]] = {}

        def run(rank: int) -> None:
            commit = StepCommit(controls[rank], threading.Event(), poll_s=0.01)
            decisions[rank] = [commit.decide(1, world, step) for step in range(6)]

        threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert decisions == {r: [True] * 6 for r in range(world)}
        store = coordinator.store()
        present = {step: store.check([keys.commit_prefix(1, step) + "decision"]) for step in range(6)}
        assert present == {0: False, 1: False, 2: False, 3: False, 4: True, 5: True}
        assert not any(store.check([keys.commit_prefix(1, step) + "arrived"]) for step in range(4))


def _plan(generation: int, pipelines: list[list[tuple[str, int, int]]], f: int = 1) -> Plan:
    """Pipelines as lists of (node, start, end) stages, one GPU per node."""
    rank, out, offset = 0, [], 0
    for index, stages in enumerate(pipelines):
        built = []
        for node, start, end in stages:
            built.append(Stage(start=start, end=end, node=node, gpus=[0], ranks=[rank]))
            rank += 1
        out.append(
            Pipeline(
                index=index,
                template_nodes=len(stages),
                nodes=[n for n, _, _ in stages],
                microbatches=2,
                microbatch_offset=offset,
                stages=built,
                iteration_ms=1,
            )
        )
        offset += 2
    templates = [
        Template(
            nodes=1,
            stages=[TemplateStage(start=0, end=4, node=0, gpus=1, gpu_offset=0, forward_ms=4, backward_ms=8)],
            iteration_ms=24,
            m_ref=2,
        ),
        Template(
            nodes=2,
            stages=[
                TemplateStage(start=0, end=2, node=0, gpus=1, gpu_offset=0, forward_ms=2, backward_ms=4),
                TemplateStage(start=2, end=4, node=1, gpus=1, gpu_offset=0, forward_ms=2, backward_ms=4),
            ],
            iteration_ms=18,
            m_ref=2,
        ),
    ]
    return Plan(
        job="j",
        generation=generation,
        num_layers=4,
        gpus_per_node=1,
        f=f,
        global_microbatches=offset,
        templates=templates,
        pipelines=out,
        iteration_ms=1,
    )


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


@pytest.mark.parametrize("peer_applied", [True, False])
def test_a_pending_rank_decides_itself_when_no_controller_reposts(peer_applied):
    """The coordinator was lost while node0:0 waited for step 7's decision; nobody re-posts it (the
    operator cannot read the store). After self_decide_s it posts the verdict the peers' reports imply."""
    import json

    from oobleck.runtime.elastic import keys

    with Coordinator() as coordinator:
        control = ControlStore(FixedEndpoint("127.0.0.1", coordinator.port), FAST)
        store = coordinator.store()
        step = 8 if peer_applied else 7  # node1:0 left generation 1 with step 7 applied (8) or not (7)
        store.set(keys.held_key("node1:0"), json.dumps({"generation": 1, "step": step, "layers": [0], "phase": "left"}))
        commit = StepCommit(control, threading.Event(), worker="node0:0", poll_s=0.01, self_decide_s=0.2)
        commit.members = ("node0:0", "node1:0")
        assert commit._recover(1, 7) is peer_applied
        assert json.loads(store.get(keys.held_key("node0:0")))["phase"] == "pending"
        # A decision already posted (by the launcher, or another pending rank) is followed as is.
        other = StepCommit(control, threading.Event(), worker="node2:0", poll_s=0.01, self_decide_s=0.2)
        assert other._recover(1, 7) is peer_applied
