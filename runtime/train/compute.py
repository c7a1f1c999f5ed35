"""How one layer runs forward: precision (autocast) and activation recomputation.

One place shared by the engine, the single-process reference and the profiler, so that all three
execute exactly the same operations and the profile describes what training runs.

- `precision="bf16"`: the forward runs under `torch.autocast(dtype=torch.bfloat16)`; parameters stay
  float32 (master weights), autograd produces float32 gradients for them, and AdamW's moments stay
  float32. The backward replays the recorded (autocast) ops, so it runs outside the context.
- `recompute=True`: `torch.utils.checkpoint` (non-reentrant) keeps only the layer's input and reruns the
  layer during the backward. It restores the RNG state it saw in the forward, so dropout masks drawn in
  the recomputation equal the forward's (the engine seeds the RNG per layer before calling it), and it
  replays under the autocast state of the forward.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

Precision = Literal["fp32", "bf16"]
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The forward context of `precision` on `device` (a no-op for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision not in DTYPES:
        raise ValueError(f"precision: expected one of {sorted(DTYPES)}, got {precision!r}")
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host `tensor` on `device` without holding up the host. To a GPU it goes through page-locked memory,
    asynchronously: a copy from pageable memory makes torch synchronize the stream, so the host would wait
    for every kernel queued before it and the GPU would then idle while the next ones were launched."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def run_layer(module: nn.Module, x: torch.Tensor, recompute: bool) -> torch.Tensor:
    """`module(x)`, keeping only `x` for the backward when `recompute` (and gradients are being recorded)."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(module, x, use_reentrant=False, preserve_rng_state=True)
    return module(x)
