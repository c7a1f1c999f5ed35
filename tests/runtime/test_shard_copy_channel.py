"""Layer copies over the real channel (gloo groups of a plan generation, two ranks in threads).

A copy's (t, k) header against a hostile or broken source: a header out of bounds, or naming another shard
than the plan's copy, or a degree the layer cannot split into, is refused with an error naming it, before
anything is built from it; the destination's layers and optimizer state are untouched, and an honest copy
then succeeds. And a rank's own shard as one piece of a re-sharded layer (a copy to itself)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.distributed import TCPStore

from oobleck.runtime.train.config import build_model
from oobleck.runtime.train.groups import GenerationGroups
from oobleck.runtime.train.layer_state import COPY_TAG_BASE, transfer
from oobleck.runtime.train.optim import LayerAdamW
from oobleck.runtime.train.shard_copy import load_state, named_state, sharding
from oobleck.runtime.train.tensor_parallel import TensorParallelGroup, shard_state, split_rules
from oobleck.runtime.train.tp_stage import build_split
from tests.runtime.test_tp_engine import CONFIG

pytestmark = pytest.mark.integration
CPU = torch.device("cpu")
LAYER = 2  # the layer the destination lacks


class Side:
    """One rank's model, layers and optimizer: the source holds every layer, the destination all but LAYER."""

    def __init__(self, layers: range | list[int]) -> None:
        self.model = build_model(CONFIG)
        self.optimizer = LayerAdamW(CONFIG.optim)
        self.layers = {i: self.model.build_layer(i) for i in layers}
        for i, module in self.layers.items():
            self.optimizer.ensure_layer(i, module)
            for state in self.optimizer.layer_state(i, module):
                state[1].exp_avg.normal_()  # moments that a lost copy would show
        self.built: list[tuple[int, int, int]] = []

    def build(self, layer: int, t: int, k: int) -> torch.nn.Module:
        self.built.append((layer, t, k))
        return build_split(self.model, layer, TensorParallelGroup(None, k, t), CPU)

    def state(self) -> dict[str, torch.Tensor]:
        named = {f"{i}.{n}": p.detach().clone() for i, m in self.layers.items() for n, p in m.named_parameters()}
        named |= {f"{i}.{n}/m": s.exp_avg.clone() for (i, n), s in self.optimizer.state.items()}
        return named


def generation(plan_builder, number: int, shard: tuple[int, int] = (1, 0)):
    make_plan, Spec = plan_builder
    copy = {"layer": LAYER, "src_node": "n0", "src_gpu": 0, "src_rank": 0, "dst_node": "n1", "dst_gpu": 0}
    copy |= {"dst_rank": 1, "bytes": 0, "src_tensor_parallel": shard[0], "src_tp_index": shard[1]}
    layout = [Spec(stages=[(0, 6, 0, 1)], microbatches=2)] * 2
    return make_plan(
        layout, num_layers=6, job="header-attack", generation=number, node_names=[["n0"], ["n1"]], copies=[copy]
    )


def run_pair(store_port: int, plan, source, destination: Side) -> tuple[object, BaseException | None]:
    """`source(groups)` on rank 0 and the real `transfer` on rank 1, each with its own store client;
    returns (what the source returned, the destination's error or None)."""
    results: dict[str, object] = {}

    def rank(index: int) -> None:
        try:
            client = TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
            groups = GenerationGroups(client, plan, index, 2, CPU, timeout=60, poll=0.01)
            if index == 0:
                results["source"] = source(groups)
            else:
                transfer(
                    plan.copies, 1, groups, destination.model, destination.layers, destination.optimizer, CPU,
                    poll=0.01, timeout=60, build=destination.build,
                )  # fmt: skip
        except BaseException as error:
            results[f"error{index}"] = error

    threads = [threading.Thread(target=rank, args=(index,), daemon=True) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert "error0" not in results, results["error0"]
    return results.get("source"), results.get("error1")  # type: ignore[return-value]


def send_header(values: list[int]):
    """A hostile source: sends the header `values` as copy 0's header and nothing else."""

    def source(groups: GenerationGroups) -> None:
        backend, peer = groups.link(0, 1)
        backend.send([torch.tensor(values, dtype=torch.int64)], peer, COPY_TAG_BASE).wait()

    return source


@pytest.mark.parametrize(
    ("header", "declared", "message"),
    [
        ([1 << 40, 0], (1, 0), r"header \(t, k\) = \(1099511627776, 0\) refused: t must be a power of two <= 16"),
        ([-2, 0], (1, 0), r"header \(t, k\) = \(-2, 0\) refused: t must be a power of two"),
        ([2, 5], (2, 1), r"header \(t, k\) = \(2, 5\) refused: .* 0 <= k < t"),
        ([2, 0], (1, 0), r"header \(t, k\) = \(2, 0\) refused: the plan's copy names the source's shard \(1, 0\)"),
        ([16, 3], (16, 3), r"header \(t, k\) = \(16, 3\) refused: tensor parallelism 16: heads \(4\)"),
    ],
    ids=["huge-t", "negative-t", "k-out-of-range", "not-the-plans-shard", "layer-cannot-split"],
)
def test_a_malformed_header_is_refused_and_nothing_is_lost(plan_builder, header, declared, message):
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    destination = Side([i for i in range(6) if i != LAYER])
    before = destination.state()
    _, error = run_pair(store.port, generation(plan_builder, 1, declared), send_header(header), destination)
    assert isinstance(error, ValueError), error
    assert f"copies: layer {LAYER} from rank 0" in str(error)
    with pytest.raises(ValueError, match=message):
        raise error
    # Refused before anything was built from it, except the one split the plan allows: never sized by the peer.
    assert destination.built == ([(LAYER, 16, 3)] if header == [16, 3] else [])
    after = destination.state()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert LAYER not in destination.layers

    # The destination goes on: an honest source's copy of the layer lands, parameters and moments.
    honest = Side(range(6))

    def source(groups: GenerationGroups) -> int:
        plan = groups.plan
        return transfer(plan.copies, 0, groups, honest.model, honest.layers, honest.optimizer, CPU, poll=0.01)

    moved, error = run_pair(store.port, generation(plan_builder, 2), source, destination)
    assert error is None and moved
    for name, parameter in honest.layers[LAYER].named_parameters():
        assert torch.equal(destination.layers[LAYER].get_parameter(name), parameter)
        want, got = honest.optimizer.state[(LAYER, name)], destination.optimizer.state[(LAYER, name)]
        assert torch.equal(got.exp_avg, want.exp_avg)


def test_a_rank_glues_its_own_shard_with_a_received_one(plan_builder):
    """A t = 2 group's rank 1 becomes a whole (t = 1) stage: the plan copies it its own shard (src == dst, nothing
    moves) and the peer's other shard; it glues both into the whole layer, parameters and moments alike."""
    make_plan, Spec = plan_builder
    copies = [
        {"layer": LAYER, "src_node": node, "src_gpu": 0, "src_rank": rank, "dst_node": "n1", "dst_gpu": 0}
        | {"dst_rank": 1, "bytes": 0, "src_tensor_parallel": 2, "src_tp_index": rank}
        for node, rank in (("n0", 0), ("n1", 1))
    ]
    layout = [Spec(stages=[(0, 6, 0, 1)], microbatches=2)] * 2
    plan = make_plan(layout, num_layers=6, job="own-piece", generation=3, node_names=[["n0"], ["n1"]], copies=copies)
    sides = [Side([]), Side([])]
    whole = Side([LAYER])  # the layer and its moments whole: what the two shards must glue back into
    rules = split_rules(whole.build(LAYER, 2, 0))
    for k, side in enumerate(sides):
        module = side.build(LAYER, 2, k)
        named = shard_state(named_state(LAYER, whole.layers[LAYER], whole.optimizer), rules, 2, k)
        load_state(LAYER, module, side.optimizer, named)
        side.layers[LAYER] = module
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def source(groups: GenerationGroups) -> int:
        peer = sides[0]
        return transfer(plan.copies, 0, groups, peer.model, peer.layers, peer.optimizer, CPU, poll=0.01)

    moved, error = run_pair(store.port, plan, source, sides[1])
    assert error is None and moved
    glued = sides[1].layers[LAYER]
    assert sharding(glued) == (1, 0)
    want = named_state(LAYER, whole.layers[LAYER], whole.optimizer)
    got = named_state(LAYER, glued, sides[1].optimizer)
    assert want.keys() == got.keys() and all(torch.equal(got[name], want[name]) for name in want)
