"""The engine's parts on their own: schedule, layout, optimizer, layer state, interruptible waits."""

from __future__ import annotations

import io
import threading
import time
from datetime import timedelta

import pytest
import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo
from torch.distributed import TCPStore

from oobleck.runtime.models.layered import load_model
from oobleck.runtime.train.config import OptimConfig, WorkerConfig, load_config
from oobleck.runtime.train.engine import one_f_one_b
from oobleck.runtime.train.groups import Interrupted, exchanges, group_specs, hand_off, layout, rows, stage_rows, wait
from oobleck.runtime.train.layer_state import flatten, state_nbytes, unflatten
from oobleck.runtime.train.optim import LayerAdamW, learning_rate, torch_adamw
from oobleck.runtime.train.reference import ReferenceState, train_reference
from oobleck.runtime.train.tensor_parallel import split_rules


def test_one_f_one_b_orders():
    assert one_f_one_b(3, 0, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert one_f_one_b(3, 2, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert one_f_one_b(4, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]  # fewer microbatches than stages
    for stages in range(1, 5):
        for stage in range(stages):
            for m in range(1, 7):
                order = one_f_one_b(stages, stage, m)
                assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
                # a backward never precedes its forward; in flight never exceeds stages - stage
                done, in_flight = set(), 0
                for kind, i in order:
                    if kind == "B":
                        assert ("F", i) in done
                        in_flight -= 1
                    else:
                        in_flight += 1
                        assert in_flight <= stages - stage
                    done.add((kind, i))


def test_layout_and_groups(plan_builder):
    make_plan, Spec = plan_builder
    plan = make_plan(
        [
            Spec(stages=[(0, 3, 0, 2), (3, 6, 1, 1)], microbatches=4),
            Spec(stages=[(0, 4, 0, 1), (4, 6, 0, 1)], microbatches=2),
        ],
        num_layers=6,
        gpus_per_node=2,
    )
    groups = {spec.name: spec.members for spec in group_specs(plan, microbatch_size=4)}
    assert groups == {
        "holders/0-1-3": (0, 1, 3),
        "holders/2-3": (2, 3),
        "holders/2-4": (2, 4),
        "link/0-2": (0, 2),
        "link/1-2": (1, 2),
        "link/2-0": (0, 2),
        "link/2-1": (1, 2),
        "link/3-4": (3, 4),
        "link/4-3": (3, 4),
    }
    mine = layout(plan, 1)
    assert (mine.first, mine.last, mine.shard, list(mine.layers)) == (True, False, 1, [0, 1, 2])
    assert mine.holder_sets == {(0, 1, 3): [0, 1, 2]}
    assert layout(plan, 2).holder_sets == {(2, 3): [3], (2, 4): [4, 5]}
    assert [rows(5, 2, i) for i in range(2)] == [(0, 2), (2, 5)]
    with pytest.raises(ValueError, match="rank: 9 is outside"):
        layout(plan, 9)


def test_tensor_parallel_layout_exchanges_and_groups(plan_builder):
    """A t = 2 stage of 4 ranks runs two groups, each its half of the rows; tensors between stages are
    whole: each receiver takes its rows from the sender of its TP index modulo the sender's t."""
    make_plan, Spec = plan_builder
    plan = make_plan([Spec(stages=[(0, 3, 0, 4, 2), (3, 6, 1, 1)], microbatches=2)], num_layers=6, gpus_per_node=4)
    mine = layout(plan, 3)
    assert (mine.tensor_parallel, mine.tp_index, mine.tp_members) == (2, 1, (2, 3))
    upper, lower = plan.pipelines[0].stages
    assert [stage_rows(4, upper, i) for i in range(4)] == [(0, 2), (0, 2), (2, 4), (2, 4)]
    assert exchanges(upper, lower, 4) == [(0, 4, (0, 2)), (2, 4, (2, 4))]  # TP rank 0 of each group sends
    assert exchanges(lower, upper, 4) == [(4, r, rows) for r, rows in zip(range(4), [(0, 2), (0, 2), (2, 4), (2, 4)])]
    names = [spec.name for spec in group_specs(plan, 4)]
    assert {"tp/0-1", "tp/2-3", "link/0-4", "link/2-4", "link/4-1", "link/4-3"} <= set(names)
    assert "link/1-4" not in names and "link/3-4" not in names


def test_shard_placements_and_resharding_keep_parameters_and_moments():
    """A layer's state cut at t = 2 and re-cut at t = 4 (glued whole in between) equals the whole layer's
    state cut at t = 4 directly; a shard's gradient placed into the whole-size sum lands where cut takes it."""
    from oobleck.runtime.train.shard_copy import assemble, named_state, sharding
    from oobleck.runtime.train.tensor_parallel import TensorParallelGroup, split_layer
    from oobleck.runtime.train.tp_stage import Placement

    model = load_model("gpt", sizes={"blocks": 1, "hidden": 16, "heads": 4, "seq_len": 4, "vocab": 10})

    def build(layer, t, k):
        return split_layer(model.build_layer(layer), TensorParallelGroup(None, k, t))

    whole, optimizer = model.build_layer(1), LayerAdamW(OptimConfig())
    optimizer.ensure_layer(1, whole)
    for index, state in enumerate(optimizer.layer_state(1, whole)):
        state[1].exp_avg.normal_(generator=torch.Generator().manual_seed(index))
        state[1].exp_avg_sq.uniform_(generator=torch.Generator().manual_seed(index))
        state[1].step.fill_(3)
    pieces = []
    for k in range(2):
        scratch = LayerAdamW(OptimConfig())
        pieces.append((assemble(1, [(whole, optimizer)], (2, k), scratch, build), scratch))
    assert [sharding(module) for module, _ in pieces] == [(2, 0), (2, 1)]
    for k in range(4):
        direct, resharded = LayerAdamW(OptimConfig()), LayerAdamW(OptimConfig())
        want = named_state(1, assemble(1, [(whole, optimizer)], (4, k), direct, build), direct)
        got = named_state(1, assemble(1, pieces, (4, k), resharded, build), resharded)
        assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want), k
    with pytest.raises(ValueError, match="re-sharding needs the layer whole or every shard"):
        assemble(1, pieces[:1], (4, 0), LayerAdamW(OptimConfig()), build)
    qkv = whole.qkv.weight  # three fused blocks
    gradient, total = torch.randn(qkv.shape), torch.zeros(qkv.shape)
    for k in range(2):
        shard = dict(build(1, 2, k).named_parameters())["qkv.weight"]
        place = Placement(tuple(qkv.shape), dict(split_rules(build(1, 2, k)))["qkv.weight"], 2, k)
        piece = place.take(gradient)
        assert piece.shape == shard.shape
        place.add(total, piece)
    assert torch.equal(total, gradient)


def test_schedule_warms_up_then_decays():
    config = OptimConfig(lr=1.0, warmup_steps=4, decay_steps=14, min_lr_ratio=0.1)
    assert [learning_rate(config, s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert learning_rate(config, 4) == 1.0
    assert learning_rate(config, 9) == pytest.approx(0.55)
    assert learning_rate(config, 14) == pytest.approx(0.1) and learning_rate(config, 100) == pytest.approx(0.1)


def test_layer_adamw_equals_torch_adamw_bitwise():
    model = load_model("tiny-gpt", seed=2)
    config = OptimConfig(lr=1e-2, weight_decay=0.1)
    ours = {i: model.build_layer(i) for i in (0, 2, 5)}
    theirs = {i: model.build_layer(i) for i in (0, 2, 5)}
    optimizer = LayerAdamW(config)
    for i, module in ours.items():
        optimizer.ensure_layer(i, module)
    stock = torch_adamw([p for m in theirs.values() for p in m.parameters()], config)
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        for a, b in zip(ours.values(), theirs.values()):
            for pa, pb in zip(a.parameters(), b.parameters()):
                pa.grad = torch.randn(pa.shape, generator=generator)
                pb.grad = pa.grad.clone()
        optimizer.step(ours.items(), lr=learning_rate(config, step))
        for group in stock.param_groups:
            group["lr"] = learning_rate(config, step)
        stock.step()
    for a, b in zip(ours.values(), theirs.values()):
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)
    assert int(optimizer.state[(2, "qkv.weight")].step) == 3


def test_layer_state_round_trip():
    model = load_model("tiny-gpt", seed=1)
    source, optimizer = model.build_layer(3), LayerAdamW(OptimConfig())
    optimizer.ensure_layer(3, source)
    for p in source.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step([(3, source)], lr=0.1)
    buffer = flatten(3, source, optimizer)
    assert buffer.dtype == torch.uint8 and buffer.numel() == state_nbytes(source)
    params = sum(p.numel() for p in source.parameters())
    assert buffer.numel() == 4 * 3 * params + 4 * len(list(source.parameters()))
    target_model = load_model("tiny-gpt", seed=99)  # different initial weights: must be overwritten
    target, received = target_model.build_layer(3), LayerAdamW(OptimConfig())
    unflatten(buffer.clone(), 3, target, received)
    for (name, a), b in zip(source.named_parameters(), target.parameters()):
        assert torch.equal(a, b)
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(getattr(optimizer.state[(3, name)], field), getattr(received.state[(3, name)], field))
    with pytest.raises(ValueError, match="layer 3: state buffer has 5 bytes"):
        unflatten(torch.zeros(5, dtype=torch.uint8), 3, target, received)


def test_reference_trainer_learns_and_is_deterministic():
    config = WorkerConfig(steps=8, microbatch_size=2, optim=OptimConfig(lr=3e-3, warmup_steps=1))
    first = train_reference(config, global_microbatches=3)
    second = train_reference(config, global_microbatches=3)
    assert first.losses == second.losses
    assert first.losses[-1] < first.losses[0] - 0.05
    # the microbatch count changes the global batch, hence the curve
    assert train_reference(config, global_microbatches=2).losses != first.losses


def test_a_reference_run_resumed_from_its_saved_state_equals_one_run():
    """The e2e tests keep a reference's state with its losses and train on from it (tests/e2e/conftest.py)."""
    config = WorkerConfig(steps=8, microbatch_size=2, optim=OptimConfig(lr=3e-3, warmup_steps=2))
    whole = train_reference(config, global_microbatches=3)
    head = train_reference(config, global_microbatches=3, steps=3)
    saved = io.BytesIO()
    torch.save(vars(head.state), saved)
    saved.seek(0)
    tail = train_reference(config, global_microbatches=3, resume=ReferenceState(**torch.load(saved, weights_only=True)))
    assert head.state.step == 3 and tail.state.step == 8
    assert head.losses + tail.losses == whole.losses
    for ours, theirs in zip(tail.layers, whole.layers):
        assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


def _pair(store, rank, name):
    return ProcessGroupGloo(PrefixStore(name, store), rank, 2, timedelta(seconds=30))


def test_wait_is_interrupted_by_the_failure_event():
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # One store client per thread: a client blocked in a store wait would stall the other thread.
    stores = [TCPStore("127.0.0.1", master.port, is_master=False) for _ in range(2)]
    backends = [None, None]
    threads = [
        threading.Thread(target=lambda r=r: backends.__setitem__(r, _pair(stores[r], r, "waitpair/"))) for r in (0, 1)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = threading.Event()
    # A message that does arrive is received through the same helper.
    payload = torch.arange(4.0)
    send = backends[0].send([payload], 1, 0)
    buffer = torch.zeros(4)
    wait(backends[1].recv([buffer], 0, 0), failed, 0.01, 10, "recv")
    wait(send, failed, 0.01, 10, "send")
    assert torch.equal(buffer, payload)
    # A receive that never completes: setting the event ends the wait promptly.
    never = backends[1].recv([torch.zeros(4)], 0, 7)
    threading.Timer(0.2, failed.set).start()
    started = time.monotonic()
    with pytest.raises(Interrupted, match="stuck recv"):
        wait(never, failed, 0.01, 30, "stuck recv")
    assert time.monotonic() - started < 3.0  # 0.2 s plus scheduling slack on a loaded machine


def test_receive_handed_off_ahead_completes_meanwhile_and_a_cancelled_one_frees_the_helper():
    """groups.hand_off: the engine posts a receive before it needs it; the helper thread waits for it while the
    caller goes on, and the caller's later wait finds it done. A ticket given up on (a step interrupted with
    receives still posted) must not leave the next wait queued behind a work that never completes."""
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stores = [TCPStore("127.0.0.1", master.port, is_master=False) for _ in range(2)]
    backends = [None, None]
    threads = [
        threading.Thread(target=lambda r=r: backends.__setitem__(r, _pair(stores[r], r, "aheadpair/"))) for r in (0, 1)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = threading.Event()
    buffer = torch.zeros(4)
    ticket = hand_off([(backends[1].recv([buffer], 0, 0), "recv ahead")])
    assert not ticket.done.is_set()  # nothing sent yet: the helper is blocked on it, the caller is not
    send = backends[0].send([torch.arange(4.0)], 1, 0)
    assert ticket.done.wait(10)  # completed by the helper without the caller waiting
    ticket.wait(failed, 0.01, 10)
    wait(send, failed, 0.01, 10, "send")
    assert torch.equal(buffer, torch.arange(4.0))
    # A receive that never completes, handed off ahead, then given up on: the next wait still completes.
    stuck = hand_off([(backends[1].recv([torch.zeros(4)], 0, 7), "never sent")])
    stuck.cancel()
    later = torch.zeros(2)
    send = backends[0].send([torch.ones(2)], 1, 3)
    started = time.monotonic()
    wait(backends[1].recv([later], 0, 3), failed, 0.01, 30, "after the cancelled one")
    wait(send, failed, 0.01, 10, "send")
    assert torch.equal(later, torch.ones(2))
    assert time.monotonic() - started < 3.0
    # Without the cancel it would have waited behind the stuck receive: the failure event ends that wait.
    behind = hand_off([(backends[1].recv([torch.zeros(4)], 0, 8), "never sent either")])
    threading.Timer(0.2, failed.set).start()
    with pytest.raises(Interrupted, match="never sent either"):
        behind.wait(failed, 0.01, 30)


def test_config_errors_name_the_field(tmp_path):
    (tmp_path / "bad.json").write_text('{"microbatch_size": 0}')
    with pytest.raises(ValueError, match="microbatch_size"):
        load_config(tmp_path / "bad.json")
    (tmp_path / "file.yaml").write_text("data: {kind: file}\n")
    with pytest.raises(ValueError, match="path"):
        load_config(tmp_path / "file.yaml")
    (tmp_path / "broken.json").write_text("{nope")
    with pytest.raises(ValueError, match="broken.json: not valid JSON"):
        load_config(tmp_path / "broken.json")
    (tmp_path / "good.yaml").write_text(
        "model: {name: gpt, sizes: {blocks: 1, hidden: 8, heads: 2, seq_len: 4, vocab: 9}}\nsteps: 3\n"
    )
    assert load_config(tmp_path / "good.yaml").steps == 3


def test_building_groups_is_interruptible(plan_builder):
    """A member that never arrives: the failure event ends the rendezvous, not the connect timeout."""
    from oobleck.runtime.train.groups import GenerationGroups

    make_plan, Spec = plan_builder
    plan = make_plan([Spec(stages=[(0, 3, 0, 1), (3, 6, 1, 1)], microbatches=2)], num_layers=6, f=0, job="lonely")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    failed = threading.Event()
    threading.Timer(0.3, failed.set).start()
    started = time.monotonic()
    with pytest.raises(Interrupted, match="building the groups of generation 0"):
        GenerationGroups(store, plan, 0, 2, torch.device("cpu"), timeout=60, failed=failed, poll=0.01)
    assert time.monotonic() - started < 3.0


def test_aliased_gradient_buffers_keep_their_views_fold_a_replaced_grad_and_unhook(plan_builder):
    """float32 sums: the `.grad`s are views of one buffer across steps; zeroing clears them, autograd adds
    into them in place; a `.grad` replaced by something else is added once; release unhooks them."""
    from oobleck.runtime.train.engine import _GradientBuffers

    make_plan, Spec = plan_builder
    plan = make_plan([Spec(stages=[(0, 2, 0, 1)], microbatches=2)], num_layers=2)
    layers = {0: torch.nn.Linear(3, 2), 1: torch.nn.Linear(2, 1)}
    buffers = _GradientBuffers(layout(plan, 0), layers, 2, torch.device("cpu"), torch.float32)
    assert buffers.aliased
    params = [p for layer in layers.values() for p in layer.parameters()]
    x = torch.ones(4, 3)
    for _ in range(2):  # two steps: the views stay the .grads, zeroed in between
        buffers.zero()
        assert all(p.grad is view for view, p in buffers.views)
        for _ in range(2):
            layers[1](layers[0](x)).sum().backward()
        assert all(p.grad is view for view, p in buffers.views)
    expected = [p.grad.clone() for p in params]
    replaced = params[0]
    replaced.grad = torch.full_like(replaced, 0.5)  # a .grad something else put there
    buffers.after_backward()  # aliased: nothing to fold yet
    assert replaced.grad is not buffers.views[0][0]
    buffers.settle()
    assert replaced.grad is buffers.views[0][0]
    assert torch.equal(replaced.grad, expected[0] + 0.5)
    buffers.release()
    assert all(p.grad is None for p in params)


def test_float64_gradient_buffers_fold_every_backward_and_free_the_installed_copies(plan_builder):
    """float64 sums: each backward's float32 `.grad` is added into its view and dropped; the installed
    gradients (sum / samples, in the parameters' dtype) are freed after the update."""
    from oobleck.runtime.train.engine import _GradientBuffers

    make_plan, Spec = plan_builder
    plan = make_plan([Spec(stages=[(0, 2, 0, 1)], microbatches=2)], num_layers=2)
    layers = {0: torch.nn.Linear(3, 2), 1: torch.nn.Linear(2, 1)}
    buffers = _GradientBuffers(layout(plan, 0), layers, 2, torch.device("cpu"), torch.float64)
    assert not buffers.aliased
    params = [p for layer in layers.values() for p in layer.parameters()]
    buffers.zero()
    sums = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for scale in (1.0, 2.0):
        (layers[1](layers[0](torch.full((4, 3), scale)))).sum().backward()
        for total, p in zip(sums, params):
            total += p.grad
        buffers.after_backward()
        assert all(p.grad is None for p in params)
    buffers.settle()
    buffers.install(8)
    for total, p in zip(sums, params):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, (total / 8).float())
    buffers.after_update()
    assert all(p.grad is None for p in params)
