"""Megatron-style tensor parallelism inside a stage: a layer's matrices split over the t ranks of a node.

One transformer block on t ranks (Shoeybi et al., "Megatron-LM", 2019, section 3):
- attention: Q, K and V split by heads (column-parallel), the output projection split by its input
  (row-parallel); each rank attends over its own heads;
- MLP: the input projections split by columns, the output projection by rows;
- the embedding and the LM head split by vocabulary rows, with a cross-entropy that never gathers the logits.

Each split region costs one all-reduce forward (after the row-parallel matrix) and one backward (of the
gradient entering the column-parallel matrices). Norms, biases after a reduce and position embeddings are
replicated: they see identical inputs and gradients on every rank of the group.

Hand-written autograd functions over plain tensors, not DTensor: a layer's state stays a set of ordinary
tensors with its usual names (`layer.self_attn.q_proj.weight`, ...), each a shard of the whole, so the step
commit, the snapshots and the layer copies of a reconfiguration handle them as they handle any layer, and a
shard is cut from (or glued back into) the whole tensor with `shard_bounds`. The split happens in place:
modules keep their classes and parameter names, only their parameters shrink and the projections that end
a split region reduce before their bias.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TensorParallelGroup:
    """The ranks of one stage that split its layers: this rank's index in it and the group's size.

    `group`: a torch.distributed process group, or any object with `all_reduce(tensor, op)` (the engine's
    channel, runtime/train/tp_stage.py, whose waits watch the failure event and whose backend changes
    with each plan generation while the split modules stay)."""

    group: Any
    rank: int
    size: int


def _all_reduce(x: torch.Tensor, group: Any, op: Any = dist.ReduceOp.SUM) -> None:
    if hasattr(group, "all_reduce"):
        group.all_reduce(x, op)
    else:
        dist.all_reduce(x, op=op, group=group)


def shard_bounds(total: int, size: int, rank: int) -> tuple[int, int]:
    """[start, end) of shard `rank` of `total` rows split over `size` ranks (the first `total % size` one
    row longer), so that vocabularies not divisible by t split too."""
    base, extra = divmod(total, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


# --- the four communication patterns ----------------------------------------------------------------


class _EnterRegion(torch.autograd.Function):
    """Forward: identity (the input is replicated). Backward: all-reduce (each rank holds a part of the gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        _all_reduce(grad, ctx.group)
        return grad, None


class _LeaveRegion(torch.autograd.Function):
    """Forward: all-reduce of the partial sums. Backward: identity (the sum's gradient is each part's)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous()
        _all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def enter_region(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    return _EnterRegion.apply(x, tp.group)


def leave_region(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    return _LeaveRegion.apply(x, tp.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split by vocabulary rows, without gathering them: three
    all-reduces of one number per token (the max, the sum of exponentials, the target's logit)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int, group: Any) -> torch.Tensor:
        logits = logits.float()
        peak = logits.max(dim=-1).values
        _all_reduce(peak, group, dist.ReduceOp.MAX)
        shifted = logits - peak.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        _all_reduce(total, group)
        local = targets - start
        mine = (local >= 0) & (local < logits.shape[-1])
        index = local.clamp(0, logits.shape[-1] - 1)
        target_logit = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * mine
        _all_reduce(target_logit, group)
        ctx.save_for_backward(exp / total.unsqueeze(-1), index, mine)
        return total.log() - target_logit

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, index, mine = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, index.unsqueeze(-1), -mine.to(softmax.dtype).unsqueeze(-1))
        return grad_logits * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, vocab: int, tp: TensorParallelGroup
) -> torch.Tensor:
    """Per-token cross-entropy (shape of `targets`) of this rank's vocabulary shard `logits` (`[..., rows]`)."""
    start, _ = shard_bounds(vocab, tp.size, tp.rank)
    flat = _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), targets.flatten(), start, tp.group)
    return flat.view(targets.shape)


# --- splitting modules in place ---------------------------------------------------------------------


@dataclass(frozen=True)
class ShardRule:
    """How one parameter splits: along `dim`, each of `parts` equal fused blocks (Q, K, V) cut by
    `shard_bounds`. A parameter without a rule is replicated."""

    dim: int
    parts: int = 1


RULES_ATTRIBUTE = "_tensor_parallel_rules"
"""Where a split module records its parameters' rules (see `split_rules`)."""
SHARD_ATTRIBUTE = "_tensor_parallel_shard"
"""Where `split_layer` records (t, k): the layer is shard k of t (runtime/train/shard_copy.py reads it)."""
WHOLE_ATTRIBUTE = "_tensor_parallel_whole_shapes"
"""Where a split module records its split parameters' whole shapes (see `whole_shapes`)."""


def cut(whole: torch.Tensor, rule: ShardRule, size: int, rank: int) -> torch.Tensor:
    """Shard `rank` of `size` of a whole tensor (a parameter or one of its AdamW moments)."""
    blocks = whole.chunk(rule.parts, dim=rule.dim)
    pieces = []
    for block in blocks:
        start, end = shard_bounds(block.shape[rule.dim], size, rank)
        pieces.append(block.narrow(rule.dim, start, end - start))
    return torch.cat(pieces, dim=rule.dim).clone()


def glue(shards: list[torch.Tensor], rule: ShardRule | None) -> torch.Tensor:
    """The whole tensor from every rank's shard, in rank order (`cut`'s inverse)."""
    if rule is None:
        return shards[0].clone()
    per_rank = [shard.chunk(rule.parts, dim=rule.dim) for shard in shards]
    blocks = [torch.cat([blocks[b] for blocks in per_rank], dim=rule.dim) for b in range(rule.parts)]
    return torch.cat(blocks, dim=rule.dim)


def split_rules(layer: nn.Module) -> dict[str, ShardRule]:
    """Every split parameter of a split layer by its name in `layer.named_parameters()`; the others are replicated."""
    rules: dict[str, ShardRule] = {}
    for prefix, module in layer.named_modules():
        for name, rule in getattr(module, RULES_ATTRIBUTE, {}).items():
            rules[f"{prefix}.{name}" if prefix else name] = rule
    return rules


def whole_shapes(layer: nn.Module) -> dict[str, tuple[int, ...]]:
    """The whole shape of every split parameter of a split layer, by name (uneven vocabulary shards
    make it unknowable from one shard)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for prefix, module in layer.named_modules():
        for name, shape in getattr(module, WHOLE_ATTRIBUTE, {}).items():
            shapes[f"{prefix}.{name}" if prefix else name] = shape
    return shapes


def whole_state(shards: list[dict[str, torch.Tensor]], rules: dict[str, ShardRule]) -> dict[str, torch.Tensor]:
    """Whole tensors from every rank's named tensors; a name `param` or `param/<moment>` follows `param`'s rule."""
    return {name: glue([s[name] for s in shards], rules.get(name.split("/")[0])) for name in shards[0]}


def shard_state(
    whole: dict[str, torch.Tensor], rules: dict[str, ShardRule], size: int, rank: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s named tensors of `size` from whole ones (`whole_state`'s inverse): with it, a layer's
    state moves from a stage of one tensor-parallel degree to a stage of another."""
    out = {}
    for name, tensor in whole.items():
        rule = rules.get(name.split("/")[0])
        out[name] = tensor.clone() if rule is None else cut(tensor, rule, size, rank)
    return out


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2): a linear layer whose weight is stored transposed, `[in, out]`."""
    return type(module).__name__ == "Conv1D"


def _split_parameter(module: nn.Module, name: str, rule: ShardRule, tp: TensorParallelGroup) -> None:
    old = getattr(module, name)
    if rule.parts > 1 and old.shape[rule.dim] % (rule.parts * tp.size):
        raise ValueError(f"cannot split {old.shape[rule.dim]} rows into {rule.parts} blocks over {tp.size} ranks")
    setattr(module, name, nn.Parameter(cut(old.data, rule, tp.size, tp.rank), requires_grad=old.requires_grad))
    rules = getattr(module, RULES_ATTRIBUTE, {})
    rules[name] = rule
    setattr(module, RULES_ATTRIBUTE, rules)
    shapes = getattr(module, WHOLE_ATTRIBUTE, {})
    shapes[name] = tuple(old.shape)
    setattr(module, WHOLE_ATTRIBUTE, shapes)


def split_columns(module: nn.Module, tp: TensorParallelGroup, parts: int = 1) -> None:
    """Keep this rank's output rows of a linear layer (`parts` fused blocks, each split)."""
    conv = _is_conv1d(module)
    _split_parameter(module, "weight", ShardRule(1 if conv else 0, parts), tp)
    if getattr(module, "bias", None) is not None:
        _split_parameter(module, "bias", ShardRule(0, parts), tp)
    if conv:
        module.nf = module.weight.shape[1]  # Conv1D sizes its output from `nf`
    else:
        module.out_features = module.weight.shape[0]


def split_rows(module: nn.Module, tp: TensorParallelGroup) -> None:
    """Keep this rank's input columns of a linear layer; its forward then sums the parts over the group
    and adds the (replicated) bias once."""
    conv = _is_conv1d(module)
    _split_parameter(module, "weight", ShardRule(0 if conv else 1), tp)
    if not conv:
        module.in_features = module.weight.shape[1]

    def forward(x: torch.Tensor) -> torch.Tensor:
        partial = x @ module.weight if conv else F.linear(x, module.weight)
        out = leave_region(partial, tp)
        return out if module.bias is None else out + module.bias

    module.forward = forward  # type: ignore[method-assign]


def enter_at(module: nn.Module, tp: TensorParallelGroup) -> None:
    """Make `module`'s (first or `hidden_states`) input the start of a split region."""

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (enter_region(args[0], tp), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": enter_region(kwargs["hidden_states"], tp)}

    module.register_forward_pre_hook(hook, with_kwargs=True)


def split_vocab_embedding(embedding: nn.Embedding, tp: TensorParallelGroup) -> None:
    """Keep this rank's vocabulary rows; a token outside them looks up zeros, and the group sums."""
    start, end = shard_bounds(embedding.num_embeddings, tp.size, tp.rank)
    _split_parameter(embedding, "weight", ShardRule(0), tp)
    pad = embedding.padding_idx
    local_pad = pad - start if pad is not None and start <= pad < end else None

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - start
        outside = (local < 0) | (local >= end - start)
        rows = F.embedding(local.masked_fill(outside, 0), embedding.weight, padding_idx=local_pad)
        return leave_region(rows.masked_fill(outside.unsqueeze(-1), 0.0), tp)

    embedding.forward = forward  # type: ignore[method-assign]


def split_vocab_head(head: nn.Linear, tp: TensorParallelGroup) -> None:
    """Keep this rank's vocabulary rows of the LM head: it outputs a logits shard (see
    `vocab_parallel_cross_entropy`)."""
    _split_parameter(head, "weight", ShardRule(0), tp)
    head.out_features = head.weight.shape[0]
    enter_at(head, tp)


# --- the model families -----------------------------------------------------------------------------


def _check_divides(what: str, count: int, tp: TensorParallelGroup) -> None:
    if count % tp.size:
        raise ValueError(f"tensor parallelism {tp.size}: {what} ({count}) must be a multiple of it")


def _split_gpt_block(block: nn.Module, tp: TensorParallelGroup) -> None:
    _check_divides("heads", block.heads, tp)
    enter_at(block.qkv, tp)
    split_columns(block.qkv, tp, parts=3)
    split_rows(block.proj, tp)
    enter_at(block.up, tp)
    split_columns(block.up, tp)
    split_rows(block.down, tp)


def _split_llama_block(block: nn.Module, tp: TensorParallelGroup) -> None:
    attention, mlp = block.layer.self_attn, block.layer.mlp
    config = block.config
    _check_divides("num_attention_heads", config.num_attention_heads, tp)
    _check_divides("num_key_value_heads", getattr(config, "num_key_value_heads", config.num_attention_heads), tp)
    enter_at(attention, tp)
    for name in ("q_proj", "k_proj", "v_proj"):
        split_columns(getattr(attention, name), tp)
    split_rows(attention.o_proj, tp)
    enter_at(mlp, tp)
    split_columns(mlp.gate_proj, tp)
    split_columns(mlp.up_proj, tp)
    split_rows(mlp.down_proj, tp)


def _split_gpt2_layer(layer: nn.Module, tp: TensorParallelGroup) -> None:
    attention, mlp = layer.layer.attn, layer.layer.mlp
    _check_divides("n_head", attention.num_heads, tp)
    enter_at(attention, tp)
    split_columns(attention.c_attn, tp, parts=3)
    attention.split_size //= tp.size  # Q, K, V of this rank's heads
    attention.num_heads //= tp.size
    split_rows(attention.c_proj, tp)
    enter_at(mlp, tp)
    split_columns(mlp.c_fc, tp)
    split_rows(mlp.c_proj, tp)


def _splitters() -> dict[str, Callable[[nn.Module, TensorParallelGroup], None]]:
    def embedding(attribute: str) -> Callable[[nn.Module, TensorParallelGroup], None]:
        return lambda module, tp: split_vocab_embedding(getattr(module, attribute), tp)

    def head(attribute: str) -> Callable[[nn.Module, TensorParallelGroup], None]:
        return lambda module, tp: split_vocab_head(getattr(module, attribute), tp)

    return {
        "Embedding": lambda module, tp: split_vocab_embedding(module.tokens, tp),
        "Block": _split_gpt_block,
        "Head": head("out"),
        "LlamaEmbedding": embedding("embed_tokens"),
        "LlamaBlock": _split_llama_block,
        "LlamaHead": head("lm_head"),
        "GPT2Embedding": embedding("wte"),
        "GPT2Layer": _split_gpt2_layer,
        "GPT2Head": head("lm_head"),
    }


def split_layer(layer: nn.Module, tp: TensorParallelGroup) -> nn.Module:
    """Split one layer of the built-in GPT or a transformers family over `tp`, in place; returns it.
    Every rank of the group must pass the same (whole) layer: each keeps its own shards."""
    if tp.size == 1:
        return layer
    splitter = _splitters().get(type(layer).__name__)
    if splitter is None:
        raise ValueError(f"tensor parallelism: no split for a layer of type {type(layer).__name__}")
    splitter(layer, tp)
    setattr(layer, SHARD_ATTRIBUTE, (tp.size, tp.rank))
    return layer


def vocab_parallel_loss(
    logits: torch.Tensor, targets: torch.Tensor, vocab: int, tp: TensorParallelGroup
) -> torch.Tensor:
    """The per-sample loss of both families (the mean over tokens of the cross-entropy, see
    `LayeredModel.loss`) from a vocabulary-split head's logits shard."""
    return vocab_parallel_cross_entropy(logits, targets, vocab, tp).mean(dim=1)
