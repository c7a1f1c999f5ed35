"""The next plan generation: one pure function that the operator, the local launcher's plan controller
and the rollback path all call.

    next_generation(previous, profile, lost, added, holdings, restorable) -> the next Plan

- Nothing lost or added and no holdings (a retry: the store is gone, or a failure named nobody): the
  same layout as generation + 1, no copies.
- Otherwise the planner's reconfiguration (`reconfigure`: Oobleck's minimal-movement moves or a
  re-instantiation of the same templates, whichever costs least), from `holdings` (what each surviving
  (node, GPU) really holds) when the caller knows them, else from `previous`'s layout.
- Some layer has no live holder (LostLayersError), or the caller says the survivors' live states
  disagree (`rollback=True`): a rollback, as `restorable` says.
  - a Restorable (the survivors' in-memory snapshots and the checkpoint directory, as the launcher
    reads them from the workers' reports): the newest step held in full (`restore_point`), a layout
    priced by what each survivor holds of it, `restore_step` and a source for every layer
    (`restore_copies`); no such step raises NoRestorePoint;
  - WORKERS_CHOOSE (the operator, which sees pods and plans only): a fresh instantiation of the same
    templates on the survivors with reason "rollback"; the workers choose the step and the sources
    from what they post (runtime/elastic/sources.py, which calls `restore_point`/`restore_copies` here too);
  - None: the LostLayersError is raised (a caller that copies live state only).

Pure: plain data in, a Plan out; it calls only the planner's public functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from oobleck.api.addresses import worker_id
from oobleck.api.plan import LayerCopy, Plan
from oobleck.api.profile import ModelProfile

from .errors import PlanningError
from .instantiate import instantiate
from .reconfigure import DEFAULT_HORIZON, LostLayersError, reconfigure

Holdings = Mapping[tuple[str, int], frozenset[int]]
"""(node, local GPU) -> the layers it holds live"""


WORKERS_CHOOSE = "workers-choose"
"""`restorable` for a controller that cannot see what survivors hold: the workers settle the rollback"""


class NoRestorePoint(PlanningError):
    """Some layer has no live holder and no step is held in full by snapshots or the checkpoint directory."""


@dataclass(frozen=True)
class Restorable:
    """What a rollback may restore from."""

    memory: Mapping[str, Mapping[int, Iterable[int]]] = field(default_factory=dict)
    """survivor ("node:gpu") -> step -> layers of its in-memory snapshots (own and its buddy's)"""
    checkpoint: Mapping[int, Iterable[int]] = field(default_factory=dict)
    """step -> layers complete in the checkpoint directory"""
    latest: int | None = None
    """the newest step a survivor reached: newer steps in the directory are an older run's"""


def lost_layers_message(error: LostLayersError) -> str:
    """A LostLayersError in the controller's words: which layers no surviving worker holds."""
    layers = error.layers
    named = (
        f"layer {layers[0]}: no surviving worker holds it"
        if len(layers) == 1
        else f"layers {layers}: no surviving worker holds them"
    )
    return f"{named} (more than f failures; restore from a checkpoint)"


def next_generation(
    previous: Plan,
    profile: ModelProfile | Sequence[int],
    lost: Sequence[str] = (),
    added: Sequence[str] = (),
    *,
    reason: str = "retry",
    holdings: Holdings | None = None,
    restorable: Restorable | str | None = None,
    rollback: bool = False,
    bandwidth: float,
    horizon: int = DEFAULT_HORIZON,
) -> Plan:
    """The generation after `previous` without the nodes `lost`, with the nodes `added` (see the module
    docstring). `profile` is the ModelProfile generation 0 was planned with, or just its per-layer
    state bytes; `bandwidth` (bytes/s) prices layer copies, `horizon` iterations the iteration time.
    `reason` names a generation that changes no node (retry, coordinator-restart). Raises
    PlanningError when the remaining nodes cannot form a pipeline, NoRestorePoint (a PlanningError
    whose cause is the LostLayersError) when a rollback has nothing to restore from."""
    lost, added = list(lost), list(added)
    if not lost and not added and holdings is None and not rollback:
        return previous.model_copy(
            update={
                "generation": previous.generation + 1,
                "copies": [],
                "lost_nodes": [],
                "added_nodes": [],
                "reason": reason,
                "restore_step": None,
            }
        )
    if not rollback:
        try:
            plan = reconfigure(
                previous,
                previous.templates,
                profile,
                lost,
                added,
                bandwidth=bandwidth,
                horizon=horizon,
                holdings=holdings,
            )
        except LostLayersError as error:
            return _rollback(previous, profile, lost, added, restorable, bandwidth, horizon, error)
        return plan if lost or added else plan.model_copy(update={"reason": reason})
    return _rollback(previous, profile, lost, added, restorable, bandwidth, horizon, None)


def _rollback(
    previous: Plan,
    profile: ModelProfile | Sequence[int],
    lost: list[str],
    added: list[str],
    restorable: Restorable | str | None,
    bandwidth: float,
    horizon: int,
    error: LostLayersError | None,
) -> Plan:
    if restorable is None:
        if error is None:
            raise PlanningError("rollback: nothing to restore from (no Restorable given)")
        raise error
    if restorable == WORKERS_CHOOSE:
        survivors = [n for n in previous.nodes if n not in set(lost)]
        fresh = instantiate(
            previous.templates,
            [*survivors, *added],
            previous.f,
            previous.global_microbatches,
            previous.job,
            gpus_per_node=previous.gpus_per_node,
            allow_degraded=True,
        )
        return fresh.model_copy(
            update={
                "generation": previous.generation + 1,
                "lost_nodes": [n for n in previous.nodes if n in set(lost)],
                "added_nodes": added,
                "reason": "rollback",
            }
        )
    assert isinstance(restorable, Restorable), f"restorable: {restorable!r}"
    step = restore_point(restorable.memory, restorable.checkpoint, previous.num_layers, restorable.latest)
    if step is None:
        cause = lost_layers_message(error) if error is not None else "the survivors hold layers at different steps"
        raise NoRestorePoint(f"{cause}; no in-memory snapshot or checkpoint holds every layer at one step") from error
    at = snapshots_at(restorable.memory, step)
    disk = {int(layer) for layer in restorable.checkpoint.get(step, ())}
    only_disk = disk - set().union(*at.values()) if at else disk
    gone = set(lost)
    priced: dict[tuple[str, int], frozenset[int]] = {
        (a.node, a.gpu): frozenset(at.get(worker_id(a.node, a.gpu), set()) | only_disk)
        for a in previous.ranks
        if a.node not in gone
    }
    plan = reconfigure(
        previous, previous.templates, profile, lost, added, bandwidth=bandwidth, horizon=horizon, holdings=priced
    )
    state_bytes = (
        [layer.state_bytes for layer in profile.layers] if isinstance(profile, ModelProfile) else list(profile)
    )
    copies = restore_copies(plan, at, disk, state_bytes)
    return plan.model_copy(update={"copies": copies, "restore_step": step, "reason": f"rollback+{plan.reason}"})


def restore_point(
    memory: Mapping[str, Mapping[int, Iterable[int]]],
    checkpoint: Mapping[int, Iterable[int]],
    num_layers: int,
    latest: int | None = None,
) -> int | None:
    """The newest step whose every layer is in a survivor's memory (`memory`: worker -> step -> layers)
    or in the checkpoint directory (`checkpoint`: step -> layers); None if there is none.

    `latest`: the job's current step; newer steps (a directory left by an earlier run) are ignored."""
    cover: dict[int, set[int]] = {}
    for steps in memory.values():
        for step, layers in steps.items():
            cover.setdefault(int(step), set()).update(layers)
    for step, layers in checkpoint.items():
        cover.setdefault(int(step), set()).update(layers)
    everything = set(range(num_layers))
    complete = [step for step, layers in cover.items() if everything <= layers and (latest is None or step <= latest)]
    return max(complete, default=None)


def restore_copies(
    plan: Plan, memory: Mapping[str, Iterable[int]], checkpoint: Iterable[int], state_bytes: list[int]
) -> list[LayerCopy]:
    """The source of every (rank, layer) of `plan` at the restore step.

    `memory`: worker ("node:gpu") -> layers whose snapshot at the step it holds; `checkpoint`: the
    layers in the directory at that step. Preference: the rank's own memory (no transfer), then the
    snapshot holder that has sent the fewest bytes so far (ties: the lower rank), then the directory.
    Raises ValueError naming a layer with no source.
    """
    held = {w: set(layers) for w, layers in memory.items()}
    on_disk = set(checkpoint)
    holders: dict[int, list[int]] = {}
    for a in plan.ranks:
        for layer in held.get(worker_id(a.node, a.gpu), ()):
            holders.setdefault(layer, []).append(a.rank)
    load = [0] * plan.world_size
    copies = []
    for a in plan.ranks:
        mine = held.get(worker_id(a.node, a.gpu), set())
        for layer in range(a.start, a.end):
            size = state_bytes[layer]
            kind: Literal["snapshot", "checkpoint"]
            if layer in mine:
                src, kind = a, "snapshot"
            elif holders.get(layer):
                rank = min(holders[layer], key=lambda r: (load[r], r))
                load[rank] += size
                src, kind = plan.ranks[rank], "snapshot"
            elif layer in on_disk:
                src, kind = a, "checkpoint"
            else:
                raise ValueError(f"restore: layer {layer} is neither in a survivor's snapshots nor in the checkpoint")
            copies.append(
                LayerCopy(
                    layer=layer,
                    src_node=src.node,
                    src_gpu=src.gpu,
                    src_rank=src.rank,
                    dst_node=a.node,
                    dst_gpu=a.gpu,
                    dst_rank=a.rank,
                    bytes=size,
                    source_kind=kind,
                )
            )
    return copies


def snapshots_at(reports: Mapping[str, Mapping[int, Iterable[int]]], step: int) -> dict[str, set[int]]:
    """worker -> layers of its snapshot at `step` (workers without any are left out)."""
    out = {w: set(steps.get(step, ())) for w, steps in reports.items()}
    return {w: layers for w, layers in out.items() if layers}
