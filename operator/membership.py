"""Who is in the job: the plan's members sorted by what happened to them (lost, scaled in, surviving),
the newcomers and spares to fold in or keep, and the pods to create and delete. Pure; decide.py drives it."""

from __future__ import annotations

from dataclasses import dataclass

from oobleck.api.plan import Plan
from oobleck.api.spec import OobleckJobSpec
from oobleck.operator.decision import JobContext
from oobleck.operator.observe import JobObservation, ready_newcomers
from oobleck.operator.render import worker_index


def next_indices(obs: JobObservation, plan: Plan | None, count: int) -> tuple[int, ...]:
    """`count` fresh worker indices above every index an existing pod or the current plan uses."""
    if count <= 0:
        return ()
    used = [w.index for w in obs.workers]
    if plan is not None:
        job = plan.job
        used += [i for n in (*plan.nodes, *plan.lost_nodes, *plan.benched) if (i := worker_index(job, n)) is not None]
    start = max(used, default=-1) + 1
    return tuple(range(start, start + count))


def cleanup(spec: OobleckJobSpec, obs: JobObservation, plan: Plan | None) -> tuple[tuple[str, str], ...]:
    """Pods to delete once the job finished: per cleanPodPolicy, and, whatever the policy, the running pods
    in no plan (spares and replacements never folded in: they hold nothing and would wait for ever)."""
    members = set(plan.nodes) if plan is not None else set()
    doomed = [
        (w.name, "not a member when the job ended")
        for w in obs.workers
        if plan is not None and w.status == "running" and w.name not in members and not w.deleting
    ]
    if spec.clean_pod_policy == "None":
        return tuple(doomed)
    for worker in obs.workers:
        if spec.clean_pod_policy == "All" or worker.status in ("running", "pending"):
            doomed.append((worker.name, f"cleanPodPolicy {spec.clean_pod_policy}"))
    coordinator = obs.coordinator
    if (
        coordinator is not None
        and not coordinator.deleting
        and (spec.clean_pod_policy == "All" or coordinator.phase in ("Running", "Pending"))
    ):
        doomed.append((coordinator.name, f"cleanPodPolicy {spec.clean_pod_policy}"))
    return tuple(dict(doomed).items())


def coordinator_pod(obs: JobObservation) -> tuple[bool, list[tuple[str, str]]]:
    """Whether to create the coordinator pod, and a failed one to delete (it is recreated on the next pass)."""
    delete: list[tuple[str, str]] = []
    if obs.coordinator is not None and not obs.coordinator.deleting and obs.coordinator.phase == "Failed":
        delete.append((obs.coordinator.name, "coordinator failed"))
    return obs.coordinator is None, delete


@dataclass(frozen=True)
class Membership:
    """The plan's members sorted by what happened to them, and the newcomers to fold in."""

    lost: dict[str, str]
    """member -> why it is lost"""
    survivors: list[str]
    scaled: list[str]
    """survivors dropped to scale down"""
    added: list[str]
    """running newcomers to fold in"""
    delete: list[tuple[str, str]]
    """non-member pods to delete: lost, dropped from the plan, or no longer wanted"""


def membership(ctx: JobContext, obs: JobObservation, plan: Plan) -> Membership:
    wanted, spares = ctx.spec.nodes.wanted, ctx.spec.nodes.spares
    members = plan.nodes
    member_set, dropped = set(members), set(plan.lost_nodes)
    lost: dict[str, str] = {}
    for name in members:
        worker = obs.get(name)
        if worker is None:
            lost[name] = f"pod {name} gone"
        elif worker.status == "lost":
            lost[name] = worker.reason
    survivors = [m for m in members if m not in lost]
    # Scale down: drop the newest members beyond the target.
    by_index = sorted(survivors, key=lambda n: worker_index(ctx.name, n) or 0)
    scaled = by_index[wanted:] if len(survivors) > wanted else []
    room = max(wanted - (len(survivors) - len(scaled)), 0)
    # Fold a running newcomer in once its runtime is up (it reported: torch imported, store reached), and
    # not while the current generation is still being adopted (its members have not trained a step in
    # it yet): otherwise the survivors would wait for the newcomer's start-up, or abandon an adoption.
    # A warm spare is such a newcomer kept waiting: a loss folds it in by the generation that drops the
    # lost node, as a scale-up does. Pods whose runtime reports nothing are folded in as soon as they run.
    # A node benched for its slowness (stragglers.mitigation spare) waits as a spare too, but only the
    # straggler logic takes it back (operator/stragglers.py), once its back-off is over.
    ready = tuple(name for name in ready_newcomers(obs, plan) if name not in plan.benched)
    eligible = ready if obs.generation_trained is None or obs.generation_trained else ()
    added = list(eligible[:room])
    # A benched pod is kept first: it fills the room it left.
    added_set, warm = set(added), set(ready) | set(plan.benched)
    # Pods kept on their way in: those filling the room left (pending or still starting), then the spares.
    keep = room - len(added) + spares
    delete: list[tuple[str, str]] = []
    # Warm ones first, then running, then pending; oldest first within each.
    waiting = sorted(obs.workers, key=lambda w: (w.name not in warm, w.status != "running", w.index))
    for worker in waiting:
        if worker.name in member_set or worker.name in added_set:
            continue
        if worker.status == "lost" or worker.name in dropped:
            delete.append((worker.name, worker.reason or "dropped from the plan"))
        elif worker.status in ("running", "pending") and keep > 0:
            keep -= 1
        elif worker.status in ("running", "pending"):
            delete.append((worker.name, f"scaled to {wanted} nodes" + (f" and {spares} spares" if spares else "")))
    return Membership(lost, survivors, scaled, added, delete)
