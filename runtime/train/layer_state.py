"""A layer's full state as one flat byte buffer, and the execution of a plan's LayerCopy list.

Full state = parameters, buffers, and for every parameter its AdamW moments and step counter, in
`named_parameters()` order (the layout is fixed by the model, so both sides agree without sending
any metadata). Bytes rather than one float dtype: mixed-precision layers round-trip exactly.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator

import torch
from torch import nn

from oobleck.api.plan import LayerCopy
from oobleck.runtime.models.layered import LayeredModel
from oobleck.runtime.train.groups import GenerationGroups, wait
from oobleck.runtime.train.optim import LayerAdamW, ParamState
from oobleck.runtime.train.shard_copy import Build, assemble, checked_header, header, own_piece

COPY_TAG_BASE = 1000  # copy i uses tags COPY_TAG_BASE + 2i (header), + 2i + 1 (state): unique, so order never matters


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
    """The layer's full state (`flatten`'s bytes) as a host copy that later updates leave alone."""
    return capture_layers([(layer, module)], optimizer)[layer]


class PinnedBuffers:
    """Page-locked host buffers for GPU captures, kept and reused: pinning costs about a second per 1.3 GB
    (3.7 s for GPT-2 medium's 4.9 GB of state on an H200), far more than the copies (0.1 s). The pool
    owns two sets of the layers' sizes: the snapshot the store holds and the one being captured; a set
    comes back (`give`) when the store drops its step. Buffers are matched by size, so a new plan whose
    layers have the old sizes (a model's identical blocks) pins nothing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._owned: Counter[int] = Counter()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
            self._owned[nbytes] += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def give(self, buffer: torch.Tensor) -> None:
        """A captured buffer nobody reads any more (its step was dropped)."""
        if buffer.device.type != "cpu" or not buffer.is_pinned():
            return
        with self._lock:
            if self._owned[buffer.numel()] > len(self._free.get(buffer.numel(), [])):
                self._free.setdefault(buffer.numel(), []).append(buffer)

    def prepare(self, sizes: dict[int, int]) -> None:
        """Pin what two sets of these layer sizes lack (off the training thread, between snapshots), and
        let go of free buffers of sizes no layer has any more."""
        wanted = Counter(sizes.values())
        with self._lock:
            for nbytes in [n for n in self._free if n not in wanted]:
                self._owned[nbytes] -= len(self._free.pop(nbytes))
            missing = {nbytes: 2 * count - self._owned[nbytes] for nbytes, count in wanted.items()}
        for nbytes, count in missing.items():
            for _ in range(count):
                buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                with self._lock:
                    self._owned[nbytes] += 1
                    self._free.setdefault(nbytes, []).append(buffer)


def capture_layers(
    layers: list[tuple[int, nn.Module]],
    optimizer: LayerAdamW,
    *,
    start: torch.cuda.Event | None = None,
    ordered: Callable[[torch.cuda.Event | None], None] | None = None,
    buffers: PinnedBuffers | None = None,
) -> dict[int, torch.Tensor]:
    """Every layer's full state (`flatten`'s bytes) as host copies that later updates leave alone.

    Runs on a snapshot thread while training goes on. On a GPU the bytes go straight from the state
    tensors into pinned host memory on a side stream that starts at `start` (an event the training
    thread recorded where the state is the one to capture; default: the current stream's work so far).
    `ordered(copied)` is then called with the event that marks the copies' end: whoever updates the
    state makes its stream wait on that event first, so forward and backward overlap the copies and
    only the update is ordered after them. Returns once the copies are done. On a CPU the copy is made
    at once and `ordered(None)` follows."""
    tensors = {layer: list(_tensors(layer, module, optimizer)) for layer, module in layers}
    first = next((t for ts in tensors.values() for t in ts), None)
    if first is None or not first.is_cuda:
        captured = {layer: flatten(layer, module, optimizer) for layer, module in layers}  # torch.cat: a copy
        if ordered is not None:
            ordered(None)
        return captured
    device = first.device
    side = torch.cuda.Stream(device)
    if start is not None:
        side.wait_event(start)
    else:
        side.wait_stream(torch.cuda.current_stream(device))
    hosts: dict[int, torch.Tensor] = {}
    with torch.cuda.stream(side):
        for layer, layer_tensors in tensors.items():
            nbytes = sum(t.numel() * t.element_size() for t in layer_tensors)
            host = (
                buffers.take(nbytes) if buffers is not None else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            )
            offset = 0
            # The state tensors outlive these copies: whoever frees or replaces them (adopting a plan)
            # first waits for the whole capture (Snapshotter.fence).
            for tensor in layer_tensors:
                raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                host[offset : offset + raw.numel()].copy_(raw, non_blocking=True)
                offset += raw.numel()
            hosts[layer] = host
    copied = torch.cuda.Event()
    copied.record(side)
    if ordered is not None:
        ordered(copied)
    copied.synchronize()
    return hosts


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
    want: tuple[int, int] = (1, 0),
    build: Build | None = None,
) -> int:
    """Execute the copies this rank takes part in; received layers land in `layers` (with their
    optimizer state) as shard `want` = (t, k) of this rank's stage. Returns the bytes this rank sent and received.

    Each copy is a (t, k) header then the source's state in that sharding; the destination keeps a piece of
    its own sharding or re-shards the pieces of a layer (runtime/train/shard_copy.py). `build(layer, t, k)`
    builds a split layer (None: whole layers only). A copy whose `source_kind` is "snapshot" is sent from
    `snapshot(layer)` (this rank's host copy at the plan's restore step, of a whole layer) instead of the live
    layer. A live copy with src == dst is a piece this rank holds itself (re-sharded with the pieces it
    receives, runtime/elastic/shard_sources.py); other copies with src == dst (a rank's own snapshot, a
    checkpoint read) are the caller's (Worker.adopt)."""
    build = build or (lambda layer, t, k: model.build_layer(layer).to(device))
    cuda = device.type == "cuda"
    moved = 0
    sends, headers, own = [], [], []
    for index, copy in enumerate(copies):
        tag = COPY_TAG_BASE + 2 * index
        if copy.src_rank == rank and copy.dst_rank != rank:
            backend, peer = groups.link(rank, copy.dst_rank)
            flat, head = _source(index, copy, rank, layers, optimizer, device, snapshot)
            sends += [(backend.send([head], peer, tag), head, copy), (backend.send([flat], peer, tag + 1), flat, copy)]
            moved += flat.numel()
        elif copy.dst_rank == rank and copy.src_rank != rank:
            head = torch.empty(2, dtype=torch.int64, device=device)
            backend, peer = groups.link(copy.src_rank, rank)
            headers.append((backend.recv([head], peer, tag), head, backend, peer, tag + 1, copy))
        elif copy.src_rank == copy.dst_rank == rank and copy.source_kind == "live":
            own.append(own_piece(copy, layers, optimizer))  # taken now: received pieces replace layers later
    receives = []
    for work, head, backend, peer, tag, copy in headers:
        wait(work, failed, poll, timeout, f"layer {copy.layer} header from rank {copy.src_rank}", cuda=cuda)
        # Optimizer state is registered only once the bytes arrived (unflatten): a transfer cut
        # short, or a header refused, must not leave zero moments behind for a layer this rank does not hold.
        module = checked_header([int(v) for v in head.tolist()], copy, build)
        flat = torch.empty(state_nbytes(module), dtype=torch.uint8, device=device)
        receives.append((backend.recv([flat], peer, tag), flat, module, copy))
    pieces: dict[int, list[tuple[nn.Module, LayerAdamW]]] = {}
    for layer, piece in own:
        pieces.setdefault(layer, []).append(piece)
    for work, flat, module, copy in receives:
        wait(work, failed, poll, timeout, f"layer {copy.layer} state from rank {copy.src_rank}", cuda=cuda)
        scratch = LayerAdamW(optimizer.config)
        unflatten(flat, copy.layer, module, scratch)
        pieces.setdefault(copy.layer, []).append((module, scratch))
        moved += flat.numel()
    for layer, received in pieces.items():
        optimizer.drop_layer(layer)  # a piece held before in another sharding: its moments go with it
        layers[layer] = assemble(layer, received, want, optimizer, build)
    for work, _, copy in sends:
        wait(work, failed, poll, timeout, f"layer {copy.layer} state to rank {copy.dst_rank}", cuda=cuda)
    return moved


def _source(
    index: int,
    copy: LayerCopy,
    rank: int,
    layers: dict[int, nn.Module],
    optimizer: LayerAdamW,
    device: torch.device,
    snapshot: Callable[[int], torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a copy's source sends: its state of the layer and the (t, k) header saying how it is split."""
    if copy.source_kind == "snapshot":
        if snapshot is None:
            raise ValueError(f"copies[{index}]: layer {copy.layer} from a snapshot, but rank {rank} keeps none")
        return snapshot(copy.layer).to(device), torch.tensor((1, 0), dtype=torch.int64, device=device)
    if copy.layer not in layers:
        raise ValueError(f"copies[{index}]: rank {rank} is the source of layer {copy.layer} but does not hold it")
    module = layers[copy.layer]
    return flatten(copy.layer, module, optimizer), header(module, device)
