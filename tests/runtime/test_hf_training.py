"""Hugging Face models trained by real worker processes (gloo) against the single-process reference,
tied embeddings included: GPT-2's embedding and head in different stages and pipelines."""

from __future__ import annotations

import pytest
import torch

from oobleck.runtime.models.hf import load_transformers
from oobleck.runtime.train.config import OptimConfig, WorkerConfig

from .test_equivalence import assert_matches_reference

pytestmark = pytest.mark.slow  # real worker processes

STEPS = 8
TINY_GPT2 = {
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 4,
    "n_positions": 8,
    "vocab_size": 40,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}


def config(**transformers) -> WorkerConfig:
    return WorkerConfig(
        job="hf",
        model={"transformers": transformers},
        microbatch_size=4,
        steps=STEPS,
        seed=7,
        optim=OptimConfig(lr=3e-3, warmup_steps=2, decay_steps=STEPS, weight_decay=0.1),
        gradient_sum_dtype="float64",  # compared with the single-process reference
    )


@pytest.mark.parametrize(
    "layout",
    [
        # embedding and head on different ranks in both pipelines: the tied sum spans all 4 ranks
        [([(0, 2, 0, 1), (2, 4, 1, 1)], 3), ([(0, 1, 0, 1), (1, 4, 1, 1)], 2)],
        # one pipeline holds both in one stage, the other splits them
        [([(0, 4, 0, 1)], 2), ([(0, 1, 0, 1), (1, 3, 1, 1), (3, 4, 2, 1)], 3)],
    ],
    ids=["split-in-both", "one-stage-and-three"],
)
def test_tied_gpt2_trains_like_one_process(tmp_path, plan_builder, workers, layout):
    make_plan, Spec = plan_builder
    plan = make_plan([Spec(stages=stages, microbatches=m) for stages, m in layout], num_layers=4)
    cfg = config(family="gpt2", config=TINY_GPT2)
    assert load_transformers("gpt2", TINY_GPT2).tied_parameters() == [((0, "wte.weight"), (3, "lm_head.weight"))]
    result = workers(tmp_path, cfg, plan, timeout=600)  # transformers imports are slow on a loaded machine
    worst, worst_param = assert_matches_reference(result, plan, cfg)
    # the two copies of the tied matrix are still one: bitwise equal on every rank, and equal to each other
    embedding, head = result.layers[0]["wte.weight"], result.layers[3]["lm_head.weight"]
    assert torch.equal(embedding, head)
    print(f"tied gpt2: worst loss rel diff {worst:.2e}, param abs diff {worst_param:.2e}")


def test_tied_gpt2_with_the_default_float32_sums_stays_close(tmp_path, plan_builder, workers):
    """The default float32 sums, where the untied gradients live in the sum buffer across steps: the tied
    copies' gradients must still start every step from nothing. Against float64 single-process training,
    with test_precision.py's float32 tolerances (loss 1e-5 relative, parameters 1e-4)."""
    from oobleck.runtime.train.reference import train_reference

    from .test_precision import assert_matches

    make_plan, Spec = plan_builder
    plan = make_plan(
        [Spec(stages=[(0, 2, 0, 1), (2, 4, 1, 1)], microbatches=3), Spec(stages=[(0, 4, 0, 1)], microbatches=2)],
        num_layers=4,
    )
    cfg = config(family="gpt2", config=TINY_GPT2)
    result = workers(tmp_path, cfg.model_copy(update={"gradient_sum_dtype": "float32"}), plan, timeout=600)
    worst = assert_matches(result, train_reference(cfg, plan.global_microbatches), plan, rtol=1e-5, atol=1e-4)
    assert torch.equal(result.layers[0]["wte.weight"], result.layers[3]["lm_head.weight"])
    print(f"tied gpt2, float32 sums: worst loss rel diff {worst[0]:.2e}, param diff {worst[1]:.2e}")


def test_llama_tiny_two_stage_pipelines_match_reference(tmp_path, plan_builder, workers):
    make_plan, Spec = plan_builder
    plan = make_plan(
        [Spec(stages=[(0, 3, 0, 1), (3, 6, 1, 1)], microbatches=3), Spec(stages=[(0, 6, 0, 1)], microbatches=2)],
        num_layers=6,
    )
    cfg = config(preset="llama-tiny", sequence_length=16)
    worst, worst_param = assert_matches_reference(workers(tmp_path, cfg, plan, timeout=600), plan, cfg)
    print(f"llama-tiny: worst loss rel diff {worst:.2e}, param abs diff {worst_param:.2e}")


def test_a_finished_run_is_a_transformers_checkpoint_and_init_from_continues_it(tmp_path, plan_builder, workers):
    from transformers import AutoModelForCausalLM

    from oobleck.runtime.models.hf_checkpoint import is_complete

    make_plan, Spec = plan_builder
    plan = make_plan(
        [Spec(stages=[(0, 3, 0, 1), (3, 6, 1, 1)], microbatches=2), Spec(stages=[(0, 6, 0, 1)], microbatches=2)],
        num_layers=6,
    )
    first = WorkerConfig.model_validate(
        config(preset="llama-tiny", sequence_length=16).model_dump() | {"checkpoint": {"path": str(tmp_path / "ckpt")}}
    )
    (tmp_path / "run1").mkdir()
    result = workers(tmp_path / "run1", first, plan, timeout=600)
    directory = tmp_path / "ckpt" / "huggingface"
    assert is_complete(directory)

    # transformers loads it, and computes the logits the run's own final layers compute
    model = load_transformers(None, preset="llama-tiny", sequence_length=16)
    tokens = torch.randint(0, model.vocab_size, (2, 16))
    hidden = tokens
    for index in range(model.num_layers):
        layer = model.build_layer(index)
        layer.load_state_dict(result.layers[index], strict=False)
        hidden = layer(hidden)
    loaded = AutoModelForCausalLM.from_pretrained(directory)
    torch.testing.assert_close(loaded(input_ids=tokens).logits, hidden, rtol=1e-5, atol=1e-5)

    # a new job initialised from it starts where the first ended, and trains like one process would
    second = config(preset="llama-tiny", sequence_length=16, init_from=str(directory))
    (tmp_path / "run2").mkdir()
    resumed = workers(tmp_path / "run2", second, plan, timeout=600)
    assert_matches_reference(resumed, plan, second)
    # the same step-0 batch: from the trained weights the loss is lower than the first run's from the seed
    assert resumed.losses[0]["loss"] < result.losses[0]["loss"]
