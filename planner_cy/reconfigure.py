"""Reconfiguration: the next plan after nodes are lost and/or added, with its layer-copy plan.

Every surviving (and added) node is used. Candidates:
- Oobleck's minimal-movement repairs: a pipeline that lost nodes shrinks to the template of its
  remaining size; a pipeline left without a template size is topped up from added nodes, merged
  with another short pipeline, or borrows nodes from the largest pipeline (which shrinks in turn);
  added nodes left over form new pipelines. Two orders are tried: merge before borrow, and borrow
  before merge.
- A fresh re-instantiation (the optimal pipeline mix for the new node count, instantiate.py), laid
  over the old pipelines so that intact ones stay where they are.
A pipeline that is not an old one kept whole has its nodes arranged (`_arrange`): each node takes the
template position where its GPUs keep the most of the layer state they hold, so that a 97-node pipeline
made from a 98-node one moves about one node's layers, not every layer after the lost node.
Each candidate gets the water-filled batch split and is scored as
    copy_ms + horizon * Z,   copy_ms = (bytes the busiest node receives) / bandwidth,
the layer state every GPU must receive being priced at its state_bytes and summed per receiving node.
The copies run in parallel, each node taking its own over its own inter-node link (`bandwidth`), so
the busiest receiver sets the time, not the total; the sending side is not priced (every layer's
holders share its sends, least-loaded first). Candidates with f + 1 pipelines beat degraded ones;
equal costs go to the fewer bytes in all, then to the earlier candidate (the list above, in order).
Ranks are kept (`stable_ranks`): every surviving GPU whose rank is below the new world size keeps
it, and the other GPUs take the free ranks in layout order, so that one lost node renumbers about
one node's GPUs (the operator patches a worker pod when its ranks change).

The copy plan lists, for every GPU of the new plan that must hold a layer it does not hold, one
source GPU among the survivors that holds it, sources chosen least-loaded first (ties: lower new
rank). A layer without any surviving holder makes LostLayersError (the operator restores a checkpoint).
What a GPU holds is what the previous plan assigns it, or, given `holdings`, what the workers report:
after an interrupted reconfiguration a receiver may lack layers the plan in force gives it (it is
then no source for them, and gets a copy) or still hold layers of its older range (then a source).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

import numpy as np

from oobleck.api.plan import LayerCopy, Plan, Template
from oobleck.api.profile import ModelProfile

from .errors import PlanningError
from .instantiate import Engine, build_plan, check_templates, choose, core, known, template_cost

DEFAULT_HORIZON = 100
"""Iterations a new layout is expected to run: weighs its iteration time against its copy time."""

_MOVES = ("shrink", "drop", "merge", "borrow", "extend")


class LostLayersError(PlanningError):
    """Some layers have no surviving replica: the job must restart from a checkpoint."""

    def __init__(self, layers: list[int], lost: list[str]) -> None:
        self.layers = layers
        super().__init__(
            f"lost: layers {layers} have no surviving replica after losing nodes {lost}; restore from a checkpoint"
        )


@dataclass(frozen=True)
class Candidate:
    """A next layout: pipelines as (template node count, nodes), with the moves that made it."""

    reason: str
    groups: tuple[tuple[int, tuple[str, ...]], ...]


def _check_ids(name: str, ids: Sequence[str]) -> list[str]:
    ids = list(ids)
    if any(not isinstance(n, str) or not n for n in ids):
        raise PlanningError(f"{name}: node ids must be non-empty strings, got {ids}")
    twice = sorted({n for n in ids if ids.count(n) > 1})
    if twice:
        raise PlanningError(f"{name}: listed twice: {twice}")
    return ids


def _partition(total: int, sizes: Sequence[int]) -> list[int] | None:
    """Split `total` into the most parts of the given sizes (largest parts first); None if impossible."""
    most = [-1] * (total + 1)
    most[0] = 0
    for j in range(1, total + 1):
        for n in sizes:
            if n <= j and most[j - n] >= 0 and most[j - n] + 1 > most[j]:
                most[j] = most[j - n] + 1
    if most[total] < 0:
        return None
    parts, j = [], total
    while j:
        n = next(n for n in sorted(sizes, reverse=True) if n <= j and most[j - n] == most[j] - 1)
        parts.append(n)
        j -= n
    return sorted(parts, reverse=True)


def _repair(
    groups: list[list[str]], shrunk: list[bool], added: list[str], sizes: Sequence[int], merge_first: bool
) -> tuple[list[list[str]], set[str]] | None:
    """Oobleck's minimal-movement repair of the surviving groups (see the module docstring)."""
    fits = set(sizes)
    moves: set[str] = set()
    if any(not g for g in groups):
        moves.add("drop")
    work = [list(g) for g in groups if g]
    if any(s and len(g) in fits for g, s in zip(groups, shrunk) if g):
        moves.add("shrink")
    pool = list(added)

    def short() -> list[int]:
        return [i for i, g in enumerate(work) if len(g) not in fits]

    for i in short():  # top up from added nodes
        d = next((d for d in range(1, len(pool) + 1) if len(work[i]) + d in fits), None)
        if d is not None:
            work[i] += pool[:d]
            del pool[:d]
            moves.add("extend")

    def merge() -> None:
        while True:
            todo = short()
            pair = next(((i, j) for i in todo for j in todo if i < j and len(work[i]) + len(work[j]) in fits), None)
            if pair is None:
                return
            i, j = pair
            work[i] += work.pop(j)
            moves.add("merge")

    def borrow() -> bool:
        for i in short():
            donors = [j for j in range(len(work)) if j != i and len(work[j]) in fits]
            if donors:
                donor = max(donors, key=lambda j: (len(work[j]), -j))
                room = len(work[donor])
                d = next((d for d in range(1, room) if len(work[i]) + d in fits and room - d in fits), None)
                if d is not None:
                    work[i] += work[donor][room - d :]
                    del work[donor][room - d :]
                    moves.add("borrow")
                    continue
            # Nothing to borrow: join the smallest group that makes a template size.
            partner = min(
                (j for j in range(len(work)) if j != i and len(work[i]) + len(work[j]) in fits),
                key=lambda j: (len(work[j]), j),
                default=None,
            )
            if partner is None:
                return False
            low, high = sorted((i, partner))
            work[low] += work.pop(high)
            moves.add("merge")
            return True  # indices moved: rescan
        return True

    if merge_first:
        merge()
    for _ in range(len(work) + 1):
        if not short():
            break
        if not borrow():
            return None
    if short():
        return None
    if pool:
        parts = _partition(len(pool), sizes)
        if parts is None:
            # Too few added nodes for a pipeline of their own: grow existing pipelines one node at a time.
            for node in pool:
                target = min(
                    (j for j in range(len(work)) if len(work[j]) + 1 in fits),
                    key=lambda j: (len(work[j]), j),
                    default=None,
                )
                if target is None:
                    return None
                work[target].append(node)
        else:
            taken = 0
            for n in parts:
                work.append(pool[taken : taken + n])
                taken += n
        moves.add("extend")
    return work, moves


def _fresh(groups: list[list[str]], intact: list[bool], added: list[str], needed: list[int]) -> list[list[str]]:
    """Lay an instantiation's pipeline sizes over the survivors, keeping whole groups where sizes allow."""
    needed = sorted(needed, reverse=True)
    kept: list[list[str]] = []
    rest: list[list[str]] = []
    # Intact pipelines first (no copy at all), then shrunk groups that happen to fit a needed size.
    for want_intact in (True, False):
        for g, whole in zip(groups, intact):
            if whole == want_intact and g:
                if len(g) in needed:
                    needed.remove(len(g))
                    kept.append(g)
                else:
                    rest.append(g)
    pool = [n for g in sorted(rest, key=len, reverse=True) for n in g] + list(added)
    taken = 0
    for n in needed:
        kept.append(pool[taken : taken + n])
        taken += n
    return kept


@dataclass(frozen=True)
class Scored:
    """A candidate as priced: cost = busiest_bytes / bandwidth + horizon * Z (ms); copy_bytes breaks ties."""

    reason: str
    pipelines: int
    copy_bytes: int  # all layer state copied
    busiest_bytes: int  # what the node receiving the most takes in: the copies run in parallel, node by node
    iteration_ms: float
    cost_ms: float
    degraded: bool


@dataclass(frozen=True)
class NextLayout:
    """The chosen next layout before it becomes a Plan (what `reconfigure` validates and lays out)."""

    reason: str
    pipelines: list[tuple[Template, tuple[str, ...]]]
    microbatches: list[int]
    copies: list[dict]
    lost: list[str]
    added: list[str]
    gpus_per_node: int
    considered: list[Scored]  # every valid candidate, in candidate order
    chosen: int  # index into considered: the best (non-degraded first, then cost, then order)
    ranks: list[int]  # the rank of every GPU of `pipelines`, in layout order (stable_ranks)


def reconfigure(
    plan: Plan,
    templates: Sequence[Template],
    profile: ModelProfile | Sequence[int],
    lost: Iterable[str] = (),
    added: Iterable[str] = (),
    *,
    bandwidth: float,
    horizon: int = DEFAULT_HORIZON,
    engine: Engine = "compiled",
    holdings: Holdings | None = None,
) -> Plan:
    """The next plan (generation + 1) after losing `lost` nodes and gaining `added` ones.

    `profile` may be just the per-layer state bytes: the copies are all this reads from it (the
    timings are in the templates). `bandwidth` (bytes/s) prices the layer copies; `horizon`
    iterations price the iteration time.
    `holdings` is what each surviving (node, GPU) really holds (a GPU left out holds nothing); None
    means what `plan` assigns. With holdings, `lost` and `added` may both be empty: the same nodes,
    re-laid out and topped up so that every GPU holds its layers (after an interrupted reconfiguration).
    Raises LostLayersError when a layer has no surviving replica, PlanningError for bad input or
    when the remaining nodes cannot form any pipeline.
    """
    chosen = next_layout(
        plan, templates, profile, lost, added, bandwidth=bandwidth, horizon=horizon, engine=engine, holdings=holdings
    )
    return to_plan(plan, templates, chosen)


def to_plan(plan: Plan, templates: Sequence[Template], chosen: NextLayout) -> Plan:
    """The Plan of a chosen next layout: generation + 1 of `plan`."""
    return build_plan(
        job=plan.job,
        generation=plan.generation + 1,
        templates=templates,
        gpus_per_node=chosen.gpus_per_node,
        f=plan.f,
        pipelines=chosen.pipelines,
        microbatches=chosen.microbatches,
        copies=chosen.copies,
        lost=chosen.lost,
        added=chosen.added,
        reason=chosen.reason,
        ranks=chosen.ranks,
    )


def next_layout(
    plan: Plan,
    templates: Sequence[Template],
    profile: ModelProfile | Sequence[int],
    lost: Iterable[str] = (),
    added: Iterable[str] = (),
    *,
    bandwidth: float,
    horizon: int = DEFAULT_HORIZON,
    engine: Engine = "compiled",
    holdings: Holdings | None = None,
) -> NextLayout:
    """Choose the next layout (see `reconfigure`; the module docstring says how)."""
    lost = _check_ids("lost", list(lost))
    added = _check_ids("added", list(added))
    if not lost and not added and holdings is None:
        raise PlanningError("lost, added: both empty; nothing to reconfigure")
    current = plan.nodes
    present = set(current)
    unknown = [n for n in lost if n not in present]
    if unknown:
        raise PlanningError(f"lost: nodes {unknown} are not in plan generation {plan.generation}")
    again = [n for n in added if n in present]
    if again:
        raise PlanningError(f"added: nodes {again} are already in plan generation {plan.generation}")
    if not bandwidth > 0:
        raise PlanningError(f"bandwidth: must be > 0 bytes/s, got {bandwidth}")
    if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 0:
        raise PlanningError(f"horizon: must be an integer >= 0, got {horizon!r}")
    num_layers, gpus_per_node = check_templates(templates, plan.gpus_per_node)
    state_bytes = _state_bytes(profile)
    if num_layers != plan.num_layers or len(state_bytes) != plan.num_layers:
        raise PlanningError(
            f"templates, profile: {num_layers} and {len(state_bytes)} layers, the plan has {plan.num_layers}"
        )
    gone = set(lost)
    lost = [n for n in current if n in gone]  # plan order, for a canonical record
    if len(gone) == len(current) and not added:
        raise PlanningError(f"lost: all {len(current)} nodes of the plan are lost and none added")
    state = np.array(state_bytes, dtype=np.int64)
    prefix = np.concatenate(([0], np.cumsum(state)))
    names = current + added
    number = {name: i for i, name in enumerate(names)}
    before = _gpus_of(plan, number)  # one pass over the plan's stages
    if holdings is None:  # what the plan assigns: ranges, filled in without a Python loop per layer
        held = _Held.from_plan(before, gone, number, gpus_per_node, state)
    else:
        holdings = _check_holdings(holdings, current, gone, gpus_per_node, num_layers)
        held = _Held.from_holdings(holdings, current + added, gpus_per_node, state)
    orphans = held.orphans()
    if orphans:
        raise LostLayersError(orphans, lost)

    by_size = {t.nodes: t for t in templates}
    sizes = sorted(by_size)
    costs = {n: template_cost(t) for n, t in by_size.items()}
    groups = [[n for n in p.nodes if n not in gone] for p in plan.pipelines]
    shrunk = [len(g) < len(p.nodes) for g, p in zip(groups, plan.pipelines)]
    intact = [not s and p.template_nodes in by_size for s, p in zip(shrunk, plan.pipelines)]
    survivors = sum(len(g) for g in groups) + len(added)

    repairs: list[Candidate] = []
    for merge_first in (True, False):
        repaired = _repair(groups, shrunk, added, sizes, merge_first)
        if repaired is not None:
            work, moves = repaired
            reason = "+".join(m for m in _MOVES if m in moves) or ("shrink" if lost else "resync")
            repairs.append(Candidate(reason, tuple((len(g), tuple(g)) for g in work)))

    kept = {(p.template_nodes, tuple(p.nodes)) for p in plan.pipelines}
    # Pipelines laid out as before keep their order; the others are arranged once (two candidates may share one).
    arranged: dict[tuple[int, tuple[str, ...]], tuple[str, ...]] = {g: g[1] for g in kept}
    per_gpu: dict[int, np.ndarray] = {}
    seen: set[Candidate] = set()
    best = None
    considered: list[Scored] = []

    def score(candidate: Candidate, index: int) -> None:
        nonlocal best
        if candidate in seen:
            return
        seen.add(candidate)
        # Plan order: largest template first, then by where the first node stood before.
        groups_sorted = sorted(candidate.groups, key=lambda g: (-g[0], number[g[1][0]]))
        todo = [g for g in dict.fromkeys(groups_sorted) if g not in arranged]
        arranged.update(zip(todo, _arrange([(by_size[n], nodes) for n, nodes in todo], held) if todo else ()))
        groups_sorted = [(n, arranged[n, nodes]) for n, nodes in groups_sorted]
        base = np.array([costs[n].base_ms for n, _ in groups_sorted], dtype=np.float64)
        slope = np.array([costs[n].slope_ms for n, _ in groups_sorted], dtype=np.float64)
        limits = np.array([costs[n].limit(plan.global_microbatches) for n, _ in groups_sorted], dtype=np.int64)
        nb = core(engine).split(base, slope, limits, plan.global_microbatches)
        if nb is None:
            return  # more pipelines than microbatches, or not enough memory for the batch
        nb = [int(v) for v in nb]
        z = max(costs[n].at(m) for (n, _), m in zip(groups_sorted, nb))
        for n, _ in groups_sorted:
            if n not in per_gpu:
                per_gpu[n] = _gpu_table(by_size[n])
        # A pipeline kept as the plan laid it out lacks nothing (unless workers report otherwise): price the rest.
        priced = groups_sorted if holdings is not None else [g for g in groups_sorted if g not in kept]
        moved, busiest = held.missing_bytes(_places(priced, per_gpu, held.index), prefix) if priced else (0, 0)
        cost = busiest / bandwidth * 1e3 + horizon * z
        degraded = len(groups_sorted) < plan.f + 1
        considered.append(Scored(candidate.reason, len(groups_sorted), moved, busiest, z, cost, degraded))
        key = (degraded, cost, moved, index)
        if best is None or key < best[0]:
            best = (key, candidate.reason, groups_sorted, nb, len(considered) - 1)

    for index, candidate in enumerate(repairs):
        score(candidate, index)
    ordered = sorted(sizes, reverse=True)
    healthy = [c.iteration_ms for c in considered if not c.degraded]
    try:
        choice = choose(
            [costs[n] for n in ordered],
            survivors,
            plan.f,
            plan.global_microbatches,
            allow_degraded=True,
            engine=engine,
            upper=min(healthy, default=math.inf),  # a repair's Z bounds the search (the choice is the same)
        )
    except PlanningError:
        choice = None  # the repairs may still find a layout; if not, the error below names the numbers
    if choice is not None:
        needed = [n for n, c in zip(ordered, choice.counts) for _ in range(c)]
        fresh = _fresh(groups, intact, added, needed)
        score(Candidate("reinstantiate", tuple((len(g), tuple(g)) for g in fresh)), len(repairs))
    if best is None:
        raise PlanningError(
            f"nodes: the {survivors} remaining nodes cannot form pipelines of {sizes} nodes "
            f"for {plan.global_microbatches} microbatches"
        )
    _, reason, groups_sorted, nb, chosen = best
    pipelines = [(by_size[n], nodes) for n, nodes in groups_sorted]
    places = _places(groups_sorted, per_gpu, held.index)
    ranks = stable_ranks(before, places, gpus_per_node)
    by_rank = np.empty_like(places)
    by_rank[ranks] = places
    copies = held.copies(by_rank, state.tolist())
    return NextLayout(reason, pipelines, nb, copies, lost, added, gpus_per_node, considered, chosen, ranks.tolist())


def stable_ranks(before: _GpuTable, places: np.ndarray, gpus_per_node: int) -> np.ndarray:
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
class _GpuTable:
    """Every GPU of a plan, in stage order: key (node index * G + local GPU), rank, layer range."""

    key: np.ndarray
    rank: np.ndarray
    start: np.ndarray
    end: np.ndarray


def _gpus_of(plan: Plan, index: Mapping[str, int]) -> _GpuTable:
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
    return _GpuTable(key, ranks, start, end)


Holdings = Mapping[tuple[str, int], Iterable[int]]
"""(node, local GPU) -> the layers that GPU holds."""


def _state_bytes(profile: ModelProfile | Sequence[int]) -> list[int]:
    """Per-layer state bytes of a profile, or the list itself, checked."""
    if isinstance(profile, ModelProfile):
        return [layer.state_bytes for layer in profile.layers]
    state = list(profile)
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in state):
        raise PlanningError(f"profile: state bytes must be integers >= 0, got {state}")
    return state


def _check_holdings(
    holdings: Holdings, current: list[str], gone: set[str], gpus_per_node: int, num_layers: int
) -> dict[tuple[str, int], frozenset[int]]:
    """Validated holdings of the surviving GPUs; a GPU of a lost or unknown node is an error, not ignored."""
    alive = set(current) - gone
    out = {}
    for key, layers in holdings.items():
        if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and isinstance(key[1], int)):
            raise PlanningError(f"holdings: keys must be (node, gpu) pairs, got {key!r}")
        node, gpu = key
        if node not in alive:
            raise PlanningError(f"holdings: node {node!r} is not a surviving node of the plan")
        if not 0 <= gpu < gpus_per_node:
            raise PlanningError(f"holdings: ({node!r}, {gpu}): the GPU is outside 0..{gpus_per_node - 1}")
        layers = frozenset(layers)
        bad = sorted(x for x in layers if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < num_layers)
        if bad:
            raise PlanningError(f"holdings: ({node!r}, {gpu}) holds layers {bad} outside 0..{num_layers - 1}")
        out[key] = layers
    return dict(sorted(out.items()))


def layout_copies(plan: Plan, holdings: Holdings, state_bytes: Sequence[int]) -> list[LayerCopy]:
    """The copies that make every rank of `plan` hold its layers, from GPUs of `plan` that hold them.

    The copy plan `reconfigure` makes, for a layout already chosen (same sources, same order).
    Raises LostLayersError naming the layers no GPU holds.
    """
    state_bytes = _state_bytes(state_bytes)
    if len(state_bytes) != plan.num_layers:
        raise PlanningError(f"state_bytes: {len(state_bytes)} layers, the plan has {plan.num_layers}")
    holdings = _check_holdings(holdings, plan.nodes, set(), plan.gpus_per_node, plan.num_layers)
    state = np.array(state_bytes, dtype=np.int64)
    held = _Held.from_holdings(holdings, plan.nodes, plan.gpus_per_node, state)
    orphans = held.orphans()
    if orphans:
        raise LostLayersError(orphans, [])
    index = held.index
    places = np.array([(index[a.node], a.gpu, a.start, a.end) for a in plan.ranks], dtype=np.int64).reshape(-1, 4)
    return [LayerCopy(**c) for c in held.copies(places, state_bytes)]


def _gpu_table(template: Template) -> np.ndarray:
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


def _layer_places(template: Template, gpus_per_node: int, num_layers: int) -> np.ndarray:
    """(G, layers): the template node whose local GPU g runs layer l, -1 where none does. Cached per template."""
    key = ("layer places", gpus_per_node, num_layers)
    return known(template, key, lambda: _make_layer_places(template, gpus_per_node, num_layers))


def _make_layer_places(template: Template, gpus_per_node: int, num_layers: int) -> np.ndarray:
    table = np.full((gpus_per_node, num_layers), -1, dtype=np.int64)
    for node, gpu, start, end in _gpu_table(template).tolist():
        table[gpu, start:end] = node
    table.flags.writeable = False
    return table


def _arrange(groups: Sequence[tuple[Template, tuple[str, ...]]], held: _Held) -> list[tuple[str, ...]]:
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
    maps = np.stack([_layer_places(t, gpus, len(held.state)) for t, _ in groups])
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


def _places(
    groups: Sequence[tuple[int, tuple[str, ...]]], per_gpu: dict[int, np.ndarray], index: dict[str, int]
) -> np.ndarray:
    """Every GPU of a layout in new rank order: rows (node index, local GPU, start, end)."""
    parts = []
    for n, nodes in groups:
        table = per_gpu[n].copy()
        table[:, 0] = np.fromiter(map(index.__getitem__, nodes), dtype=np.int64, count=len(nodes))[table[:, 0]]
        parts.append(table)
    return np.concatenate(parts)


class _Held:
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
        cls, table: _GpuTable, gone: set[str], index: dict[str, int], gpus_per_node: int, state: np.ndarray
    ) -> _Held:
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
    ) -> _Held:
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
