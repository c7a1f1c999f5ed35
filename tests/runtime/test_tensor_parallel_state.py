"""Tensor-parallel shards as state: cut from whole tensors exactly as the module split cuts them, glued back
whole, and re-sharded between degrees (pure: no process group)."""

from __future__ import annotations

import copy

import pytest
import torch

from oobleck.runtime.models.hf import PRESETS, load_transformers
from oobleck.runtime.models.layered import GPT, GPTSizes
from oobleck.runtime.train.tensor_parallel import (
    TensorParallelGroup,
    shard_state,
    split_layer,
    split_rules,
    whole_state,
)

GPT2 = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 4, "n_positions": 8, "vocab_size": 50}
LLAMA = {**PRESETS["llama-tiny"], "num_key_value_heads": 4}


def _layers():
    gpt = GPT(GPTSizes(blocks=1, hidden=32, heads=4, seq_len=8, vocab=50), seed=1)
    gpt2 = load_transformers(None, dict(GPT2), seed=1, sequence_length=8)
    llama = load_transformers(None, dict(LLAMA), seed=1, sequence_length=8)
    return {
        f"{name}-{index}": model.build_layer(index)
        for name, model in (("gpt", gpt), ("gpt2", gpt2), ("llama", llama))
        for index in range(3)
    }


LAYERS = _layers()


def _named(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A layer's parameters with stand-in AdamW moments (same shapes, other values)."""
    out = {}
    for name, parameter in layer.named_parameters():
        out[name] = parameter.detach().clone()
        out[f"{name}/exp_avg"] = parameter.detach() * 2 + 1
    return out


def _split(layer, size: int, rank: int):
    return split_layer(copy.deepcopy(layer), TensorParallelGroup(None, rank, size))


@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("size", [2, 4])
def test_state_cuts_are_the_module_splits_and_glue_back_whole(name, size):
    layer = LAYERS[name]
    whole = _named(layer)
    splits = [_split(layer, size, rank) for rank in range(size)]
    rules = split_rules(splits[0])
    assert rules, "a transformer layer splits some matrix"
    shards = [shard_state(whole, rules, size, rank) for rank in range(size)]
    for rank, split in enumerate(splits):
        for pname, parameter in split.named_parameters():
            assert torch.equal(shards[rank][pname], parameter.detach()), (name, rank, pname)
    glued = whole_state(shards, rules)
    assert glued.keys() == whole.keys()
    assert all(torch.equal(glued[k], whole[k]) for k in whole), name


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_resharding_from_four_to_two_ranks_equals_cutting_the_whole_for_two(name):
    layer = LAYERS[name]
    whole = _named(layer)
    four = [shard_state(whole, split_rules(_split(layer, 4, 0)), 4, r) for r in range(4)]
    rules_two = split_rules(_split(layer, 2, 0))
    resharded = [shard_state(whole_state(four, split_rules(_split(layer, 4, 0))), rules_two, 2, r) for r in range(2)]
    for rank in range(2):
        direct = shard_state(whole, rules_two, 2, rank)
        assert all(torch.equal(resharded[rank][k], direct[k]) for k in direct), (name, rank)
