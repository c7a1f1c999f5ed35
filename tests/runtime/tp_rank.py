"""One rank of a tensor-parallel exactness check (a test driver, not a test).

usage: tp_rank.py RANK WORLD PORT MODEL:DTYPE[,MODEL:DTYPE...]
For each case: builds every layer of MODEL whole (as every rank does: a layer is a function of seed and index), runs a
forward and backward of the unsplit stack and of the stack split over the WORLD ranks (gloo), and prints
one JSON line per case: the relative errors of the loss, the logits shard and every parameter's gradient shard.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist

from oobleck.runtime.models.hf import PRESETS, load_transformers
from oobleck.runtime.models.layered import GPT, GPTSizes
from oobleck.runtime.train.tensor_parallel import TensorParallelGroup, shard_bounds, split_layer, vocab_parallel_loss

TINY_GPT2 = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 4,
    "n_positions": 16,
    "vocab_size": 50,  # not a multiple of 4: uneven vocabulary shards
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "tie_word_embeddings": True,
}
LLAMA_4_KV = {**PRESETS["llama-tiny"], "num_key_value_heads": 4}  # kv heads must split over t = 4 too


def build(name: str):
    if name == "gpt":
        return GPT(GPTSizes(blocks=2, hidden=32, heads=4, seq_len=16, vocab=64), seed=3)
    if name == "gpt2":
        return load_transformers(None, dict(TINY_GPT2), seed=3, sequence_length=16)
    if name == "llama":
        return load_transformers(None, dict(LLAMA_4_KV), seed=3, sequence_length=16)
    if name == "qwen2":
        return load_transformers(None, {**LLAMA_4_KV, "model_type": "qwen2"}, seed=3, sequence_length=16)
    raise SystemExit(f"unknown model {name}")


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item() or 1.0
    return (got.float() - want.float()).abs().max().item() / scale


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tp = TensorParallelGroup(dist.group.WORLD, rank, world)
    for case in sys.argv[4].split(","):
        name, dtype_name = case.split(":")
        print(json.dumps({"case": case, "rank": rank, **check(build(name), getattr(torch, dtype_name), tp)}))
    dist.destroy_process_group()


def check(model, dtype: torch.dtype, tp: TensorParallelGroup) -> dict:
    rank, world = tp.rank, tp.size
    vocab = model.sizes.vocab if isinstance(model, GPT) else model.vocab_size
    whole = [model.build_layer(i).to(dtype) for i in range(model.num_layers)]
    split = [split_layer(copy.deepcopy(layer), tp) for layer in whole]
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, vocab, (3, 16), generator=generator)
    targets = torch.randint(0, vocab, (3, 16), generator=generator)

    x = tokens
    for layer in whole:
        x = layer(x)
    want_loss = model.loss(x, targets).sum()
    want_loss.backward()
    want_logits = x.detach()

    y = tokens
    for layer in split:
        y = layer(y)
    got_loss = vocab_parallel_loss(y, targets, vocab, tp).sum()
    got_loss.backward()
    start, end = shard_bounds(vocab, world, rank)

    errors = {
        "loss": relative(got_loss.detach(), want_loss.detach()),
        "logits": relative(y.detach(), want_logits[..., start:end]),
    }
    for index, (full, part) in enumerate(zip(whole, split)):
        # The expected gradient shards: the whole gradients cut by the same split.
        grads = copy.deepcopy(full)
        with torch.no_grad():
            for parameter, source in zip(grads.parameters(), full.parameters()):
                parameter.copy_(source.grad)
        split_layer(grads, tp)
        expected = dict(grads.named_parameters())
        for pname, parameter in part.named_parameters():
            assert parameter.shape == expected[pname].shape, (index, pname, parameter.shape, expected[pname].shape)
            errors[f"{index}.{pname}"] = relative(parameter.grad, expected[pname])
    shards = sum(p.numel() for layer in split for p in layer.parameters())
    return {
        "errors": errors,
        "shard_parameters": shards,
        "whole_parameters": sum(p.numel() for layer in whole for p in layer.parameters()),
    }


if __name__ == "__main__":
    main()
