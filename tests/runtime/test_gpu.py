"""CUDA / NCCL: the same code path as gloo, on GPUs. Skipped without CUDA (or without two GPUs)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed import TCPStore

from oobleck.runtime.config import OptimConfig, WorkerConfig
from oobleck.runtime.reference import train_reference
from oobleck.runtime.worker import Worker

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


def test_single_rank_on_cuda_matches_cuda_reference(plan_builder):
    make_plan, Spec = plan_builder
    plan = make_plan([Spec(stages=[(0, 6, 0, 1)], microbatches=3)], num_layers=6, f=0, job="gpu")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    worker = Worker(CONFIG, store, "n0", 0)
    outcomes = worker.run_static(plan)
    reference = train_reference(CONFIG, 3, device="cuda")
    for outcome, expected in zip(outcomes, reference.losses):
        assert outcome.loss == pytest.approx(expected, rel=1e-5)
    for layer, params in worker.layer_state().items():
        for name, value in params.items():
            assert torch.allclose(value, reference.layers[layer][name], rtol=0, atol=1e-5)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL refuses two ranks on one GPU)")
def test_nccl_pipeline_matches_reference(tmp_path, plan_builder, workers):
    make_plan, Spec = plan_builder
    # Two stages on GPUs 0 and 1 of one node: NCCL p2p both ways (1F1B), no replicas.
    plan = make_plan(
        [Spec(stages=[(0, 3, 0, 1), (3, 6, 0, 1)], microbatches=4)], num_layers=6, gpus_per_node=2, f=0, job="gpu"
    )
    result = workers(tmp_path, CONFIG, plan)
    reference = train_reference(CONFIG, plan.global_microbatches, device="cuda")
    for record, expected in zip(result.losses, reference.losses):
        assert record["loss"] == pytest.approx(expected, rel=1e-5)
    for layer, params in result.layers.items():
        for name, value in params.items():
            assert torch.allclose(value, reference.layers[layer][name], rtol=0, atol=1e-5)
