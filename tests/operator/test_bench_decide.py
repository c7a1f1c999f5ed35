"""`stragglers.mitigation: spare` in decide(): a node at 1/4 of its speed is taken out of training and kept as
a warm spare, taken back after its back-off, benched again at once while still slow (with a longer back-off),
and kept once it computes at pace again."""

from __future__ import annotations

import json
from dataclasses import replace

from oobleck.api.profile import LayerProfile, ModelProfile
from oobleck.operator.stragglers import BENCHED_READMITTED, STRAGGLER_BENCHED, dwell_until

from .test_decide import World
from .test_rebalance_decide import WINDOW, Reports

MIB = 1 << 20


def _spec(h):
    return h.spec(
        # 10 blocks + embedding + head: the 12 layers of PROFILE
        model={"gpt": {"layers": 10, "hiddenSize": 64, "heads": 4, "sequenceLength": 32, "vocabSize": 256}},
        nodes={"min": 2, "max": 4},
        training={"steps": 1000, "globalBatchSize": 64, "microbatchSize": 2},
        gpuMemory=str(int(8.2 * MIB)),  # 7 of PROFILE's layers fit on a GPU, 8 do not: two 2-node pipelines
        stragglers={"threshold": 1.5, "window": WINDOW, "mitigation": "spare"},
    )


PROFILE = ModelProfile(
    model="even12",
    microbatch_size=2,
    layers=[
        LayerProfile(forward_ms=1.0, backward_ms=2.0, state_bytes=MIB, activation_bytes=1 << 16, output_bytes=1 << 10)
        for _ in range(12)
    ],
)
"""as tests/planner/test_bench.py's: the price benches a node at 1/4 (a profiled model, not the synthetic
estimate of a model this small, whose few microseconds a step no copy would ever pay for)"""


class BenchReports(Reports):
    """Reports as the runtime makes them: a benched worker's pace history is dropped (Worker.bench)."""

    def run(self, steps: int, paces: dict[str, float]):
        decisions = []
        for _ in range(steps):
            for node in self.history:
                if node not in self.world.current.plan.nodes:
                    self.history[node] = []
            decisions += super().run(1, paces)
        return decisions

    def until(self, done, paces: dict[str, float], limit: int = 200):
        """Steps at these paces until `done(plan)` holds for the plan in force (at most `limit`): the decisions."""
        decisions = []
        while not done(self.world.current.plan):
            assert len(decisions) < limit, self.world.current.plan.reason
            decisions += self.run(1, paces)
        return decisions


def _world(h) -> World:
    world = World(h, _spec(h), n_nodes=4)
    world.profile = PROFILE
    world.settle()
    return world


def _reasons(decisions) -> list[str]:
    return [e.reason for d in decisions for e in d.events if e.reason in (STRAGGLER_BENCHED, BENCHED_READMITTED)]


def test_a_quarter_speed_node_waits_as_a_spare_and_comes_back_once_at_pace(h):
    world = _world(h)
    first = world.current.plan
    assert [len(p.nodes) for p in first.pipelines] == [2, 2]
    slow = first.pipelines[1].stages[0].node
    pods = set(world.pods)
    reports = BenchReports(world)
    reports.run(3 * WINDOW, {})
    assert world.current.plan.generation == first.generation

    # At 1/4: confirmed after the window, then benched; its pod stays, a spare in the status.
    decisions = reports.until(lambda plan: plan.generation > first.generation, {slow: 4.0})
    benched = world.current.plan
    assert benched.reason.startswith("slow node benched"), benched.reason
    assert benched.benched == {slow: 4.0} and slow not in benched.nodes and len(benched.nodes) == 3
    assert benched.mitigations == 1 and _reasons(decisions) == [STRAGGLER_BENCHED]
    assert len(decisions) <= 2 * WINDOW + 1  # the window, and the calibration before it
    reports.run(1, {slow: 4.0})  # the status of the next pass reads the new plan
    assert set(world.pods) == pods and world.status.spares == 1 and world.status.spare_pods == [slow]

    # Its back-off (window steps for the first straggler plan): no pod joins, nothing changes before.
    decisions = reports.until(lambda plan: plan.generation > benched.generation, {slow: 4.0})
    assert reports.step >= dwell_until(benched, world.spec.stragglers) and set(world.pods) == pods
    # Then taken back: the probe.
    back = world.current.plan
    assert back.reason.startswith("benched node taken back") and slow in back.nodes and not back.benched
    assert {c.dst_node for c in back.copies} >= {slow} and _reasons(decisions) == [BENCHED_READMITTED]
    # Still slow: benched again as soon as it is confirmed, without waiting for the probe's back-off.
    decisions = reports.until(lambda plan: plan.generation > back.generation, {slow: 4.0})
    again = world.current.plan
    assert again.benched == {slow: 4.0} and again.mitigations == 3, again.reason
    assert again.mitigation_step < dwell_until(back, world.spec.stragglers), (len(decisions), again.mitigation_step)
    # A longer back-off this time: window x 2^(3-1).
    assert dwell_until(again, world.spec.stragglers) - again.mitigation_step == 4 * WINDOW

    # At pace again (released): taken back after the back-off, and it stays.
    reports.until(lambda plan: plan.generation > again.generation, {})
    home = world.current.plan
    assert slow in home.nodes and not home.benched and reports.step >= again.mitigation_step + 4 * WINDOW
    reports.run(6 * WINDOW, {})
    assert world.current.plan.generation == home.generation, world.current.plan.reason
    assert set(world.pods) == pods and world.status.spares == 0


def test_a_warm_spare_takes_the_benched_nodes_place_in_the_same_generation(h):
    spec = _spec(h)
    world = World(h, spec.model_copy(update={"nodes": spec.nodes.model_copy(update={"spares": 1})}), n_nodes=5)
    world.profile = PROFILE
    world.settle()
    first = world.current.plan
    (spare,) = [name for name in world.pods if name != "c" and name not in first.nodes]
    world.pods[spare] = replace(world.pods[spare], progress=json.dumps({"generation": -1, "step": 0}))  # up
    slow = first.pipelines[1].stages[0].node
    reports = BenchReports(world)
    reports.until(lambda plan: plan.generation > first.generation, {slow: 4.0})
    swapped = world.current.plan
    assert swapped.benched == {slow: 4.0} and spare in swapped.added_nodes, swapped.reason
    assert spare in swapped.nodes and slow not in swapped.nodes and len(swapped.nodes) == 4
    # The benched node is the spare now: kept, never folded in, not taken back while the job is whole.
    reports.run(8 * WINDOW, {})
    assert world.current.plan.generation == swapped.generation, world.current.plan.reason
    assert world.status.spare_pods == [slow] and len(world.pods) == 5 + 1  # + the coordinator
