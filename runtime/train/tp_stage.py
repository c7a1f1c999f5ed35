"""A stage with tensor_parallel = t > 1 in the engine: its split layers, their collectives, their gradient sums.

A stage of g ranks runs g / t groups of t consecutive ranks (groups.tensor_parallel_groups); each group splits
every layer of the stage (runtime/train/tensor_parallel.py) and runs the rows of the microbatch the group's
position gives it (groups.stage_rows). Tensors between stages stay whole: every rank of a group receives the
same whole activations and sends the same whole input gradient (groups.exchanges says who pairs with whom).

Gradient sums across pipelines of different t: a layer's holders (every rank of every stage holding it, at
any t) sum one *whole-size* buffer per holder set, as with t = 1. A TP rank adds its shard's gradient at the
shard's place in the whole tensor and zeros elsewhere; a replicated parameter (norms, biases after a reduce)
is added by TP rank 0 of each group only, so each group counts once. Zeros add exactly, so the sum equals
the one of t = 1 pipelines bit for bit in float64 (the shards' own gradients differ from the unsplit ones by
float32 matmul shapes only). Each rank then takes its shard of the sum. This costs t times the bytes of a
shard-wise sum, but works whatever mix of t the holders have; a shard-wise reduce (only when every holder of
a layer has the same t and index) is the optimisation left for later.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from oobleck.runtime.models.layered import GPT, LayeredModel
from oobleck.runtime.train.groups import GenerationGroups, Layout, exchanges, wait_collective
from oobleck.runtime.train.optim import LayerAdamW
from oobleck.runtime.train.tensor_parallel import (
    ShardRule,
    TensorParallelGroup,
    cut,
    shard_bounds,
    split_layer,
    split_rules,
    vocab_parallel_loss,
    whole_shapes,
)


class Channel:
    """The collectives of a rank's split layers, over the current generation's TP group.

    The split modules keep a reference to one channel for their whole life; a new plan generation rebinds
    it to that generation's backend (`bind`). Its waits watch the failure event (`Interrupted`) and turn a
    dead peer into `CommError`, like every other wait of the engine."""

    def __init__(self) -> None:
        self.backend: Any = None
        self.members: tuple[int, ...] = ()
        self.failed: threading.Event | None = None
        self.poll, self.timeout = 0.05, 600.0

    def bind(self, backend: Any, members: tuple[int, ...], failed: threading.Event | None, poll: float, timeout: float):
        self.backend, self.members, self.failed, self.poll, self.timeout = backend, members, failed, poll, timeout

    def all_reduce(self, x: torch.Tensor, op: Any) -> None:
        if self.backend is None:
            raise RuntimeError("tensor-parallel channel used before a generation bound it")
        options = dist.AllreduceOptions()
        options.reduceOp = op
        work = self.backend.allreduce([x], options)
        what = f"tensor-parallel all-reduce over ranks {list(self.members)}"
        wait_collective(work, self.failed, self.poll, self.timeout, what)


def tp_group(lay: Layout, channel: Channel) -> TensorParallelGroup:
    return TensorParallelGroup(channel, lay.tp_index, lay.tensor_parallel)


def bind(channel: Channel, lay: Layout, groups: GenerationGroups, failed, poll: float, timeout: float) -> None:
    """Point the channel at this generation's TP group of `lay` (nothing to bind when t = 1)."""
    if lay.tensor_parallel > 1:
        channel.bind(groups.tensor_parallel(lay.tp_members), lay.tp_members, failed, poll, timeout)


def build_split(model: LayeredModel, layer: int, tp: TensorParallelGroup, device: torch.device) -> nn.Module:
    """Layer `layer` as this rank's shards: built whole (a pure function of seed and index), then split."""
    return split_layer(model.build_layer(layer).to(device), tp)


def vocabulary(model: LayeredModel) -> int:
    return model.sizes.vocab if isinstance(model, GPT) else int(model.vocab_size)  # type: ignore[attr-defined]


def stage_loss(
    model: LayeredModel, tp: TensorParallelGroup | None
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The per-sample loss of the last stage: the model's own, or over a vocabulary-split head's logits shard."""
    if tp is None or tp.size == 1:
        return model.loss
    vocab = vocabulary(model)
    return lambda logits, targets: vocab_parallel_loss(logits, targets, vocab, tp)


def pieces(lay: Layout, microbatch_size: int, offset: int, sending: bool) -> list[tuple[int, tuple[int, int]]]:
    """(peer rank, rows) of what this rank sends to (`sending`) or receives from the stage `offset` away,
    rows ascending; [] past the pipeline's ends."""
    index = lay.stage_index + offset
    if not 0 <= index < len(lay.pipeline.stages):
        return []
    other = lay.pipeline.stages[index]
    if sending:
        return [(dst, rows) for src, dst, rows in exchanges(lay.stage, other, microbatch_size) if src == lay.rank]
    return [(src, rows) for src, dst, rows in exchanges(other, lay.stage, microbatch_size) if dst == lay.rank]


@dataclass(frozen=True)
class Placement:
    """Where a TP rank's gradient of one parameter sits in the whole parameter's gradient."""

    whole: tuple[int, ...]
    rule: ShardRule | None
    """None: a replicated parameter"""
    size: int
    rank: int

    def add(self, whole: torch.Tensor, grad: torch.Tensor) -> None:
        """Add this rank's contribution into the whole-size sum (a replicated one: TP rank 0 only)."""
        if self.rule is None:
            if self.rank == 0:
                whole += grad
            return
        dim, parts = self.rule.dim, self.rule.parts
        for block, piece in zip(whole.chunk(parts, dim), grad.chunk(parts, dim)):
            start, end = shard_bounds(block.shape[dim], self.size, self.rank)
            block.narrow(dim, start, end - start).add_(piece)

    def take(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a whole-size sum."""
        return whole.clone() if self.rule is None else cut(whole, self.rule, self.size, self.rank)


def placements(lay: Layout, layers: dict[int, nn.Module]) -> dict[tuple[int, str], Placement]:
    """The placement of every parameter of this rank's (split) layers; {} when t = 1."""
    if lay.tensor_parallel == 1:
        return {}
    found = {}
    for layer in lay.layers:
        module = layers[layer]
        rules, shapes = split_rules(module), whole_shapes(module)
        for name, parameter in module.named_parameters():
            whole = shapes.get(name, tuple(parameter.shape))
            found[(layer, name)] = Placement(whole, rules.get(name), lay.tensor_parallel, lay.tp_index)
    return found


@torch.no_grad()
def gather_state(
    model: LayeredModel,
    layers: dict[int, nn.Module],
    lay: Layout,
    channel: Channel,
    device: torch.device,
    optimizer: LayerAdamW,
) -> tuple[dict[int, nn.Module], LayerAdamW]:
    """Every layer of this rank's stage whole, with its AdamW state in a scratch optimizer, glued from the TP
    group's shards: snapshots and exports hold whole layers, which a stage of any t restores from. One
    all-reduce per tensor: each rank adds its shard at its place into zeros (a replicated one: TP rank 0
    only), so the sum is the whole tensor exactly. Every rank of the group calls it, in the training thread."""
    placed = placements(lay, layers)
    scratch = LayerAdamW(optimizer.config)
    wholes = {}
    for layer in lay.layers:
        whole = model.build_layer(layer).to(device)
        scratch.ensure_layer(layer, whole)
        for name, parameter in whole.named_parameters():
            state, shard = optimizer.state[(layer, name)], layers[layer].get_parameter(name).detach()
            mine = scratch.state[(layer, name)]
            for target, source in (
                (parameter, shard),
                (mine.exp_avg, state.exp_avg),
                (mine.exp_avg_sq, state.exp_avg_sq),
            ):
                total = torch.zeros_like(target)
                placed[(layer, name)].add(total, source)
                channel.all_reduce(total, dist.ReduceOp.SUM)
                target.copy_(total)
            mine.step.copy_(state.step)
        wholes[layer] = whole
    return wholes, scratch
