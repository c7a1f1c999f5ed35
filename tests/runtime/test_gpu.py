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


# fp32; bf16 autocast with recomputation and clipping (float32 master weights); bf16 with the default
# float32 sums (the same order of additions as the reference's float32 sums on one rank).
VARIANTS = [
    {},
    {"precision": "bf16", "recompute": "full", "max_grad_norm": 0.05},
    {"precision": "bf16", "gradient_sum_dtype": "float32"},
]


@pytest.mark.parametrize("update", VARIANTS, ids=["fp32", "bf16-recompute-clip", "bf16-fp32-sums"])
def test_single_rank_on_cuda_matches_cuda_reference(plan_builder, update):
    make_plan, Spec = plan_builder
    config = CONFIG.model_copy(update=update)
    plan = make_plan([Spec(stages=[(0, 6, 0, 1)], microbatches=3)], num_layers=6, f=0, job="gpu")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    worker = Worker(config, store, "n0", 0)
    outcomes = worker.run_static(plan)
    reference = train_reference(config, 3, device="cuda")
    for outcome, expected in zip(outcomes, reference.losses):
        assert outcome.loss == pytest.approx(expected, rel=1e-5)
    for layer, params in worker.layer_state().items():
        for name, value in params.items():
            assert value.dtype == torch.float32, f"layer {layer} {name}: {value.dtype} master weights"
            assert torch.allclose(value, reference.layers[layer][name], rtol=0, atol=1e-5)


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


def test_a_gpu_snapshot_holds_the_state_from_before_an_update_queued_right_after_it():
    """The update waits only until the capture's copies are queued ahead of it (Snapshotter.ordered), not
    for the copies themselves: the GPU must still run them first. A long kernel queued before the capture
    keeps the copies pending while the training thread queues the update."""
    import threading

    from torch import nn

    from oobleck.runtime.train.layer_state import PinnedBuffers, capture_layers, flatten
    from oobleck.runtime.train.optim import LayerAdamW

    module = nn.Linear(4096, 8192).cuda()  # ~34M parameters: ~400 MB of state with the AdamW moments
    optimizer = LayerAdamW(OptimConfig())
    optimizer.ensure_layer(0, module)
    expected = flatten(0, module, optimizer).cpu()
    busy = torch.randn(8192, 8192, device="cuda")
    for _ in range(20):  # ~tens of ms of GPU work ahead of the capture's copies
        busy = busy @ busy / 8192
    ordered = threading.Event()
    result: dict = {}
    capture = threading.Thread(
        target=lambda: result.update(
            capture_layers(
                [(0, module)],
                optimizer,
                compute_stream=torch.cuda.current_stream(),
                ordered=ordered.set,
                buffers=PinnedBuffers(),
            )
        )
    )
    capture.start()
    assert ordered.wait(30)
    with torch.no_grad():  # the "update", queued at once on the training stream
        for parameter in module.parameters():
            parameter.add_(1.0)
    capture.join(30)
    assert torch.equal(result[0], expected)
    assert not torch.equal(flatten(0, module, optimizer).cpu(), expected)
