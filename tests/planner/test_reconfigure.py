"""Reconfiguration: next plans after losing and adding nodes, their moves, and their layer-copy plans."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from oobleck.api.plan import Plan, Template, TemplateStage
from oobleck.api.profile import ClusterShape, LayerProfile, ModelProfile
from oobleck.planner import LostLayersError, instantiate, reconfigure
from oobleck.planner.errors import PlanningError
from oobleck.planner.placement import Held, arrange, gpus_of
from oobleck.planner.reconfigure import next_layout, to_plan
from oobleck.planner.repairs import partition, repair
from oobleck.planner.templates import generate_templates

GPUS = 2
BANDWIDTH = 1e10


def make_template(nodes: int, layer_ms: list[float], comm_ms: float = 0.25, m_ref: int = 64) -> Template:
    """Two single-GPU stages per node, layers split as evenly as their count allows."""
    parts = nodes * GPUS
    bounds = [round(i * len(layer_ms) / parts) for i in range(parts + 1)]
    stages = []
    for index, (start, end) in enumerate(zip(bounds, bounds[1:])):
        forward = sum(layer_ms[start:end])
        stages.append(
            TemplateStage(
                start=start,
                end=end,
                node=index // GPUS,
                gpus=1,
                gpu_offset=index % GPUS,
                forward_ms=forward,
                backward_ms=2 * forward,
            )
        )
    times = [s.forward_ms + s.backward_ms for s in stages]
    total = sum(times) + 2 * comm_ms * (parts - 1) + (m_ref - 1) * max(times)
    return Template(nodes=nodes, stages=stages, iteration_ms=total, m_ref=m_ref)


LAYERS = 18  # a 3-node pipeline then beats a 2-node one per node: 4 x 3 nodes on 12
PROFILE = ModelProfile(
    model="test",
    microbatch_size=1,
    layers=[
        LayerProfile(
            forward_ms=1.0, backward_ms=2.0, state_bytes=(i + 1) << 20, activation_bytes=1 << 20, output_bytes=1 << 16
        )
        for i in range(LAYERS)
    ],
)
TEMPLATES = [make_template(n, [1.0] * LAYERS) for n in (2, 3)]


def names(n: int) -> list[str]:
    return [str(i) for i in range(n)]


def first_plan(n_nodes: int, f: int = 1, microbatches: int = 48) -> Plan:
    return instantiate(TEMPLATES, names(n_nodes), f, microbatches, "job")


def check_next(before: Plan, after: Plan, lost: list[str], added: list[str], profile: ModelProfile = PROFILE) -> None:
    """The invariants of every reconfigured plan and its copy plan."""
    survivors = [n for n in before.nodes if n not in lost] + added
    assert sorted(after.nodes) == sorted(survivors), "every surviving and added node is used, once"
    assert after.generation == before.generation + 1
    assert after.lost_nodes == [n for n in before.nodes if n in lost] and after.added_nodes == added
    assert after.reason and after.reason != "initial"
    assert after.global_microbatches == before.global_microbatches
    assert after.degraded == (len(after.pipelines) < after.f + 1)
    # Stable ranks: a GPU keeps its rank while it is below the new world size; the rest take the free ones.
    old = {(a.node, a.gpu): a.rank for a in before.ranks}
    renumbered = [a for a in after.ranks if old.get((a.node, a.gpu), after.world_size) != a.rank]
    assert all(old.get((a.node, a.gpu), after.world_size) >= after.world_size for a in renumbered)
    held = {(a.node, a.gpu): (a.start, a.end) for a in before.ranks if a.node not in lost}
    expected = set()
    for a in after.ranks:
        old = held.get((a.node, a.gpu), (0, 0))
        expected |= {(a.rank, layer) for layer in range(a.start, a.end) if not old[0] <= layer < old[1]}
    got = [(c.dst_rank, c.layer) for c in after.copies]
    assert sorted(got) == sorted(expected) and len(got) == len(set(got)), "exactly the missing layers are copied"
    for c in after.copies:
        assert after.rank_of(c.dst_node, c.dst_gpu) == c.dst_rank
        assert after.rank_of(c.src_node, c.src_gpu) == c.src_rank
        start, end = held[(c.src_node, c.src_gpu)]
        assert start <= c.layer < end, "the source held the layer before the failure"
        assert c.bytes == profile.layers[c.layer].state_bytes
    # Least-loaded sources: replaying the copies, each source had the least bytes sent among the holders.
    sent: dict[int, int] = {}
    for c in after.copies:
        holders = [after.rank_of(node, gpu) for (node, gpu), (s, e) in held.items() if s <= c.layer < e]
        assert min((sent.get(r, 0), r) for r in holders) == (sent.get(c.src_rank, 0), c.src_rank)
        sent[c.src_rank] = sent.get(c.src_rank, 0) + c.bytes


def unchanged_places(before: Plan, after: Plan) -> set[tuple[str, int]]:
    old = {(a.node, a.gpu): (a.start, a.end) for a in before.ranks}
    return {(a.node, a.gpu) for a in after.ranks if old.get((a.node, a.gpu)) == (a.start, a.end)}


def test_losing_one_node_shrinks_only_its_pipeline() -> None:
    before = first_plan(12)  # four pipelines of 3 nodes
    assert [p.template_nodes for p in before.pipelines] == [3, 3, 3, 3]
    after = reconfigure(before, TEMPLATES, PROFILE, lost=["4"], bandwidth=BANDWIDTH)
    check_next(before, after, ["4"], [])
    assert after.reason == "shrink"
    assert [p.template_nodes for p in after.pipelines] == [3, 3, 3, 2]
    # The other pipelines keep every GPU's layers: only the shrunk pipeline's GPUs receive copies.
    untouched = {n for p in before.pipelines if "4" not in p.nodes for n in p.nodes}
    assert {(n, g) for n in untouched for g in range(GPUS)} <= unchanged_places(before, after)
    assert {c.dst_node for c in after.copies} <= {"3", "5"}


def test_survivors_keep_their_ranks_and_the_freed_ranks_go_to_the_last() -> None:
    before = first_plan(12)  # four pipelines of 3 nodes x 2 GPUs: ranks 0..23 in layout order
    after = reconfigure(before, TEMPLATES, PROFILE, lost=["4"], bandwidth=BANDWIDTH)
    check_next(before, after, ["4"], [])
    old = {(a.node, a.gpu): a.rank for a in before.ranks}
    moved = {(a.node, a.gpu): a.rank for a in after.ranks if old[(a.node, a.gpu)] != a.rank}
    # Node 4 held ranks 8 and 9; the GPUs of ranks 22 and 23 (node 11, past the new end) take them.
    assert after.world_size == 22 and moved == {("11", 0): 8, ("11", 1): 9}
    grown = reconfigure(after, TEMPLATES, PROFILE, added=["x"], bandwidth=BANDWIDTH)
    check_next(after, grown, [], ["x"])
    assert all(after.rank_of(a.node, a.gpu) in (a.rank, None) for a in grown.ranks)
    assert sorted(grown.rank_of("x", g) for g in range(GPUS)) == [22, 23]


def test_short_pipeline_borrows_from_the_largest() -> None:
    groups = [["a", "b", "c"], ["d", "e", "f"], ["g"]]
    work, moves = repair(groups, [False, False, True], [], [2, 3], merge_first=True)
    assert moves == {"borrow"}
    assert work == [["a", "b"], ["d", "e", "f"], ["g", "c"]]


def test_two_short_pipelines_merge() -> None:
    work, moves = repair([["a", "b", "c"], ["d"], ["e"]], [False, True, True], [], [2, 3], merge_first=True)
    assert moves == {"merge"} and work == [["a", "b", "c"], ["d", "e"]]
    # Borrowing first: each short pipeline takes a node from the largest instead, while it can.
    work, moves = repair([["a", "b", "c"], ["d"], ["e"]], [False, True, True], [], [2, 3], merge_first=False)
    assert "borrow" in moves and sorted(len(g) for g in work) in ([2, 2], [3, 2], [2, 3])


def test_added_nodes_top_up_then_form_pipelines() -> None:
    work, moves = repair([["a", "b", "c"], ["d"]], [False, True], ["x", "y", "z"], [2, 3], merge_first=True)
    assert moves == {"extend"}
    assert work == [["a", "b", "c"], ["d", "x"], ["y", "z"]]
    assert partition(7, [2, 3]) == [3, 2, 2] or partition(7, [2, 3]) == [2, 2, 3]
    assert partition(1, [2, 3]) is None


def test_a_whole_pipeline_lost_is_dropped_and_the_rest_keep_their_layers() -> None:
    before = first_plan(12)
    lost = before.pipelines[1].nodes
    after = reconfigure(before, TEMPLATES, PROFILE, lost=lost, bandwidth=BANDWIDTH)
    check_next(before, after, lost, [])
    assert len(after.pipelines) == 3 and not after.copies and after.reason == "drop"


def test_added_nodes_get_every_layer_they_run() -> None:
    before = first_plan(12)
    after = reconfigure(before, TEMPLATES, PROFILE, added=["x", "y", "z"], bandwidth=BANDWIDTH)
    check_next(before, after, [], ["x", "y", "z"])
    assert len(after.pipelines) == 5
    assert {c.dst_node for c in after.copies} == {"x", "y", "z"}
    assert after.iteration_ms < before.iteration_ms


def test_lost_layers_name_the_layers() -> None:
    before = first_plan(4, f=1)  # two pipelines of two nodes; nodes 0 and 2 both hold the first half
    assert [p.nodes for p in before.pipelines] == [["0", "1"], ["2", "3"]]
    first_half = sorted({layer for a in before.ranks if a.node == "0" for layer in range(a.start, a.end)})
    assert first_half == list(range(first_half[-1] + 1)) and len(first_half) < LAYERS
    with pytest.raises(LostLayersError, match=re.escape(f"layers {first_half} have no surviving replica")) as info:
        reconfigure(before, TEMPLATES, PROFILE, lost=["0", "2"], bandwidth=BANDWIDTH)
    assert info.value.layers == first_half


def test_fewer_than_f_plus_one_pipelines_continue_degraded() -> None:
    before = first_plan(4, f=1)
    after = reconfigure(before, TEMPLATES, PROFILE, lost=["2", "3"], bandwidth=BANDWIDTH)
    check_next(before, after, ["2", "3"], [])
    assert after.degraded and len(after.pipelines) == 1
    assert after.pipelines[0].microbatches == before.global_microbatches


def test_the_cheapest_candidate_wins() -> None:
    before = first_plan(13, f=1, microbatches=60)
    for horizon in (0, 1, 100, 10**6):
        layout = next_layout(before, TEMPLATES, PROFILE, lost=["4", "9"], bandwidth=BANDWIDTH, horizon=horizon)
        assert len(layout.considered) >= 2
        healthy = [c for c in layout.considered if not c.degraded]
        chosen = layout.considered[layout.chosen]
        assert chosen.cost_ms == min(c.cost_ms for c in healthy)
        if horizon == 0:
            assert chosen.busiest_bytes == min(c.busiest_bytes for c in healthy)
        if horizon == 10**6:
            assert chosen.iteration_ms == min(c.iteration_ms for c in healthy)
        after = reconfigure(before, TEMPLATES, PROFILE, lost=["4", "9"], bandwidth=BANDWIDTH, horizon=horizon)
        assert sum(c.bytes for c in after.copies) == chosen.copy_bytes
        assert after.iteration_ms == chosen.iteration_ms


def wide_template(nodes: int, bounds: list[int]) -> Template:
    """One stage per node on both GPUs (they hold the same layers): node i runs layers bounds[i]..bounds[i+1]."""
    stages = [
        TemplateStage(start=a, end=b, node=i, gpus=GPUS, gpu_offset=0, forward_ms=b - a, backward_ms=2 * (b - a))
        for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
    ]
    times = [s.forward_ms + s.backward_ms for s in stages]
    return Template(nodes=nodes, stages=stages, iteration_ms=sum(times) + 63 * max(times), m_ref=64)


def test_losing_one_node_of_a_one_layer_per_node_pipeline_moves_two_nodes_layers() -> None:
    """Six layers of 1..6 MiB; the 6-node template runs layer i on node i, the 5-node one runs [0, 2) on
    node 0 and layer i + 1 on node i. Losing node 5 (layer 5) of the pipeline of nodes 0..5: placed in
    order, every node of the 5-node pipeline would lack a layer (10 copies). Placed where they keep the
    most, nodes 1..4 keep layers 1..4 at positions 0..3; node 0 (keeping 2 MiB at position 0, less than
    node 1's 4) takes the free position 4. So node 1 gets layer 0 and node 0 layer 5, on both GPUs:
    4 copies, 2 x (1 + 6) = 14 MiB, the busiest node (0) taking 12 MiB."""
    profile = ModelProfile(model="six", microbatch_size=1, layers=PROFILE.layers[:6])
    templates = [wide_template(6, [0, 1, 2, 3, 4, 5, 6]), wide_template(5, [0, 2, 3, 4, 5, 6])]
    before = instantiate(templates, names(12), 1, 48, "job")
    assert [(p.template_nodes, p.nodes) for p in before.pipelines] == [(6, names(6)), (6, names(12)[6:])]
    layout = next_layout(before, templates, profile, lost=["5"], bandwidth=BANDWIDTH)
    assert layout.pipelines[1][1] == ("1", "2", "3", "4", "0")
    for scored in layout.considered:  # the re-instantiation lays out the same pipelines: the same price
        assert (scored.copy_bytes, scored.busiest_bytes) == (14 << 20, 12 << 20)
    assert layout.considered[layout.chosen].reason == "shrink"
    after = to_plan(before, templates, layout)
    check_next(before, after, ["5"], [], profile)
    assert after.reason == "shrink" and [p.template_nodes for p in after.pipelines] == [6, 5]
    got = sorted((c.dst_node, c.dst_gpu, c.layer) for c in after.copies)
    assert got == [("0", 0, 5), ("0", 1, 5), ("1", 0, 0), ("1", 1, 0)]
    assert {c.src_node for c in after.copies} <= {"0", "6", "11"}  # layer 0: nodes 0 and 6; layer 5: node 11


def test_copies_are_priced_by_the_busiest_receiving_node() -> None:
    """Pipelines [0 1 2], [3 4], [5 6] (3- and 2-node templates, 18 layers of 1..18 MiB); nodes 4 and 6 lost.
    Merging the remnants [3 5]: both held the 2-node template's first half, so node 5 takes the second
    half, layers 9..17: 10+...+18 = 126 MiB, all of it on one node. Borrowing first: [3] borrows node 2
    (it keeps layers 12, 13 and 15..17 at the 2-node template's second position and takes 9, 10, 11 and 14:
    10+11+12+15 = 48 MiB) and [5] joins [0 1] as its third node (layers 12..17: 13+...+18 = 93 MiB): 141 MiB
    in all, but the busiest node takes 93. The same Z, so the parallel copies decide: merge+borrow, where a
    sum of bytes would have chosen the merge."""
    before = first_plan(7, f=1, microbatches=60)
    assert [p.nodes for p in before.pipelines] == [["0", "1", "2"], ["3", "4"], ["5", "6"]]
    for horizon in (0, 100):
        layout = next_layout(before, TEMPLATES, PROFILE, lost=["4", "6"], bandwidth=BANDWIDTH, horizon=horizon)
        priced = {c.reason: (c.copy_bytes >> 20, c.busiest_bytes >> 20) for c in layout.considered}
        assert priced["merge"] == (126, 126) and priced["merge+borrow"] == (141, 93)
        chosen = layout.considered[layout.chosen]
        assert chosen.reason == "merge+borrow"
        assert chosen.cost_ms == (93 << 20) / BANDWIDTH * 1e3 + horizon * chosen.iteration_ms
        assert sorted(sorted(nodes) for _, nodes in layout.pipelines) == [["0", "1", "5"], ["2", "3"]]
        after = to_plan(before, TEMPLATES, layout)
        check_next(before, after, ["4", "6"], [])
        received = {node: sum(c.bytes for c in after.copies if c.dst_node == node) >> 20 for node in after.nodes}
        assert {n: b for n, b in received.items() if b} == {"5": 93, "2": 48}


def test_reconfiguration_is_deterministic_and_chains() -> None:
    before = first_plan(17)
    a = reconfigure(before, TEMPLATES, PROFILE, lost=["3", "11"], bandwidth=BANDWIDTH)
    b = reconfigure(before, TEMPLATES, PROFILE, lost=["11", "3"], bandwidth=BANDWIDTH, engine="reference")
    assert a.to_json() == b.to_json()
    c = reconfigure(a, TEMPLATES, PROFILE, lost=["0"], added=["new"], bandwidth=BANDWIDTH)
    check_next(a, c, ["0"], ["new"])
    assert c.generation == 2


@pytest.mark.parametrize(
    ("lost", "added", "message"),
    [
        (["99"], [], "lost: nodes ['99'] are not in plan generation 0"),
        (["1", ""], [], "lost: node ids must be non-empty strings"),
        (["1", "1"], [], "lost: listed twice: ['1']"),
        ([], ["2"], "added: nodes ['2'] are already in plan generation 0"),
        ([], [], "lost, added: both empty"),
        (names(6), [], "lost: all 6 nodes of the plan are lost"),
    ],
)
def test_bad_requests_name_the_field(lost: list[str], added: list[str], message: str) -> None:
    before = first_plan(6)
    with pytest.raises(PlanningError) as info:
        reconfigure(before, TEMPLATES, PROFILE, lost=lost, added=added, bandwidth=BANDWIDTH)
    assert str(info.value).startswith(message)


def test_bad_bandwidth_and_profile_are_named() -> None:
    before = first_plan(6)
    with pytest.raises(PlanningError, match="bandwidth: must be > 0"):
        reconfigure(before, TEMPLATES, PROFILE, lost=["1"], bandwidth=0)
    short = ModelProfile(model="x", microbatch_size=1, layers=PROFILE.layers[:4])
    with pytest.raises(PlanningError, match="templates, profile: 18 and 4 layers"):
        reconfigure(before, TEMPLATES, short, lost=["1"], bandwidth=BANDWIDTH)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(4, 26), st.integers(0, 2), st.integers(12, 80), st.data())
def test_any_loss_gives_a_valid_plan_or_names_the_lost_layers(n_nodes, f, microbatches, data) -> None:
    try:
        before = first_plan(n_nodes, f=f, microbatches=microbatches)
    except PlanningError:
        event("no first plan")
        return
    nodes = before.nodes
    lost = data.draw(st.lists(st.sampled_from(nodes), unique=True, max_size=min(6, len(nodes) - 1)))
    added = data.draw(st.lists(st.sampled_from([f"x{i}" for i in range(5)]), unique=True, max_size=4))
    if not lost and not added:
        return
    survivors = {(a.node, a.gpu): (a.start, a.end) for a in before.ranks if a.node not in lost}
    orphaned = [l for l in range(LAYERS) if not any(s <= l < e for s, e in survivors.values())]
    try:
        after = reconfigure(before, TEMPLATES, PROFILE, lost=lost, added=added, bandwidth=BANDWIDTH)
    except LostLayersError as error:
        assert error.layers == orphaned and orphaned
        event("lost layers")
        return
    except PlanningError as error:
        # Only when the remaining nodes admit no pipeline layout at all (e.g. a single node left).
        assert str(error).startswith("nodes:"), error
        assert len(nodes) - len(lost) + len(added) < 2
        return
    assert not orphaned
    check_next(before, after, lost, added)
    event(f"reconfigured: {after.reason}")


# ---------------------------------------------------------------- reported holdings


def layout(plan: Plan, without: tuple[str, ...] = ()) -> dict[tuple[str, int], set[int]]:
    """What every GPU of `plan` holds once it has adopted it (copies done), less the nodes `without`."""
    return {(a.node, a.gpu): set(range(a.start, a.end)) for a in plan.ranks if a.node not in without}


def check_copies(after: Plan, held: dict[tuple[str, int], set[int]]) -> None:
    """The copy plan against what the GPUs really hold: exactly the missing layers, from real holders."""
    expected = {
        (a.rank, layer)
        for a in after.ranks
        for layer in range(a.start, a.end)
        if layer not in held.get((a.node, a.gpu), set())
    }
    got = [(c.dst_rank, c.layer) for c in after.copies]
    assert sorted(got) == sorted(expected) and len(got) == len(set(got)), "exactly the missing layers are copied"
    sent: dict[int, int] = {}
    for c in after.copies:
        assert c.layer in held[(c.src_node, c.src_gpu)], "the source really holds the layer"
        assert after.rank_of(c.src_node, c.src_gpu) == c.src_rank and after.rank_of(c.dst_node, c.dst_gpu) == c.dst_rank
        holders = [after.rank_of(node, gpu) for (node, gpu), layers in held.items() if c.layer in layers]
        assert min((sent.get(r, 0), r) for r in holders) == (sent.get(c.src_rank, 0), c.src_rank)
        sent[c.src_rank] = sent.get(c.src_rank, 0) + c.bytes


def test_plan_holdings_give_the_same_plan_as_none() -> None:
    before = first_plan(13, f=1, microbatches=60)
    plain = reconfigure(before, TEMPLATES, PROFILE, lost=["4", "9"], bandwidth=BANDWIDTH)
    held = layout(before, without=("4", "9"))
    for engine in ("compiled", "reference"):
        told = reconfigure(
            before, TEMPLATES, PROFILE, lost=["4", "9"], bandwidth=BANDWIDTH, engine=engine, holdings=held
        )
        assert told.to_json() == plain.to_json()


def test_an_interrupted_receiver_is_no_source_and_gets_its_copies() -> None:
    """Generation 1's copies never arrived on nodes 3 and 5, then node 1 fails too."""
    before = first_plan(12)
    middle = reconfigure(before, TEMPLATES, PROFILE, lost=["4"], bandwidth=BANDWIDTH)
    receivers = {(c.dst_node, c.dst_gpu) for c in middle.copies}
    assert receivers and {n for n, _ in receivers} <= {"3", "5"}
    # What they really hold: their generation-0 layers, none of generation 1's copies.
    held = layout(middle, without=("1",))
    for key in receivers:
        held[key] = set(layout(before)[key])
    lacking = {
        (node, gpu, layer) for (node, gpu) in receivers for layer in layout(middle)[(node, gpu)] - held[(node, gpu)]
    }
    # Trusting the plan in force, receivers would send layers they lack, and nobody would send them theirs.
    believed = reconfigure(middle, TEMPLATES, PROFILE, lost=["1"], bandwidth=BANDWIDTH)
    assert any((c.src_node, c.src_gpu, c.layer) in lacking for c in believed.copies)
    assert not any((c.dst_node, c.dst_gpu, c.layer) in lacking for c in believed.copies)
    for engine in ("compiled", "reference"):
        after = reconfigure(middle, TEMPLATES, PROFILE, lost=["1"], bandwidth=BANDWIDTH, engine=engine, holdings=held)
        check_copies(after, held)
    assert not any((c.src_node, c.src_gpu, c.layer) in lacking for c in after.copies)
    assert any((c.dst_node, c.dst_gpu, c.layer) in lacking for c in after.copies)
    kept = {(a.node, a.gpu) for a in after.ranks} & receivers
    assert kept, "a receiver stays in the next plan"
    for key in kept:  # every layer it runs and lacks reaches it
        rank = after.rank_of(*key)
        a = after.ranks[rank]
        missing = set(range(a.start, a.end)) - held[key]
        assert missing == {c.layer for c in after.copies if c.dst_rank == rank}


def test_a_layer_only_a_worker_reports_is_not_lost() -> None:
    before = first_plan(4, f=1)
    assert [p.nodes for p in before.pipelines] == [["0", "1"], ["2", "3"]]
    first_half = sorted({layer for a in before.ranks if a.node == "0" for layer in range(a.start, a.end)})
    with pytest.raises(LostLayersError):
        reconfigure(before, TEMPLATES, PROFILE, lost=["0", "2"], bandwidth=BANDWIDTH)
    # GPU 0 of node 1 still holds the first half (its range in an older generation): nothing is lost.
    held = layout(before, without=("0", "2"))
    held[("1", 0)] |= set(first_half)
    after = reconfigure(before, TEMPLATES, PROFILE, lost=["0", "2"], bandwidth=BANDWIDTH, holdings=held)
    check_copies(after, held)
    assert {(c.src_node, c.src_gpu) for c in after.copies if c.layer in first_half} == {("1", 0)}
    # Only part of it: the error names the rest, and only the rest.
    held[("1", 0)] -= set(first_half[:2])
    with pytest.raises(LostLayersError) as info:
        reconfigure(before, TEMPLATES, PROFILE, lost=["0", "2"], bandwidth=BANDWIDTH, holdings=held)
    assert info.value.layers == first_half[:2]


def test_nothing_lost_or_added_tops_up_what_is_missing() -> None:
    before = first_plan(12)
    with pytest.raises(PlanningError, match="lost, added: both empty"):
        reconfigure(before, TEMPLATES, PROFILE, bandwidth=BANDWIDTH)
    held = layout(before)
    a = before.ranks[7]
    held[(a.node, a.gpu)] -= {a.start}
    after = reconfigure(before, TEMPLATES, PROFILE, bandwidth=BANDWIDTH, holdings=held)
    assert after.reason == "resync" and after.generation == 1
    places = [[(r.node, r.gpu, r.start, r.end) for r in p.ranks] for p in (before, after)]
    assert places[0] == places[1], "the same nodes keep the same layout"
    assert [(c.dst_rank, c.layer) for c in after.copies] == [(7, a.start)]
    check_copies(after, held)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({("4", 0): {0}}, "holdings: node '4' is not a surviving node"),
        ({("x", 0): {0}}, "holdings: node 'x' is not a surviving node"),
        ({("1", 2): {0}}, "holdings: ('1', 2): the GPU is outside 0..1"),
        ({("1", 0): {18}}, "holdings: ('1', 0) holds layers [18] outside 0..17"),
        ({"1:0": {0}}, "holdings: keys must be (node, gpu) pairs"),
    ],
)
def test_bad_holdings_are_named(change: dict, message: str) -> None:
    before = first_plan(6)
    held = layout(before, without=("4",)) | change
    with pytest.raises(PlanningError) as info:
        reconfigure(before, TEMPLATES, PROFILE, lost=["4"], bandwidth=BANDWIDTH, holdings=held)
    assert str(info.value).startswith(message)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(4, 20), st.data())
def test_any_reported_holdings_give_copies_from_real_holders(n_nodes, data) -> None:
    """Survivors hold their layout give or take some layers: the copies follow what they hold."""
    before = first_plan(n_nodes)
    lost = data.draw(st.lists(st.sampled_from(before.nodes), unique=True, min_size=1, max_size=3))
    held = layout(before, without=tuple(lost))
    for key in sorted(held):
        held[key] = (held[key] - data.draw(st.sets(st.integers(0, LAYERS - 1), max_size=3))) | data.draw(
            st.sets(st.integers(0, LAYERS - 1), max_size=2)
        )
    orphaned = [l for l in range(LAYERS) if not any(l in layers for layers in held.values())]
    try:
        after = reconfigure(before, TEMPLATES, PROFILE, lost=lost, bandwidth=BANDWIDTH, holdings=held)
    except LostLayersError as error:
        assert error.layers == orphaned and orphaned
        return
    except PlanningError as error:
        assert str(error).startswith("nodes:"), error
        return
    assert not orphaned
    check_copies(after, held)
    reference = reconfigure(
        before, TEMPLATES, PROFILE, lost=lost, bandwidth=BANDWIDTH, holdings=held, engine="reference"
    )
    assert reference.to_json() == after.to_json()


# ---------------------------------------------------------------- arranging a pipeline's nodes


def arrange_plainly(groups: list[tuple[Template, tuple[str, ...]]], held: dict) -> list[tuple[str, ...]]:
    """The arrangement rule stated plainly, pipeline by pipeline: the (node, place) pairs by bytes kept
    (most first; ties: earlier node, then earlier place), each taken while both are free; then the nodes
    keeping nothing take the free places in order. `held`: (node, GPU) -> (start, end)."""
    out = []
    for template, nodes in groups:
        kept: dict[tuple[int, int], int] = {}
        for stage in template.stages:
            for gpu in range(stage.gpu_offset, stage.gpu_offset + stage.gpus):
                for a, name in enumerate(nodes):
                    start, end = held.get((name, gpu), (0, 0))
                    common = range(max(start, stage.start), min(end, stage.end))
                    kept[a, stage.node] = kept.get((a, stage.node), 0) + sum(
                        PROFILE.layers[l].state_bytes for l in common
                    )
        pairs = sorted((-b, a, p) for (a, p), b in kept.items() if b > 0)
        place: dict[int, int] = {}
        for _, a, p in pairs:
            if a not in place and p not in place.values():
                place[a] = p
        free = iter(p for p in range(template.nodes) if p not in place.values())
        order = [""] * len(nodes)
        for a, name in enumerate(nodes):
            order[place[a] if a in place else next(free)] = name
        out.append(tuple(order))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(6, 26), st.data())
def test_the_batched_arrangement_is_the_plain_greedy(n_nodes, data) -> None:
    """`arrange` (all pipelines in one numpy batch, most pairs set aside at once) = the plain rule, on
    pipelines made of any survivors, in any order, for any template."""
    before = first_plan(n_nodes)
    lost = data.draw(st.lists(st.sampled_from(before.nodes), unique=True, max_size=3))
    alive = [n for n in before.nodes if n not in lost]
    number = {name: i for i, name in enumerate(before.nodes)}
    state = np.array([layer.state_bytes for layer in PROFILE.layers], dtype=np.int64)
    held = Held.from_plan(gpus_of(before, number), set(lost), number, GPUS, state)
    shuffled = data.draw(st.permutations(alive))
    groups, at = [], 0
    for template in data.draw(st.lists(st.sampled_from(TEMPLATES), min_size=1, max_size=4)):
        if at + template.nodes > len(shuffled):
            break
        groups.append((template, tuple(shuffled[at : at + template.nodes])))
        at += template.nodes
    ranges = {(a.node, a.gpu): (a.start, a.end) for a in before.ranks if a.node not in lost}
    assert arrange(groups, held) == arrange_plainly(groups, ranges)


# ---------------------------------------------------------------- with generated templates


def test_generated_templates_scenario() -> None:
    rng = random.Random(5)
    layers = [
        LayerProfile(
            forward_ms=rng.uniform(0.5, 3.0),
            backward_ms=rng.uniform(1.0, 6.0),
            state_bytes=8 << 30,
            activation_bytes=1 << 27,
            output_bytes=1 << 24,
        )
        for _ in range(32)
    ]
    profile = ModelProfile(model="random32", microbatch_size=1, layers=layers)
    cluster = ClusterShape(
        nodes=21, gpus_per_node=4, gpu_memory_bytes=40 << 30, intra_node_bandwidth=2e11, inter_node_bandwidth=2.5e10
    )
    templates = generate_templates(profile, cluster, f=3)
    before = instantiate(templates, names(21), 3, 64, "job")
    for lost in (["3"], ["3", "7"], ["0", "5", "10", "15"]):
        after = reconfigure(before, templates, profile, lost=lost, bandwidth=cluster.inter_node_bandwidth)
        assert sorted(after.nodes) == sorted(n for n in names(21) if n not in lost)
        assert len(after.pipelines) >= 4 and not after.degraded
        assert sum(p.microbatches for p in after.pipelines) == 64


@pytest.mark.slow
def test_a_thousand_nodes_compiled_and_reference_agree() -> None:
    from oobleck.planner.synthetic import GPT3, gpt_profile

    profile = gpt_profile(GPT3["gpt3-175b"], seq_len=2048, microbatch_size=1, gpu_flops=400e12, hbm_bandwidth=3.35e12)
    cluster = ClusterShape(
        nodes=1024, gpus_per_node=8, gpu_memory_bytes=80 << 30, intra_node_bandwidth=450e9, inter_node_bandwidth=50e9
    )
    templates = generate_templates(profile, cluster, f=3, m_ref=32)
    plans = [instantiate(templates, names(1024), 3, 1536, "big", engine=e) for e in ("compiled", "reference")]
    assert plans[0].to_json() == plans[1].to_json()
    before = plans[0]
    assert sorted(before.nodes, key=int) == names(1024) and before.world_size == 8192
    lost = [p.nodes[-1] for p in before.pipelines[::6]]
    after = [
        reconfigure(before, templates, profile, lost=lost, bandwidth=50e9, engine=e) for e in ("compiled", "reference")
    ]
    assert after[0].to_json() == after[1].to_json()
    next_plan = after[0]
    assert sorted(next_plan.nodes) == sorted(n for n in names(1024) if n not in lost)
    assert len(next_plan.pipelines) >= 4 and sum(p.microbatches for p in next_plan.pipelines) == 1536
    held = {(a.node, a.gpu): (a.start, a.end) for a in before.ranks if a.node not in lost}
    missing = sum(
        1
        for a in next_plan.ranks
        for layer in range(a.start, a.end)
        if not held.get((a.node, a.gpu), (0, 0))[0] <= layer < held.get((a.node, a.gpu), (0, 0))[1]
    )
    assert len(next_plan.copies) == missing
    for c in next_plan.copies:
        assert held[(c.src_node, c.src_gpu)][0] <= c.layer < held[(c.src_node, c.src_gpu)][1]
