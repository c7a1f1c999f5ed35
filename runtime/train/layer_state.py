"""A layer's full state as one flat byte buffer, and the execution of a plan's LayerCopy list.

Full state = parameters, buffers, and for every parameter its AdamW moments and step counter, in
`named_parameters()` order (the layout is fixed by the model, so both sides agree without sending
any metadata). Bytes rather than one float dtype: mixed-precision layers round-trip exactly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import torch
from torch import nn

from oobleck.api.plan import LayerCopy
from oobleck.runtime.models.layered import LayeredModel
from oobleck.runtime.train.groups import GenerationGroups, wait
from oobleck.runtime.train.optim import LayerAdamW, ParamState

COPY_TAG_BASE = 1000  # copy i uses tag COPY_TAG_BASE + i: unique per copy, so order never matters


def _tensors(layer: int, module: nn.Module, optimizer: LayerAdamW) -> Iterator[torch.Tensor]:
    for name, parameter in module.named_parameters():
        state: ParamState = optimizer.state[(layer, name)]
        yield parameter.data
        yield state.exp_avg
        yield state.exp_avg_sq
        yield state.step
    for _, buffer in module.named_buffers():
        yield buffer


def state_nbytes(module: nn.Module) -> int:
    """Bytes of a layer's full state (what `flatten` produces), from the module alone."""
    step = torch.zeros((), dtype=torch.float32).element_size()
    parameters = sum(3 * p.numel() * p.element_size() + step for p in module.parameters())
    return parameters + sum(b.numel() * b.element_size() for b in module.buffers())


def flatten(layer: int, module: nn.Module, optimizer: LayerAdamW) -> torch.Tensor:
    """The layer's full state as one uint8 tensor on the module's device."""
    return torch.cat(
        [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in _tensors(layer, module, optimizer)]
    )


def capture(layer: int, module: nn.Module, optimizer: LayerAdamW) -> torch.Tensor:
    """The layer's full state (`flatten`'s bytes) as a host copy that later updates leave alone.

    Runs on a snapshot thread while training goes on: on a GPU the copy goes through a side stream
    that first waits for the work already queued (the last update), into pinned memory."""
    tensors = list(_tensors(layer, module, optimizer))
    if tensors and tensors[0].is_cuda:
        device = tensors[0].device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.default_stream(device))
        with torch.cuda.stream(stream):
            flat = flatten(layer, module, optimizer)
            host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
            host.copy_(flat, non_blocking=True)
        stream.synchronize()
        return host
    return flatten(layer, module, optimizer)  # torch.cat allocates: already a copy


@torch.no_grad()
def unflatten(buffer: torch.Tensor, layer: int, module: nn.Module, optimizer: LayerAdamW) -> None:
    """Overwrite the layer's parameters, buffers and optimizer state from `flatten`'s output."""
    expected = state_nbytes(module)
    if buffer.numel() != expected:
        raise ValueError(f"layer {layer}: state buffer has {buffer.numel()} bytes, the model's layer needs {expected}")
    optimizer.ensure_layer(layer, module)
    offset = 0
    for tensor in _tensors(layer, module, optimizer):
        size = tensor.numel() * tensor.element_size()
        # clone() realigns the slice so that it can be reinterpreted as the tensor's dtype
        tensor.copy_(buffer[offset : offset + size].clone().view(tensor.dtype).view(tensor.shape))
        offset += size


def transfer(
    copies: list[LayerCopy],
    rank: int,
    groups: GenerationGroups,
    model: LayeredModel,
    layers: dict[int, nn.Module],
    optimizer: LayerAdamW,
    device: torch.device,
    failed: threading.Event | None = None,
    poll: float = 0.05,
    timeout: float = 600.0,
    snapshot: Callable[[int], torch.Tensor] | None = None,
) -> int:
    """Execute the copies this rank takes part in; received layers land in `layers` (with their
    optimizer state). Returns the bytes this rank sent and received.

    A copy whose `source_kind` is "snapshot" is sent from `snapshot(layer)` (this rank's host copy
    at the plan's restore step) instead of the live layer; copies with src == dst (a rank's own
    snapshot, a checkpoint read) are the caller's (Worker.adopt), not a transfer."""
    moved = 0
    sends, receives = [], []
    for index, copy in enumerate(copies):
        tag = COPY_TAG_BASE + index
        if copy.src_rank == rank and copy.dst_rank != rank:
            backend, peer = groups.link(rank, copy.dst_rank)
            if copy.source_kind == "snapshot":
                if snapshot is None:
                    raise ValueError(f"copies[{index}]: layer {copy.layer} from a snapshot, but rank {rank} keeps none")
                flat = snapshot(copy.layer).to(device)
            elif copy.layer not in layers:
                raise ValueError(
                    f"copies[{index}]: rank {rank} is the source of layer {copy.layer} but does not hold it"
                )
            else:
                flat = flatten(copy.layer, layers[copy.layer], optimizer)
            sends.append((backend.send([flat], peer, tag), flat, copy))
            moved += flat.numel()
        elif copy.dst_rank == rank and copy.src_rank != rank:
            # Optimizer state is registered only once the bytes arrived (unflatten): a transfer cut
            # short must not leave zero moments behind for a layer this rank does not hold.
            module = model.build_layer(copy.layer).to(device)
            flat = torch.empty(state_nbytes(module), dtype=torch.uint8, device=device)
            backend, peer = groups.link(copy.src_rank, rank)
            receives.append((backend.recv([flat], peer, tag), flat, module, copy))
    for work, flat, module, copy in receives:
        wait(
            work,
            failed,
            poll,
            timeout,
            f"layer {copy.layer} state from rank {copy.src_rank}",
            cuda=device.type == "cuda",
        )
        unflatten(flat, copy.layer, module, optimizer)
        layers[copy.layer] = module
        moved += flat.numel()
    for work, _, copy in sends:
        wait(
            work, failed, poll, timeout, f"layer {copy.layer} state to rank {copy.dst_rank}", cuda=device.type == "cuda"
        )
    return moved
