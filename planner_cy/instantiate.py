"""Instantiation and batch distribution: templates + nodes + batch -> a plan of generation 0.

Cost model (shared with templates.py): a template's pipeline running m microbatches with 1F1B takes
T(m) = base + (m - 1) * slope, where slope is its slowest stage (forward + backward) and base = T(1)
adds every stage and the activation transfers between them. A template records T(m_ref), so both
numbers are recovered from it alone (`template_cost`).

The problem (exact): choose x_t pipelines of each template t with sum x_t * n_t = N (every node used)
and f + 1 <= sum x_t <= B, and microbatches nb_i >= 1 per pipeline with sum nb_i = B, minimising
Z = max_i T_i(nb_i). For a candidate Z a pipeline of t can take cap_t(Z) = #{m : T_t(m) <= Z}
microbatches, so Z is feasible iff some x has sum x_t * cap_t(Z) >= B: a knapsack over node counts
(pipeline counts capped at f + 1; tracked exactly up to B only when B could bind). The least feasible Z
is found by binary search over the candidate values T_t(m); the split then water-fills the batch.
The compiled core (_instantiate.pyx) does the numeric work; ref_instantiate.py is its reference.

Layout conventions: pipelines are ordered by template size (largest first), nodes are taken in the
order given, ranks are numbered pipeline by pipeline, stage by stage, GPU by GPU, and each pipeline
runs a contiguous block of global microbatch indices in pipeline order.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import Literal, TypeVar

import numpy as np

from oobleck.api.plan import LayerCopy, Plan, Template
from oobleck.api.profile import ClusterShape, ModelProfile

from . import ref_instantiate
from .errors import PlanningError

Engine = Literal["compiled", "reference"]
_T = TypeVar("_T")


def core(engine: Engine) -> ModuleType:
    """The module doing the numeric work: the compiled core or its plain-Python reference."""
    if engine == "compiled":
        from . import _instantiate

        return _instantiate
    if engine == "reference":
        return ref_instantiate
    raise PlanningError(f"engine: must be 'compiled' or 'reference', got {engine!r}")


@dataclass(frozen=True)
class TemplateCost:
    """T(m) = base_ms + (m - 1) * slope_ms for a template of `nodes` nodes, m <= max_microbatches."""

    nodes: int
    base_ms: float
    slope_ms: float
    max_microbatches: int | None  # None: any count fits in memory
    m_ref: int = 1  # the count the template was optimised for (named in errors)

    def limit(self, microbatches: int) -> int:
        """The most of `microbatches` one pipeline of this template may run."""
        return microbatches if self.max_microbatches is None else min(self.max_microbatches, microbatches)

    def at(self, microbatches: int) -> float:
        """Iteration time with `microbatches` microbatches (same arithmetic as the compiled core)."""
        return ref_instantiate.t_of(self.base_ms, self.slope_ms, microbatches)


class _ByIdentity:
    """Facts about immutable objects (templates), cached by identity: a reconfiguration re-reads the same
    templates every time, ~5000 stages at 1024 nodes. An entry keeps its object alive, so its id cannot be
    reused while cached."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self.entries: OrderedDict[tuple[int, Hashable], tuple[object, object]] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, obj: object, extra: Hashable, compute: Callable[[], _T]) -> _T:
        key = (id(obj), extra)
        with self.lock:
            hit = self.entries.get(key)
            if hit is not None and hit[0] is obj:
                self.entries.move_to_end(key)
                return hit[1]  # type: ignore[return-value]
        value = compute()  # outside the lock: errors propagate and are not cached
        with self.lock:
            self.entries[key] = (obj, value)
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)
        return value


_KNOWN = _ByIdentity()


def known(obj: object, what: Hashable, compute: Callable[[], _T]) -> _T:
    """`compute()`, cached per (object identity, what): for facts derived from immutable templates."""
    return _KNOWN.get(obj, what, compute)


def template_cost(template: Template) -> TemplateCost:
    """Recover T(1) and the slowest stage time from a template's T(m_ref) (cached per template object)."""
    return _KNOWN.get(template, "cost", lambda: _template_cost(template))


def _template_cost(template: Template) -> TemplateCost:
    slope = max(stage.forward_ms + stage.backward_ms for stage in template.stages)
    base = template.iteration_ms - (template.m_ref - 1) * slope
    # T(1) sums every stage, so it is at least the slowest one; allow rounding noise only.
    if base < slope * (1 - 1e-9) - 1e-9:
        raise PlanningError(
            f"templates[nodes={template.nodes}]: iteration_ms {template.iteration_ms} is below "
            f"m_ref * slowest stage = {template.m_ref} * {slope}"
        )
    # The template records the most microbatches its memory holds (the rule checked at that count).
    limit = template.max_microbatches
    return TemplateCost(template.nodes, max(base, slope), slope, limit, template.m_ref)


def check_templates(templates: Sequence[Template], gpus_per_node: int | None = None) -> tuple[int, int]:
    """Validate templates against each other; returns (num_layers, gpus_per_node).

    gpus_per_node defaults to the most GPUs any template places on one node.
    """
    if not templates:
        raise PlanningError("templates: empty; need at least one pipeline template")
    sizes = [t.nodes for t in templates]
    if len(set(sizes)) != len(sizes):
        raise PlanningError(f"templates: node counts must be distinct, got {sorted(sizes)}")
    widest = max(_KNOWN.get(t, "widest", partial(_widest, t)) for t in templates)
    if gpus_per_node is None:
        gpus_per_node = widest
    if gpus_per_node < 1 or gpus_per_node & (gpus_per_node - 1):
        raise PlanningError(f"gpus_per_node: must be a power of two, got {gpus_per_node}")
    num_layers = templates[0].stages[-1].end
    for t in templates:
        _KNOWN.get(t, ("layout", gpus_per_node, num_layers), partial(_check_layout, t, gpus_per_node, num_layers))
    return num_layers, gpus_per_node


def _widest(t: Template) -> int:
    return max(stage.gpu_offset + stage.gpus for stage in t.stages)


def _check_layout(t: Template, gpus_per_node: int, num_layers: int) -> bool:
    """One template's stages: contiguous over every layer, each on its nodes' GPUs, none shared."""
    where = f"templates[nodes={t.nodes}]"
    if (
        t.stages[0].start != 0
        or t.stages[-1].end != num_layers
        or any(a.end != b.start for a, b in zip(t.stages, t.stages[1:]))
    ):
        raise PlanningError(f"{where}: stages must cover layers 0..{num_layers} contiguously")
    used: dict[int, int] = {}  # node -> bitmask of the GPUs its stages use
    for s in t.stages:
        if s.start >= s.end:
            raise PlanningError(f"{where}: stage [{s.start}, {s.end}) holds no layer")
        if s.node >= t.nodes:
            raise PlanningError(f"{where}: a stage sits on node {s.node}, the template has {t.nodes} nodes")
        if s.gpu_offset + s.gpus > gpus_per_node:
            raise PlanningError(
                f"{where}: a stage uses GPUs {s.gpu_offset}..{s.gpu_offset + s.gpus - 1}, "
                f"gpus_per_node is {gpus_per_node}"
            )
        gpus = ((1 << s.gpus) - 1) << s.gpu_offset
        if used.get(s.node, 0) & gpus:
            raise PlanningError(f"{where}: two stages share a GPU on node {s.node}")
        used[s.node] = used.get(s.node, 0) | gpus
    if len(used) != t.nodes:
        raise PlanningError(f"{where}: nodes {sorted(set(range(t.nodes)) - set(used))} host no stage")
    return True


@dataclass(frozen=True)
class Choice:
    """Pipelines per template (templates in the order given to `choose`) and the iteration time they reach."""

    counts: tuple[int, ...]
    iteration_ms: float
    degraded: bool


def choose(
    costs: Sequence[TemplateCost],
    n_nodes: int,
    f: int,
    microbatches: int,
    *,
    allow_degraded: bool,
    engine: Engine,
    upper: float = math.inf,
) -> Choice:
    """Pick x_t (see the module docstring); PlanningError names the binding number when none exists.

    `upper`: the iteration time of a layout of these nodes already known (with f+1 pipelines or more):
    the search starts below it. The choice does not depend on it."""
    impl = core(engine)
    sizes = np.array([c.nodes for c in costs], dtype=np.int64)
    base = np.array([c.base_ms for c in costs], dtype=np.float64)
    slope = np.array([c.slope_ms for c in costs], dtype=np.float64)
    limits = np.array([c.limit(microbatches) for c in costs], dtype=np.int64)
    shown = sorted(int(n) for n in sizes)
    most = impl.max_pipelines(sizes, n_nodes)
    if most < 0:
        raise PlanningError(f"nodes: {n_nodes} nodes cannot be split exactly into pipelines of {shown} nodes")
    if most <= microbatches:
        top = most  # the count limit cannot bind
    else:
        # Pipeline counts that use every node and can each get a microbatch.
        possible = np.flatnonzero(impl.pipeline_counts(sizes, n_nodes, microbatches))
        if possible.size == 0:
            fewest = int(np.flatnonzero(impl.pipeline_counts(sizes, n_nodes, most))[0])
            raise PlanningError(
                f"global_microbatches: {microbatches} is fewer than the {fewest} pipelines that {n_nodes} nodes "
                f"form at least (templates of {shown} nodes); every pipeline needs a microbatch"
            )
        top = int(possible[-1])
    wanted = f + 1
    degraded = top < wanted
    if degraded:
        if not allow_degraded:
            if wanted > microbatches:
                raise PlanningError(
                    f"global_microbatches: {microbatches} cannot feed f+1 = {wanted} pipelines (one microbatch each)"
                )
            raise PlanningError(
                f"nodes: {n_nodes} nodes form at most {top} pipelines of {shown} nodes "
                f"with {microbatches} microbatches; f = {f} needs f+1 = {wanted}"
            )
        wanted = top
    # Every mix has at most `microbatches` pipelines here, so templates that two others replace without
    # loss can be dropped exactly (see _instantiate.dominated): usually every size of 2*n0 nodes or more.
    keep = ~impl.dominated(sizes, base, slope, limits) if most <= microbatches else np.ones(len(costs), dtype=bool)
    # Every exact split of N nodes into pipelines of at most n_max nodes has at least ceil(N / n_max) of them:
    # when that reaches f+1 the count constraint cannot bind, and the knapsack drops its pipeline-count axis.
    at_least = 0 if -(-n_nodes // int(sizes[keep].max())) >= wanted and most <= microbatches else wanted
    found = impl.solve(sizes[keep], base[keep], slope[keep], limits[keep], n_nodes, at_least, microbatches, upper)
    if found is None:  # the counts allow a choice, so memory limits bind
        capped = {c.nodes: c.max_microbatches for c in costs if c.max_microbatches is not None}
        raise PlanningError(
            f"global_microbatches: {microbatches} microbatches do not fit in memory on {n_nodes} nodes: a pipeline "
            f"of these templates holds at most this many microbatches (by node count) {capped}; use more nodes, "
            f"fewer microbatches per step, or a larger reference microbatch count (m_ref = "
            f"{max(c.m_ref for c in costs)} now: training.referenceMicrobatches in a job, --m-ref in `oobleck plan`): "
            "templates are then laid out to keep that many microbatches in flight within memory"
        )
    z, kept_counts = found
    counts = np.zeros(len(costs), dtype=np.int64)
    counts[keep] = kept_counts
    return Choice(tuple(int(c) for c in counts), float(z), degraded)


def split_batch(costs: Sequence[TemplateCost], microbatches: int, *, engine: Engine) -> list[int]:
    """Microbatches per pipeline (pipelines given by their template costs, in plan order)."""
    if not 1 <= len(costs) <= microbatches:
        raise PlanningError(f"global_microbatches: {microbatches} cannot feed {len(costs)} pipelines")
    base = np.array([c.base_ms for c in costs], dtype=np.float64)
    slope = np.array([c.slope_ms for c in costs], dtype=np.float64)
    limits = np.array([c.limit(microbatches) for c in costs], dtype=np.int64)
    nb = core(engine).split(base, slope, limits, microbatches)
    if nb is None:
        raise PlanningError(
            f"global_microbatches: {microbatches} microbatches exceed what {len(costs)} pipelines hold in memory "
            f"({int(limits.sum())} at most)"
        )
    return [int(n) for n in nb]


def _check_job(job: str, nodes: Sequence[str], f: int, microbatches: int) -> None:
    if not isinstance(job, str) or not job:
        raise PlanningError("job: must be a non-empty name")
    if not nodes:
        raise PlanningError("nodes: empty")
    if any(not isinstance(n, str) or not n for n in nodes):
        raise PlanningError("nodes: every node id must be a non-empty string")
    if len(set(nodes)) != len(nodes):
        twice = sorted({n for n in nodes if list(nodes).count(n) > 1})
        raise PlanningError(f"nodes: listed twice: {twice}")
    if isinstance(f, bool) or not isinstance(f, int) or f < 0:
        raise PlanningError(f"f: must be an integer >= 0, got {f!r}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise PlanningError(f"global_microbatches: must be an integer >= 1, got {microbatches!r}")


def build_plan(
    *,
    job: str,
    generation: int,
    templates: Sequence[Template],
    gpus_per_node: int,
    f: int,
    pipelines: Sequence[tuple[Template, Sequence[str]]],
    microbatches: Sequence[int],
    copies: Sequence[LayerCopy | dict] = (),
    lost: Sequence[str] = (),
    added: Sequence[str] = (),
    reason: str,
    ranks: Sequence[int] | None = None,
) -> Plan:
    """Lay pipelines (template + its nodes, in plan order) out as a validated Plan.

    Stages carry their node, GPUs and ranks; the Plan derives every per-rank view from them. `ranks`
    gives the rank of every GPU in layout order (pipeline by pipeline, stage by stage, GPU by GPU);
    None numbers them in that order.
    """
    num_layers = templates[0].stages[-1].end
    out_pipelines = []
    position = 0
    offset = 0
    slowest = 0.0
    for index, ((template, nodes), nb) in enumerate(zip(pipelines, microbatches, strict=True)):
        stages = []
        for stage in template.stages:
            gpus = list(range(stage.gpu_offset, stage.gpu_offset + stage.gpus))
            numbers = (
                range(position, position + stage.gpus) if ranks is None else ranks[position : position + stage.gpus]
            )
            stages.append(
                {
                    "start": stage.start,
                    "end": stage.end,
                    "node": nodes[stage.node],
                    "gpus": gpus,
                    "ranks": [int(r) for r in numbers],
                    "tensor_parallel": stage.tensor_parallel,
                }
            )
            position += stage.gpus
        ms = template_cost(template).at(nb)
        slowest = max(slowest, ms)
        out_pipelines.append(
            {
                "index": index,
                "template_nodes": template.nodes,
                "nodes": list(nodes),
                "microbatches": nb,
                "microbatch_offset": offset,
                "stages": stages,
                "iteration_ms": ms,
            }
        )
        offset += nb
    return Plan.model_validate(
        {
            "job": job,
            "generation": generation,
            "num_layers": num_layers,
            "gpus_per_node": gpus_per_node,
            "f": f,
            "global_microbatches": offset,
            "templates": sorted(templates, key=lambda t: t.nodes),
            "pipelines": out_pipelines,
            "copies": list(copies),
            "degraded": len(out_pipelines) < f + 1,
            "iteration_ms": slowest,
            "lost_nodes": list(lost),
            "added_nodes": list(added),
            "reason": reason,
        }
    )


def instantiate(
    templates: Sequence[Template],
    nodes: Sequence[str],
    f: int,
    global_microbatches: int,
    job: str,
    *,
    gpus_per_node: int | None = None,
    allow_degraded: bool = False,
    engine: Engine = "compiled",
) -> Plan:
    """The first plan (generation 0) of a job on `nodes`, tolerating `f` pipeline losses.

    Uses every node, forms at least f + 1 pipelines (fewer only with allow_degraded, flagged
    degraded) and splits `global_microbatches` to minimise the slowest pipeline's iteration time.
    """
    _check_job(job, nodes, f, global_microbatches)
    _, gpus_per_node = check_templates(templates, gpus_per_node)
    ordered = sorted(templates, key=lambda t: -t.nodes)
    costs = [template_cost(t) for t in ordered]
    choice = choose(costs, len(nodes), f, global_microbatches, allow_degraded=allow_degraded, engine=engine)
    pipelines: list[tuple[Template, Sequence[str]]] = []
    taken = 0
    for template, count in zip(ordered, choice.counts):
        for _ in range(count):
            pipelines.append((template, nodes[taken : taken + template.nodes]))
            taken += template.nodes
    nb = split_batch([template_cost(t) for t, _ in pipelines], global_microbatches, engine=engine)
    return build_plan(
        job=job,
        generation=0,
        templates=templates,
        gpus_per_node=gpus_per_node,
        f=f,
        pipelines=pipelines,
        microbatches=nb,
        reason="initial",
    )


def plan_job(
    profile: ModelProfile,
    cluster: ClusterShape,
    f: int,
    global_microbatches: int,
    job: str,
    *,
    nodes: Sequence[str] | None = None,
    m_ref: int | None = None,
    microbatch_size: int | None = None,
    allow_degraded: bool = False,
    engine: Engine = "compiled",
    max_tp: int = 1,
) -> Plan:
    """Templates + instantiation in one call (what the operator runs for a new job).

    Nodes are named "0".."N-1" unless `nodes` (cluster.nodes of them) is given. `m_ref` is the
    microbatch count templates are optimised for; None: derived from the batch (templates.default_m_ref).
    `microbatch_size` (samples) limits a stage to the GPU counts that split it evenly. `max_tp`: the largest
    tensor-parallel degree a stage may take (templates.generate_templates).
    """
    from .templates import generate_templates

    if nodes is None:
        nodes = [str(i) for i in range(cluster.nodes)]
    elif len(nodes) != cluster.nodes:
        raise PlanningError(f"nodes: {len(nodes)} node ids given, cluster.nodes is {cluster.nodes}")
    templates = generate_templates(
        profile,
        cluster,
        f,
        m_ref,
        global_microbatches=global_microbatches,
        microbatch_size=microbatch_size,
        max_tp=max_tp,
    )
    return instantiate(
        templates,
        list(nodes),
        f,
        global_microbatches,
        job,
        gpus_per_node=cluster.gpus_per_node,
        allow_degraded=allow_degraded,
        engine=engine,
    )
