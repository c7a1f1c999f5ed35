"""Where each node of a next layout goes, and what it must receive: the GPU tables of templates, the layer
state every GPU holds (`Held`), the arrangement that keeps the most state in place (`arrange`), the copies
that fill the gaps, and ranks that survive a reconfiguration (`stable_ranks`)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

import numpy as np

from oobleck.api.plan import Plan, Template

from .errors import PlanningError
from .instantiate import known


def stable_ranks(before: GpuTable, places: np.ndarray, gpus_per_node: int) -> np.ndarray:
    """The rank of every GPU of a new layout (`places` rows in layout order, keyed like `before`).

    A GPU of the previous plan (`before`) keeps its rank when that is below the new world size; the
    others (added nodes, GPUs whose rank is past the end) take the free ranks, in layout order. Ranks
    only label the workers, so keeping them costs nothing, and one lost node then renumbers about one
    node's GPUs (the last ranks) instead of every GPU after it.
    """
    world = len(places)
    keys = places[:, 0] * gpus_per_node + places[:, 1]
    rank_of = np.full(max(int(keys.max()), int(before.key.max())) + 1, -1, dtype=np.int64)
    rank_of[before.key] = before.rank
    ranks = rank_of[keys]
    keep = (ranks >= 0) & (ranks < world)
    ranks[~keep] = np.setdiff1d(np.arange(world), ranks[keep], assume_unique=True)
    return ranks


@dataclass(frozen=True)
class GpuTable:
    """Every GPU of a plan, in stage order: key (node index * G + local GPU), rank, layer range."""

    key: np.ndarray
    rank: np.ndarray
    start: np.ndarray
    end: np.ndarray


def gpus_of(plan: Plan, index: Mapping[str, int]) -> GpuTable:
    """The GPU table of `plan`, its nodes numbered by `index` (which must name every node of the plan).

    Flat lists per stage attribute (comprehensions, no Python loop per GPU), then numpy.
    """
    stages = [stage for pipeline in plan.pipelines for stage in pipeline.stages]

    def per_stage(values: Iterable[int]) -> np.ndarray:
        return np.fromiter(values, dtype=np.int64, count=len(stages))

    gpus_lists = list(map(attrgetter("gpus"), stages))
    width = per_stage(map(len, gpus_lists))
    node = per_stage(map(index.__getitem__, map(attrgetter("node"), stages)))
    gpus = np.fromiter(chain.from_iterable(gpus_lists), dtype=np.int64)
    ranks = np.fromiter(chain.from_iterable(map(attrgetter("ranks"), stages)), dtype=np.int64)
    key = np.repeat(node * plan.gpus_per_node, width) + gpus
    start = np.repeat(per_stage(map(attrgetter("start"), stages)), width)
    end = np.repeat(per_stage(map(attrgetter("end"), stages)), width)
    return GpuTable(key, ranks, start, end)


def gpu_table(template: Template) -> np.ndarray:
    """Per GPU of a template, in rank order: (node within the pipeline, local GPU, start, end).

    Cached per template object (read-only: callers copy before changing it)."""
    return known(template, "gpu table", lambda: _make_gpu_table(template))


def _make_gpu_table(template: Template) -> np.ndarray:
    table = np.array(
        [
            (st.node, gpu, st.start, st.end)
            for st in template.stages
            for gpu in range(st.gpu_offset, st.gpu_offset + st.gpus)
        ],
        dtype=np.int64,
    )
    table.flags.writeable = False
    return table


def layer_places(template: Template, gpus_per_node: int, num_layers: int) -> np.ndarray:
    """(G, layers): the template node whose local GPU g runs layer l, -1 where none does. Cached per template."""
    key = ("layer places", gpus_per_node, num_layers)
    return known(template, key, lambda: _make_layer_places(template, gpus_per_node, num_layers))


def _make_layer_places(template: Template, gpus_per_node: int, num_layers: int) -> np.ndarray:
    table = np.full((gpus_per_node, num_layers), -1, dtype=np.int64)
    for node, gpu, start, end in gpu_table(template).tolist():
        table[gpu, start:end] = node
    table.flags.writeable = False
    return table


def arrange(groups: Sequence[tuple[Template, tuple[str, ...]]], held: Held) -> list[tuple[str, ...]]:
    """The nodes of each pipeline in template order, each placed where it keeps the most of what it holds.

    Template node j runs given layers on each local GPU; a node placed there keeps the state its GPUs
    already hold of them (reported gaps aside). Greedy, per pipeline: the (node, place) pairs that keep
    the most bytes first (ties: earlier node, then earlier place), each taken while both are free; the
    nodes keeping nothing fill the free places in order. Losing one node of a pipeline with one layer
    per node then moves one node's layers, not those of every node after the lost one. All pipelines
    at once (their nodes and places numbered one after another), so that numpy sees one batch.
    """
    gpus = held.gpus
    counts = [len(nodes) for _, nodes in groups]
    offsets = np.cumsum([0, *counts])
    flat = [node for _, nodes in groups for node in nodes]
    total = len(flat)
    # Place maps of every pipeline: (pipelines, G, layers), places numbered within their pipeline.
    maps = np.stack([layer_places(t, gpus, len(held.state)) for t, _ in groups])
    group_of = np.repeat(np.arange(len(groups)), counts)
    index = np.fromiter(map(held.index.__getitem__, flat), dtype=np.int64, count=total)
    keys = (index[:, None] * gpus + np.arange(gpus)).ravel()  # (node, GPU) rows, node-major
    start, end = held.start[keys], held.end[keys]
    length = np.where(start >= 0, end - start, 0)
    row = np.repeat(np.arange(len(keys)), length)  # one item per (row, layer it holds)
    layer = start[row] + np.arange(len(row)) - np.repeat(np.cumsum(length) - length, length)
    node = row // gpus
    place = maps[group_of[node], row % gpus, layer]
    ok = place >= 0
    node, layer = node[ok], layer[ok]
    place = place[ok] + offsets[group_of[node]]  # numbered over all pipelines
    pair, where = np.unique(node * total + place, return_inverse=True)
    kept = np.bincount(where, weights=held.state[layer], minlength=len(pair))
    order = np.lexsort((pair % total, pair // total, -kept))  # the greedy's order
    u, v = pair[order] // total, pair[order] % total
    # A pair first both for its node and for its place is taken whatever comes before it: set those
    # aside at once (usually nearly all) and run the greedy over the pairs left.
    top = np.zeros(len(u), dtype=bool)
    top[np.unique(u, return_index=True)[1]] = True
    top[np.setdiff1d(np.arange(len(v)), np.unique(v, return_index=True)[1], assume_unique=True)] = False
    place_of = np.full(total, -1, dtype=np.int64)
    place_of[u[top]] = v[top]
    taken = np.zeros(total, dtype=bool)
    taken[v[top]] = True
    rest = (place_of[u] < 0) & ~taken[v]
    chosen, used = place_of.tolist(), taken.tolist()
    for a, b in zip(u[rest].tolist(), v[rest].tolist()):
        if chosen[a] < 0 and not used[b]:
            chosen[a], used[b] = b, True
    place_of = np.array(chosen, dtype=np.int64)
    # The rest, in order, take the free places; each pipeline has as many of both, so one zip serves all.
    free = np.ones(total, dtype=bool)
    free[place_of[place_of >= 0]] = False
    place_of[place_of < 0] = np.flatnonzero(free)
    at = np.empty(total, dtype=np.int64)
    at[place_of] = np.arange(total)
    order_out = [flat[i] for i in at.tolist()]
    return [tuple(order_out[a:b]) for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]


def places_of(
    groups: Sequence[tuple[int, tuple[str, ...]]], per_gpu: dict[int, np.ndarray], index: dict[str, int]
) -> np.ndarray:
    """Every GPU of a layout in new rank order: rows (node index, local GPU, start, end)."""
    parts = []
    for n, nodes in groups:
        table = per_gpu[n].copy()
        table[:, 0] = np.fromiter(map(index.__getitem__, nodes), dtype=np.int64, count=len(nodes))[table[:, 0]]
        parts.append(table)
    return np.concatenate(parts)


class Held:
    """What every surviving GPU holds before the change, indexed by node index * G + GPU.

    A range per GPU, [start, end) (-1, -1: nothing), as every plan assigns, kept as arrays so that a
    plan's holdings cost no Python loop per layer. Reported holdings need not be a range (a GPU whose
    previous reconfiguration was interrupted holds its old range plus whichever copies arrived): a
    GPU's range then spans its lowest to highest layer, and `gaps` lists the (key, layer) pairs of
    the range it does not hold.
    """

    def __init__(
        self,
        names: list[str],
        gpus_per_node: int,
        state: np.ndarray,
        start: np.ndarray,
        end: np.ndarray,
        gaps: tuple[list[int], list[int]] = ([], []),
        index: dict[str, int] | None = None,
    ) -> None:
        self.names = names
        self.index = {name: i for i, name in enumerate(names)} if index is None else index
        self.gpus = gpus_per_node
        self.state = state
        self.start, self.end = start, end
        self.gaps = tuple(np.array(a, dtype=np.int64) for a in gaps)

    @classmethod
    def from_plan(
        cls, table: GpuTable, gone: set[str], index: dict[str, int], gpus_per_node: int, state: np.ndarray
    ) -> Held:
        """What the surviving GPUs hold according to the plan whose GPUs are `table`: each its [start, end) range.

        `index` numbers the nodes (names in order)."""
        names = list(index)
        start = np.full(len(names) * gpus_per_node, -1, dtype=np.int64)
        end = start.copy()
        start[table.key], end[table.key] = table.start, table.end
        for node in gone:  # a lost node holds nothing
            start[index[node] * gpus_per_node : (index[node] + 1) * gpus_per_node] = -1
            end[index[node] * gpus_per_node : (index[node] + 1) * gpus_per_node] = -1
        return cls(names, gpus_per_node, state, start, end, index=index)

    @classmethod
    def from_holdings(
        cls, held: dict[tuple[str, int], frozenset[int]], names: list[str], gpus_per_node: int, state: np.ndarray
    ) -> Held:
        """Reported holdings: each GPU's range spans its lowest to highest layer, less its gaps."""
        index = {name: i for i, name in enumerate(names)}
        start = np.full(len(names) * gpus_per_node, -1, dtype=np.int64)
        end = start.copy()
        gaps: tuple[list[int], list[int]] = ([], [])
        for (node, gpu), layers in held.items():
            if layers:
                key = index[node] * gpus_per_node + gpu
                start[key], end[key] = min(layers), max(layers) + 1
                missing = sorted(set(range(start[key], end[key])) - layers)
                gaps[0].extend([key] * len(missing))
                gaps[1].extend(missing)
        return cls(names, gpus_per_node, state, start, end, gaps=gaps)

    def orphans(self) -> list[int]:
        """Layers that no surviving GPU holds."""
        num_layers = len(self.state)
        alive = self.start >= 0
        cover = np.zeros(num_layers + 1, dtype=np.int64)
        np.add.at(cover, self.start[alive], 1)
        np.add.at(cover, self.end[alive], -1)
        cover = np.cumsum(cover)[:num_layers]
        np.add.at(cover, self.gaps[1], -1)
        return np.flatnonzero(cover == 0).tolist()

    def _keys(self, places: np.ndarray) -> np.ndarray:
        return places[:, 0] * self.gpus + places[:, 1]

    def _gaps_in(self, places: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The gaps, as (new rank, layer) pairs, that fall inside the rank's new range."""
        keys, layers = self.gaps
        if not len(keys):
            return keys, layers
        rank_of = np.full(len(self.start), -1, dtype=np.int64)
        rank_of[self._keys(places)] = np.arange(len(places))
        ranks = rank_of[keys]
        ok = ranks >= 0
        ranks, layers = ranks[ok], layers[ok]
        inside = (places[ranks, 2] <= layers) & (layers < places[ranks, 3])
        return ranks[inside], layers[inside]

    def missing_bytes(self, places: np.ndarray, prefix: np.ndarray) -> tuple[int, int]:
        """State bytes the GPUs of a layout lack (prefix: cumulative state_bytes by layer): in all, and the
        most that one node's GPUs lack together."""
        keys, start, end = self._keys(places), places[:, 2], places[:, 3]
        old_start, old_end = self.start[keys], self.end[keys]
        low = np.maximum(start, old_start)
        high = np.minimum(end, old_end)
        kept = np.where((old_start >= 0) & (low < high), prefix[np.maximum(high, 0)] - prefix[np.maximum(low, 0)], 0)
        lack = prefix[end] - prefix[start] - kept
        ranks, layers = self._gaps_in(places)
        np.add.at(lack, ranks, self.state[layers])
        short = np.flatnonzero(lack)
        if not len(short):
            return 0, 0
        per_node = np.zeros(len(self.names), dtype=np.int64)
        np.add.at(per_node, places[short, 0], lack[short])
        return int(lack.sum()), int(per_node.max())

    def copies(self, places: np.ndarray, state: list[int]) -> list[dict]:
        """Sources for every layer a GPU of the layout lacks (LayerCopy fields), least-loaded holder first.

        Load is the bytes a source has sent so far, over all layers; ties go to the lower new rank.
        """
        keys = self._keys(places)
        old_start, old_end = self.start[keys], self.end[keys]
        gaps: dict[int, set[int]] = {}  # new rank -> layers of its old range it lacks
        lacking: dict[int, set[int]] = {}  # layer -> new ranks whose old range has it but who lack it
        rank_of = dict(zip(keys.tolist(), range(len(keys)))) if len(self.gaps[0]) else {}
        for key, layer in zip(*(a.tolist() for a in self.gaps)):
            rank = rank_of.get(key)  # None: a GPU the layout does not use, no source and no destination
            if rank is not None:
                gaps.setdefault(rank, set()).add(layer)
                lacking.setdefault(layer, set()).add(rank)
        irregular = np.zeros(len(places), dtype=bool)
        irregular[list(gaps)] = True
        changed = np.flatnonzero((places[:, 2] != old_start) | (places[:, 3] != old_end) | irregular).tolist()
        wanted = []  # (rank, layer) to fill, in rank then layer order
        for rank in changed:
            low, high, less = int(old_start[rank]), int(old_end[rank]), gaps.get(rank, ())
            wanted.extend(
                (rank, layer)
                for layer in range(places[rank, 2], places[rank, 3])
                if not (low <= layer < high and layer not in less)
            )
        if not wanted:
            return []
        survivor = np.flatnonzero(old_start >= 0)  # new ranks of the GPUs that hold state, ascending
        s_start, s_end = old_start[survivor], old_end[survivor]
        holders = {}
        for layer in sorted({w[1] for w in wanted}):
            ranks = survivor[(s_start <= layer) & (layer < s_end)].tolist()
            holders[layer] = [r for r in ranks if r not in lacking[layer]] if layer in lacking else ranks
            if not holders[layer]:  # held only by GPUs the layout leaves idle: no rank to send from
                raise PlanningError(f"layer {layer}: held only by GPUs the new layout does not use")
        # Per layer: its holders by rank, a cursor past those that already sent something, and a heap of
        # (load when pushed, rank) of those. An unused holder's load is 0, so the cursor's is the least of them.
        cursor = dict.fromkeys(holders, 0)
        heaps: dict[int, list[tuple[int, int]]] = {layer: [] for layer in holders}
        sent: dict[int, int] = {}
        copies = []
        for rank, layer in wanted:
            ranks, heap, at = holders[layer], heaps[layer], cursor[layer]
            while at < len(ranks) and ranks[at] in sent:
                heapq.heappush(heap, (sent[ranks[at]], ranks[at]))
                at += 1
            cursor[layer] = at
            while heap and heap[0][0] != sent[heap[0][1]]:  # stale: that source sent another layer since
                heapq.heapreplace(heap, (sent[heap[0][1]], heap[0][1]))
            if at < len(ranks) and (not heap or (0, ranks[at]) < heap[0]):
                source, load = ranks[at], 0
                cursor[layer] = at + 1
            else:
                load, source = heapq.heappop(heap)
            sent[source] = load + state[layer]
            heapq.heappush(heap, (sent[source], source))
            copies.append(
                {
                    "layer": layer,
                    "src_node": self.names[places[source, 0]],
                    "src_gpu": int(places[source, 1]),
                    "src_rank": source,
                    "dst_node": self.names[places[rank, 0]],
                    "dst_gpu": int(places[rank, 1]),
                    "dst_rank": rank,
                    "bytes": state[layer],
                }
            )
        return copies
