"""Tied parameters with tensor-parallel stages: GPT-2's embedding and head (one shared matrix) on stages of
different t train like one process, and a tied TP job's export loads in `transformers`.

Real worker processes, gloo on CPU. The tied gradient sum is one whole-size all-reduce over every holder of
either copy (runtime/train/engine.py `_TiedGradients`): a vocabulary shard adds its rows at their place, so
the sum is exact whatever t each copy's stage has. Tolerances: the engine's for float64 sums (loss 1e-5
relative, parameters 1e-5 absolute).
"""

from __future__ import annotations

import pytest
import torch

from oobleck.runtime.models.hf import load_transformers
from oobleck.runtime.train.config import WorkerConfig, build_model
from oobleck.runtime.train.reference import train_reference
from tests.runtime.test_hf_training import TINY_GPT2
from tests.runtime.test_hf_training import config as hf_config
from tests.runtime.test_tp_engine import assert_export_computes_the_runs_logits, run_and_check, whole_layers

pytestmark = pytest.mark.slow  # real worker processes
HEAD = 3  # TINY_GPT2: embedding, two blocks, head


def tied_config(**update) -> WorkerConfig:
    return WorkerConfig.model_validate(hf_config(family="gpt2", config=TINY_GPT2).model_dump() | update)


def assert_copies_equal(result, plan, config: WorkerConfig) -> None:
    """Every holder's embedding matrix equals every holder's head matrix, bit for bit (shards glued whole):
    the two copies of the tied parameter are still one."""
    wholes = whole_layers(result.per_rank, plan, build_model(config))
    embeddings = [whole["wte.weight"] for whole in wholes[0]]
    heads = [whole["lm_head.weight"] for whole in wholes[HEAD]]
    for matrix in embeddings + heads:
        assert torch.equal(matrix, embeddings[0])


def test_tied_copies_at_different_t(tmp_path, plan_builder, workers):
    """The embedding on a t = 2 stage, the head on a t = 1 stage; beside them a one-stage t = 2 pipeline holds
    both copies as shards: the tied sum adds vocabulary shards of t = 2 and the whole head of t = 1. Clipped
    by the global norm, which counts the tied matrix once, whole, though the counting rank holds a shard."""
    make_plan, Spec = plan_builder
    plan = make_plan(
        [Spec(stages=[(0, 2, 0, 2, 2), (2, 4, 1, 1)], microbatches=3), Spec(stages=[(0, 4, 0, 2, 2)], microbatches=2)],
        num_layers=4,
        gpus_per_node=2,
    )
    config = tied_config(max_grad_norm=0.05)
    assert build_model(config).tied_parameters() == [((0, "wte.weight"), (HEAD, "lm_head.weight"))]
    reference = train_reference(config, plan.global_microbatches)
    unclipped = train_reference(tied_config(), plan.global_microbatches)
    assert reference.losses[1:] != unclipped.losses[1:], "clipping changed nothing: the test would prove little"
    result = run_and_check(tmp_path, workers, plan, config, reference=reference)
    assert_copies_equal(result, plan, config)


def test_tied_copies_both_at_t2_export_whole(tmp_path, plan_builder, workers):
    """Both copies on t = 2 stages of one pipeline, beside a one-rank t = 1 pipeline holding both whole; the finished run's export holds the tied matrix once, whole, and
    `from_pretrained` computes the run's own logits from it."""
    make_plan, Spec = plan_builder
    plan = make_plan(
        [Spec(stages=[(0, 2, 0, 2, 2), (2, 4, 1, 2, 2)], microbatches=3), Spec(stages=[(0, 4, 0, 1)], microbatches=2)],
        num_layers=4,
        gpus_per_node=2,
    )
    config = tied_config(job="tp-tied-export", checkpoint={"path": str(tmp_path / "ckpt")})
    result = run_and_check(tmp_path, workers, plan, config)
    assert_copies_equal(result, plan, config)
    assert_export_computes_the_runs_logits(
        tmp_path / "ckpt" / "huggingface", result, plan, load_transformers("gpt2", TINY_GPT2)
    )
