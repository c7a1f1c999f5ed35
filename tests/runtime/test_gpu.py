"""CUDA / NCCL: the same code path as gloo, on GPUs. Skipped without CUDA (or without two GPUs)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed import TCPStore

from oobleck.runtime.elastic.worker import Worker
from oobleck.runtime.train.config import OptimConfig, WorkerConfig
from oobleck.runtime.train.reference import train_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CONFIG = WorkerConfig(
    job="gpu",
    gradient_sum_dtype="float64",  # compared with the single-process reference to 1e-5
    device="cuda",
    microbatch_size=4,
    steps=10,
    seed=5,
    optim=OptimConfig(lr=3e-3, warmup_steps=2, decay_steps=10),
)


# (config, relative loss tolerance, absolute weight tolerance). bf16 sums in float32, the reference's
# order of additions on one rank, and is then exact too. With clipping it cannot be: the runtime's global
# norm is summed in float64 across layers (ranks), the stock clip_grad_norm_ in float32, and bf16 rounding
# turns that last-bit difference of the scale into different losses (4e-5 relative by step 3 on an H200).
# fp32 runs with clipping (tests/runtime/test_precision.py, test_tp_engine.py) hold it to 1e-5.
VARIANTS = [
    ({}, 1e-5, 1e-5),
    ({"precision": "bf16", "recompute": "full", "gradient_sum_dtype": "float32"}, 1e-5, 1e-5),
    ({"precision": "bf16", "gradient_sum_dtype": "float32"}, 1e-5, 1e-5),
    ({"precision": "bf16", "gradient_sum_dtype": "float32", "max_grad_norm": 0.05}, 1e-3, 2e-3),
]


@pytest.mark.parametrize(("update", "rel", "atol"), VARIANTS, ids=["fp32", "bf16-recompute", "bf16", "bf16-clip"])
def test_single_rank_on_cuda_matches_cuda_reference(plan_builder, update, rel, atol):
    make_plan, Spec = plan_builder
    config = CONFIG.model_copy(update=update)
    plan = make_plan([Spec(stages=[(0, 6, 0, 1)], microbatches=3)], num_layers=6, f=0, job="gpu")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    worker = Worker(config, store, "n0", 0)
    outcomes = worker.run_static(plan)
    reference = train_reference(config, 3, device="cuda")
    for outcome, expected in zip(outcomes, reference.losses):
        assert outcome.loss == pytest.approx(expected, rel=rel)
    for layer, params in worker.layer_state().items():
        for name, value in params.items():
            assert value.dtype == torch.float32, f"layer {layer} {name}: {value.dtype} master weights"
            assert torch.allclose(value, reference.layers[layer][name], rtol=0, atol=atol)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL refuses two ranks on one GPU)")
@pytest.mark.parametrize("update", VARIANTS[:2], ids=["fp32", "bf16-recompute-clip"])
def test_nccl_pipeline_matches_reference(tmp_path, plan_builder, workers, update):
    config = CONFIG.model_copy(update=update)
    make_plan, Spec = plan_builder
    # Two stages on GPUs 0 and 1 of one node: NCCL p2p both ways (1F1B), no replicas.
    plan = make_plan(
        [Spec(stages=[(0, 3, 0, 1), (3, 6, 0, 1)], microbatches=4)], num_layers=6, gpus_per_node=2, f=0, job="gpu"
    )
    result = workers(tmp_path, config, plan)
    reference = train_reference(config, plan.global_microbatches, device="cuda")
    for record, expected in zip(result.losses, reference.losses):
        assert record["loss"] == pytest.approx(expected, rel=1e-5)
    for layer, params in result.layers.items():
        for name, value in params.items():
            assert torch.allclose(value, reference.layers[layer][name], rtol=0, atol=1e-5)


def test_a_gpu_snapshot_overlaps_the_steps_work_and_holds_the_state_from_before_the_update():
    """The copies start from the event recorded before the step's work and run beside it; only the update
    waits for them, on the GPU (Snapshotter.ordered). Long GPU work queued after the start event stands
    for forward and backward: the copies must be done while it still runs, and the update queued behind
    the copies' event must not leak into the capture."""
    import threading

    from torch import nn

    from oobleck.runtime.train.layer_state import PinnedBuffers, capture_layers, flatten
    from oobleck.runtime.train.optim import LayerAdamW

    module = nn.Linear(4096, 8192).cuda()  # ~34M parameters: ~400 MB of state with the AdamW moments
    optimizer = LayerAdamW(OptimConfig())
    optimizer.ensure_layer(0, module)
    buffers = PinnedBuffers()
    # A worker's first capture (step 0) pins the buffers and sets up the side streams; this one is later.
    first = capture_layers([(0, module)], optimizer, buffers=buffers)
    buffers.prepare({0: first[0].numel()})
    expected = flatten(0, module, optimizer).cpu()
    assert torch.equal(first[0], expected)
    start = torch.cuda.Event()
    start.record()
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(300):  # "forward and backward": ~0.4 s of H200 work that leaves the state alone
        busy = busy @ busy / 8192
    work_done = torch.cuda.Event()
    work_done.record()
    copied: list = []
    arrived = threading.Event()
    result: dict = {}

    def order(event) -> None:
        copied.append(event)
        arrived.set()

    capture = threading.Thread(
        target=lambda: result.update(
            capture_layers([(0, module)], optimizer, start=start, ordered=order, buffers=buffers)
        )
    )
    capture.start()
    assert arrived.wait(30)
    torch.cuda.current_stream().wait_event(copied[0])
    with torch.no_grad():  # the update, queued at once behind the copies' event
        for parameter in module.parameters():
            parameter.add_(1.0)
    capture.join(30)
    assert not work_done.query(), "the copies waited for the step's work instead of running beside it"
    assert torch.equal(result[0], expected)
    torch.cuda.synchronize()
    assert not torch.equal(flatten(0, module, optimizer).cpu(), expected)


def test_pinned_buffers_come_back_and_two_sets_are_all_that_is_ever_pinned():
    from oobleck.runtime.train.layer_state import PinnedBuffers

    pool = PinnedBuffers()
    first = pool.take(1 << 20)
    assert first.is_pinned()
    pool.prepare({0: 1 << 20})  # the second set, pinned ahead
    second = pool.take(1 << 20)
    assert second.data_ptr() != first.data_ptr()
    pool.prepare({0: 1 << 20})
    pool.give(first)  # the store dropped the older step
    assert pool.take(1 << 20).data_ptr() == first.data_ptr(), "reused, not pinned again"
    pool.give(torch.empty(1 << 20, dtype=torch.uint8))  # pageable (a buddy's push): not the pool's
    pool.give(second)
    pool.prepare({0: 1 << 20})
    assert pool.take(1 << 20).data_ptr() == second.data_ptr()
