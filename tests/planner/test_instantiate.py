"""Instantiation and batch distribution: the compiled core against its reference and an exhaustive search,
and the plans built from them."""

from __future__ import annotations

import itertools
import random
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from oobleck.api.plan import Template, TemplateStage
from oobleck.api.profile import ClusterShape, LayerProfile, ModelProfile
from oobleck.planner import _instantiate as compiled
from oobleck.planner import ref_instantiate as reference
from oobleck.planner.errors import PlanningError
from oobleck.planner.instantiate import instantiate, plan_job, template_cost
from oobleck.planner.templates import generate_templates

T = reference.t_of


def make_template(
    nodes: int,
    layer_ms: list[float],
    gpus: int = 2,
    comm_ms: float = 0.25,
    m_ref: int = 64,
    max_microbatches: int | None = None,
) -> Template:
    """One stage per node on all its GPUs, layers split as evenly as their count allows."""
    bounds = [round(i * len(layer_ms) / nodes) for i in range(nodes + 1)]
    stages = []
    for node, (start, end) in enumerate(zip(bounds, bounds[1:])):
        forward = sum(layer_ms[start:end]) / gpus
        stages.append(
            TemplateStage(
                start=start, end=end, node=node, gpus=gpus, gpu_offset=0, forward_ms=forward, backward_ms=2 * forward
            )
        )
    times = [s.forward_ms + s.backward_ms for s in stages]
    total = sum(times) + 2 * comm_ms * (nodes - 1) + (m_ref - 1) * max(times)
    return Template(nodes=nodes, stages=stages, iteration_ms=total, m_ref=m_ref, max_microbatches=max_microbatches)


EQUAL = [1.0] * 12
TEMPLATES = [make_template(n, EQUAL) for n in (2, 3, 4, 5)]


# ---------------------------------------------------------------- the numeric core


def best_z_for(pipelines: list[tuple[float, float, int]], microbatches: int) -> float | None:
    """Exhaustively: the least max_i T_i(nb_i) over nb_i in [1, limit_i] summing to `microbatches`.

    For a threshold v every pipeline can take #{m <= limit: T(m) <= v}; the least candidate v where all
    take at least one and together at least `microbatches` is the optimum (any split under v fits)."""
    values = sorted({T(b, s, m) for b, s, lim in pipelines for m in range(1, lim + 1)})
    for v in values:
        caps = [sum(1 for m in range(1, lim + 1) if T(b, s, m) <= v) for b, s, lim in pipelines]
        if min(caps) >= 1 and sum(caps) >= microbatches:
            return v
    return None


def exhaustive(sizes, base, slope, limits, n_nodes, kmin, microbatches):
    """The least Z over every pipeline multiset that uses exactly n_nodes nodes."""
    best = None
    bounds = [n_nodes // n for n in sizes]
    for x in itertools.product(*(range(b + 1) for b in bounds)):
        if sum(c * n for c, n in zip(x, sizes)) != n_nodes or not kmin <= sum(x) <= microbatches:
            continue
        pipelines = [(base[t], slope[t], limits[t]) for t, c in enumerate(x) for _ in range(c)]
        z = best_z_for(pipelines, microbatches)
        if z is not None and (best is None or z < best):
            best = z
    return best


# Small integer-ish times make ties between candidates common, which is where the two engines could differ.
times = st.one_of(st.integers(1, 12).map(lambda v: v / 4), st.floats(0.05, 10.0, allow_nan=False))


@st.composite
def problems(draw, max_nodes=24, max_batch=64):
    sizes = draw(st.lists(st.integers(1, 7), min_size=1, max_size=4, unique=True))
    nt = len(sizes)
    slope = [draw(times) for _ in range(nt)]
    base = [s + draw(times) * draw(st.integers(0, 4)) for s in slope]  # T(1) >= the slowest stage
    microbatches = draw(st.integers(1, max_batch))
    limits = [draw(st.one_of(st.just(microbatches), st.integers(1, microbatches))) for _ in range(nt)]
    n_nodes = draw(st.integers(1, max_nodes))
    kmin = draw(st.integers(0, 4))  # 0: no pipeline-count axis (choose passes it when the count cannot bind)
    return sizes, base, slope, limits, n_nodes, kmin, microbatches


def as_arrays(sizes, base, slope, limits):
    return (
        np.array(sizes, dtype=np.int64),
        np.array(base, dtype=np.float64),
        np.array(slope, dtype=np.float64),
        np.array(limits, dtype=np.int64),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_solve_is_exact_against_exhaustive_search(problem) -> None:
    sizes, base, slope, limits, n_nodes, kmin, microbatches = problem
    found = compiled.solve(*as_arrays(sizes, base, slope, limits), n_nodes, kmin, microbatches)
    expected = exhaustive(sizes, base, slope, limits, n_nodes, kmin, microbatches)
    if expected is None:
        assert found is None
        return
    assert found is not None
    z, counts = found
    assert z == expected
    assert sum(int(c) * n for c, n in zip(counts, sizes)) == n_nodes
    assert kmin <= int(counts.sum()) <= microbatches
    chosen = [(base[t], slope[t], limits[t]) for t, c in enumerate(counts) for _ in range(int(c))]
    assert best_z_for(chosen, microbatches) == z


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_nodes=40, max_batch=200))
def test_compiled_solve_equals_reference(problem) -> None:
    sizes, base, slope, limits, n_nodes, kmin, microbatches = problem
    arrays = as_arrays(sizes, base, slope, limits)
    assert compiled.max_pipelines(arrays[0], n_nodes) == reference.max_pipelines(sizes, n_nodes)
    assert (
        compiled.pipeline_counts(arrays[0], n_nodes, microbatches).tolist()
        == reference.pipeline_counts(sizes, n_nodes, microbatches).tolist()
    )
    a = compiled.solve(*arrays, n_nodes, kmin, microbatches)
    b = reference.solve(*arrays, n_nodes, kmin, microbatches)
    assert (a is None) == (b is None)
    if a is not None:
        assert a[0] == b[0]
        assert a[1].tolist() == b[1].tolist()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_nodes=40, max_batch=200), st.data())
def test_an_upper_hint_never_changes_the_answer(problem, data) -> None:
    """`upper` (a repair's Z in a reconfiguration) only narrows the search: any value, feasible or not,
    gives the same Z and counts as none."""
    sizes, base, slope, limits, n_nodes, kmin, microbatches = problem
    arrays = as_arrays(sizes, base, slope, limits)
    plain = compiled.solve(*arrays, n_nodes, kmin, microbatches)
    values = [b + (m - 1) * s for b, s, lim in zip(base, slope, limits) for m in range(1, min(lim, microbatches) + 1)]
    hint = data.draw(st.sampled_from(values) | st.floats(-1e3, 1e6) if values else st.floats(-1e3, 1e6))
    hinted = compiled.solve(*arrays, n_nodes, kmin, microbatches, hint)
    assert (plain is None) == (hinted is None)
    if plain is not None:
        assert plain[0] == hinted[0] and plain[1].tolist() == hinted[1].tolist()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_nodes=40, max_batch=200))
def test_pruning_dominated_templates_is_exact(problem) -> None:
    sizes, base, slope, limits, n_nodes, kmin, microbatches = problem
    arrays = as_arrays(sizes, base, slope, limits)
    flags = compiled.dominated(*arrays)
    assert flags.tolist() == reference.dominated(*arrays).tolist()
    if compiled.max_pipelines(arrays[0], n_nodes) > microbatches:
        return  # choose prunes only when no mix has more pipelines than microbatches
    keep = ~flags
    full = compiled.solve(*arrays, n_nodes, kmin, microbatches)
    pruned = compiled.solve(*(a[keep] for a in arrays), n_nodes, kmin, microbatches)
    assert (full is None) == (pruned is None)
    if full is not None:
        assert full[0] == pruned[0]


def test_a_template_two_smaller_ones_replace_is_dominated() -> None:
    # 2 nodes: T(m) = 3 + (m - 1); 4 nodes: T(m) = 3.5 + (m - 1) / 2: two 2-node pipelines take at least as many
    # microbatches by any time. The 3-node template has no pair summing to 3 nodes.
    sizes, base, slope, limits = as_arrays([2, 4, 3], [3.0, 3.5, 100.0], [1.0, 0.5, 1.0], [64, 64, 64])
    assert compiled.dominated(sizes, base, slope, limits).tolist() == [False, True, False]
    assert reference.dominated(sizes, base, slope, limits).tolist() == [False, True, False]


@st.composite
def splits(draw, max_pipelines=6, max_batch=80):
    k = draw(st.integers(1, max_pipelines))
    microbatches = draw(st.integers(k, max_batch))
    slope = [draw(times) for _ in range(k)]
    base = [s + draw(times) * draw(st.integers(0, 4)) for s in slope]
    limits = [draw(st.one_of(st.just(microbatches), st.integers(1, microbatches))) for _ in range(k)]
    assume(sum(limits) >= microbatches)
    return base, slope, limits, microbatches


@settings(max_examples=300, deadline=None)
@given(splits())
def test_split_is_balanced_and_equals_reference(problem) -> None:
    base, slope, limits, microbatches = problem
    arrays = (np.array(base), np.array(slope), np.array(limits, dtype=np.int64))
    nb = compiled.split(*arrays, microbatches).tolist()
    assert nb == reference.split(*arrays, microbatches).tolist()
    assert sum(nb) == microbatches
    assert all(1 <= n <= lim for n, lim in zip(nb, limits))
    z = max(T(b, s, n) for b, s, n in zip(base, slope, nb))
    assert z == best_z_for(list(zip(base, slope, limits)), microbatches)
    # Water-filled: moving one microbatch from any pipeline to any other never lowers the mover's time.
    for i, j in itertools.permutations(range(len(nb)), 2):
        if nb[i] > 1 and nb[j] < limits[j]:
            assert T(base[i], slope[i], nb[i]) <= T(base[j], slope[j], nb[j] + 1)


@pytest.mark.parametrize("seed", range(20))
def test_split_is_optimal_over_every_composition(seed: int) -> None:
    rng = random.Random(seed)
    k = rng.randint(1, 3)
    microbatches = rng.randint(k, 9)
    base = [rng.choice([1.0, 2.0, 2.5, 4.0]) for _ in range(k)]
    slope = [rng.choice([0.5, 1.0, 1.5]) for _ in range(k)]
    limits = [microbatches] * k
    best = min(
        max(T(b, s, n) for b, s, n in zip(base, slope, combo))
        for combo in itertools.product(range(1, microbatches + 1), repeat=k)
        if sum(combo) == microbatches
    )
    nb = compiled.split(np.array(base), np.array(slope), np.array(limits, dtype=np.int64), microbatches)
    assert max(T(b, s, int(n)) for b, s, n in zip(base, slope, nb)) == best


def test_split_refuses_what_cannot_fit() -> None:
    base, slope = np.array([1.0, 1.0]), np.array([1.0, 1.0])
    assert compiled.split(base, slope, np.array([2, 2], dtype=np.int64), 5) is None
    assert compiled.split(base, slope, np.array([5, 5], dtype=np.int64), 1) is None
    assert reference.split(base, slope, np.array([2, 2], dtype=np.int64), 5) is None


def test_counts_flags() -> None:
    sizes = np.array([3, 5], dtype=np.int64)
    assert compiled.max_pipelines(sizes, 15) == 5
    assert compiled.max_pipelines(sizes, 7) == -1
    assert np.flatnonzero(compiled.pipeline_counts(sizes, 15, 6)).tolist() == [3, 5]
    assert np.flatnonzero(reference.pipeline_counts(sizes, 15, 6)).tolist() == [3, 5]


# ---------------------------------------------------------------- plans


def names(n: int) -> list[str]:
    return [str(i) for i in range(n)]


def check_plan(plan, nodes, f, microbatches, templates) -> None:
    """Invariants every instantiated plan must satisfy."""
    assert sorted(plan.nodes) == sorted(nodes), "every node is used, once"
    assert len(plan.pipelines) >= f + 1 or plan.degraded
    assert sum(p.microbatches for p in plan.pipelines) == microbatches
    offset = 0
    for index, pipeline in enumerate(plan.pipelines):
        assert pipeline.index == index
        assert pipeline.microbatch_offset == offset
        offset += pipeline.microbatches
    sizes = [p.template_nodes for p in plan.pipelines]
    assert sizes == sorted(sizes, reverse=True), "largest templates first"
    by_nodes = {t.nodes: t for t in templates}
    gpus_per_pipeline = [sum(s.gpus for s in by_nodes[p.template_nodes].stages) for p in plan.pipelines]
    assert plan.world_size == sum(gpus_per_pipeline)
    rank = 0
    for pipeline in plan.pipelines:
        for stage_index, stage in enumerate(pipeline.stages):
            for r in stage.ranks:
                assert r == rank, "ranks are dense: pipeline by pipeline, stage by stage, GPU by GPU"
                a = plan.ranks[r]
                assert (a.pipeline, a.stage, a.start, a.end) == (pipeline.index, stage_index, stage.start, stage.end)
                assert a.node in pipeline.nodes
                rank += 1
    costs = {t.nodes: template_cost(t) for t in templates}
    for pipeline in plan.pipelines:
        assert pipeline.iteration_ms == costs[pipeline.template_nodes].at(pipeline.microbatches)
    assert plan.iteration_ms == max(p.iteration_ms for p in plan.pipelines)


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 40), st.integers(0, 3), st.integers(1, 120))
def test_instantiate_plans_are_valid_and_optimal(n_nodes: int, f: int, microbatches: int) -> None:
    costs = [template_cost(t) for t in TEMPLATES]
    small = n_nodes <= 24 and microbatches <= 64
    expected = None
    if small:
        expected = exhaustive(
            [c.nodes for c in costs],
            [c.base_ms for c in costs],
            [c.slope_ms for c in costs],
            [c.limit(microbatches) for c in costs],
            n_nodes,
            f + 1,
            microbatches,
        )
    try:
        plan = instantiate(TEMPLATES, names(n_nodes), f, microbatches, "job")
    except PlanningError as error:
        assert not small or expected is None
        assert str(error).startswith(("nodes:", "global_microbatches:"))
        return
    check_plan(plan, names(n_nodes), f, microbatches, TEMPLATES)
    assert plan.generation == 0 and plan.reason == "initial" and not plan.copies
    if small:
        assert plan.iteration_ms == expected


def test_instantiate_is_deterministic_and_engines_agree() -> None:
    layers = [random.Random(3).uniform(0.5, 2.0) for _ in range(16)]
    templates = [make_template(n, layers) for n in (3, 4, 5)]
    nodes = [f"node-{i}" for i in range(23)]
    plans = [instantiate(templates, nodes, 2, 50, "job", engine=e) for e in ("compiled", "compiled", "reference")]
    assert plans[0].to_json() == plans[1].to_json() == plans[2].to_json()
    # Templates in another order describe the same job: the same plan.
    assert instantiate(list(reversed(templates)), nodes, 2, 50, "job").to_json() == plans[0].to_json()


def test_nodes_are_taken_in_the_order_given() -> None:
    nodes = ["c", "a", "b", "e", "d", "f"]
    plan = instantiate(TEMPLATES[:2], nodes, 1, 8, "job")
    assert plan.nodes == nodes  # pipelines take consecutive runs of the given order
    assert [p.nodes for p in plan.pipelines] == [["c", "a"], ["b", "e"], ["d", "f"]]


@pytest.mark.parametrize(
    ("nodes", "f", "microbatches", "field"),
    [
        (7, 3, 16, "nodes: 7 nodes form at most 3 pipelines"),
        (1, 0, 16, "nodes: 1 nodes cannot be split exactly"),
        (5, 1, 1, "global_microbatches: 1 cannot feed f+1 = 2"),
        (40, 0, 3, "global_microbatches: 3 is fewer than the 8 pipelines"),
        (9, -1, 8, "f: must be an integer >= 0"),
        (9, 1, 0, "global_microbatches: must be an integer >= 1"),
    ],
)
def test_infeasible_jobs_name_the_field(nodes: int, f: int, microbatches: int, field: str) -> None:
    with pytest.raises(PlanningError, match=re.escape(field)):
        instantiate(TEMPLATES, names(nodes), f, microbatches, "job")


def test_bad_templates_and_nodes_are_named() -> None:
    with pytest.raises(PlanningError, match="templates: empty"):
        instantiate([], names(4), 0, 4, "job")
    with pytest.raises(PlanningError, match="templates: node counts must be distinct"):
        instantiate([TEMPLATES[0], TEMPLATES[0]], names(4), 0, 4, "job")
    other = make_template(3, [1.0] * 10)
    with pytest.raises(PlanningError, match="stages must cover layers 0..12"):
        instantiate([TEMPLATES[0], other], names(4), 0, 4, "job")
    with pytest.raises(PlanningError, match=r"nodes: listed twice: \['1'\]"):
        instantiate(TEMPLATES, ["0", "1", "1", "2"], 0, 4, "job")
    with pytest.raises(PlanningError, match="gpus_per_node: must be a power of two"):
        instantiate(TEMPLATES, names(4), 0, 4, "job", gpus_per_node=3)


def test_degraded_when_allowed() -> None:
    plan = instantiate(TEMPLATES, names(7), 3, 16, "job", allow_degraded=True)
    assert plan.degraded and len(plan.pipelines) == 3
    check_plan(plan, names(7), 3, 16, TEMPLATES)


def test_memory_limit_caps_microbatches_per_pipeline() -> None:
    # The template's memory holds at most max_microbatches (not m_ref): a pipeline may not run more.
    small = [make_template(n, EQUAL, m_ref=2, max_microbatches=3) for n in (4, 5)]
    plan = instantiate(small, names(8), 0, 6, "job")
    assert [p.microbatches for p in plan.pipelines] == [3, 3]
    with pytest.raises(PlanningError, match="global_microbatches: 7 microbatches do not fit in memory") as error:
        instantiate(small, names(8), 0, 7, "job")
    assert "training.referenceMicrobatches" in str(error.value) and "regenerate" not in str(error.value)


# ---------------------------------------------------------------- Oobleck-style scenarios


def profile(kind: str) -> ModelProfile:
    rng = random.Random(7)
    if kind == "equal24":
        times = [(2.0, 4.0)] * 24
    else:
        times = [(rng.uniform(0.5, 3.0), rng.uniform(1.0, 6.0)) for _ in range(32)]
    layers = [
        LayerProfile(forward_ms=f, backward_ms=b, state_bytes=8 << 30, activation_bytes=1 << 27, output_bytes=1 << 24)
        for f, b in times
    ]
    return ModelProfile(model=kind, microbatch_size=1, layers=layers)


def cluster(nodes: int) -> ClusterShape:
    return ClusterShape(
        nodes=nodes, gpus_per_node=4, gpu_memory_bytes=40 << 30, intra_node_bandwidth=2e11, inter_node_bandwidth=2.5e10
    )


@pytest.mark.parametrize("kind", ["equal24", "random32"])
@pytest.mark.parametrize("n_nodes", [13, 21])
@pytest.mark.parametrize("f", [1, 3])
def test_oobleck_scenarios_every_covered_node_count(kind: str, n_nodes: int, f: int) -> None:
    model = profile(kind)
    templates = generate_templates(model, cluster(n_nodes), f=f)
    n0 = min(t.nodes for t in templates)
    assert n0 >= 2, "the scenario must need multi-node pipelines to mean anything"
    microbatches = 64
    layer_ms = [layer.forward_ms + layer.backward_ms for layer in model.layers]
    for count in range((f + 1) * n0, n_nodes + 1):
        plan = instantiate(templates, names(count), f, microbatches, kind)
        check_plan(plan, names(count), f, microbatches, templates)
        assert len(plan.pipelines) >= f + 1 and not plan.degraded
        # Balanced stages: no stage exceeds the pipeline's per-GPU share of the work by more than one layer.
        for pipeline in plan.pipelines:
            template = next(t for t in templates if t.nodes == pipeline.template_nodes)
            gpus = sum(s.gpus for s in template.stages)
            slowest = max(s.forward_ms + s.backward_ms for s in template.stages)
            assert slowest <= sum(layer_ms) / gpus + max(layer_ms), (count, pipeline.template_nodes)
        # Balanced pipelines: no microbatch could move to another pipeline and finish sooner.
        costs = {t.nodes: template_cost(t) for t in templates}
        for a, b in itertools.permutations(plan.pipelines, 2):
            if a.microbatches > 1:
                assert a.iteration_ms <= costs[b.template_nodes].at(b.microbatches + 1)


def test_plan_job_names_nodes_and_matches_instantiate() -> None:
    model = profile("equal24")
    shape = cluster(13)
    plan = plan_job(model, shape, 1, 64, "job")
    templates = generate_templates(model, shape, f=1, global_microbatches=64)
    assert plan.to_json() == instantiate(templates, names(13), 1, 64, "job", gpus_per_node=4).to_json()
    with pytest.raises(PlanningError, match="nodes: 2 node ids given, cluster.nodes is 13"):
        plan_job(model, shape, 1, 64, "job", nodes=["a", "b"])
