"""Around a straggler by moving layers: its pipeline's stage bounds re-chosen for its nodes' measured speeds.

Re-splitting the batch alone (resplit.py) gives a pipeline with a slow node fewer microbatches, but the
slow node still runs a full stage's layers: at half speed one slow node of four leaves the job at about
86 % of the ideal (issue 22). Moving layers off the slow node evens its pipeline out: stage i of a
pipeline costs `f_i * sum(layer_ms[start_i:end_i])`, with `f_i` its node's slowdown over the stage's
GPUs, and the bounds are chosen exactly:

1. the smallest possible bottleneck B* (the slowest stage: what every extra microbatch costs in 1F1B),
2. then, among the bounds whose every stage is at most B*, the smallest sum of stage costs (the fill and
   drain), so T(m) = sum + (m - 1) * B* is the least for large m.

Both are dynamic programs over the layer prefix, O(stages x layers^2). The nodes, GPUs and ranks stay
where they are; only `start`/`end` move, and the layers a rank gains are copied from a rank that holds
them (the reconfiguration's copies: `reconfigure.layout_copies`). Then the batch is re-split over the
pipelines' new costs (the same `split_batch` as resplit). Losses stay exact: the same microbatches in
the same order, whatever rank computes a layer.

A pipeline with no slow node keeps (or returns to) its template's bounds, so once no node is slow the
job is back on the planner's own layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import accumulate

from oobleck.api.plan import Pipeline, Plan, Stage
from oobleck.api.profile import ModelProfile

from .bench import bench
from .instantiate import Engine, TemplateCost, split_batch, template_cost
from .reconfigure import layout_copies
from .resplit import RESPLIT_REASON, pipeline_slowdowns, resplit, with_pipelines

REBALANCE_REASON = "layers moved off slow nodes"

Fits = Callable[[int, int, int], bool]
"""fits(stage, start, end): whether layers [start, end) fit in the memory of the pipeline's stage `stage`"""


def _always(stage: int, start: int, end: int) -> bool:
    return True


def memory_rule(profile: ModelProfile, gpu_memory_bytes: int, pipeline: Pipeline, microbatches: int) -> Fits:
    """The planner's memory rule (planner_cy/templates.py) for the stages of `pipeline` running `microbatches`:
    stage s (0-based) of S keeps min(S - s, m) microbatches' activations, split over its GPUs, beside its
    layers' state."""
    state = [0, *accumulate(layer.state_bytes for layer in profile.layers)]
    act = [0, *accumulate(layer.activation_bytes for layer in profile.layers)]
    count = len(pipeline.stages)

    def fits(stage: int, start: int, end: int) -> bool:
        gpus = len(pipeline.stages[stage].gpus)
        in_flight = min(count - stage, microbatches)
        return (state[end] - state[start]) * gpus + in_flight * (act[end] - act[start]) <= gpus * gpu_memory_bytes

    return fits


def stage_bounds(
    layer_ms: Sequence[float], factors: Sequence[float], fits: Fits = _always
) -> list[tuple[int, int]] | None:
    """Contiguous bounds of len(factors) stages over the layers, stage i costing factors[i] x its layers'
    ms: the least bottleneck, then the least sum at that bottleneck. None when no bounds fit."""
    k, n = len(factors), len(layer_ms)
    if not 1 <= k <= n:
        return None
    prefix = [0.0, *accumulate(layer_ms)]

    def cost(i: int, a: int, b: int) -> float:
        return factors[i] * (prefix[b] - prefix[a]) if fits(i, a, b) else float("inf")

    inf = float("inf")
    # worst[i][j]: the least bottleneck of stages 0..i-1 over layers 0..j-1
    worst = [[inf] * (n + 1) for _ in range(k + 1)]
    worst[0][0] = 0.0
    for i in range(1, k + 1):
        for j in range(i, n - (k - i) + 1):
            worst[i][j] = min(
                (max(worst[i - 1][a], cost(i - 1, a, j)) for a in range(i - 1, j) if worst[i - 1][a] < inf),
                default=inf,
            )
    bottleneck = worst[k][n]
    if bottleneck == inf:
        return None
    bound = bottleneck * (1 + 1e-12)
    # total[i][j]: the least sum of stages 0..i-1 over layers 0..j-1, every stage at most the bottleneck
    total = [[inf] * (n + 1) for _ in range(k + 1)]
    choice = [[-1] * (n + 1) for _ in range(k + 1)]
    total[0][0] = 0.0
    for i in range(1, k + 1):
        for j in range(i, n - (k - i) + 1):
            for a in range(i - 1, j):
                c = cost(i - 1, a, j)
                if total[i - 1][a] < inf and c <= bound and total[i - 1][a] + c < total[i][j]:
                    total[i][j], choice[i][j] = total[i - 1][a] + c, a
    bounds, j = [], n
    for i in range(k, 0, -1):
        a = choice[i][j]
        bounds.append((a, j))
        j = a
    return bounds[::-1]


def _with_bounds(stage: Stage, start: int, end: int, template: tuple[int, int], profile: ModelProfile) -> Stage:
    """`stage` on layers [start, end), with its profiled cost when that is not its template stage's
    (the runtime's pace needs every stage's: runtime/train/pace.py)."""
    if (start, end) == template:
        return stage.model_copy(update={"start": start, "end": end, "forward_ms": None, "backward_ms": None})
    gpus, layers = len(stage.gpus), profile.layers[start:end]
    forward = sum(layer.forward_ms for layer in layers) / gpus
    backward = sum(layer.backward_ms for layer in layers) / gpus
    return Stage.model_validate(
        stage.model_dump() | {"start": start, "end": end, "forward_ms": forward, "backward_ms": backward}
    )


def _stage_factors(pipeline: Pipeline, slowdowns: Mapping[str, float]) -> list[float]:
    return [max(1.0, slowdowns.get(stage.node, 1.0)) / len(stage.gpus) for stage in pipeline.stages]


def _cost(pipeline: Pipeline, layer_ms: Sequence[float], factors: Sequence[float], limit: int | None) -> TemplateCost:
    stages = [f * sum(layer_ms[s.start : s.end]) for s, f in zip(pipeline.stages, factors, strict=True)]
    return TemplateCost(len(pipeline.nodes), sum(stages), max(stages), limit)


def rebalance(
    plan: Plan,
    profile: ModelProfile,
    slowdowns: Mapping[str, float],
    min_gain: float = 0.0,
    *,
    gpu_memory_bytes: int | None = None,
    engine: Engine = "compiled",
) -> Plan | None:
    """Generation + 1 of `plan` with the stage bounds of every pipeline holding a slow node chosen for its
    nodes' speeds (the others on their template's bounds) and the batch re-split over the new costs; None
    when that is the plan in force or gains less than `min_gain` of the step time at the measured speeds.

    The profile gives each layer's forward + backward ms per microbatch, its state bytes (the copies') and,
    with `gpu_memory_bytes`, the memory each stage's new layers need (None: not checked)."""
    if len(profile.layers) != plan.num_layers:
        raise ValueError(f"profile: {len(profile.layers)} layers, the plan has {plan.num_layers}")
    layer_ms = [layer.forward_ms + layer.backward_ms for layer in profile.layers]
    state_bytes = [layer.state_bytes for layer in profile.layers]
    templates = {t.nodes: t for t in plan.templates}
    paces = pipeline_slowdowns(plan, slowdowns)
    pipelines, now_costs, costs = [], [], []
    for pipeline, pace in zip(plan.pipelines, paces, strict=True):
        template = templates[pipeline.template_nodes]
        limit = template_cost(template).max_microbatches
        factors = _stage_factors(pipeline, slowdowns)
        now_costs.append(_cost(pipeline, layer_ms, factors, limit))
        if pace > 1.0:
            fits = (
                _always
                if gpu_memory_bytes is None
                else memory_rule(profile, gpu_memory_bytes, pipeline, pipeline.microbatches)
            )
            bounds = stage_bounds(layer_ms, factors, fits)
        else:
            bounds = [(s.start, s.end) for s in template.stages]
        if bounds is None or len(bounds) != len(pipeline.stages):
            bounds = [(s.start, s.end) for s in pipeline.stages]
        stages = [
            _with_bounds(s, a, b, (t.start, t.end), profile)
            for s, (a, b), t in zip(pipeline.stages, bounds, template.stages, strict=True)
        ]
        moved = pipeline.model_copy(update={"stages": stages})
        pipelines.append(moved)
        costs.append(_cost(moved, layer_ms, factors, limit))
    counts = split_batch(costs, plan.global_microbatches, engine=engine)
    now = max(c.at(p.microbatches) for p, c in zip(plan.pipelines, now_costs, strict=True))
    then = max(c.at(m) for c, m in zip(costs, counts, strict=True))
    same_layout = all(
        [(s.start, s.end) for s in a.stages] == [(s.start, s.end) for s in b.stages]
        for a, b in zip(plan.pipelines, pipelines, strict=True)
    )
    if (same_layout and counts == [p.microbatches for p in plan.pipelines]) or (
        slowdowns and then > now * (1 - min_gain)
    ):
        return None
    slow = {node: round(s, 2) for node, s in slowdowns.items() if s > 1.0}
    if same_layout:  # the memory rule kept every layout: a re-split, and named so
        return with_pipelines(
            plan,
            pipelines,
            costs,
            counts,
            f"{RESPLIT_REASON} by measured speed {slow or '(all at pace)'}: {counts} microbatches",
            slowdowns,
        )
    layout = [[(s.start, s.end) for s in p.stages] for p in pipelines]
    reason = f"{REBALANCE_REASON} by measured speed {slow or '(all at pace)'}: stages {layout}, {counts} microbatches"
    draft = with_pipelines(plan, pipelines, costs, counts, reason, slowdowns)
    holdings = {(a.node, a.gpu): range(a.start, a.end) for a in plan.ranks}
    return draft.model_copy(update={"copies": layout_copies(draft, holdings, state_bytes)})


def step_ms(plan: Plan, profile: ModelProfile, slowdowns: Mapping[str, float]) -> float:
    """`plan`'s step time at the measured speeds: its slowest pipeline, each stage costing its node's
    slowdown (at least 1) x its layers' profiled ms over its GPUs."""
    layer_ms = [layer.forward_ms + layer.backward_ms for layer in profile.layers]
    return max(_cost(p, layer_ms, _stage_factors(p, slowdowns), None).at(p.microbatches) for p in plan.pipelines)


def copy_ms(plan: Plan, bandwidth: float) -> float:
    """The time `plan`'s copies take: the bytes of the node receiving the most over its link (as reconfigure.py)."""
    received: dict[str, int] = {}
    for copy in plan.copies:
        received[copy.dst_node] = received.get(copy.dst_node, 0) + copy.bytes
    return max(received.values(), default=0) / bandwidth * 1e3


def mitigate(
    plan: Plan,
    profile: ModelProfile,
    slowdowns: Mapping[str, float],
    min_gain: float,
    *,
    bandwidth: float,
    horizon: int,
    gpu_memory_bytes: int | None = None,
    engine: Engine = "compiled",
    bench_min_nodes: int | None = None,
    bench_replacement: str | None = None,
) -> Plan | None:
    """Around the nodes slowed by `slowdowns` (issue 22, mitigations a, b and c priced): the cheapest of
    (a) re-splitting the batch (resplit.py), (b) moving layers with the batch re-split (`rebalance`) and,
    with `bench_min_nodes`, (c) taking the slowest node out as a spare (bench.py: the best plan on the
    other nodes, at least that many, or with `bench_replacement`, a warm spare, in its place), each priced as copy time + `horizon` x its step time at the measured
    speeds (ms, the same price as reconfigure.py's); a tie goes to the earlier, which moves less. None when
    none shortens the step in force by `min_gain` (all judged by the same model, `step_ms`: resplit's own
    treats a pipeline whose layers were moved as its template)."""
    candidates = [
        resplit(plan, slowdowns, engine=engine),
        rebalance(plan, profile, slowdowns, gpu_memory_bytes=gpu_memory_bytes, engine=engine),
    ]
    slowest = max(slowdowns, key=lambda n: slowdowns[n], default=None)
    if bench_min_nodes is not None and slowest is not None and slowdowns[slowest] > 1.0:
        candidates.append(
            bench(
                plan,
                profile,
                slowest,
                slowdowns,
                bandwidth=bandwidth,
                horizon=horizon,
                min_nodes=bench_min_nodes,
                replacement=bench_replacement,
            )
        )
    priced = []
    for candidate in candidates:
        if candidate is None:
            continue
        step = step_ms(candidate, profile, slowdowns)
        if step <= step_ms(plan, profile, slowdowns) * (1 - min_gain):
            priced.append((copy_ms(candidate, bandwidth) + horizon * step, len(priced), candidate))
    return min(priced, key=lambda p: p[:2])[2] if priced else None
