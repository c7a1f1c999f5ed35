"""Reconfiguration: the next plan after nodes are lost and/or added, with its layer-copy plan.

Every surviving (and added) node is used. Candidates:
- Oobleck's minimal-movement repairs: a pipeline that lost nodes shrinks to the template of its
  remaining size; a pipeline left without a template size is topped up from added nodes, merged
  with another short pipeline, or borrows nodes from the largest pipeline (which shrinks in turn);
  added nodes left over form new pipelines. Two orders are tried: merge before borrow, and borrow
  before merge.
- A fresh re-instantiation (the optimal pipeline mix for the new node count, instantiate.py), laid
  over the old pipelines so that intact ones stay where they are.
A pipeline that is not an old one kept whole has its nodes arranged (`arrange`): each node takes the
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

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from oobleck.api.plan import LayerCopy, Plan, Template
from oobleck.api.profile import ModelProfile

from .errors import PlanningError
from .instantiate import Engine, build_plan, check_templates, choose, core, template_cost
from .placement import Held, arrange, gpu_table, gpus_of, places_of, stable_ranks
from .repairs import MOVES, Candidate, check_ids, fresh, repair

DEFAULT_HORIZON = 100
"""Iterations a new layout is expected to run: weighs its iteration time against its copy time."""


class LostLayersError(PlanningError):
    """Some layers have no surviving replica: the job must restart from a checkpoint."""

    def __init__(self, layers: list[int], lost: list[str]) -> None:
        self.layers = layers
        super().__init__(
            f"lost: layers {layers} have no surviving replica after losing nodes {lost}; restore from a checkpoint"
        )


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


def _check_request(
    plan: Plan,
    templates: Sequence[Template],
    profile: ModelProfile | Sequence[int],
    lost: Iterable[str],
    added: Iterable[str],
    bandwidth: float,
    horizon: int,
    holdings: Holdings | None,
) -> tuple[list[str], list[str], int, list[int]]:
    """The request's checks: (lost nodes in plan order, added nodes, GPUs per node, each layer's state bytes)."""
    lost = check_ids("lost", list(lost))
    added = check_ids("added", list(added))
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
    if len(gone) == len(current) and not added:
        raise PlanningError(f"lost: all {len(current)} nodes of the plan are lost and none added")
    return [n for n in current if n in gone], added, gpus_per_node, state_bytes


class _Pricer:
    """Prices candidates as busiest receiver's copy time + horizon * Z and keeps the best (the module
    docstring's order); arranges each pipeline that is not kept as laid out once, however many candidates
    share it."""

    def __init__(
        self,
        plan: Plan,
        by_size: Mapping[int, Template],
        held: Held,
        number: Mapping[str, int],
        bandwidth: float,
        horizon: int,
        engine: Engine,
        price_kept: bool,
    ) -> None:
        self.plan, self.by_size, self.held, self.number = plan, by_size, held, number
        self.bandwidth, self.horizon, self.engine = bandwidth, horizon, engine
        self.costs = {n: template_cost(t) for n, t in by_size.items()}
        self.kept = {(p.template_nodes, tuple(p.nodes)) for p in plan.pipelines}
        # A pipeline kept as the plan laid it out lacks nothing, unless workers report otherwise (price_kept).
        self.price_kept = price_kept
        self.arranged: dict[tuple[int, tuple[str, ...]], tuple[str, ...]] = {g: g[1] for g in self.kept}
        self.per_gpu: dict[int, np.ndarray] = {}
        self.prefix = np.concatenate(([0], np.cumsum(np.array(held.state, dtype=np.int64))))
        self.seen: set[Candidate] = set()
        self.considered: list[Scored] = []
        self.best: tuple | None = None

    def score(self, candidate: Candidate, index: int) -> None:
        if candidate in self.seen:
            return
        self.seen.add(candidate)
        plan, costs = self.plan, self.costs
        # Plan order: largest template first, then by where the first node stood before.
        groups = sorted(candidate.groups, key=lambda g: (-g[0], self.number[g[1][0]]))
        todo = [g for g in dict.fromkeys(groups) if g not in self.arranged]
        if todo:
            self.arranged.update(zip(todo, arrange([(self.by_size[n], nodes) for n, nodes in todo], self.held)))
        groups = [(n, self.arranged[n, nodes]) for n, nodes in groups]
        base = np.array([costs[n].base_ms for n, _ in groups], dtype=np.float64)
        slope = np.array([costs[n].slope_ms for n, _ in groups], dtype=np.float64)
        limits = np.array([costs[n].limit(plan.global_microbatches) for n, _ in groups], dtype=np.int64)
        split = core(self.engine).split(base, slope, limits, plan.global_microbatches)
        if split is None:
            return  # more pipelines than microbatches, or not enough memory for the batch
        nb = [int(v) for v in split]
        z = max(costs[n].at(m) for (n, _), m in zip(groups, nb))
        for n, _ in groups:
            if n not in self.per_gpu:
                self.per_gpu[n] = gpu_table(self.by_size[n])
        priced = groups if self.price_kept else [g for g in groups if g not in self.kept]
        moved, busiest = (
            self.held.missing_bytes(places_of(priced, self.per_gpu, self.held.index), self.prefix) if priced else (0, 0)
        )
        cost = busiest / self.bandwidth * 1e3 + self.horizon * z
        degraded = len(groups) < plan.f + 1
        self.considered.append(Scored(candidate.reason, len(groups), moved, busiest, z, cost, degraded))
        key = (degraded, cost, moved, index)
        if self.best is None or key < self.best[0]:
            self.best = (key, candidate.reason, groups, nb, len(self.considered) - 1)


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
    lost, added, gpus_per_node, state_bytes = _check_request(
        plan, templates, profile, lost, added, bandwidth, horizon, holdings
    )
    current, gone = plan.nodes, set(lost)
    num_layers = plan.num_layers
    state = np.array(state_bytes, dtype=np.int64)
    number = {name: i for i, name in enumerate(current + added)}
    before = gpus_of(plan, number)  # one pass over the plan's stages
    if holdings is None:  # what the plan assigns: ranges, filled in without a Python loop per layer
        held = Held.from_plan(before, gone, number, gpus_per_node, state)
    else:
        holdings = _check_holdings(holdings, current, gone, gpus_per_node, num_layers)
        held = Held.from_holdings(holdings, current + added, gpus_per_node, state)
    orphans = held.orphans()
    if orphans:
        raise LostLayersError(orphans, lost)

    by_size = {t.nodes: t for t in templates}
    sizes = sorted(by_size)
    groups = [[n for n in p.nodes if n not in gone] for p in plan.pipelines]
    shrunk = [len(g) < len(p.nodes) for g, p in zip(groups, plan.pipelines)]
    intact = [not s and p.template_nodes in by_size for s, p in zip(shrunk, plan.pipelines)]
    survivors = sum(len(g) for g in groups) + len(added)
    pricer = _Pricer(plan, by_size, held, number, bandwidth, horizon, engine, price_kept=holdings is not None)

    repairs: list[Candidate] = []
    for merge_first in (True, False):
        repaired = repair(groups, shrunk, added, sizes, merge_first)
        if repaired is not None:
            work, moves = repaired
            reason = "+".join(m for m in MOVES if m in moves) or ("shrink" if lost else "resync")
            repairs.append(Candidate(reason, tuple((len(g), tuple(g)) for g in work)))
    for index, candidate in enumerate(repairs):
        pricer.score(candidate, index)
    ordered = sorted(sizes, reverse=True)
    healthy = [c.iteration_ms for c in pricer.considered if not c.degraded]
    try:
        choice = choose(
            [pricer.costs[n] for n in ordered],
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
        laid = fresh(groups, intact, added, needed)
        pricer.score(Candidate("reinstantiate", tuple((len(g), tuple(g)) for g in laid)), len(repairs))
    if pricer.best is None:
        raise PlanningError(
            f"nodes: the {survivors} remaining nodes cannot form pipelines of {sizes} nodes "
            f"for {plan.global_microbatches} microbatches"
        )
    _, reason, chosen_groups, nb, chosen = pricer.best
    pipelines = [(by_size[n], nodes) for n, nodes in chosen_groups]
    places = places_of(chosen_groups, pricer.per_gpu, held.index)
    ranks = stable_ranks(before, places, gpus_per_node)
    by_rank = np.empty_like(places)
    by_rank[ranks] = places
    copies = held.copies(by_rank, state.tolist())
    return NextLayout(
        reason, pipelines, nb, copies, lost, added, gpus_per_node, pricer.considered, chosen, ranks.tolist()
    )


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
    held = Held.from_holdings(holdings, plan.nodes, plan.gpus_per_node, state)
    orphans = held.orphans()
    if orphans:
        raise LostLayersError(orphans, [])
    index = held.index
    places = np.array([(index[a.node], a.gpu, a.start, a.end) for a in plan.ranks], dtype=np.int64).reshape(-1, 4)
    return [LayerCopy(**c) for c in held.copies(places, state_bytes)]
