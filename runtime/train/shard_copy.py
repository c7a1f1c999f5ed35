"""A layer's state moved between ranks of different tensor-parallel degrees: shards copied, or re-sharded.

A plan's LayerCopy names one layer, a source and a destination; with tensor parallelism the source holds
the layer as shard k of t (its own split, `sharding`), the destination needs shard k' of t' (its new stage).
Every copy first sends a two-number header, the source's (t, k), then the source's full state in that
sharding (layer_state.flatten of the split module). The destination checks the header before use
(`checked_header`: bounded, and the sharding the plan's copy names), then:
- keeps the piece as it is when (t, k) = (t', k'): a shard copy between ranks of the same degree (t = 1 too);
- otherwise glues the pieces it received for the layer into whole tensors (one piece of t = 1, or the t
  shards of one degree: the plan lists a copy from each of the source group's ranks) and cuts its own shard
  from them: parameters, both AdamW moments, the step counter and buffers (`whole_state`/`shard_state`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from oobleck.api.plan import MAX_TENSOR_PARALLEL, LayerCopy
from oobleck.runtime.train.optim import LayerAdamW, ParamState
from oobleck.runtime.train.tensor_parallel import SHARD_ATTRIBUTE, shard_state, split_rules, whole_state

Build = Callable[[int, int, int], nn.Module]
"""(layer, t, k) -> the layer built whole from (seed, index) and split as shard k of t"""


def sharding(module: nn.Module) -> tuple[int, int]:
    """(t, k) of a layer as this rank holds it: (1, 0) for a whole layer."""
    return getattr(module, SHARD_ATTRIBUTE, (1, 0))


def header(module: nn.Module, device: torch.device) -> torch.Tensor:
    return torch.tensor(sharding(module), dtype=torch.int64, device=device)


def checked_header(values: list[int], copy: LayerCopy, build: Build) -> nn.Module:
    """The empty module a copy's payload is received into, from the (t, k) header its source sent, which is
    checked before anything is built: t a power of two <= MAX_TENSOR_PARALLEL, 0 <= k < t, the sharding
    the plan's copy names (`LayerCopy.src_tensor_parallel`, `src_tp_index`: the plan and the holdings it
    was settled from are signed), and one the layer splits into. The payload's size is then the built
    module's (`state_nbytes`), at most the whole layer's: never a size the peer chose."""
    where = f"copies: layer {copy.layer} from rank {copy.src_rank}"
    if len(values) != 2:
        raise ValueError(f"{where}: the header must be two numbers (t, k), got {len(values)}")
    t, k = values
    if not (1 <= t <= MAX_TENSOR_PARALLEL and t & (t - 1) == 0 and 0 <= k < t):
        raise ValueError(
            f"{where}: header (t, k) = ({t}, {k}) refused: t must be a power of two <= {MAX_TENSOR_PARALLEL} "
            "and 0 <= k < t"
        )
    if (t, k) != copy.src_shard:
        raise ValueError(
            f"{where}: header (t, k) = ({t}, {k}) refused: the plan's copy names the source's shard "
            f"{copy.src_shard} (src_tensor_parallel, src_tp_index)"
        )
    try:
        return build(copy.layer, t, k)
    except ValueError as error:
        raise ValueError(f"{where}: header (t, k) = ({t}, {k}) refused: {error}") from error


def named_state(layer: int, module: nn.Module, optimizer: LayerAdamW) -> dict[str, torch.Tensor]:
    """Parameters (`name`), their moments (`name/exp_avg`, `name/exp_avg_sq`: these follow the parameter's
    split rule), step counters and buffers (under `step:`/`buffer:` names: replicated)."""
    named: dict[str, torch.Tensor] = {}
    for name, parameter in module.named_parameters():
        state: ParamState = optimizer.state[(layer, name)]
        named[name] = parameter.data
        named[f"{name}/exp_avg"] = state.exp_avg
        named[f"{name}/exp_avg_sq"] = state.exp_avg_sq
        named[f"step:{name}"] = state.step
    for name, buffer in module.named_buffers():
        named[f"buffer:{name}"] = buffer
    return named


@torch.no_grad()
def load_state(layer: int, module: nn.Module, optimizer: LayerAdamW, named: dict[str, torch.Tensor]) -> None:
    """`named_state`'s inverse: overwrite the module's parameters and buffers and register its AdamW state."""
    optimizer.ensure_layer(layer, module)
    for name, parameter in module.named_parameters():
        state = optimizer.state[(layer, name)]
        parameter.copy_(named[name])
        state.exp_avg.copy_(named[f"{name}/exp_avg"])
        state.exp_avg_sq.copy_(named[f"{name}/exp_avg_sq"])
        state.step.copy_(named[f"step:{name}"])
    for name, buffer in module.named_buffers():
        buffer.copy_(named[f"buffer:{name}"])


def own_piece(
    copy: LayerCopy, layers: dict[int, nn.Module], optimizer: LayerAdamW
) -> tuple[int, tuple[nn.Module, LayerAdamW]]:
    """A copy from this rank to itself: its own piece of the layer, with that state in a scratch optimizer
    (the real one drops the layer's state before `assemble` fills it anew)."""
    module = layers.get(copy.layer)
    if module is None or sharding(module) != copy.src_shard:
        held = "nothing" if module is None else f"shard {sharding(module)}"
        raise ValueError(
            f"copies: rank {copy.src_rank} is the source of its own layer {copy.layer} as shard {copy.src_shard} "
            f"but holds {held}"
        )
    scratch = LayerAdamW(optimizer.config)
    for name, _ in module.named_parameters():
        scratch.state[(copy.layer, name)] = optimizer.state[(copy.layer, name)]
    return copy.layer, (module, scratch)


def assemble(
    layer: int,
    pieces: list[tuple[nn.Module, LayerAdamW]],
    want: tuple[int, int],
    optimizer: LayerAdamW,
    build: Build,
) -> nn.Module:
    """The destination's module of `layer` at sharding `want` from the received pieces (each a module split
    as its source held it, with that state in a scratch optimizer); its state lands in `optimizer`."""
    by_sharding = {sharding(module): (module, scratch) for module, scratch in pieces}
    if want in by_sharding:  # the same shard (or both whole): a plain copy
        module, scratch = by_sharding[want]
        load_state(layer, module, optimizer, named_state(layer, module, scratch))
        return module
    if (1, 0) in by_sharding:
        module, scratch = by_sharding[(1, 0)]
        whole = named_state(layer, module, scratch)
    else:
        degrees = {t for t, _ in by_sharding}
        t = min(degrees)
        shards = [by_sharding.get((t, k)) for k in range(t)]
        if len(degrees) != 1 or any(piece is None for piece in shards):
            raise ValueError(
                f"copies: layer {layer} arrived as shards {sorted(by_sharding)}: re-sharding needs the layer whole "
                f"or every shard of one degree"
            )
        rules = split_rules(shards[0][0])  # type: ignore[index]
        whole = whole_state([named_state(layer, m, s) for m, s in shards], rules)  # type: ignore[misc]
    target = build(layer, *want)
    load_state(layer, target, optimizer, shard_state(whole, split_rules(target), want[0], want[1]))
    return target
