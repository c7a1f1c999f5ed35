"""Pipeline templates: the best pipeline layout for each node count (the planner's first step).

Cost model (the contract; the README's "Cost model" section says the same)
---------------------------------------------------------------------------
- A stage is a contiguous layer range [i, j) on g GPUs of one node, g a power of two <= G, with tensor-parallel
  degree t, a power of two dividing g and <= the job's T (max_tensor_parallel, default 1). Each layer is split
  over t GPUs (Megatron-style); the g / t groups split every microbatch along the batch dimension, so g / t
  must divide the microbatch size (`stage_gpu_limit`).
- A layer's time at degree t, one whole microbatch on t GPUs: measured (LayerProfile.tensor_parallel) or
  estimated as f_t = forward_ms / t + A_t and b_t = backward_ms / t + A_t, where A_t = 2 ring all-reduces of
  the layer's output (output_bytes) over the intra-node bandwidth, 2 * 2(t - 1)/t * output_bytes / bw
  (Megatron: one after attention, one after the MLP, in each direction). A_1 = 0 and t = 1 is the profile.
  A stage takes F = sum f_t * t / g and Bw = sum b_t * t / g per microbatch.
- Between consecutive stages, per microbatch and direction: C = output_bytes(last layer of the stage) /
  bandwidth (inter-node if the next stage is on another node, else intra-node).
- A pipeline of S stages running m microbatches with 1F1B takes
  T(m) = sum_s (F_s + Bw_s) + sum_{s<S} 2 * C_s + (m - 1) * max_s (F_s + Bw_s).
- Memory on each GPU of stage s (1-based): sum state_bytes / t + min(S - s + 1, m) * (sum split / t + sum
  replicated) * t / g must not exceed gpu_memory_bytes, where replicated = replicated_activation_bytes and
  split = activation_bytes - replicated (t = 1: state + min(.) * activation_bytes / g, as without TP).
- Each stage takes the t of least F + Bw that fits in memory at its position (ties: the smaller t).
- A template for n nodes: each node holds one or more whole stages and all of its G GPUs are used (a
  node's GPUs form an ordered composition of G into powers of two; stage k starts at GPU `gpu_offset`).

A template is optimised for m = m_ref microbatches: T(m_ref) is the objective and the search checks memory at
m_ref. m_ref is the count a pipeline is expected to run (`default_m_ref`: the batch spread over the most
pipelines the nodes can form; a job may set it). A template records the most microbatches its memory holds
(`max_microbatches`, the memory rule checked at that count, >= m_ref), and instantiation allows a pipeline
exactly that many: no m_ref cap.

Units (why integers): times are quantised to whole nanoseconds per layer (round(ms * 1e6), per degree t: the estimate rounds
forward_ms / t and A_t separately) and the search works in units of 1/G ns, where a stage on g GPUs at degree t
takes ticks_t * t * (G / g) exactly; a boundary costs
round(2 * output_bytes * 1e9 * G / bandwidth) units. Memory stays in bytes. With exact integers, equal costs
are really equal, so the tie-break below decides them, identically in the compiled core, the reference and
the tests' brute force.

Exactness and tie-break: the search (planner_cy/_templates.pyx, reference planner_cy/ref_templates.py)
returns, for every node count, the layout minimising T(m_ref) over all stage counts, layer splits and GPU
splits. Ties go to (1) the smaller bottleneck max_s (F_s + Bw_s), then (2) the lexicographically first
stage sequence read from the first stage, comparing each stage by its end layer (earlier first), then by
its GPU count (more first), then by its tensor-parallel degree (smaller first).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from oobleck.api.plan import Template, TemplateStage
from oobleck.api.profile import ClusterShape, LayerProfile, ModelProfile
from oobleck.planner import _templates
from oobleck.planner.errors import PlanningError

DEFAULT_M_REF = 16
"""Microbatches per pipeline the templates are optimised for when the caller does not say."""

TICKS_PER_MS = 1_000_000
"""Layer times are quantised to whole nanoseconds."""

_LIMIT = 1 << 62  # every intermediate of the integer search stays below this (int64 headroom)


@dataclass(frozen=True)
class CostTables:
    """The cost model in exact integers, as prefix sums over layer boundaries 0..L (see module doc).

    Time tables have one row per tensor-parallel degree t = 1, 2, 4, .., max_tp (row k: t = 2**k).
    """

    gpus: int
    max_gpus: int  # the most GPUs of one stage: min(G, max_dp * max_tp)
    m_ref: int
    memory: int
    forward_pf: np.ndarray  # [k, l]: ticks (ns), one microbatch on 2**k GPUs (tensor-parallel)
    backward_pf: np.ndarray
    time_pf: np.ndarray  # forward + backward ticks
    state_pf: np.ndarray  # bytes
    act_pf: np.ndarray  # bytes
    comm_intra: np.ndarray  # [l]: 2 * C after layer l inside a node, units of 1/G ns (last entry unused)
    comm_inter: np.ndarray  # [l]: the same between nodes
    rep_pf: np.ndarray  # bytes: the replicated part of act_pf (not split by tensor parallelism)
    max_dp: int  # the most ways a microbatch splits (a power of two dividing it, <= G)
    max_tp: int  # the largest tensor-parallel degree (a power of two <= G)

    @property
    def num_layers(self) -> int:
        return self.time_pf.shape[1] - 1

    def degrees(self, g: int) -> list[int]:
        """The tensor-parallel degrees a stage of g GPUs may take, smallest first (g / t must be <= max_dp)."""
        t, out = 1, []
        while t <= min(g, self.max_tp):
            if g // t <= self.max_dp:
                out.append(t)
            t *= 2
        return out

    def units_to_ms(self, units: int) -> float:
        return units / (self.gpus * TICKS_PER_MS)


@dataclass(frozen=True)
class Layout:
    """The search's plain result for one node count: stage ends, GPU counts and TP degrees, first stage first."""

    nodes: int
    objective: int  # T(m_ref), units of 1/G ns
    peak: int  # max stage time, same units
    ends: tuple[int, ...]
    gpus: tuple[int, ...]
    tp: tuple[int, ...]


def _prefix(values: Iterable[int]) -> np.ndarray:
    out = [0]
    for value in values:
        out.append(out[-1] + value)
    return np.array(out, dtype=np.int64)


def stage_gpu_limit(gpus_per_node: int, microbatch_size: int | None) -> int:
    """The most ways a stage may split a microbatch: the largest power of two <= G dividing the microbatch size.

    A stage of g GPUs at tensor-parallel degree t splits every microbatch into g / t equal shares (the cost
    model's F * t / g); without TP that is the most GPUs of a stage. None: no microbatch size given, any
    power of two <= G.
    """
    if microbatch_size is None:
        return gpus_per_node
    if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) or microbatch_size < 1:
        raise PlanningError(f"microbatch_size: must be an integer >= 1, got {microbatch_size!r}")
    return min(gpus_per_node, microbatch_size & -microbatch_size)


def _check_max_tp(max_tp: int, gpus_per_node: int) -> None:
    if isinstance(max_tp, bool) or not isinstance(max_tp, int) or max_tp < 1 or max_tp & (max_tp - 1):
        raise PlanningError(f"max_tensor_parallel: must be a power of two >= 1, got {max_tp!r}")
    if max_tp > gpus_per_node:
        raise PlanningError(
            f"max_tensor_parallel: {max_tp} exceeds gpus_per_node = {gpus_per_node} (a stage lives on one node)"
        )


def tp_ticks(layer: LayerProfile, t: int, intra_bandwidth: float) -> tuple[int, int]:
    """(forward, backward) ticks of one whole microbatch of `layer` at tensor-parallel degree t (module doc)."""
    if t == 1:
        return round(layer.forward_ms * TICKS_PER_MS), round(layer.backward_ms * TICKS_PER_MS)
    measured = layer.measured_at(t)
    if measured is not None:
        return round(measured.forward_ms * TICKS_PER_MS), round(measured.backward_ms * TICKS_PER_MS)
    all_reduces = round(2 * 2 * (t - 1) / t * layer.output_bytes * 1e9 / intra_bandwidth)
    return (
        round(layer.forward_ms * TICKS_PER_MS / t) + all_reduces,
        round(layer.backward_ms * TICKS_PER_MS / t) + all_reduces,
    )


def cost_tables(
    profile: ModelProfile,
    cluster: ClusterShape,
    m_ref: int = DEFAULT_M_REF,
    microbatch_size: int | None = None,
    max_tp: int = 1,
) -> CostTables:
    """Quantise a profile and cluster shape into the integer tables the search runs on.

    Raises PlanningError when m_ref < 1, microbatch_size < 1, max_tp is no power of two <= G or a figure is
    too large for exact 62-bit arithmetic.
    """
    if isinstance(m_ref, bool) or not isinstance(m_ref, int) or m_ref < 1:
        raise PlanningError(f"m_ref: must be an integer >= 1, got {m_ref!r}")
    layers = profile.layers
    G = cluster.gpus_per_node
    _check_max_tp(max_tp, G)
    degrees = [1 << k for k in range(max_tp.bit_length())]
    ticks = [[tp_ticks(layer, t, cluster.intra_node_bandwidth) for layer in layers] for t in degrees]

    def comm(bandwidth: float) -> list[int]:
        return [round(2 * layer.output_bytes * 1e9 * G / bandwidth) for layer in layers]

    intra, inter = comm(cluster.intra_node_bandwidth), comm(cluster.inter_node_bandwidth)
    state = [layer.state_bytes for layer in layers]
    act = [layer.activation_bytes for layer in layers]
    slowest = max(t * sum(f + b for f, b in row) for t, row in zip(degrees, ticks))
    bounds = {  # checked before anything becomes an int64
        "T(m_ref) in units of 1/G ns": slowest * G * m_ref + max(intra + inter) * len(layers),
        "G * total state_bytes": G * sum(state),
        "min(m_ref, L) * max_tp * total activation_bytes": min(m_ref, len(layers)) * max_tp * sum(act),
        "G * gpu_memory_bytes": G * cluster.gpu_memory_bytes,
    }
    for what, value in bounds.items():
        if value >= _LIMIT:
            raise PlanningError(f"profile too large for exact planning: {what} = {value} >= 2**62")
    max_dp = stage_gpu_limit(G, microbatch_size)
    return CostTables(
        gpus=G,
        max_gpus=min(G, max_dp * max_tp),
        m_ref=m_ref,
        memory=cluster.gpu_memory_bytes,
        forward_pf=np.stack([_prefix(f for f, _ in row) for row in ticks]),
        backward_pf=np.stack([_prefix(b for _, b in row) for row in ticks]),
        time_pf=np.stack([_prefix(f + b for f, b in row) for row in ticks]),
        state_pf=_prefix(state),
        act_pf=_prefix(act),
        comm_intra=np.array(intra, dtype=np.int64),
        comm_inter=np.array(inter, dtype=np.int64),
        rep_pf=_prefix(layer.replicated_activation_bytes for layer in layers),
        max_dp=max_dp,
        max_tp=max_tp,
    )


def search_layouts(tables: CostTables, max_nodes: int) -> dict[int, Layout]:
    """Best layout of every node count 1..max_nodes that fits in memory (compiled core, one pass)."""
    if max_nodes < 1:
        raise PlanningError(f"max_nodes: must be >= 1, got {max_nodes}")
    L = tables.num_layers
    objective = np.zeros(max_nodes + 1, dtype=np.int64)
    peak = np.zeros(max_nodes + 1, dtype=np.int64)
    stages = np.zeros(max_nodes + 1, dtype=np.int32)
    ends = np.zeros((max_nodes + 1, L), dtype=np.int32)
    gpus = np.zeros((max_nodes + 1, L), dtype=np.int32)
    tp = np.zeros((max_nodes + 1, L), dtype=np.int32)
    _templates.search(
        tables.time_pf,
        tables.state_pf,
        tables.act_pf,
        tables.rep_pf,
        tables.comm_intra,
        tables.comm_inter,
        tables.gpus,
        tables.max_dp,
        tables.max_tp,
        max_nodes,
        tables.m_ref,
        tables.memory,
        objective,
        peak,
        stages,
        ends,
        gpus,
        tp,
    )
    return {
        n: Layout(
            n,
            int(objective[n]),
            int(peak[n]),
            tuple(ends[n, : stages[n]].tolist()),
            tuple(gpus[n, : stages[n]].tolist()),
            tuple(tp[n, : stages[n]].tolist()),
        )
        for n in range(1, max_nodes + 1)
        if stages[n] > 0
    }


def stage_memory(tables: CostTables, i: int, j: int, g: int, t: int) -> tuple[int, int]:
    """(room, per in-flight microbatch) of layers [i, j) on g GPUs at degree t, both times g (integers only).

    A GPU fits the stage with p microbatches in flight iff p * (second) <= (first): g * memory - (g / t) * state
    and split + t * replicated activations.
    """
    state = int(tables.state_pf[j] - tables.state_pf[i])
    act = int(tables.act_pf[j] - tables.act_pf[i])
    rep = int(tables.rep_pf[j] - tables.rep_pf[i])
    return g * tables.memory - (g // t) * state, act + (t - 1) * rep


def max_microbatches(tables: CostTables, layout: Layout) -> int | None:
    """The most microbatches one pipeline of this layout may run: memory checked at that count; None: any.

    Stage s (1-based) of S keeps min(S - s + 1, m) microbatches in flight, so only stages with S - s + 1 > m
    can bind, at floor(room / activations). The search checked m_ref, so the answer is >= m_ref.
    """
    most = None
    start, S = 0, len(layout.ends)
    for k, (end, g, t) in enumerate(zip(layout.ends, layout.gpus, layout.tp)):
        room, act = stage_memory(tables, start, end, g, t)
        if (S - k) * act > room:
            most = room // act if most is None else min(most, room // act)
        start = end
    return most


def to_template(tables: CostTables, layout: Layout) -> Template:
    """The plan contract's Template for a layout (stage times already divided by their g / t groups)."""
    stages = []
    start, node, offset = 0, 0, 0
    for end, g, t in zip(layout.ends, layout.gpus, layout.tp):
        row = t.bit_length() - 1
        forward = int(tables.forward_pf[row, end] - tables.forward_pf[row, start])
        backward = int(tables.backward_pf[row, end] - tables.backward_pf[row, start])
        stages.append(
            TemplateStage(
                start=start,
                end=end,
                node=node,
                gpus=g,
                gpu_offset=offset,
                forward_ms=forward * t / g / TICKS_PER_MS,
                backward_ms=backward * t / g / TICKS_PER_MS,
                tensor_parallel=t,
            )
        )
        start, offset = end, offset + g
        if offset == tables.gpus:
            node, offset = node + 1, 0
    return Template(
        nodes=layout.nodes,
        stages=stages,
        iteration_ms=tables.units_to_ms(layout.objective),
        m_ref=tables.m_ref,
        max_microbatches=max_microbatches(tables, layout),
    )


def _no_fit(profile: ModelProfile, cluster: ClusterShape, tables: CostTables) -> PlanningError:
    """Explain why no template of any size fits: name the heaviest single layer if it alone is too big."""
    g, memory = tables.max_gpus, cluster.gpu_memory_bytes
    t = tables.degrees(g)[-1]
    needs = [
        layer.state_bytes / t + (layer.activation_bytes + (t - 1) * layer.replicated_activation_bytes) / g
        for layer in profile.layers
    ]
    index = max(range(len(needs)), key=needs.__getitem__)  # the first of the heaviest
    need = needs[index]
    if need > memory:
        return PlanningError(
            f"no template fits: layer {index} alone needs state / t + activations * t / g = {need:.0f} bytes per "
            f"GPU (g = {g} GPUs per stage at most, tensor-parallel t = {t}), gpu_memory_bytes is {memory}"
        )
    return PlanningError(
        f"no template of 1..{len(profile.layers)} nodes fits: the {len(profile.layers)} layers need more than "
        f"gpu_memory_bytes = {memory} on some GPU in every split (with m_ref = {tables.m_ref} microbatches in flight)"
    )


def all_templates(
    profile: ModelProfile,
    cluster: ClusterShape,
    m_ref: int = DEFAULT_M_REF,
    *,
    microbatch_size: int | None = None,
    max_tp: int = 1,
) -> list[Template]:
    """The best template of every node count 1..cluster.nodes that fits in memory, by node count."""
    tables = cost_tables(profile, cluster, m_ref, microbatch_size, max_tp)
    return [to_template(tables, layout) for layout in search_layouts(tables, cluster.nodes).values()]


def min_nodes(
    profile: ModelProfile,
    cluster: ClusterShape,
    m_ref: int = DEFAULT_M_REF,
    *,
    microbatch_size: int | None = None,
    max_tp: int = 1,
) -> int:
    """n0: the fewest nodes of any memory-feasible template (independent of cluster.nodes).

    Raises PlanningError when no template of any size fits.
    """
    tables = cost_tables(profile, cluster, m_ref, microbatch_size, max_tp)
    feasible = search_layouts(tables, tables.num_layers)  # a node holds >= 1 layer: never more nodes than layers
    if not feasible:
        raise _no_fit(profile, cluster, tables)
    return min(feasible)


def best_template(
    profile: ModelProfile,
    cluster: ClusterShape,
    nodes: int,
    m_ref: int = DEFAULT_M_REF,
    *,
    microbatch_size: int | None = None,
    max_tp: int = 1,
) -> Template:
    """The best template of exactly `nodes` nodes; PlanningError if none fits in memory."""
    if nodes < 1:
        raise PlanningError(f"nodes: must be >= 1, got {nodes}")
    tables = cost_tables(profile, cluster, m_ref, microbatch_size, max_tp)
    layout = search_layouts(tables, nodes).get(nodes)
    if layout is None:
        raise PlanningError(
            f"no template of {nodes} nodes fits: {len(profile.layers)} layers on {nodes} x {cluster.gpus_per_node} GPUs "
            f"with gpu_memory_bytes = {cluster.gpu_memory_bytes} and m_ref = {m_ref}"
        )
    return to_template(tables, layout)


def usable_sizes(feasible: Iterable[int], f: int, max_nodes: int) -> list[int]:
    """The template sizes worth generating: every feasible size from n0 up to max(N - f*n0, 2*n0 - 1), <= N.

    A pipeline of more than N - f*n0 nodes leaves fewer than f*n0 nodes for the other f pipelines, so no plan
    with f+1 pipelines uses it. The sizes n0 .. 2*n0-1 split every count of nodes >= n0 into pipelines (see
    `uncovered_counts`): they stay even above N - f*n0, for the degraded plans (fewer than f+1 pipelines)
    that survivors of more failures form. The others are offered because a mix of larger templates can be
    faster (and hold more microbatches within memory), and a reconfiguration may land on any of them.
    """
    feasible = sorted(set(feasible))
    if not feasible:
        raise PlanningError(f"no template of 1..{max_nodes} nodes fits in memory")
    n0 = feasible[0]
    return [n for n in feasible if n <= min(max(max_nodes - f * n0, 2 * n0 - 1), max_nodes)]


def _most_parts(sizes: list[int], limit: int) -> list[int]:
    """most[x] = the most parts (each in `sizes`) summing exactly to x, -1 if x is no such sum."""
    most = [-1] * (limit + 1)
    most[0] = 0
    for x in range(1, limit + 1):
        most[x] = max((most[x - s] + 1 for s in sizes if s <= x and most[x - s] >= 0), default=-1)
    return most


def uncovered_counts(sizes: Iterable[int], f: int, max_nodes: int) -> list[int]:
    """Node counts in [(f+1)*min(sizes), max_nodes] that are no sum of >= f+1 template sizes (usually none).

    With every size n0 .. 2*n0-1 feasible there are none: N' = q*n0 + r (0 <= r < n0, q >= f+1) is q-1
    pipelines of n0 nodes plus one of n0 + r. Memory can rule a size out; such counts leave nodes idle.
    """
    sizes = sorted(set(sizes))
    most = _most_parts(sizes, max_nodes)
    return [n for n in range((f + 1) * sizes[0], max_nodes + 1) if most[n] < f + 1]


def default_m_ref(n0: int, nodes: int, f: int, global_microbatches: int) -> int:
    """The microbatches per pipeline when the batch is spread evenly over the most pipelines N nodes form.

    That is the count a pipeline runs in the plan with the most pipelines (at least f+1): ceil(B / P),
    P = max(f + 1, N // n0), never above B.
    """
    pipelines = max(f + 1, nodes // max(n0, 1))
    return max(1, -(-global_microbatches // pipelines))


def _fewest_nodes_bound(profile: ModelProfile, cluster: ClusterShape) -> int:
    """A lower bound on n0 from state alone: a node holds at most G * gpu_memory_bytes of distinct state."""
    total = sum(layer.state_bytes for layer in profile.layers)
    per_node = cluster.gpus_per_node * cluster.gpu_memory_bytes
    return max(1, -(-total // per_node))


def generate_templates(
    profile: ModelProfile,
    cluster: ClusterShape,
    f: int,
    m_ref: int | None = None,
    *,
    global_microbatches: int | None = None,
    microbatch_size: int | None = None,
    min_nodes_per_pipeline: int = 1,
    max_tp: int = 1,
) -> list[Template]:
    """Templates for every usable size (see usable_sizes), sorted by node count.

    min_nodes_per_pipeline (the Oobleck artifact's n0 given by hand): no template of fewer nodes, even where one fits;
    each remaining size keeps the same best layout, so only the choice of sizes changes.

    cluster.nodes is N, the most nodes the job will have. m_ref None: derived from the batch (default_m_ref,
    with n0 found at that m_ref: the search is redone while the derived count grows and some template still
    fits), or DEFAULT_M_REF without a global_microbatches. microbatch_size limits the ways a stage splits a
    microbatch (stage_gpu_limit); max_tp is the largest tensor-parallel degree a stage may take (opt-in). Raises
    PlanningError, with the numbers, when N < (f+1)*n0 or when no template fits at all.
    """
    if isinstance(f, bool) or not isinstance(f, int) or f < 0:
        raise PlanningError(f"f: must be an integer >= 0, got {f!r}")
    N = cluster.nodes
    least = min_nodes_per_pipeline
    if isinstance(least, bool) or not isinstance(least, int) or not 1 <= least <= N:
        raise PlanningError(f"min_nodes_per_pipeline: must be an integer in 1..N = {N}, got {least!r}")
    if least > len(profile.layers):
        raise PlanningError(
            f"min_nodes_per_pipeline: {least} nodes exceed the model's {len(profile.layers)} layers "
            "(every node of a pipeline holds at least one layer)"
        )

    def search(tables: CostTables) -> dict[int, Layout]:
        found = search_layouts(tables, min(N, tables.num_layers))
        return {n: layout for n, layout in found.items() if n >= least}

    if m_ref is None and global_microbatches is not None:
        if isinstance(global_microbatches, bool) or not isinstance(global_microbatches, int) or global_microbatches < 1:
            raise PlanningError(f"global_microbatches: must be an integer >= 1, got {global_microbatches!r}")
        m_ref = default_m_ref(max(least, _fewest_nodes_bound(profile, cluster)), N, f, global_microbatches)
        tables = cost_tables(profile, cluster, m_ref, microbatch_size, max_tp)
        layouts = search(tables)
        while layouts:  # a larger m_ref only raises n0, so this settles within a few searches
            wanted = default_m_ref(min(layouts), N, f, global_microbatches)
            if wanted <= tables.m_ref:
                break
            wider = cost_tables(profile, cluster, wanted, microbatch_size, max_tp)
            found = search(wider)
            if not found:
                break  # nothing fits with that many in flight: keep the last m_ref that fits
            tables, layouts = wider, found
    else:
        tables = cost_tables(profile, cluster, DEFAULT_M_REF if m_ref is None else m_ref, microbatch_size, max_tp)
        layouts = search(tables)
    if not layouts:
        n0 = max(
            least, min_nodes(profile, cluster, tables.m_ref, microbatch_size=microbatch_size, max_tp=max_tp)
        )  # raises if none fits
        raise PlanningError(
            f"N = {N} nodes cannot hold f+1 = {f + 1} pipelines: the smallest template needs n0 = {n0} nodes, "
            f"(f+1)*n0 = {(f + 1) * n0} > {N}"
        )
    n0 = min(layouts)
    if (f + 1) * n0 > N:
        raise PlanningError(
            f"N = {N} nodes cannot hold f+1 = {f + 1} pipelines of at least n0 = {n0} nodes: (f+1)*n0 = {(f + 1) * n0} > {N}"
        )
    return [to_template(tables, layouts[n]) for n in usable_sizes(layouts, f, N)]
