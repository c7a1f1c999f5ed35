"""Around a very slow node by taking it out (issue 22, mitigation c): the next generation without it, the
node kept as a warm spare, and the generation that takes it back.

A re-split (resplit.py) or moved layers (rebalance.py) keep a slow node busy; at 1/4 or 1/8 of its speed
the pipeline it is in still drags the job, while the best plan on the other nodes (the templates cover
every usable node count) does not. Taking it out is the planner's own reconfiguration for a lost node
(`next_generation`: the layers it held are copied from their replicas, losses exact), with the node
recorded in `Plan.benched` instead of `Plan.lost_nodes`: its pod is kept and waits in no plan, as a
spare does, until `readmit` folds it back in like a scale-up (copies from the holders, losses exact).
With a warm spare at hand, the same generation folds the spare in (a loss's reconfiguration with a spare):
the job keeps its node count and the benched node is the spare.

A bench never rolls back: when some layer has no replica outside the slow node (f = 0, or a loss
since), taking the node out would lose training state, and a slow node is better than a rollback.
"""

from __future__ import annotations

from collections.abc import Mapping

from oobleck.api.plan import Plan
from oobleck.api.profile import ModelProfile

from .errors import PlanningError
from .nextgen import next_generation

BENCH_REASON = "slow node benched as a spare"
READMIT_REASON = "benched node taken back"


def bench(
    plan: Plan,
    profile: ModelProfile,
    node: str,
    slowdowns: Mapping[str, float],
    *,
    bandwidth: float,
    horizon: int,
    min_nodes: int = 1,
    replacement: str | None = None,
) -> Plan | None:
    """Generation + 1 of `plan` without `node` (benched at its figure in `slowdowns`), with `replacement` (a
    warm spare) in its place if given, the other slowdowns recorded as the ones it was planned around; None
    when fewer than `min_nodes` nodes would remain, no pipeline forms on them, or some layer has no replica
    outside `node`."""
    added = [replacement] if replacement is not None else []
    if node not in plan.nodes or len(plan.nodes) - 1 + len(added) < max(min_nodes, 1):
        return None
    try:
        draft = next_generation(plan, profile, [node], added, bandwidth=bandwidth, horizon=horizon)
    except PlanningError:
        return None
    if draft.restore_step is not None or draft.reason == "rollback":
        return None
    figure = round(slowdowns.get(node, 1.0), 3)
    return Plan.model_validate(
        draft.model_dump()
        | {
            "lost_nodes": [],
            "benched": {**plan.benched, node: figure},
            "slowdowns": {n: s for n, s in slowdowns.items() if n != node and n in draft.nodes and s > 1.0},
            "reason": f"{BENCH_REASON}: {node} at {figure}x"
            + (f", spare {replacement} in its place" if replacement is not None else "")
            + f"; {len(draft.nodes)} nodes ({draft.reason})",
        }
    )


def readmit(plan: Plan, profile: ModelProfile, node: str, *, bandwidth: float, horizon: int) -> Plan:
    """Generation + 1 of `plan` with the benched `node` back in training (a scale-up by one node: the
    layers it gets are copied from their holders); the other benched nodes stay out."""
    if node not in plan.benched:
        raise PlanningError(f"node {node!r} is not benched in plan generation {plan.generation}")
    draft = next_generation(plan, profile, added=[node], bandwidth=bandwidth, horizon=horizon)
    return Plan.model_validate(
        draft.model_dump()
        | {
            "benched": {n: s for n, s in plan.benched.items() if n != node},
            "slowdowns": dict(plan.slowdowns),
            "reason": f"{READMIT_REASON}: {node}, benched at {plan.benched[node]}x; {len(draft.nodes)} nodes "
            f"({draft.reason})",
        }
    )
