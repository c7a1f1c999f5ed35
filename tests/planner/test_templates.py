"""Pipeline templates: exactness (brute force), compiled == reference, sizes, errors, determinism."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oobleck.api.profile import ClusterShape, LayerProfile, ModelProfile, TensorParallelTimes
from oobleck.planner import templates as T
from oobleck.planner.errors import PlanningError
from oobleck.planner.ref_templates import search_layouts_ref

# ---------------------------------------------------------------------------------------------
# An independent oracle: every node composition, every layer split, costs straight from the formula.


def compositions(total: int, most: int | None = None) -> list[tuple[int, ...]]:
    """Ordered splits of a node's GPUs into powers of two (each at most `most`)."""
    if total == 0:
        return [()]
    out = []
    g = 1
    while g <= total and (most is None or g <= most):
        out += [(g,) + rest for rest in compositions(total - g, most)]
        g *= 2
    return out


def layer_ticks(layer: LayerProfile, t: int, intra: float) -> int:
    """Forward + backward ticks of one microbatch at degree t: measured, else the documented estimate."""
    if t == 1:
        return round(layer.forward_ms * 1e6) + round(layer.backward_ms * 1e6)
    measured = {entry.degree: entry for entry in layer.tensor_parallel}.get(t)
    if measured is not None:
        return round(measured.forward_ms * 1e6) + round(measured.backward_ms * 1e6)
    all_reduces = round(2 * 2 * (t - 1) / t * layer.output_bytes * 1e9 / intra)  # 2 ring all-reduces per direction
    return round(layer.forward_ms * 1e6 / t) + round(layer.backward_ms * 1e6 / t) + 2 * all_reduces


def brute_force(
    profile: ModelProfile,
    cluster: ClusterShape,
    nodes: int,
    m: int,
    microbatch_size: int | None = None,
    max_tp: int = 1,
):
    """(objective, peak, ends, gpus, degrees) of the best template by the documented order, or None.

    With a microbatch size, a stage's data-parallel ways g / t must divide it (every group gets an equal share);
    every stage tries every degree t <= max_tp dividing its g."""
    G, L = cluster.gpus_per_node, len(profile.layers)
    most_dp = G if microbatch_size is None else max(g for g in (1, 2, 4, 8, 16) if microbatch_size % g == 0)
    intra = cluster.intra_node_bandwidth

    def comm(layer: int, bandwidth: float) -> int:
        return round(2 * profile.layers[layer].output_bytes * 1e9 * G / bandwidth)

    def degrees(g: int) -> list[int]:
        return [t for t in (1, 2, 4, 8) if t <= max_tp and g % t == 0 and g // t <= most_dp]

    best = None
    for per_node in itertools.product(compositions(G, most_dp * max_tp), repeat=nodes):
        gpus = [g for node in per_node for g in node]
        node_of = [k for k, node in enumerate(per_node) for _ in node]
        S = len(gpus)
        for cuts in itertools.combinations(range(1, L), S - 1):
            bounds = (0, *cuts, L)
            comms = sum(
                comm(
                    bounds[s + 1] - 1,
                    cluster.inter_node_bandwidth if node_of[s] != node_of[s + 1] else cluster.intra_node_bandwidth,
                )
                for s in range(S - 1)
            )
            for tps in itertools.product(*(degrees(g) for g in gpus)):
                times, fits = [], True
                for s in range(S):
                    i, j, g, t = bounds[s], bounds[s + 1], gpus[s], tps[s]
                    state = sum(x.state_bytes for x in profile.layers[i:j])
                    rep = sum(x.replicated_activation_bytes for x in profile.layers[i:j])
                    split = sum(x.activation_bytes for x in profile.layers[i:j]) - rep
                    # state / t + in-flight * (split / t + rep) * t / g <= memory, times g
                    fits &= (g // t) * state + min(S - s, m) * (split + t * rep) <= g * cluster.gpu_memory_bytes
                    times.append(sum(layer_ticks(x, t, intra) for x in profile.layers[i:j]) * t * (G // g))
                if not fits:
                    continue
                key = (
                    sum(times) + comms + (m - 1) * max(times),
                    max(times),
                    [(bounds[s + 1], -gpus[s], tps[s]) for s in range(S)],
                )
                if best is None or key < best[0]:
                    best = (key, (key[0], key[1], bounds[1:], tuple(gpus), tuple(tps)))
    return None if best is None else best[1]


# ---------------------------------------------------------------------------------------------
# Random inputs. Small integers make equal costs (ties) common, which is where a planner goes wrong.


@st.composite
def instances(draw, max_layers=6, gpus=(1, 2, 4), max_nodes=3, tp=False):
    """(profile, cluster, m, microbatch size, max_tp); with tp, measured TP times and replicated activations."""
    L = draw(st.integers(1, max_layers))
    G = draw(st.sampled_from(gpus))
    max_tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if t <= G])) if tp else 1
    layers = []
    for _ in range(L):
        activation = draw(st.integers(0, 6))
        measured = [
            TensorParallelTimes(
                degree=t, forward_ms=draw(st.integers(0, 4)) * 0.25, backward_ms=draw(st.integers(0, 4)) * 0.125
            )
            for t in (2, 4, 8)
            if tp and t <= max_tp and draw(st.booleans())
        ]
        layers.append(
            LayerProfile(
                forward_ms=draw(st.integers(0, 4)) * 0.5,
                backward_ms=draw(st.integers(0, 4)) * 0.25,
                state_bytes=draw(st.integers(0, 12)),
                activation_bytes=activation,
                output_bytes=draw(st.integers(0, 3)) * 1000,
                replicated_activation_bytes=draw(st.integers(0, activation)) if tp else 0,
                tensor_parallel=measured,
            )
        )
    if sum(x.forward_ms + x.backward_ms for x in layers) == 0:
        layers[0] = layers[0].model_copy(update={"forward_ms": 1.0})
    profile = ModelProfile(model="random", microbatch_size=1, layers=layers)
    cluster = ClusterShape(
        nodes=draw(st.integers(1, max_nodes)),
        gpus_per_node=G,
        gpu_memory_bytes=draw(st.integers(4, 40)),
        intra_node_bandwidth=1e6,
        inter_node_bandwidth=draw(st.sampled_from([2.5e5, 1e6])),
    )
    return profile, cluster, draw(st.integers(1, 5)), draw(st.sampled_from([None, 1, 2, 3, 4, 6, 8])), max_tp


FAST = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_against_brute_force(case) -> None:
    profile, cluster, m, mbs, max_tp = case
    tables = T.cost_tables(profile, cluster, m, mbs, max_tp)
    compiled = T.search_layouts(tables, cluster.nodes)
    reference = search_layouts_ref(tables, cluster.nodes)
    for n in range(1, cluster.nodes + 1):
        expected = brute_force(profile, cluster, n, m, mbs, max_tp)
        for name, found in (("compiled", compiled.get(n)), ("reference", reference.get(n))):
            got = None if found is None else (found.objective, found.peak, found.ends, found.gpus, found.tp)
            assert got == expected, f"{name}, {n} nodes"


@FAST
@given(instances())
def test_search_equals_brute_force(case):
    check_against_brute_force(case)


@FAST
@given(instances(max_layers=5, tp=True))
def test_tensor_parallel_search_equals_brute_force(case):
    """Per-stage degrees, measured or estimated TP times, replicated activations: all three searches agree."""
    check_against_brute_force(case)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(max_layers=12, gpus=(1, 2, 4, 8), max_nodes=7))
def test_compiled_equals_reference(case):
    profile, cluster, m, mbs, _ = case
    tables = T.cost_tables(profile, cluster, m, mbs)
    assert T.search_layouts(tables, cluster.nodes) == search_layouts_ref(tables, cluster.nodes)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(max_layers=12, gpus=(1, 2, 4, 8), max_nodes=7, tp=True))
def test_tensor_parallel_compiled_equals_reference(case):
    profile, cluster, m, mbs, max_tp = case
    tables = T.cost_tables(profile, cluster, m, mbs, max_tp)
    assert T.search_layouts(tables, cluster.nodes) == search_layouts_ref(tables, cluster.nodes)


def test_tie_break_earliest_end_then_more_gpus():
    """Only the last layer costs anything: every split of the free layers ties; the documented order decides."""
    layers = [
        LayerProfile(forward_ms=float(k == 3), backward_ms=0, state_bytes=1, activation_bytes=0, output_bytes=0)
        for k in range(4)
    ]
    profile = ModelProfile(model="ties", microbatch_size=1, layers=layers)
    cluster = ClusterShape(
        nodes=2, gpus_per_node=2, gpu_memory_bytes=10, intra_node_bandwidth=1e9, inter_node_bandwidth=1e9
    )
    template = T.best_template(profile, cluster, 2, m_ref=4)
    assert [(s.start, s.end, s.gpus) for s in template.stages] == [(0, 1, 2), (1, 4, 2)]
    assert brute_force(profile, cluster, 2, 4)[2:4] == ((1, 4), (2, 2))
    assert search_layouts_ref(T.cost_tables(profile, cluster, 4), 2)[2].gpus == (2, 2)
    tight = cluster.model_copy(
        update={"gpu_memory_bytes": 2}
    )  # <= 2 layers per stage: node 0 holds [0, 2), earliest end first
    assert [(s.start, s.end, s.gpus) for s in T.best_template(profile, tight, 2, m_ref=4).stages] == [
        (0, 1, 1),
        (1, 2, 1),
        (2, 4, 2),
    ]


def test_exact_where_one_best_suffix_per_state_is_not():
    """Layer times 1,1,4 / 1 GPU per node / 2 nodes, m = 3: a split minimising the sum is not the best."""
    layers = [
        LayerProfile(forward_ms=t, backward_ms=0, state_bytes=0, activation_bytes=0, output_bytes=o)
        for t, o in ((1, 0), (1, 10**6), (4, 0))
    ]
    profile = ModelProfile(model="skew", microbatch_size=1, layers=layers)
    # Boundary after layer 0 is free, after layer 1 costs 2 * 10^6 / 10^6 s = 2000 ms: [0,1)[1,3) totals 6 with peak 5,
    # [0,2)[2,3) totals 2006 with peak 4: T(3) = 16 vs 2014; with m = 1000, 5001 + ... loses to 2006 + 999*4.
    cluster = ClusterShape(
        nodes=2, gpus_per_node=1, gpu_memory_bytes=1, intra_node_bandwidth=1e6, inter_node_bandwidth=1e6
    )
    assert [(s.start, s.end) for s in T.best_template(profile, cluster, 2, m_ref=3).stages] == [(0, 1), (1, 3)]
    assert [(s.start, s.end) for s in T.best_template(profile, cluster, 2, m_ref=3000).stages] == [(0, 2), (2, 3)]


# ---------------------------------------------------------------------------------------------
# The Template contract: structure, stage figures and iteration time agree with the cost model.


def recompute_ms(profile: ModelProfile, cluster: ClusterShape, template, m: int) -> float:
    stages = template.stages
    times = [s.forward_ms + s.backward_ms for s in stages]
    comm = 0.0
    for a, b in zip(stages, stages[1:]):
        bandwidth = cluster.inter_node_bandwidth if a.node != b.node else cluster.intra_node_bandwidth
        comm += 2 * profile.layers[a.end - 1].output_bytes / bandwidth * 1e3
    return sum(times) + comm + (m - 1) * max(times)


def memory_holds(profile: ModelProfile, cluster: ClusterShape, template, count: int) -> bool:
    """The memory rule for every GPU of a template's pipeline running `count` microbatches."""
    stages = template.stages
    for k, s in enumerate(stages):
        layers = profile.layers[s.start : s.end]
        state = sum(x.state_bytes for x in layers)
        act = sum(x.activation_bytes for x in layers)
        if s.gpus * state + min(len(stages) - k, count) * act > s.gpus * cluster.gpu_memory_bytes:
            return False
    return True


def check_template(profile: ModelProfile, cluster: ClusterShape, template, m: int, mbs: int | None = None) -> None:
    G, stages = cluster.gpus_per_node, template.stages
    if mbs is not None:
        assert all(mbs % s.gpus == 0 for s in stages)
    # max_microbatches is exact: memory holds at that count and not one more (None: at every count)
    most = template.max_microbatches
    assert most is None or most >= m
    if most is None:
        assert memory_holds(profile, cluster, template, len(stages))
    else:
        assert memory_holds(profile, cluster, template, most) and not memory_holds(profile, cluster, template, most + 1)
    assert stages[0].start == 0 and stages[-1].end == len(profile.layers)
    assert all(a.end == b.start and a.start < a.end for a, b in zip(stages, stages[1:]))
    assert [s.node for s in stages] == sorted(s.node for s in stages) and stages[-1].node == template.nodes - 1
    for node in range(template.nodes):
        on_node = [s for s in stages if s.node == node]
        assert [s.gpu_offset for s in on_node] == list(itertools.accumulate([0] + [s.gpus for s in on_node[:-1]]))
        assert sum(s.gpus for s in on_node) == G and all(s.gpus & (s.gpus - 1) == 0 for s in on_node)
    for k, s in enumerate(stages):
        layers = profile.layers[s.start : s.end]
        quantum = 0.5e-6 * len(layers)  # each layer's time is rounded to the nanosecond
        assert s.forward_ms == pytest.approx(sum(x.forward_ms for x in layers) / s.gpus, abs=quantum)
        assert s.backward_ms == pytest.approx(sum(x.backward_ms for x in layers) / s.gpus, abs=quantum)
        inflight = min(len(stages) - k, m)
        memory = sum(x.state_bytes for x in layers) + inflight * sum(x.activation_bytes for x in layers) / s.gpus
        assert memory <= cluster.gpu_memory_bytes
    assert template.m_ref == m
    quantum = 1e-6 * len(profile.layers) * m  # ns-rounded layers, counted up to m times
    assert template.iteration_ms == pytest.approx(recompute_ms(profile, cluster, template, m), rel=1e-9, abs=quantum)


@FAST
@given(instances(max_layers=10, gpus=(1, 2, 4, 8), max_nodes=6))
def test_templates_follow_the_cost_model(case):
    profile, cluster, m, mbs, _ = case
    for template in T.all_templates(profile, cluster, m_ref=m, microbatch_size=mbs):
        check_template(profile, cluster, template, m, mbs)


# ---------------------------------------------------------------------------------------------
# Template sizes (item 1).


def splits(sizes: list[int], total: int, parts: int) -> bool:
    """Whether `total` is a sum of at least `parts` numbers from `sizes` (plain recursion, memoised)."""
    from functools import cache

    @cache
    def most(x: int) -> float:
        if x == 0:
            return 0
        return max((most(x - s) + 1 for s in sizes if s <= x), default=-math.inf)

    return most(total) >= parts


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12), st.integers(0, 4), st.integers(1, 80), st.sets(st.integers(1, 80)))
def test_usable_sizes_are_every_feasible_size_up_to_n_minus_f_n0(n0, f, N, extra):
    feasible = set(range(n0, 2 * n0)) | {n for n in extra if n > n0}
    sizes = T.usable_sizes(feasible, f, N)
    assert sizes == sorted(n for n in feasible if n <= min(N, max(N - f * n0, 2 * n0 - 1)))
    if (f + 1) * n0 <= N:
        assert T.uncovered_counts(sizes, f, N) == []
    for total in range((f + 1) * n0, N + 1):
        assert splits(sizes, total, f + 1), total


def test_a_size_that_does_not_fit_leaves_named_gaps():
    # Sizes 3 and 5 fit, 4 does not: 7 = 3 + 4 nodes cannot form 2 pipelines, and with f = 0 neither can 4.
    assert T.usable_sizes({3, 5, 7, 9}, 1, 12) == [3, 5, 7, 9]
    assert T.usable_sizes({3, 5, 7, 9}, 2, 12) == [3, 5]  # up to 2*n0 - 1 = 5 (12 - 2*3 = 6)
    assert T.usable_sizes({3, 4, 5, 7}, 1, 7) == [3, 4, 5]  # 7 - 3 = 4, but 5 <= 2*n0 - 1 stays for degraded plans
    assert T.uncovered_counts([3, 5], 1, 12) == [7]
    assert T.uncovered_counts([3, 5], 0, 12) == [4, 7]


def gpt_like(L: int, rng: random.Random | None = None, state: int = 2 * 10**9) -> ModelProfile:
    layers = [
        LayerProfile(
            forward_ms=(1.0 if rng is None else rng.uniform(0.5, 2.0)),
            backward_ms=(2.0 if rng is None else rng.uniform(1.0, 4.0)),
            state_bytes=state,
            activation_bytes=2 * 10**8,
            output_bytes=8 * 10**6,
        )
        for _ in range(L)
    ]
    return ModelProfile(model=f"gpt-like-{L}", microbatch_size=1, layers=layers)


def cluster_of(N: int, G: int = 1, memory: int = 16 * 10**9) -> ClusterShape:
    return ClusterShape(
        nodes=N, gpus_per_node=G, gpu_memory_bytes=memory, intra_node_bandwidth=2e11, inter_node_bandwidth=2.5e10
    )


# Oobleck's evaluation shapes: a 24-layer model with equal layers and a 32-layer model with random times.
@pytest.mark.parametrize("N", [13, 21])
@pytest.mark.parametrize("f", [1, 3])
@pytest.mark.parametrize("model", ["equal-24", "random-32"])
def test_oobleck_scenarios(model, N, f):
    profile = gpt_like(24) if model == "equal-24" else gpt_like(32, random.Random(7))
    cluster = cluster_of(N)
    n0 = T.min_nodes(profile, cluster)
    # 2 GB state per layer in 16 GB with 0.2 GB per in-flight microbatch: memory decides n0.
    assert n0 == (4 if model == "equal-24" else 6)
    if (f + 1) * n0 > N:
        with pytest.raises(PlanningError, match=rf"N = {N} .* f\+1 = {f + 1} .* n0 = {n0} .* = {(f + 1) * n0} > {N}"):
            T.generate_templates(profile, cluster, f)
        return
    templates = T.generate_templates(profile, cluster, f)
    assert [t.nodes for t in templates] == list(range(n0, max(N - f * n0, 2 * n0 - 1) + 1))
    for template in templates:
        check_template(profile, cluster, template, T.DEFAULT_M_REF)
    for total in range((f + 1) * n0, N + 1):
        assert splits([t.nodes for t in templates], total, f + 1)
    tables = T.cost_tables(profile, cluster)
    assert T.search_layouts(tables, N) == search_layouts_ref(tables, N)
    if model == "equal-24":
        # n0 = 4: memory forces the stages nearest the start, which hold the most microbatches, to be shorter
        assert [s.end - s.start for s in templates[0].stages] == [5, 6, 6, 7]
        for template in templates[1:]:  # memory not binding: the bottleneck holds at most ceil(24 / n) + 1 layers
            assert max(s.end - s.start for s in template.stages) <= math.ceil(24 / template.nodes) + 1


def test_eight_gpu_nodes_split_only_for_memory():
    profile = gpt_like(32, random.Random(3))
    roomy = T.all_templates(profile, cluster_of(8, G=8, memory=10**12))
    assert all(
        len(t.stages) == t.nodes and all(s.gpus == 8 for s in t.stages) for t in roomy
    )  # splitting a node never speeds up
    tight = T.all_templates(profile, cluster_of(8, G=8, memory=16 * 10**9))
    assert tight[0].nodes == 1 and len(tight[0].stages) > 1  # 64 GB of state fits one node only split into stages
    for template in tight:
        check_template(profile, cluster_of(8, G=8, memory=16 * 10**9), template, T.DEFAULT_M_REF)


# ---------------------------------------------------------------------------------------------
# Errors name the numbers; determinism.


def test_errors_name_the_numbers():
    profile = gpt_like(24)
    with pytest.raises(PlanningError, match=r"N = 7 nodes .* f\+1 = 2 .* n0 = 4 .* \(f\+1\)\*n0 = 8 > 7"):
        T.generate_templates(profile, cluster_of(7), 1)
    with pytest.raises(PlanningError, match=r"N = 3 nodes .* n0 = 4"):
        T.generate_templates(profile, cluster_of(3), 0)
    with pytest.raises(
        PlanningError, match=r"layer 0 alone needs .* 2200000000 bytes per GPU .* gpu_memory_bytes is 2000000000"
    ):
        T.min_nodes(profile, cluster_of(3, memory=2 * 10**9))
    with pytest.raises(PlanningError, match="no template of 2 nodes fits"):
        T.best_template(profile, cluster_of(3), 2)
    with pytest.raises(PlanningError, match="m_ref: must be an integer >= 1, got 0"):
        T.cost_tables(profile, cluster_of(3), 0)
    with pytest.raises(PlanningError, match="microbatch_size: must be an integer >= 1, got 0"):
        T.cost_tables(profile, cluster_of(3), 4, 0)
    with pytest.raises(PlanningError, match="f: must be an integer >= 0, got -1"):
        T.generate_templates(profile, cluster_of(3), -1)
    with pytest.raises(PlanningError, match=r"too large for exact planning: T\(m_ref\)"):
        T.cost_tables(
            ModelProfile(
                model="huge",
                microbatch_size=1,
                layers=[
                    LayerProfile(forward_ms=1e15, backward_ms=0, state_bytes=0, activation_bytes=0, output_bytes=0)
                ],
            ),
            cluster_of(1),
        )


def test_same_inputs_same_bytes():
    profile, cluster = gpt_like(32, random.Random(11)), cluster_of(21, G=4, memory=12 * 10**9)
    first = [t.model_dump_json() for t in T.generate_templates(profile, cluster, 1)]
    second = [t.model_dump_json() for t in T.generate_templates(profile.model_copy(deep=True), cluster, 1)]
    assert first == second and len(first) > 1


def test_compiled_boundary_rejects_bad_shapes():
    import numpy as np

    from oobleck.planner import _templates

    tables = T.cost_tables(gpt_like(4), cluster_of(2))
    out = lambda *shape, t=np.int64: np.zeros(shape, dtype=t)  # noqa: E731
    with pytest.raises(ValueError, match=r"ends: length 2, expected 3"):
        _templates.search(
            tables.time_pf,
            tables.state_pf,
            tables.act_pf,
            tables.rep_pf,
            tables.comm_intra,
            tables.comm_inter,
            1,
            1,
            1,
            2,
            4,
            10**10,
            out(3),
            out(3),
            out(3, t=np.int32),
            out(2, 4, t=np.int32),
            out(3, 4, t=np.int32),
            out(3, 4, t=np.int32),
        )


# The compiled core prunes with upper bounds and caps positions at a derived K; the reference does neither.
# Realistic profiles where memory is tight (3 GiB: 1-3 layers per stage, uneven GPU splits) to loose (80 GiB: one
# stage per node) on 8-GPU nodes exercise all three.
@pytest.mark.parametrize("memory_gib", [3, 5, 8, 80])
@pytest.mark.parametrize("m", [1, 4, 9])
@pytest.mark.parametrize("mbs", [None, 2])
def test_compiled_equals_reference_on_gpt_profiles(memory_gib, m, mbs):
    from oobleck.planner.synthetic import GPTShape, gpt_profile

    profile = gpt_profile(
        GPTShape(blocks=10, hidden=2048, heads=16),
        seq_len=2048,
        microbatch_size=2,
        gpu_flops=4e14,
        hbm_bandwidth=3.35e12,
    )
    cluster = ClusterShape(
        nodes=4,
        gpus_per_node=8,
        gpu_memory_bytes=memory_gib * 2**30,
        intra_node_bandwidth=4.5e11,
        inter_node_bandwidth=5e10,
    )
    tables = T.cost_tables(profile, cluster, m, mbs)
    compiled = T.search_layouts(tables, 4)
    assert compiled == search_layouts_ref(tables, 4)
    assert compiled or (mbs == 2 and memory_gib == 3), "some size must fit"  # 2-GPU stages at most: 3 GiB is too tight


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: opt-in, the estimate's arithmetic, memory, errors.


def test_tensor_parallelism_is_opt_in():
    profile, cluster = gpt_like(24, random.Random(5)), cluster_of(6, G=8, memory=16 * 10**9)
    plain = T.all_templates(profile, cluster)
    assert all(s.tensor_parallel == 1 for t in plain for s in t.stages)
    assert plain == T.all_templates(profile, cluster, max_tp=1)
    with_tp = T.all_templates(profile, cluster, max_tp=8)
    assert any(s.tensor_parallel > 1 for t in with_tp for s in t.stages)
    for a, b in zip(plain, with_tp):
        assert b.iteration_ms <= a.iteration_ms  # t = 1 stays available: TP never plans slower


def test_estimated_tensor_parallel_times_follow_the_formula():
    """f_t = forward / t + 2 ring all-reduces of output_bytes (2 (t - 1) / t of them each) over the intra bandwidth."""
    layer = LayerProfile(
        forward_ms=8.0, backward_ms=16.0, state_bytes=0, activation_bytes=0, output_bytes=10**9, name="block"
    )
    profile = ModelProfile(model="one", microbatch_size=1, layers=[layer])
    cluster = cluster_of(1, G=4)
    tables = T.cost_tables(profile, cluster, max_tp=4)
    bandwidth = cluster.intra_node_bandwidth
    for row, t in enumerate((1, 2, 4)):
        all_reduces_ms = 2 * 2 * (t - 1) / t * 1e9 / bandwidth * 1e3
        assert tables.forward_pf[row, 1] == pytest.approx((8.0 / t + all_reduces_ms) * 1e6, abs=1)
        assert tables.backward_pf[row, 1] == pytest.approx((16.0 / t + all_reduces_ms) * 1e6, abs=1)
    measured = layer.model_copy(
        update={"tensor_parallel": [TensorParallelTimes(degree=2, forward_ms=5, backward_ms=9)]}
    )
    tables = T.cost_tables(profile.model_copy(update={"layers": [measured]}), cluster, max_tp=2)
    assert (tables.forward_pf[1, 1], tables.backward_pf[1, 1]) == (5_000_000, 9_000_000)  # measured: no estimate


def test_tensor_parallelism_divides_state_and_split_activations():
    """20 bytes of state and 8 of activations (2 replicated) on 12-byte GPUs, microbatches of one sample (no
    data-parallel split): only t = 4 fits, state / t + (split / t + replicated) * t / g per GPU."""
    layer = LayerProfile(
        forward_ms=1, backward_ms=0, state_bytes=20, activation_bytes=8, replicated_activation_bytes=2, output_bytes=0
    )
    profile = ModelProfile(model="one", microbatch_size=1, layers=[layer])
    cluster = ClusterShape(
        nodes=1, gpus_per_node=4, gpu_memory_bytes=12, intra_node_bandwidth=1e9, inter_node_bandwidth=1e9
    )
    with pytest.raises(PlanningError, match="no template fits"):
        T.min_nodes(profile, cluster, m_ref=1, microbatch_size=1)
    # t = 2 on 2 GPUs: 20 / 2 + (6 / 2 + 2) = 15 > 12; t = 4 on 4 GPUs: 20 / 4 + (6 / 4 + 2) = 8.5 <= 12
    (template,) = T.all_templates(profile, cluster, 1, microbatch_size=1, max_tp=4)
    assert [(s.gpus, s.tensor_parallel) for s in template.stages] == [(4, 4)]
    assert template.stages[0].forward_ms == pytest.approx(1 / 4)
    assert template.max_microbatches is None  # one stage keeps one microbatch in flight at any count


def test_tensor_parallel_errors_name_the_field():
    profile = gpt_like(4)
    with pytest.raises(PlanningError, match="max_tensor_parallel: must be a power of two >= 1, got 3"):
        T.cost_tables(profile, cluster_of(2), max_tp=3)
    with pytest.raises(PlanningError, match="max_tensor_parallel: 16 exceeds gpus_per_node = 8"):
        T.cost_tables(profile, cluster_of(2, G=8), max_tp=16)
    with pytest.raises(ValueError, match="replicated_activation_bytes: 5 exceeds activation_bytes = 4"):
        LayerProfile(
            forward_ms=1,
            backward_ms=1,
            state_bytes=0,
            activation_bytes=4,
            replicated_activation_bytes=5,
            output_bytes=0,
        )
    with pytest.raises(ValueError, match=r"tensor_parallel: each degree at most once, got \[2, 2\]"):
        LayerProfile(
            forward_ms=1,
            backward_ms=1,
            state_bytes=0,
            activation_bytes=0,
            output_bytes=0,
            tensor_parallel=[TensorParallelTimes(degree=2, forward_ms=1, backward_ms=1)] * 2,
        )
    with pytest.raises(ValueError, match="degree\n.*must be a power of two, got 6"):
        TensorParallelTimes(degree=6, forward_ms=1, backward_ms=1)


def test_measured_tensor_parallel_times_override_the_estimate():
    """Where the profile measured a degree, the planner believes the measurement: a slow measured t = 2 is avoided
    even though the estimate (half the compute, cheap all-reduces) would take it."""
    layers = [
        LayerProfile(forward_ms=4, backward_ms=8, state_bytes=10, activation_bytes=0, output_bytes=1000)
        for _ in range(4)
    ]
    profile = ModelProfile(model="m", microbatch_size=1, layers=layers)
    cluster = ClusterShape(
        nodes=1, gpus_per_node=2, gpu_memory_bytes=100, intra_node_bandwidth=1e9, inter_node_bandwidth=1e9
    )
    (estimated,) = T.all_templates(profile, cluster, 4, microbatch_size=1, max_tp=2)
    assert [s.tensor_parallel for s in estimated.stages] == [2]  # 6 ms per layer at t = 2 beats 2 x 12 ms stages
    slow = TensorParallelTimes(degree=2, forward_ms=4, backward_ms=8)  # measured: no faster than one GPU
    measured = profile.model_copy(update={"layers": [x.model_copy(update={"tensor_parallel": [slow]}) for x in layers]})
    (template,) = T.all_templates(measured, cluster, 4, microbatch_size=1, max_tp=2)
    assert [(s.gpus, s.tensor_parallel) for s in template.stages] == [(1, 1), (1, 1)]
