"""Execute one global step of a plan on this rank: 1F1B, per-layer gradient sums, AdamW.

The mathematics equals single-process training on the global batch (runtime/train/reference.py):
- every pipeline runs its own microbatches (global indices offset..offset+M-1); a stage of g ranks
  splits each microbatch by rows; the loss is the per-sample loss *summed*, so the pieces add up;
- after each microbatch's backward, gradients are added into accumulators of `gradient_sum_dtype`
  (one flat buffer per set of ranks holding the same layers), then summed over those holders by one
  all-reduce per set and divided by the global sample count;
- optionally (`max_grad_norm`) clipped by the global norm over all layers (`Engine._clip`).
Layers run through runtime/train/compute.py: bf16 autocast (`precision`) and recomputation (`recompute`) are
the same operations the reference runs, so they keep the guarantees below.
Tolerance (float64 sums; float32 sums add float32 rounding): with g = 1 stages each microbatch's float32 gradient is bitwise the reference's (same
ops, same inputs, one thread); the only difference is the order of float64 additions (~1e-16
relative), which survives the cast to float32 as at most one ulp. Splitting a microbatch across g > 1
ranks changes float32 reduction shapes inside the matmuls (~1e-7 relative), and AdamW's
normalisation lets that grow on parameters with tiny gradients. The tests hold every step's loss to
1e-5 relative and the final parameters to 1e-5 absolute; measured on tiny-gpt, 20 steps: g = 1
layouts are bitwise identical to the reference, a g = 2 stage gives 4e-8 (loss) and 4e-6 (params).
Stochastic layers (dropout) draw from an RNG seeded per (seed, step, microbatch, layer), so their
masks match the reference exactly on g = 1 stages; a g > 1 stage draws masks for its rows only and
matches the reference in distribution, not bit for bit.

Failure semantics: every wait watches the `failed` event (set by the control side) and raises
`Interrupted`; a dead peer raises `CommError`. Both happen before the optimizer update begins, so
an interrupted step leaves parameters and optimizer state untouched and can be redone. Whether all
ranks apply a step or none is the control side's call: the optimizer's `step` is where it can still
refuse (runtime/elastic/commit.py wraps it with a commit decision); once the update starts it runs to the end.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Container
from dataclasses import dataclass

import torch
from torch import nn

from oobleck.api.plan import Plan
from oobleck.runtime.models.layered import LayeredModel, layer_seed, output_spec
from oobleck.runtime.train.compute import autocast, run_layer, to_device
from oobleck.runtime.train.config import Timeouts, WorkerConfig
from oobleck.runtime.train.data import Dataset, StepBatches
from oobleck.runtime.train.groups import (
    GenerationGroups,
    Interrupted,
    Layout,
    Ticket,
    hand_off,
    layout,
    stage_rows,
    tied_holders,
    wait,
    wait_all,
)
from oobleck.runtime.train.numerics import find_non_finite
from oobleck.runtime.train.optim import LayerAdamW, learning_rate
from oobleck.runtime.train.tp_stage import Channel, Placement, pieces, placements, stage_loss, tp_group

FORWARD_TAG, BACKWARD_TAG = 0, 1
RECEIVE_AHEAD = 1
"""Receives posted beyond the one being waited for (CPU): the next one's data moves while this rank computes."""


@dataclass
class StepOutcome:
    step: int
    generation: int
    loss: float | None
    """mean loss over the global batch; known on ranks holding the last layer, None elsewhere"""
    samples: int
    tokens: int
    seconds: float
    compute_seconds: float = 0.0
    """this rank's own forwards and backwards (no waits for peers): the stage's pace, compared with its profile"""


class _ComputeClock:
    """Seconds spent in this rank's own forwards and backwards during one step.

    On CPU the work is done when the call returns (wall time around it); on CUDA kernels run
    asynchronously, so the spans are CUDA events read once at the end of the step."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self.began = 0.0
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self) -> None:
        if self.cuda:
            self.events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self.events[-1][0].record()
        else:
            self.began = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.events[-1][1].record()
        else:
            self.seconds += time.perf_counter() - self.began

    def total(self) -> float:
        if self.cuda and self.events:
            self.events[-1][1].synchronize()
            return sum(begin.elapsed_time(end) for begin, end in self.events) / 1000.0
        return self.seconds


def one_f_one_b(stages: int, stage: int, microbatches: int) -> list[tuple[str, int]]:
    """The 1F1B order of one stage: warm-up forwards, alternating forward/backward, cool-down backwards."""
    warmup = min(stages - stage - 1, microbatches)
    order = [("F", m) for m in range(warmup)]
    for i in range(microbatches - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", m) for m in range(microbatches - warmup, microbatches)]
    return order


class _GradientBuffers:
    """One flat accumulator per holder set, with a view per (layer, parameter name).

    The set holding the last layer carries one extra slot: the loss sum, reduced with the gradients.
    A parameter with a `Placement` (a tensor-parallel shard, runtime/train/tp_stage.py) gets a view of its
    whole size, into which the shard's gradient is added at its place (never aliased).
    When the accumulator has the parameters' dtype (float32 sums of float32 master weights), each
    parameter's `.grad` *is* its view: autograd adds every microbatch's gradient into the buffer in
    place (as DDP's buckets do), with no copy per microbatch, and the sum is divided in place. The views
    stay the `.grad`s between steps (zeroing the buffer clears them), so a step spends no Python per
    parameter on re-pointing them; a `.grad` something else replaced is folded in once, at the step's end.
    Float64 sums add each microbatch's float32 gradient into the view instead.
    """

    def __init__(
        self,
        lay: Layout,
        layers: dict[int, nn.Module],
        num_layers: int,
        device: torch.device,
        dtype: torch.dtype,
        tied: Container[tuple[int, str]] = frozenset(),
        placed: dict[tuple[int, str], Placement] | None = None,
    ) -> None:
        placed = placed or {}
        self.sets: list[tuple[tuple[int, ...], torch.Tensor]] = []
        self.views: list[tuple[torch.Tensor, nn.Parameter]] = []
        self.placed: list[Placement | None] = []
        self.grad_parts: list[torch.Tensor] = []
        self.loss_slot: torch.Tensor | None = None
        for members, held in sorted(lay.holder_sets.items(), key=lambda item: item[1][0]):
            # tied parameters are summed by _TiedGradients instead
            params = [
                (p, placed.get((layer, n)))
                for layer in held
                for n, p in layers[layer].named_parameters()
                if (layer, n) not in tied
            ]
            shapes = [torch.Size(place.whole) if place else p.shape for p, place in params]
            has_loss = num_layers - 1 in held
            flat = torch.zeros(sum(s.numel() for s in shapes) + int(has_loss), dtype=dtype, device=device)
            offset = 0
            for (p, place), shape in zip(params, shapes):
                self.views.append((flat[offset : offset + shape.numel()].view(shape), p))
                self.placed.append(place)
                offset += shape.numel()
            self.grad_parts.append(flat[:offset])
            if has_loss:
                self.loss_slot = flat[offset:]
            self.sets.append((members, flat))
        self.aliased = not placed and all(p.dtype == dtype for _, p in self.views)

    def release(self) -> None:
        """Unhook the views from the parameters (a buffer outlived by its layers must not stay reachable)."""
        for view, p in self.views:
            if p.grad is view:
                p.grad = None

    def zero(self) -> None:
        """Clear the sums: aliased, every `.grad` is (again) its zeroed view; else every `.grad` is None."""
        for _, flat in self.sets:
            flat.zero_()
        for view, p in self.views:
            if self.aliased:
                if p.grad is not view:
                    p.grad = view
            elif p.grad is not None:
                p.grad = None

    def after_backward(self) -> None:
        """After each microbatch's backward. Aliased, autograd already added into the views: nothing to do."""
        if not self.aliased:
            self._fold()

    def settle(self) -> None:
        """After the step's last backward, before the reduction: aliased, a `.grad` that something replaced
        (none in practice) is folded into its view."""
        if self.aliased:
            self._fold()

    def after_update(self) -> None:
        """After the optimizer's step. Unaliased, the installed gradients are copies: free them."""
        if not self.aliased:
            for _, p in self.views:
                p.grad = None

    def _fold(self) -> None:
        """Add every parameter's `.grad` that is not its view into the view."""
        for (view, p), place in zip(self.views, self.placed):
            grad = p.grad
            if grad is None or grad is view:
                continue
            if place is None:
                view += grad
            else:
                place.add(view, grad)
            p.grad = view if self.aliased else None

    def whole_gradients(self, samples: int) -> dict[nn.Parameter, torch.Tensor]:
        """Every TP shard's whole (reduced, divided) gradient: what its layer's norm counts. Call after `install`."""
        return {p: (view / samples).to(p.dtype) for (view, p), place in zip(self.views, self.placed) if place}

    def install(self, samples: int) -> None:
        """Set every parameter's gradient to its (reduced) sum divided by the global sample count."""
        if self.aliased:
            for part in self.grad_parts:
                part.div_(samples)
            return
        for (view, p), place in zip(self.views, self.placed):
            p.grad = ((view if place is None else place.take(view)) / samples).to(p.dtype)


class _TiedGradients:
    """Gradient sums of tied parameters (LayeredModel.tied_parameters: e.g. GPT-2's embedding and head).

    Each tied layer owns a copy of the parameter. A rank adds the gradients of the copies it holds into
    one accumulator per tie; the accumulators are summed over every rank holding *any* of the tie's
    layers (the union of their holders, one group per tie) and installed into every copy, so all copies
    get the one gradient of the shared parameter and, updated identically, stay identical.
    A copy held as a tensor-parallel shard (its `Placement`) adds its gradient at its place in a whole-size
    accumulator and takes its shard of the sum back, as the holder sets do: the tied copies may live on
    stages of different t (a vocabulary shard adds its rows at their place; zeros add exactly)."""

    def __init__(
        self,
        model: LayeredModel,
        plan: Plan,
        held: dict[int, nn.Module],
        device: torch.device,
        dtype: torch.dtype,
        placed: dict[tuple[int, str], Placement],
    ) -> None:
        self.ties: list[tuple[tuple[int, ...], torch.Tensor, list[tuple[nn.Parameter, Placement | None]]]] = []
        for tie in model.tied_parameters():
            copies = [
                (held[layer].get_parameter(name), placed.get((layer, name))) for layer, name in tie if layer in held
            ]
            if copies:
                members = tied_holders(plan, [layer for layer, _ in tie])
                first, place = copies[0]
                shape = place.whole if place is not None else tuple(first.shape)
                self.ties.append((members, torch.zeros(shape, dtype=dtype, device=device), copies))

    @staticmethod
    def keys(model: LayeredModel) -> set[tuple[int, str]]:
        return {copy for tie in model.tied_parameters() for copy in tie}

    def zero(self) -> None:
        """Clear the sums and the copies' `.grad`s (the last step installed them; autograd would add to them)."""
        for _, total, copies in self.ties:
            total.zero_()
            for p, _ in copies:
                p.grad = None

    def accumulate(self) -> None:
        for _, total, copies in self.ties:
            for p, place in copies:
                if p.grad is not None:
                    if place is None:
                        total += p.grad
                    else:
                        place.add(total, p.grad)
                    p.grad = None

    def after_update(self) -> None:
        """After the optimizer's step: the installed gradients are copies; free them."""
        for _, _, copies in self.ties:
            for p, _ in copies:
                p.grad = None

    def launch(self, groups: GenerationGroups) -> list[tuple[object, tuple[int, ...]]]:
        works = []
        for members, total, _ in self.ties:
            backend = groups.tied(members)
            if backend is not None:
                works.append((backend.allreduce([total]), members))
        return works

    def install(self, samples: int) -> None:
        for _, total, copies in self.ties:
            for p, place in copies:
                p.grad = ((total if place is None else place.take(total)) / samples).to(p.dtype)

    def whole_gradients(self, samples: int) -> dict[nn.Parameter, torch.Tensor]:
        """Every shard copy's whole (reduced, divided) gradient: what clipping counts. Call after `install`."""
        return {p: (total / samples).to(p.dtype) for _, total, copies in self.ties for p, place in copies if place}


class Engine:
    """Runs global steps of one plan generation on one rank."""

    def __init__(
        self,
        config: WorkerConfig,
        model: LayeredModel,
        data: Dataset,
        optimizer: LayerAdamW,
        layers: dict[int, nn.Module],
        plan: Plan,
        rank: int,
        groups: GenerationGroups,
        device: torch.device,
        failed: threading.Event | None = None,
        channel: Channel | None = None,
    ) -> None:
        """`channel`: the collectives of this rank's split layers (needed when its stage has t > 1)."""
        self.config, self.model, self.data, self.optimizer = config, model, data, optimizer
        self.plan, self.rank, self.groups, self.device = plan, rank, groups, device
        self.failed = failed
        self.layout = layout(plan, rank)
        self.timeouts: Timeouts = config.timeouts
        self.mb = config.microbatch_size
        for stage in self.layout.pipeline.stages:
            if len(stage.ranks) // stage.tensor_parallel > self.mb:
                raise ValueError(
                    f"microbatch_size: {self.mb} samples cannot be split over the {len(stage.ranks)} ranks of a stage "
                    f"of pipeline {self.layout.pipeline.index} (tensor_parallel {stage.tensor_parallel})"
                )
        if self.layout.tensor_parallel > 1 and channel is None:
            raise ValueError(f"rank {rank}: a tensor_parallel stage needs the layers' channel")
        missing = [layer for layer in self.layout.layers if layer not in layers]
        if missing:
            raise ValueError(f"rank {rank} lacks layers {missing} that generation {plan.generation} assigns to it")
        self.held = [(layer, layers[layer]) for layer in self.layout.layers]
        self.non_finite: str | None = None
        """what was NaN/Inf in the last step's reduced sums (None: all finite)"""
        self.rows = stage_rows(self.mb, self.layout.stage, self.layout.shard)
        self.samples = plan.global_microbatches * self.mb
        sum_dtype = getattr(torch, config.gradient_sum_dtype)
        tied = _TiedGradients.keys(model)
        placed = placements(self.layout, layers)
        self.buffers = _GradientBuffers(self.layout, layers, plan.num_layers, device, sum_dtype, tied, placed)
        self.loss = stage_loss(model, tp_group(self.layout, channel) if channel is not None else None)
        # The TP ranks of a group compute the same loss: only TP rank 0 adds it to the sum.
        self.counts_loss = self.layout.tp_index == 0
        self.tied = _TiedGradients(model, plan, dict(self.held), device, sum_dtype, placed)
        # What arrives from the previous stage: layer start-1's output, a slice of its rows.
        self.input_spec = None if self.layout.first else output_spec(model, self.layout.stage.start - 1, self.mb)
        self.output_spec = None if self.layout.last else output_spec(model, self.layout.stage.end - 1, self.mb)
        self.tokens_per_sample = int(model.example_input(1).numel())
        self.recompute = config.recompute == "full"
        # Each layer's squared gradient norm is counted by one rank only: the lowest of its holders.
        self.norm_layers = [
            layer for members, held in self.layout.holder_sets.items() if min(members) == rank for layer in held
        ]

    def release(self) -> None:
        """Unhook this engine's gradient buffers from the layers (before another engine replaces it)."""
        self.buffers.release()

    # -- communication helpers -------------------------------------------------------------------

    def _wait(self, work, what: str) -> None:
        wait(work, self.failed, self.timeouts.poll, self.timeouts.step, what, cuda=self.device.type == "cuda")

    def _wait_all(self, works: list[tuple[object, str]]) -> None:
        """`_wait` for each (work, what), with one hand-off to the waiting thread for all of them."""
        wait_all(works, self.failed, self.timeouts.poll, self.timeouts.step, cuda=self.device.type == "cuda")

    def _check(self) -> None:
        if self.failed is not None and self.failed.is_set():
            raise Interrupted("interrupted between operations")

    def _post_receive(
        self, offset: int, spec: tuple[tuple[int, ...], torch.dtype], tag: int, what: str
    ) -> tuple[list[torch.Tensor], list[tuple[object, str]], Ticket | None]:
        """Post the receives of one tensor from the stage `offset` away; `_take` waits for them.
        On CPU they are handed to the waiting thread at once (groups.hand_off)."""
        shape, dtype = spec
        buffers, works = [], []
        for peer, (lo, hi) in pieces(self.layout, self.mb, offset, sending=False):
            backend, peer_index = self.groups.link(peer, self.rank)
            buffer = torch.empty((hi - lo, *shape[1:]), dtype=dtype, device=self.device)
            works.append((backend.recv([buffer], peer_index, tag), f"{what} from rank {peer}"))
            buffers.append(buffer)
        return buffers, works, None if self.device.type == "cuda" else hand_off(works)

    def _post(self, kind: str, m: int):
        """Post the receive that schedule item (kind, m) needs: activations for "F", gradients for "B"."""
        index = self.layout.pipeline.microbatch_offset + m
        if kind == "F":
            assert self.input_spec is not None
            return self._post_receive(-1, self.input_spec, FORWARD_TAG, f"activations of microbatch {index}")
        assert self.output_spec is not None
        return self._post_receive(+1, self.output_spec, BACKWARD_TAG, f"gradients of microbatch {index}")

    def _take(self, posted) -> torch.Tensor:
        buffers, works, ticket = posted
        if ticket is None:
            self._wait_all(works)
        else:
            ticket.wait(self.failed, self.timeouts.poll, self.timeouts.step)
        return buffers[0] if len(buffers) == 1 else torch.cat(buffers)

    def _send(self, tensor: torch.Tensor, offset: int, tag: int, pending: list) -> None:
        base = self.rows[0]
        for peer, (lo, hi) in pieces(self.layout, self.mb, offset, sending=True):
            backend, peer_index = self.groups.link(self.rank, peer)
            piece = tensor[lo - base : hi - base].contiguous()
            pending.append((backend.send([piece], peer_index, tag), piece, peer))

    # -- one step ----------------------------------------------------------------------------------

    def train_step(self, step: int) -> StepOutcome:
        """Forward and backward of this rank's share of global step `step`, then the update.

        The 1F1B schedule is one loop on purpose: it reads in the order it runs, and it is the per-step hot
        path (no extra frames per microbatch). The sums and the update follow in `_finish_step`."""
        # long: the 1F1B schedule reads in the order it runs, as one loop (the docstring says why)
        started = time.perf_counter()
        lay = self.layout
        pipeline = lay.pipeline
        self.buffers.zero()
        self.tied.zero()
        lo, hi = self.rows
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        pending: list = []  # sends in flight: (work, tensor kept alive, peer)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        compute = _ComputeClock(self.device)
        order = one_f_one_b(len(pipeline.stages), lay.stage_index, pipeline.microbatches)
        # This step's receives in the order they are needed; each is posted RECEIVE_AHEAD items before its use.
        needed = [(kind, m) for kind, m in order if (kind == "F" and not lay.first) or (kind == "B" and not lay.last)]
        ahead = 0 if self.device.type == "cuda" else RECEIVE_AHEAD
        posted: deque = deque()
        taken = 0
        batches = StepBatches(
            self.data, step, pipeline.microbatch_offset, pipeline.microbatches if lay.first or lay.last else 0
        )
        try:
            for kind, m in order:
                self._check()
                index = pipeline.microbatch_offset + m
                if (kind == "F" and not lay.first) or (kind == "B" and not lay.last):
                    while taken + len(posted) < min(len(needed), taken + 1 + ahead):
                        posted.append(self._post(*needed[taken + len(posted)]))
                    batches.make_all()  # about to wait for a peer: the rest of the step's batches, on an idle core
                    received = self._take(posted.popleft())
                    taken += 1
                if kind == "F":
                    # Both copies queued before the forward: the host then never waits for the GPU mid-step.
                    batch = batches.take(m, all_now=not needed) if lay.first or lay.last else None
                    targets = to_device(batch[1][lo:hi], self.device) if batch is not None and lay.last else None
                    if lay.first:
                        assert batch is not None
                        x = to_device(batch[0][lo:hi], self.device)
                        source = None
                    else:
                        x = received
                        x.requires_grad_(True)
                        source = x
                    out = x
                    compute.start()
                    with autocast(self.device, self.config.precision):
                        for layer, module in self.held:
                            if self.model.stochastic:
                                torch.manual_seed(layer_seed(self.config.seed, step, index, layer))
                            out = run_layer(module, out, self.recompute)
                        if lay.last:
                            assert targets is not None
                            out = self.loss(out, targets).sum()
                            if self.counts_loss:
                                loss_sum += out.detach().double()
                    compute.stop()
                    if not lay.last:
                        # Autocast may hand back another dtype than the (autocast-free) spec the receiver expects.
                        assert self.output_spec is not None
                        out = out.to(self.output_spec[1])
                        self._send(out.detach(), +1, FORWARD_TAG, pending)
                    saved[m] = (source, out)
                else:
                    source, out = saved.pop(m)
                    compute.start()
                    if lay.last:
                        out.backward()
                    else:
                        out.backward(received)
                    compute.stop()
                    if source is not None:
                        self._send(source.grad, -1, BACKWARD_TAG, pending)
                    self.buffers.after_backward()
                    self.tied.accumulate()
        except BaseException:
            for _, _, ticket in posted:  # receives posted ahead that this step will not take
                if ticket is not None:
                    ticket.cancel()
            raise
        return self._finish_step(step, pending, loss_sum, compute, started)

    def _finish_step(
        self, step: int, pending: list, loss_sum: torch.Tensor, compute: _ComputeClock, started: float
    ) -> StepOutcome:
        """After the schedule: the sends' hand-off, the gradient sums, the non-finite check, clipping and the
        optimizer's step."""
        # One hand-off for every send of the step (most completed long ago).
        self._wait_all([(work, f"send to rank {peer}") for work, _, peer in pending])
        self.buffers.settle()
        if self.buffers.loss_slot is not None:
            self.buffers.loss_slot += loss_sum
        self._reduce()
        self.buffers.install(self.samples)
        self.tied.install(self.samples)
        # Checked here, applied by the optimizer's commit: every rank takes the same branch (runtime/elastic/nonfinite.py).
        self.non_finite = find_non_finite(
            [flat for _, flat in self.buffers.sets], self.buffers.loss_slot, self.buffers.views, self._param_name
        )
        # Read while the GPU is idle after the check's sync: read after the update, it would make the host
        # wait for the update instead of launching the next step behind it.
        loss = None
        if self.buffers.loss_slot is not None:
            loss = float(self.buffers.loss_slot.item()) / self.samples
        if self.config.max_grad_norm is not None:
            self._clip(self.config.max_grad_norm)
        self.optimizer.step(self.held, learning_rate(self.config.optim, step))
        self.buffers.after_update()
        self.tied.after_update()
        return StepOutcome(
            step=step,
            generation=self.plan.generation,
            loss=loss,
            samples=self.samples,
            tokens=self.samples * self.tokens_per_sample,
            seconds=time.perf_counter() - started,
            compute_seconds=compute.total(),
        )

    def _param_name(self, parameter: torch.Tensor) -> tuple[int, str]:
        return next((layer, n) for layer, m in self.held for n, p in m.named_parameters() if p is parameter)

    def _clip(self, max_norm: float) -> float:
        """Scale every gradient by max_norm / (global norm + 1e-6) when that is below 1, as
        torch.nn.utils.clip_grad_norm_ does on one process; returns the global norm.

        The global norm covers every layer once: replicas of a layer hold identical reduced gradients,
        so only the lowest-ranked holder adds the layer's squared norm into a per-layer vector (float64),
        summed over all ranks by one all-reduce; every rank then computes the same norm from it. A TP shard
        counts its whole gradient, which every rank of its holder set has after the sum."""
        squares = torch.zeros(self.plan.num_layers, dtype=torch.float64, device=self.device)
        counted = set(self.norm_layers)
        shared = self.model.tied_parameters()
        wholes = self.buffers.whole_gradients(self.samples) | self.tied.whole_gradients(self.samples)
        for layer, module in self.held:
            if layer not in counted:
                continue
            for name, p in module.named_parameters():
                if p.grad is not None and not any((layer, name) in group[1:] for group in shared):
                    squares[layer] += wholes.get(p, p.grad).double().square().sum()
        backend = self.groups.everyone()
        if backend is not None:
            self._wait(backend.allreduce([squares]), "gradient norms over all ranks")
        norm = float(squares.sum().sqrt())
        scale = max_norm / (norm + 1e-6)
        if scale < 1.0:
            for _, module in self.held:
                for p in module.parameters():
                    if p.grad is not None:
                        p.grad.mul_(scale)
        return norm

    def _reduce(self) -> None:
        """Sum every holder set's buffer over its members (all launched, then all awaited)."""
        works = []
        for members, flat in self.buffers.sets:
            backend = self.groups.holders(members)
            if backend is not None:
                works.append((backend.allreduce([flat]), members))
        works += self.tied.launch(self.groups)
        self._wait_all([(work, f"gradient sum over ranks {list(members)}") for work, members in works])
