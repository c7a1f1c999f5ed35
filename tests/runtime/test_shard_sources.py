"""Copies that know tensor-parallel shards (runtime/elastic/shard_sources.py), as the members of a generation
settle them from what they report (runtime/elastic/sources.resolve): same-t shards first, then one degree's
full set, then a whole replica, and a rollback only when none of these survives. Pure functions over
hand-built plans and holdings; tests/runtime/test_tp_launch.py runs the same choice in a whole job."""

from __future__ import annotations

import pytest

from oobleck.api.plan import LayerCopy
from oobleck.runtime.elastic.shard_sources import LostShards, shard_copies, sound
from oobleck.runtime.elastic.sources import Holding, resolve

STATE = [400] * 6
COMMON = {"num_layers": 6, "gpus_per_node": 2, "generation": 1}


def shards(step: int, t: int, k: int, layers=range(6), **more) -> Holding:
    """A trained member holding `layers` as shard k of t."""
    return Holding(step=step, started=True, shards={layer: (t, k) for layer in layers}, **more)


def pieces(copies: list[LayerCopy]) -> set[tuple[str, str, int, tuple[int, int]]]:
    """(source worker, destination worker, layer, source shard) of every copy."""
    return {(f"{c.src_node}:{c.src_gpu}", f"{c.dst_node}:{c.dst_gpu}", c.layer, c.src_shard) for c in copies}


def test_holdings_carry_their_shards_through_json():
    holding = shards(4, 2, 1, layers=[3, 5])
    again = Holding.from_json(holding.to_json())
    assert again == holding and again.held() == {3: (2, 1), 5: (2, 1)}
    assert Holding.from_json(Holding(step=1, layers=(0,)).to_json()).shards == {}  # older records: no shards


def test_a_t2_stage_is_served_by_same_t_shards_in_place(plan_builder):
    """No whole replica of any layer survives, but a complete t = 2 set does: a new t = 2 node gets each of its
    shards from the holder of that very shard (no rollback), and the survivors keep theirs."""
    make_plan, Spec = plan_builder
    plan = make_plan(
        [Spec(stages=[(0, 6, 0, 2, 2)], microbatches=2), Spec(stages=[(0, 6, 0, 2, 2)], microbatches=2)],
        node_names=[["n0"], ["n3"]],
        **COMMON,
    )
    holdings = {"n0:0": shards(4, 2, 0), "n0:1": shards(4, 2, 1), "n3:0": Holding(step=0), "n3:1": Holding(step=0)}
    settled = resolve(plan, holdings, STATE)
    assert settled.restore_step is None
    assert pieces(settled.copies) == {(f"n0:{k}", f"n3:{k}", layer, (2, k)) for k in (0, 1) for layer in range(6)}
    assert all(c.bytes == 200 for c in settled.copies)  # half the layer's state each
    assert sound(settled, {w: h.held() for w, h in holdings.items() if h.started})


def test_a_whole_stage_glues_one_degrees_full_set(plan_builder):
    """A new t = 1 node gets every layer as the two shards of the surviving t = 2 group, glued on arrival."""
    make_plan, Spec = plan_builder
    plan = make_plan(
        [Spec(stages=[(0, 6, 0, 2, 2)], microbatches=2), Spec(stages=[(0, 6, 0, 1)], microbatches=2)],
        node_names=[["n5"], ["n9"]],
        **COMMON,
    )
    held = {f"n5:{k}": {layer: (2, k) for layer in range(6)} for k in (0, 1)}
    copies = shard_copies(plan, held, STATE)
    assert pieces(copies) == {(f"n5:{k}", "n9:0", layer, (2, k)) for k in (0, 1) for layer in range(6)}


def test_a_t2_group_reshards_a_t4_set_before_a_whole_replica_and_cuts_its_own_whole_layer(plan_builder):
    """n1:0 holds every layer whole and now runs a t = 2 shard: it cuts its own (a copy to itself, 0 bytes).
    n1:1 has nothing: it gathers n0's t = 4 set (a quarter of the state each) rather than take n1:0's whole
    layer."""
    make_plan, Spec = plan_builder
    plan = make_plan(
        [Spec(stages=[(0, 6, 0, 4, 4)], microbatches=2), Spec(stages=[(0, 6, 0, 2, 2)], microbatches=2)],
        node_names=[["n0"], ["n1"]],
        **{**COMMON, "gpus_per_node": 4},
    )
    held = {f"n0:{k}": {layer: (4, k) for layer in range(6)} for k in range(4)}
    held |= {"n1:0": {layer: (1, 0) for layer in range(6)}}
    copies = shard_copies(plan, held, STATE)
    assert pieces(copies) == {(f"n0:{k}", "n1:1", layer, (4, k)) for k in range(4) for layer in range(6)} | {
        ("n1:0", "n1:0", layer, (1, 0)) for layer in range(6)
    }
    assert {c.bytes for c in copies if c.src_rank != c.dst_rank} == {100}
    assert {c.bytes for c in copies if c.src_rank == c.dst_rank} == {0}
    assert sound(plan.model_copy(update={"copies": copies}), held)


def test_without_a_complete_set_or_a_whole_replica_the_members_roll_back(plan_builder):
    make_plan, Spec = plan_builder
    plan = make_plan(
        [Spec(stages=[(0, 6, 0, 2, 2)], microbatches=2), Spec(stages=[(0, 6, 0, 2, 2)], microbatches=2)],
        node_names=[["n0"], ["n3"]],
        **COMMON,
    )
    snapshots = {2: tuple(range(6))}
    holdings = {
        "n0:0": shards(4, 2, 0, snapshots=snapshots),
        "n0:1": Holding(step=0),  # a replacement GPU: shard 1 of every layer is gone
        "n3:0": Holding(step=0),
        "n3:1": Holding(step=0),
    }
    with pytest.raises(LostShards, match=r"layers \[0, 1, 2, 3, 4, 5\]"):
        shard_copies(plan, {"n0:0": holdings["n0:0"].held()}, STATE)
    settled = resolve(plan, holdings, STATE)
    assert settled.restore_step == 2 and "rollback" in settled.reason


def test_a_proposal_naming_a_shard_holder_as_a_whole_source_is_not_sound(plan_builder):
    """A controller that places layers, not shards, proposes a shard holder as the source of a whole layer:
    the members replace the copy with the shards that make the destination's sharding."""
    make_plan, Spec = plan_builder
    layout = [Spec(stages=[(0, 6, 0, 2, 2)], microbatches=2), Spec(stages=[(0, 6, 0, 1)], microbatches=2)]
    names = [["n0"], ["n1"]]
    bare = make_plan(layout, node_names=names, **COMMON)
    wrong = [
        {"layer": layer, "src_node": "n0", "src_gpu": 0, "src_rank": 0, "dst_node": "n1", "dst_gpu": 0}
        | {"dst_rank": 2, "bytes": 0}
        for layer in range(6)
    ]
    proposal = make_plan(layout, node_names=names, copies=wrong, **COMMON)
    holdings = {"n0:0": shards(4, 2, 0), "n0:1": shards(4, 2, 1), "n1:0": Holding(step=0)}
    assert not sound(proposal, {w: h.held() for w, h in holdings.items() if h.started})
    settled = resolve(proposal, holdings, STATE)
    assert settled.restore_step is None
    assert pieces(settled.copies) == {(f"n0:{k}", "n1:0", layer, (2, k)) for k in (0, 1) for layer in range(6)}
    assert bare.copies == []
