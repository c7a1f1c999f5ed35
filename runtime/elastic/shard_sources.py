"""Copies that serve a generation's tensor-parallel stages from the shards its members hold.

A member holds each of its layers whole, (t, k) = (1, 0), or as shard k of t (runtime/train/tensor_parallel.py).
A rank of the new plan needs each layer of its stage as (t', k'): its stage's t and its index in its TP group.
For every layer a rank does not already hold in that form, its sources are, in this order:
1. a holder of exactly (t', k'): one copy, kept as it arrives (for a t' = 1 stage: a whole holder);
2. the rank's own whole layer, cut where it is (nothing moves);
3. every shard of one degree d > 1 (the smallest such d first): d copies, glued whole and cut on arrival;
4. a whole holder, for a t' > 1 stage: one copy, cut on arrival.
A rank's own piece of a layer in another sharding is a source like any other, and the first choice (a copy
with src == dst moves nothing: `transfer` re-shards it with the pieces received); among other holders of one
piece, the one that has sent the fewest bytes so far sends it (then the lowest rank), which spreads the copies
over the survivors. When some layer has no source at all, `LostShards` names the layers and the members roll
back to their snapshots (runtime/elastic/sources.py).

Each copy names the source's (t, k) (`LayerCopy.src_tensor_parallel`, `src_tp_index`): the destination
refuses a header that says otherwise (runtime/train/shard_copy.py). Pure: plain data in, copies out.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from oobleck.api.addresses import parse_worker_id, worker_id
from oobleck.api.plan import LayerCopy, Plan

Sharding = tuple[int, int]
"""(t, k): shard k of t; (1, 0) is the whole layer"""
WHOLE: Sharding = (1, 0)
Held = Mapping[str, Mapping[int, Sharding]]
"""worker "node:gpu" -> layer -> the sharding it holds the layer in"""


class LostShards(Exception):
    """Some layers have no source: no holder of the wanted shard, no complete shard set, no whole replica."""

    def __init__(self, layers: list[int]) -> None:
        super().__init__(f"layers {layers}: no holder of a needed shard, no complete set of one degree, no whole copy")
        self.layers = layers


def wanted(plan: Plan) -> dict[int, Sharding]:
    """Every rank's sharding of its stage's layers: (its stage's t, its index in its TP group)."""
    return {
        rank: (stage.tensor_parallel, index % stage.tensor_parallel)
        for pipeline in plan.pipelines
        for stage in pipeline.stages
        for index, rank in enumerate(stage.ranks)
    }


def uses_shards(plan: Plan, held: Held) -> bool:
    """Whether `plan` has a t > 1 stage or some member holds a shard: the copies must then know shards."""
    return any(t > 1 for t, _ in wanted(plan).values()) or any(
        sharding != WHOLE for layers in held.values() for sharding in layers.values()
    )


def completes(pieces: set[Sharding], want: Sharding) -> bool:
    """Whether the pieces a destination receives for one layer make its shard `want`: the piece itself, a
    whole layer, or every shard of one degree (runtime/train/shard_copy.assemble)."""
    if want in pieces or WHOLE in pieces:
        return True
    degrees = {t for t, _ in pieces}
    return len(degrees) == 1 and pieces == {(t, k) for t in degrees for k in range(t)}


def sound(plan: Plan, held: Held) -> bool:
    """Whether `plan`'s copies can be served by `held` and leave every rank its layers in its sharding:
    each copy's source holds the layer as the copy says (live state only), and each rank either holds a
    layer as it needs it or receives pieces that complete it."""
    incoming: dict[tuple[int, int], set[Sharding]] = defaultdict(set)
    for copy in plan.copies:
        if copy.source_kind != "live" or held.get(worker_id(copy.src_node, copy.src_gpu), {}).get(copy.layer) != (
            copy.src_shard
        ):
            return False
        incoming[(copy.dst_rank, copy.layer)].add(copy.src_shard)  # src == dst: its own piece, re-sharded
    shardings = wanted(plan)
    for a in plan.ranks:
        want, mine = shardings[a.rank], held.get(worker_id(a.node, a.gpu), {})
        for layer in range(a.start, a.end):
            pieces = incoming.get((a.rank, layer))
            if not (completes(pieces, want) if pieces else mine.get(layer) == want):
                return False
    return True


class _Sources:
    """Who holds which piece of which layer, and the bytes each has been given to send so far."""

    def __init__(self, plan: Plan, held: Held, state_bytes: list[int]) -> None:
        self.state_bytes = state_bytes
        self.holders: dict[tuple[int, Sharding], list[tuple[int, str, int]]] = defaultdict(list)
        for worker, layers in held.items():
            node, gpu = parse_worker_id(worker)
            rank = plan.rank_of(node, gpu)
            if rank is None:
                continue  # not a member of the generation: it takes part in no copy
            for layer, sharding in layers.items():
                self.holders[(layer, sharding)].append((rank, node, gpu))
        self.sent: dict[int, int] = defaultdict(int)

    def _holder(self, layer: int, sharding: Sharding, dst: int) -> tuple[int, str, int] | None:
        options = self.holders.get((layer, sharding), [])
        return min(options, key=lambda h: (h[0] != dst, self.sent[h[0]], h[0])) if options else None

    def choose(self, layer: int, want: Sharding, dst: int) -> list[tuple[tuple[int, str, int], Sharding]] | None:
        """The pieces (holder, sharding) that make shard `want` of `layer` at rank `dst` (module docstring's
        order); None when there are none."""
        exact = self._holder(layer, want, dst)
        if exact is not None:
            return self._take([(exact, want)], layer, dst)
        whole = self._holder(layer, WHOLE, dst)
        if whole is not None and whole[0] == dst:
            return self._take([(whole, WHOLE)], layer, dst)  # its own whole layer, cut: nothing moves
        degrees = sorted({t for (held, (t, _)) in self.holders if held == layer and t > 1})
        for t in degrees:
            pieces = [(self._holder(layer, (t, k), dst), (t, k)) for k in range(t)]
            if all(holder is not None for holder, _ in pieces):
                return self._take(pieces, layer, dst)  # type: ignore[arg-type]
        return None if whole is None else self._take([(whole, WHOLE)], layer, dst)

    def _take(self, pieces: list[tuple[tuple[int, str, int], Sharding]], layer: int, dst: int):
        for (rank, _, _), (t, _) in pieces:
            self.sent[rank] += 0 if rank == dst else self.state_bytes[layer] // t
        return pieces


def shard_copies(plan: Plan, held: Held, state_bytes: list[int]) -> list[LayerCopy]:
    """Copies from the members' holdings `held` that give every rank of `plan` its layers in its sharding
    (module docstring). Raises LostShards naming the layers without a source."""
    sources = _Sources(plan, held, state_bytes)
    shardings = wanted(plan)
    copies: list[LayerCopy] = []
    lost: set[int] = set()
    for a in plan.ranks:
        want, mine = shardings[a.rank], held.get(worker_id(a.node, a.gpu), {})
        for layer in range(a.start, a.end):
            if mine.get(layer) == want:
                continue
            pieces = sources.choose(layer, want, a.rank)
            if pieces is None:
                lost.add(layer)
                continue
            for (rank, node, gpu), (t, k) in pieces:
                copies.append(
                    LayerCopy(
                        layer=layer,
                        src_node=node,
                        src_gpu=gpu,
                        src_rank=rank,
                        dst_node=a.node,
                        dst_gpu=a.gpu,
                        dst_rank=a.rank,
                        bytes=0 if rank == a.rank else state_bytes[layer] // t,
                        src_tensor_parallel=t,
                        src_tp_index=k,
                    )
                )
    if lost:
        raise LostShards(sorted(lost))
    return copies
