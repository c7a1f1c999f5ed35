"""Around a straggler by batch alone: the next generation with the global batch re-split by measured speed.

A pipeline runs at the pace of its slowest node, so a pipeline whose slowest node computes `s` times
slower than profiled costs `s * T(m)` for `m` microbatches. `split_batch` already balances pipelines by
cost; fed the scaled costs, it gives the slow pipeline fewer microbatches so that all finish together.
No layer moves (no copies, the same stages on the same nodes and ranks), and the losses stay exact: the
global batch is the same microbatches in the same order, only their division among the pipelines
changes, and every gradient sum is divided by the global sample count whatever the division.

Slowdowns under 1 count as 1 (a node faster than the others is noise here, not capacity to plan on),
so a job whose stragglers all recovered re-splits back to the profile's split.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from oobleck.api.plan import Pipeline, Plan

from .instantiate import Engine, TemplateCost, split_batch, template_cost


def pipeline_slowdowns(plan: Plan, slowdowns: Mapping[str, float]) -> list[float]:
    """Each pipeline's pace against its profile: its slowest node's slowdown (at least 1)."""
    return [max([1.0, *(slowdowns.get(node, 1.0) for node in pipeline.nodes)]) for pipeline in plan.pipelines]


RESPLIT_REASON = "batch re-split"


def resplit(
    plan: Plan, slowdowns: Mapping[str, float], min_gain: float = 0.0, *, engine: Engine = "compiled"
) -> Plan | None:
    """Generation + 1 of `plan` with its microbatches divided by the pipelines' measured speeds, or None
    when that division is the one in force or gains less than `min_gain` (a fraction of the step time at
    those speeds: a measured speed that wobbles must not make a generation per wobble)."""
    templates = {t.nodes: t for t in plan.templates}
    paces = pipeline_slowdowns(plan, slowdowns)
    costs = []
    for pipeline, pace in zip(plan.pipelines, paces, strict=True):
        cost = template_cost(templates[pipeline.template_nodes])
        costs.append(
            TemplateCost(cost.nodes, cost.base_ms * pace, cost.slope_ms * pace, cost.max_microbatches, cost.m_ref)
        )
    counts = split_batch(costs, plan.global_microbatches, engine=engine)
    now = max(cost.at(p.microbatches) for p, cost in zip(plan.pipelines, costs, strict=True))
    then = max(cost.at(count) for cost, count in zip(costs, counts, strict=True))
    if counts == [p.microbatches for p in plan.pipelines] or then > now * (1 - min_gain):
        return None
    slow = {node: round(s, 2) for node, s in slowdowns.items() if s > 1.0}
    reason = f"{RESPLIT_REASON} by measured speed {slow or '(all at pace)'}: {counts} microbatches"
    return with_pipelines(plan, plan.pipelines, costs, counts, reason, slowdowns)


def with_pipelines(
    plan: Plan,
    pipelines: Sequence[Pipeline],
    costs: Sequence[TemplateCost],
    counts: Sequence[int],
    reason: str,
    slowdowns: Mapping[str, float],
) -> Plan:
    """Generation + 1 of `plan` with these pipelines running `counts` microbatches (in order, at the costs'
    iteration times), no node lost or added, no copies (a caller that moves layers adds them), planned
    around `slowdowns` (those over 1 recorded in the plan)."""
    placed, offset = [], 0
    for pipeline, cost, count in zip(pipelines, costs, counts, strict=True):
        placed.append(
            pipeline.model_copy(
                update={"microbatches": count, "microbatch_offset": offset, "iteration_ms": cost.at(count)}
            )
        )
        offset += count
    body = plan.model_dump() | {
        "generation": plan.generation + 1,
        "pipelines": [p.model_dump() for p in placed],
        "copies": [],
        "lost_nodes": [],
        "added_nodes": [],
        "restore_step": None,
        "iteration_ms": max(p.iteration_ms for p in placed),
        "reason": reason,
        "slowdowns": {node: s for node, s in slowdowns.items() if s > 1.0},
    }
    return Plan.model_validate(body)
