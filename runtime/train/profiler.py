"""Measure every layer on the actual device and write the planner's `ModelProfile` JSON.

Per layer, for one microbatch: forward and backward milliseconds (median of `iterations` runs after
`warmup` runs, synchronised on CUDA), state bytes (parameters + gradients + two AdamW moments),
activation bytes (what autograd keeps until the backward: measured on CUDA as the memory still
allocated after the forward, estimated on CPU as the saved tensors of the autograd graph) and output
bytes (the tensor sent to the next layer).

The layer runs as training will run it (runtime/train/compute.py): under the job's precision (bf16 autocast
saves smaller activations and runs other kernels) and, with `recompute="full"`, checkpointed, so
activation bytes shrink to the kept input (on CPU: the input's bytes, which is all the checkpoint
keeps; on CUDA: measured as always) and backward milliseconds include the forward rerun. The planner's
cost model needs no recompute term of its own: the profile carries it.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from oobleck.api.profile import LayerProfile, ModelProfile
from oobleck.runtime.models.layered import LayeredModel
from oobleck.runtime.train.compute import autocast, run_layer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _saved_bytes(output: torch.Tensor) -> int:
    """Bytes of tensors autograd saved for the backward of `output`'s graph (distinct storages)."""
    seen: set[int] = set()
    total = 0
    stack = [output.grad_fn] if output.grad_fn is not None else []
    visited: set[int] = set()
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in visited:
            continue
        visited.add(id(fn))
        for attribute in dir(fn):
            if not attribute.startswith("_saved_"):
                continue
            try:
                value = getattr(fn, attribute)
            except RuntimeError:
                continue
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(tensor, torch.Tensor) and not isinstance(tensor, nn.Parameter):
                    key = tensor.untyped_storage().data_ptr()
                    if key not in seen:
                        seen.add(key)
                        total += tensor.untyped_storage().nbytes()
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return total


def profile_layer(
    module: nn.Module,
    x: torch.Tensor,
    device: torch.device,
    warmup: int,
    iterations: int,
    name: str,
    precision: str = "fp32",
    recompute: bool = False,
) -> tuple[LayerProfile, torch.Tensor]:
    """Profile one layer on input `x`; returns its profile and its output (the next layer's input)."""
    needs_grad = x.is_floating_point()
    forward, backward = [], []
    activation = 0
    for run in range(warmup + iterations):
        inp = x.detach().requires_grad_(needs_grad)
        _sync(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        start = time.perf_counter()
        with autocast(device, precision):
            out = run_layer(module, inp, recompute)
        _sync(device)
        middle = time.perf_counter()
        if device.type == "cuda":
            activation = torch.cuda.memory_allocated(device) - before
        elif recompute:
            # The checkpoint keeps its input (its saved tensors are placeholders until the rerun).
            activation = inp.untyped_storage().nbytes()
        else:
            activation = _saved_bytes(out)
        out.backward(torch.ones_like(out))
        _sync(device)
        end = time.perf_counter()
        module.zero_grad(set_to_none=True)
        if run >= warmup:
            forward.append((middle - start) * 1e3)
            backward.append((end - middle) * 1e3)
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    output = out.detach()
    return (
        LayerProfile(
            name=name,
            forward_ms=statistics.median(forward),
            backward_ms=statistics.median(backward),
            state_bytes=4 * params,  # weights + gradients + exp_avg + exp_avg_sq
            activation_bytes=int(activation),
            output_bytes=output.numel() * output.element_size(),
        ),
        output,
    )


def profile_model(
    model: LayeredModel,
    microbatch_size: int,
    device: torch.device,
    warmup: int = 2,
    iterations: int = 5,
    precision: str = "fp32",
    recompute: str = "none",
) -> ModelProfile:
    """Profile every layer of `model` in order, feeding each the previous one's real output, run with
    `precision` and `recompute` as training runs it."""
    if recompute not in ("none", "full"):
        raise ValueError(f"recompute: expected 'none' or 'full', got {recompute!r}")
    if iterations < 1:
        raise ValueError(f"iterations: must be >= 1, got {iterations}")
    x = model.example_input(microbatch_size).to(device)
    layers = []
    for index in range(model.num_layers):
        module = model.build_layer(index).to(device)
        layer, x = profile_layer(
            module, x, device, warmup, iterations, model.layer_name(index), precision, recompute == "full"
        )
        layers.append(layer)
        del module
    described = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()} threads"
    )
    return ModelProfile(model=model.name, microbatch_size=microbatch_size, device=described, layers=layers)
