"""Layers moved off a slow node (planner_cy/rebalance.py): exact stage bounds, real plans, exact copies."""

from __future__ import annotations

import itertools
import random

import pytest

from oobleck.planner.rebalance import rebalance, stage_bounds
from oobleck.planner.resplit import resplit

from .test_resplit import PROFILE, two_by_two

STATE = [layer.state_bytes for layer in PROFILE.layers]


def _brute(layer_ms, factors, fits=lambda i, a, b: True):
    """Every contiguous split into len(factors) stages: the least (bottleneck, sum)."""
    n, k = len(layer_ms), len(factors)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = list(zip((0, *cuts), (*cuts, n)))
        if not all(fits(i, a, b) for i, (a, b) in enumerate(bounds)):
            continue
        stages = [f * sum(layer_ms[a:b]) for f, (a, b) in zip(factors, bounds)]
        key = (max(stages), sum(stages))
        best = key if best is None or key < best else best
    return best


@pytest.mark.parametrize("seed", range(40))
def test_stage_bounds_are_the_least_bottleneck_then_the_least_sum(seed):
    rng = random.Random(seed)
    n, k = rng.randint(1, 9), rng.randint(1, 4)
    layer_ms = [rng.choice([0.5, 1.0, 2.0, 3.0]) * rng.randint(1, 4) for _ in range(n)]
    factors = [rng.choice([1.0, 1.0, 2.0, 4.0, 1.5]) for _ in range(k)]
    limit = rng.choice([None, 3, 4])
    fits = (lambda i, a, b: True) if limit is None else (lambda i, a, b: b - a <= limit + i)
    bounds = stage_bounds(layer_ms, factors, fits=fits)
    expected = _brute(layer_ms, factors, fits) if k <= n else None
    if expected is None:
        assert bounds is None
        return
    assert bounds is not None and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a < b for a, b in bounds) and all(x[1] == y[0] for x, y in zip(bounds, bounds[1:]))
    stages = [f * sum(layer_ms[a:b]) for f, (a, b) in zip(factors, bounds)]
    assert max(stages) == pytest.approx(expected[0]) and sum(stages) == pytest.approx(expected[1])


def test_a_node_at_half_speed_carries_a_third_of_its_pipelines_layers_and_they_are_copied():
    plan = two_by_two()
    after = rebalance(plan, PROFILE, {"c": 2.0})
    assert after is not None and after.generation == plan.generation + 1 and not after.lost_nodes
    fast, slow = after.pipelines
    assert [(s.start, s.end) for s in fast.stages] == [(s.start, s.end) for s in plan.pipelines[0].stages]
    c, d = slow.stages
    assert c.node == "c" and d.node == "d" and (c.end - c.start, d.end - d.start) == (2, 6)
    # 2 or 3 layers on c both leave an 18 ms bottleneck (2 x 3 x 3 ms, 6 x 3 ms): 2 fills and drains faster.
    assert [s.ranks for s in slow.stages] == [s.ranks for s in plan.pipelines[1].stages]
    # d gains layers 2 and 3 (c's before), copied from ranks that held them, with their state bytes.
    gained = sorted((x.layer, x.dst_node, x.bytes) for x in after.copies)
    assert gained == [(2, "d", STATE[2]), (3, "d", STATE[3])]
    assert {x.src_node for x in after.copies} <= {"a", "b", "c"}
    # The batch re-split over the new costs beats the re-split alone.
    only_split = resplit(plan, {"c": 2.0})
    assert only_split is not None and after.iteration_ms < only_split.iteration_ms
    assert "layers moved" in after.reason and "'c': 2.0" in after.reason
    # Already so: nothing. Recovered: the template's bounds and split again, the layers copied back.
    assert rebalance(after, PROFILE, {"c": 2.0}) is None
    back = rebalance(after, PROFILE, {})
    assert back is not None
    assert [[(s.start, s.end) for s in p.stages] for p in back.pipelines] == [
        [(s.start, s.end) for s in p.stages] for p in plan.pipelines
    ]
    assert [p.microbatches for p in back.pipelines] == [16, 16] and sorted(
        (x.layer, x.dst_node) for x in back.copies
    ) == [(2, "c"), (3, "c")]
    assert rebalance(plan, PROFILE, {}) is None


def test_a_small_gain_or_a_layer_that_does_not_fit_moves_nothing():
    plan = two_by_two()
    assert rebalance(plan, PROFILE, {"c": 1.05}, min_gain=0.1) is None
    # 1 MiB of state and 64 KiB of activations per layer; the first stage keeps 2 microbatches in flight,
    # the second 1: with 4.6 MiB per GPU d fits 4 layers (4.25 MiB), not 5 (5.3): only the batch moves.
    after = rebalance(plan, PROFILE, {"c": 2.0}, gpu_memory_bytes=int(4.6 * (1 << 20)))
    assert after is not None and after.copies == [] and after.reason.startswith("batch re-split")
    assert [(s.start, s.end) for s in after.pipelines[1].stages] == [(0, 4), (4, 8)]


def test_the_cost_model_reaches_the_ideal_at_half_and_quarter_speed_where_the_re_split_does_not():
    """Issue 22's figure of merit, in the planner's own cost model: throughput against the ideal
    (the unthrottled job x the sum of node speeds / nodes), one node of four slow."""
    plan = two_by_two()
    base = plan.global_microbatches / plan.iteration_ms
    for slowdown in (2.0, 4.0):
        ideal = base * (3 + 1 / slowdown) / 4
        split = resplit(plan, {"c": slowdown})
        moved = rebalance(plan, PROFILE, {"c": slowdown})
        assert split is not None and moved is not None
        by_split = plan.global_microbatches / split.iteration_ms / ideal
        by_moving = plan.global_microbatches / moved.iteration_ms / ideal
        assert by_moving >= 0.9 > by_split, (slowdown, by_split, by_moving)


def test_the_price_picks_moving_layers_unless_their_copies_cost_more_than_the_horizon_gains():
    """mitigate: copy time + horizon x step time at the measured speeds, the cheaper of (a) and (b)."""
    from oobleck.planner.rebalance import copy_ms, mitigate, step_ms

    plan = two_by_two()
    slow = {"c": 2.0}
    split, moved = resplit(plan, slow), rebalance(plan, PROFILE, slow)
    assert split is not None and moved is not None and moved.copies and not split.copies
    assert step_ms(moved, PROFILE, slow) < step_ms(split, PROFILE, slow) < step_ms(plan, PROFILE, slow)
    fast = mitigate(plan, PROFILE, slow, 0.1, bandwidth=25e9, horizon=100)
    assert fast is not None and fast.reason.startswith("layers moved") and fast.copies == moved.copies
    # Copies over a link so slow that they cost more than 100 steps' gain: the re-split, nothing moved.
    gain = 100 * (step_ms(split, PROFILE, slow) - step_ms(moved, PROFILE, slow))
    bandwidth = copy_ms(moved, 1.0) / gain / 2
    assert copy_ms(moved, bandwidth) == pytest.approx(2 * gain)
    crawl = mitigate(plan, PROFILE, slow, 0.1, bandwidth=bandwidth, horizon=100)
    assert crawl is not None and crawl.reason.startswith("batch re-split") and not crawl.copies
    # Nothing gains a tenth: nothing.
    assert mitigate(plan, PROFILE, {"c": 1.05}, 0.1, bandwidth=25e9, horizon=100) is None
