"""Where each layer's state comes from, settled by the members of a generation themselves.

A plan controller decides the layout (who runs which layers) and proposes copies. Its copies rest on
what it knows about the workers' holdings. The local launcher reads the workers' reports from the
store, but the operator sees only pods and plans: after an interrupted reconfiguration (a kill while
layers were being copied) a worker may hold less than the previous layout says, and after more
than f failures some layer may have no live replica at all. A plan whose copies name a source that
does not hold the layer would fail every member of the generation.

So before adopting generation g every member posts what it holds (`gen{g}/holding/{worker}`: step,
whole layers, tensor-parallel shards (layer, t, k), whether it has trained, its snapshots, the checkpoint
directory's steps) and waits for the others; then each computes, from the same records, the same answer
(`resolve`, a pure function):

- the members go on from the newest step any of them holds layers at. Members behind it (a data-parallel
  rank that did not apply a step its replicas applied: such steps need no commit, runtime/elastic/commit.py)
  count as holding nothing: they drop their layers and take them by copy at that step (`catch_up_step`);
- the proposal stands when every copy's source holds its layer (in the sharding the copy names) at that
  step, and every rank gets every layer of its stage in its own sharding (its own, a copy, or - in a
  fresh job - built from the seed);
- otherwise the copies are recomputed from the records: with the planner's copy plan for the layout
  (`layout_copies`), or, when the plan has tensor-parallel stages or some member holds shards, with
  copies that know shards (runtime/elastic/shard_sources.py: same-t shards, one degree's full set, a whole replica);
- if some layer has no live holder at that step, the generation rolls back: the newest step that the
  members' snapshots and the checkpoint directory cover in full (`snapshot.restore_point`), with
  `snapshot.restore_copies` as the copies;
- if nothing can restore every layer, `Unrecoverable` names the layers: the job needs a restart.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from oobleck.api.addresses import parse_worker_id, worker_id
from oobleck.api.plan import Plan
from oobleck.runtime.elastic import keys
from oobleck.runtime.elastic.shard_sources import LostShards, shard_copies, sound, uses_shards


class Unrecoverable(Exception):
    """No member, snapshot or checkpoint holds some layer: the job cannot go on in place.

    Not a RuntimeError: those end a generation (the worker waits for the next plan); this ends the worker."""


@dataclass(frozen=True)
class Holding:
    """What one member of a generation holds as it joins it."""

    step: int
    layers: tuple[int, ...] = ()
    started: bool = False
    """has trained or received state (else its layers can be built from the seed)"""
    snapshots: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    """step -> layers of in-memory snapshots it holds (its own and its buddy's)"""
    checkpoint: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    """step -> layers complete in the checkpoint directory, as this member reads it"""
    shards: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    """layer -> (t, k): the layers it holds as tensor-parallel shard k of t (not in `layers`, which are whole)"""

    def held(self) -> dict[int, tuple[int, int]]:
        """Every live layer with its sharding: (1, 0) for a whole one."""
        return {layer: (1, 0) for layer in self.layers} | dict(self.shards)

    def to_json(self) -> str:
        return json.dumps(
            {
                "step": self.step,
                "layers": list(self.layers),
                "started": self.started,
                "snapshots": {str(k): list(v) for k, v in self.snapshots.items()},
                "checkpoint": {str(k): list(v) for k, v in self.checkpoint.items()},
                "shards": {str(layer): list(sharding) for layer, sharding in self.shards.items()},
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Holding:
        data = json.loads(text)
        return cls(
            step=int(data["step"]),
            layers=tuple(data["layers"]),
            started=bool(data["started"]),
            snapshots={int(k): tuple(v) for k, v in data.get("snapshots", {}).items()},
            checkpoint={int(k): tuple(v) for k, v in data.get("checkpoint", {}).items()},
            shards={int(layer): _sharding(v) for layer, v in data.get("shards", {}).items()},
        )


def _sharding(value) -> tuple[int, int]:
    t, k = (int(v) for v in value)
    return t, k


def resolve(plan: Plan, holdings: Mapping[str, Holding], state_bytes: list[int]) -> Plan:
    """The plan whose copies the members' `holdings` (worker "node:gpu" -> Holding) can serve (see module doc).

    Deterministic: every member computes the same plan from the same records. Raises Unrecoverable."""
    from oobleck.planner.nextgen import restore_copies, restore_point, snapshots_at
    from oobleck.planner.reconfigure import LostLayersError, layout_copies

    if plan.restore_step is not None:
        return plan  # the controller already chose a rollback from the workers' reports
    trained = {w: h for w, h in holdings.items() if h.started}
    if not trained:
        return plan  # a fresh job: every layer is built from the seed
    newest = newest_step(holdings)
    # Members behind the newest step hold nothing usable: they catch up by copy (`catch_up_step`).
    current = {w for w, h in trained.items() if h.step == newest}
    live = {w: set(h.layers) if w in current else set() for w, h in trained.items()}
    held = {w: h.held() if w in current else {} for w, h in trained.items()}
    if sound(plan, held):
        return plan
    try:
        if uses_shards(plan, held):  # tensor-parallel stages or shards held: copies that know shards
            copies = shard_copies(plan, held, state_bytes)
        else:
            keyed = {parse_worker_id(w): frozenset(ls) for w, ls in live.items()}
            copies = layout_copies(plan, keyed, state_bytes)
        return plan.model_copy(update={"copies": copies, "reason": f"{plan.reason}+resolved"})
    except (LostLayersError, LostShards):
        pass  # some layer has no live source at the newest step: roll back
    # Roll back: the newest step covered by the members' snapshots and the directory.
    memory = {w: h.snapshots for w, h in holdings.items()}
    first = min(plan.ranks, key=lambda a: a.rank)
    first_holding = holdings.get(worker_id(first.node, first.gpu))
    checkpoint = first_holding.checkpoint if first_holding is not None else {}
    latest = max((h.step for h in trained.values()), default=None)
    step = restore_point(memory, checkpoint, plan.num_layers, latest)
    if step is None:
        whole = set().union(*live.values()) if live else set()
        missing = sorted(set(range(plan.num_layers)) - whole)
        raise Unrecoverable(
            f"generation {plan.generation}: layers {missing or 'of several steps'} have no live holder and no snapshot "
            "or checkpoint holds every layer at one step; the job must restart from storage"
        )
    copies = restore_copies(plan, snapshots_at(memory, step), set(checkpoint.get(step, ())), state_bytes)
    return plan.model_copy(update={"copies": copies, "restore_step": step, "reason": f"{plan.reason}+rollback"})


def newest_step(holdings: Mapping[str, Holding]) -> int | None:
    """The newest step at which a member that has trained holds layers (None: nobody has)."""
    return max((h.step for h in holdings.values() if h.started and (h.layers or h.shards)), default=None)


def catch_up_step(plan: Plan, holdings: Mapping[str, Holding], me: str) -> int | None:
    """The step member `me` must take all its layers at, by copy, when it is behind the newest holders of a
    plan that goes on from their state (not a rollback); None when it is not behind."""
    mine, newest = holdings.get(me), newest_step(holdings)
    if plan.restore_step is not None or mine is None or not mine.started or newest is None or mine.step >= newest:
        return None
    return newest


def exchange(
    store, plan: Plan, me: str, mine: Holding, failed, timeout_s: float, poll_s: float = 0.05
) -> dict[str, Holding]:
    """Post `mine` for `plan`'s generation and collect every member's (all or a timeout / failure).

    Raises TimeoutError, or InterruptedError when `failed` (the failure Event) is set while waiting."""
    import datetime

    from oobleck.runtime.elastic.store import is_store_loss

    keys.set_holding(store, plan.generation, me, mine.to_json())
    members = [worker_id(a.node, a.gpu) for a in plan.ranks]
    names = [keys.holding_key(plan.generation, w) for w in members]
    deadline = time.monotonic() + timeout_s
    while True:
        if failed.is_set():
            raise InterruptedError(f"interrupted while collecting the holdings of generation {plan.generation}")
        try:
            store.wait(names, datetime.timedelta(seconds=poll_s))
            break
        except RuntimeError as error:
            if is_store_loss(error):
                raise
        if time.monotonic() > deadline:
            absent = [w for w, n in zip(members, names) if not store.check([n])]
            raise TimeoutError(
                f"holdings of generation {plan.generation}: no record from {absent} in {timeout_s:.0f} s"
            )
    # A holding that does not verify (a stranger rewrote it) is never used: the exchange fails instead.
    holdings = keys.open_holdings(plan.generation, members, store.multi_get(names))
    refused = sorted(w for w, v in holdings.items() if v is None)
    if refused:
        raise TimeoutError(f"holdings of generation {plan.generation}: records of {refused} do not verify")
    return {w: Holding.from_json(v) for w, v in holdings.items() if v is not None}
