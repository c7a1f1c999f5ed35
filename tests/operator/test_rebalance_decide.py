"""`stragglers.mitigation: rebalance` in decide(): layers moved off a confirmed straggler, kept while it stays
slow whatever its figures wobble, and given back once it is at pace again, one generation each way."""

from __future__ import annotations

import json
from dataclasses import replace

from oobleck.operator.stragglers import LAYERS_REBALANCED, RECOVERED

from .test_decide import World

WINDOW = 4


def _spec(h):
    return h.spec(
        model={"gpt": {"layers": 8, "hiddenSize": 64, "heads": 4, "sequenceLength": 32, "vocabSize": 256}},
        nodes={"min": 4, "max": 4},
        training={"steps": 1000, "globalBatchSize": 16, "microbatchSize": 2},
        gpuMemory="8Mi",  # two 2-node pipelines: the model's ~7 MB of state does not fit on one GPU
        stragglers={"threshold": 1.5, "window": WINDOW, "mitigation": "rebalance"},
    )


class Reports:
    """The members' pace reports of the plan in force, as the runtime makes them: a stage change drops a
    node's history (runtime/train/pace.py)."""

    def __init__(self, world: World) -> None:
        self.world, self.step = world, 10
        self.history: dict[str, list[list[float]]] = {n: [] for n in world.current.plan.nodes}
        self.stages = self._stages()

    def _stages(self) -> dict[str, tuple[int, int]]:
        return {s.node: (s.start, s.end) for p in self.world.current.plan.pipelines for s in p.stages}

    def run(self, steps: int, paces: dict[str, float], baselines: dict[str, float] | None = None):
        """`steps` more steps at these paces (1 for a node not named), over these calibrated paces (`baselines`:
        1 for a node not named; None: reports without one, as older workers wrote); the decisions, each applied."""
        decisions = []
        for _ in range(steps):
            stages = self._stages()
            for node, stage in stages.items():
                if self.stages.get(node) != stage:
                    self.history[node] = []
            self.stages = stages
            self.step += 1
            plan = self.world.current.plan
            for node in plan.nodes:
                self.history[node] = [*self.history[node], [self.step, paces.get(node, 1.0)]][-24:]
                body = {"generation": plan.generation, "step": self.step, "pace": self.history[node]}
                if baselines is not None:
                    body["paceBaseline"] = baselines.get(node, 1.0)
                self.world.pods[node] = replace(self.world.pods[node], progress=json.dumps(body))
            decisions.append(self.world.step())
            self.world.apply(decisions[-1])
        return decisions


def test_layers_move_off_a_slow_node_stay_through_its_wobbles_and_come_back_once_it_recovers(h):
    world = World(h, _spec(h), n_nodes=4)
    world.settle()
    first = world.current.plan
    pipeline = next(p for p in first.pipelines if len(p.stages) > 1)
    slow = pipeline.stages[0].node
    held = pipeline.stages[0].end - pipeline.stages[0].start
    reports = Reports(world)

    # At pace: nothing changes.
    reports.run(3 * WINDOW, {})
    assert world.current.plan.generation == first.generation

    # Twice as slow: confirmed after the window, then the layers move (the price chose b over a re-split).
    decisions = reports.run(2 * WINDOW + 1, {slow: 2.0})
    moved = world.current.plan
    assert moved.generation == first.generation + 1 and moved.reason.startswith("layers moved"), moved.reason
    assert moved.slowdowns == {slow: 2.0}  # what it was planned around: the straggler's median figure
    assert moved.mitigations == 1 and moved.mitigation_step is not None
    stages = next(p for p in moved.pipelines if p.nodes == pipeline.nodes).stages
    assert stages[0].node == slow and stages[0].end - stages[0].start < held
    assert all(s.forward_ms is not None for s in stages)  # a moved stage carries its profiled cost
    assert moved.copies and {c.dst_node for c in moved.copies} <= set(pipeline.nodes) - {slow}
    assert [e.reason for d in decisions for e in d.events].count(LAYERS_REBALANCED) == 1

    # Still slow on the smaller stage (the calibration carried), its figure wobbling: no new generation.
    for pace in (2.0, 1.8, 2.3, 1.9, 2.2, 2.0):
        reports.run(WINDOW, {slow: pace})
    assert world.current.plan.generation == moved.generation

    # At pace again: a figure or a few under the threshold are not enough ...
    reports.run(WINDOW - 1, {})
    assert world.current.plan.generation == moved.generation
    # ... a window's worth is: the template's layout again, the layers copied back to the node.
    decisions = reports.run(1, {})
    back = world.current.plan
    assert back.generation == moved.generation + 1, back.reason
    assert [[(s.start, s.end) for s in p.stages] for p in back.pipelines] == [
        [(s.start, s.end) for s in p.stages] for p in first.pipelines
    ]
    assert all(s.forward_ms is None for p in back.pipelines for s in p.stages)
    assert {c.dst_node for c in back.copies} == {slow}
    assert back.mitigations == 2 and not back.slowdowns
    # Released as it was confirmed, a window after its last slow figure: in the same decision.
    assert [e.reason for d in decisions for e in d.events] == [RECOVERED, LAYERS_REBALANCED]

    # And it stays there.
    reports.run(4 * WINDOW, {})
    assert world.current.plan.generation == back.generation


def test_a_node_slow_from_its_start_keeps_its_layers_moved_while_slow_though_no_node_shares_its_layers(h):
    """Slow from its first step, a node reads 1x against its own pace and 2x against the node on its layers.
    Once layers moved, no node runs the same layers: it is measured by its own pace times its anchor (how far
    its pace was off its peer's), so the layers stay moved while it stays slow, and come back once it is at
    its peers' pace (twice as fast as it calibrated)."""
    world = World(h, _spec(h), n_nodes=4)
    world.settle()
    first = world.current.plan
    pipeline = next(p for p in first.pipelines if len(p.stages) > 1)
    slow = pipeline.stages[0].node
    reports = Reports(world)
    slow_start = {slow: 2.0}  # its calibrated pace: twice its peer's compute per profiled cost

    reports.run(2 * WINDOW + 1, {}, slow_start)
    moved = world.current.plan
    assert moved.generation == first.generation + 1 and moved.reason.startswith("layers moved"), moved.reason
    assert moved.slowdowns == {slow: 2.0} and moved.pace_anchors[slow] == 2.0
    assert all(len({(s.start, s.end) for s in p.stages}) == len(p.stages) for p in moved.pipelines)
    # As slow as it calibrated (1x against itself), for many windows: the layers stay moved.
    reports.run(10 * WINDOW, {}, slow_start)
    assert world.current.plan.generation == moved.generation, world.current.plan.reason
    # At its peers' pace: half its calibrated figure. The template's layout again, once.
    reports.run(2 * WINDOW, {slow: 0.5}, slow_start)
    back = world.current.plan
    assert back.generation == moved.generation + 1 and not back.slowdowns, back.reason
    reports.run(4 * WINDOW, {slow: 0.5}, slow_start)
    assert world.current.plan.generation == back.generation


def _resplit_world(h):
    """A settled job with `mitigation: resplit`, its first plan and a node of a 2-node pipeline to slow."""
    spec = _spec(h)
    world = World(
        h, spec.model_copy(update={"stragglers": spec.stragglers.model_copy(update={"mitigation": "resplit"})})
    )
    world.settle()
    first = world.current.plan
    return world, first, next(p for p in first.pipelines if len(p.stages) > 1).stages[0].node


def test_the_resplit_mitigation_never_moves_layers(h):
    world, first, slow = _resplit_world(h)
    reports = Reports(world)
    reports.run(3 * WINDOW, {slow: 2.0})
    split = world.current.plan
    assert split.generation == first.generation + 1 and split.reason.startswith("batch re-split"), split.reason
    assert not split.copies and all(s.forward_ms is None for p in split.pipelines for s in p.stages)


def test_a_resplit_stays_while_the_figure_wobbles_across_the_split_points(h):
    """As a real-node run showed with the default `resplit`: a node about 2x slower read 1.6x to 2.6x window
    by window, and each figure alone called for the other of [3, 5] and [2, 6] (8 generations in 20 s). Here
    [2, 6] is best from 1.7x to 2.5x, [3, 5] under and [1, 7] over: without the hysteresis each window
    below made a generation."""
    world, first, slow = _resplit_world(h)
    reports = Reports(world)
    reports.run(2 * WINDOW + 1, {slow: 2.0})
    split = world.current.plan
    assert split.generation == first.generation + 1 and split.reason.startswith("batch re-split"), split.reason
    assert split.mitigations == 1 and split.slowdowns == {slow: 2.0}
    for _ in range(4):
        for pace in (1.55, 3.0, 1.6, 2.9):
            reports.run(WINDOW, {slow: pace})
    assert world.current.plan.generation == split.generation, world.current.plan.reason
    # At pace again for a window: the profile's split, in one generation.
    reports.run(2 * WINDOW, {})
    back = world.current.plan
    assert back.generation == split.generation + 1 and not back.slowdowns, back.reason
    assert [p.microbatches for p in back.pipelines] == [p.microbatches for p in first.pipelines]


def test_a_speed_that_wobbles_widely_makes_one_move_not_one_per_wobble(h):
    """As measured on a loaded host (a CPU quota of 0.1 CPU): 6.3x, then 9.6x, 5.9x, 7.4x, 10.8x a window each.
    Each figure alone would call for another split; the plan must win at both ends of the wobble."""
    world = World(h, _spec(h), n_nodes=4)
    world.settle()
    first = world.current.plan
    slow = next(p for p in first.pipelines if len(p.stages) > 1).stages[0].node
    reports = Reports(world)
    reports.run(2 * WINDOW + 1, {slow: 6.3})
    moved = world.current.plan
    assert moved.generation == first.generation + 1, moved.reason
    for _ in range(3):
        for pace in (9.6, 5.9, 7.4, 10.8):
            reports.run(WINDOW, {slow: pace})
    assert world.current.plan.generation == moved.generation, world.current.plan.reason
    # Slower by more than REPLAN_FACTOR than the figure the plan was made for: made again for the new one.
    reports.run(2 * WINDOW, {slow: 20.0})
    again = world.current.plan
    assert again.generation == moved.generation + 1 and again.slowdowns[slow] > 2 * 6.3, again.reason


def test_each_straggler_plan_stays_twice_as_long_as_the_one_before(h):
    """The back-off that bounds the generations however the figures wobble: a plan made at step 100 after
    n straggler plans stays until step 100 + window x 2^(n-1)."""
    from oobleck.operator.stragglers import dwell_until

    world = World(h, _spec(h), n_nodes=4)
    world.settle()
    plan = world.current.plan
    policy = world.spec.stragglers
    for count, until in ((1, 100 + WINDOW), (2, 100 + 2 * WINDOW), (3, 100 + 4 * WINDOW), (5, 100 + 16 * WINDOW)):
        placed = plan.model_copy(update={"mitigation_step": 100, "mitigations": count})
        assert dwell_until(placed, policy) == until
