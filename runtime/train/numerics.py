"""Finding NaN/Inf in a step's reduced gradients and loss (what to do about it is elastic/nonfinite.py)."""

from __future__ import annotations

import torch


def _all_finite(sums: list[torch.Tensor]) -> bool:
    """Whether every element of `sums` is finite, with one reading pass per buffer and one host sync.

    A float64 sum of float32 values cannot overflow (|sum| <= n * 3.4e38 stays far below 1.8e308), so it
    is finite exactly when every value is: an Inf stays Inf or meets its opposite as NaN, and a NaN stays
    NaN. `torch.isfinite(flat).all()` would write a bool per element and sync once per buffer. A float64
    buffer's sum can overflow on huge finite values, so a non-finite total is only a hint: the caller
    confirms it element by element."""
    if not sums:
        return True
    total = torch.stack([flat.sum(dtype=torch.float64) for flat in sums]).sum()
    return bool(torch.isfinite(total))


def find_non_finite(sums: list[torch.Tensor], loss: torch.Tensor | None, views, layer_of) -> str | None:
    """What is not finite after the gradient sums, or None: one pass per flat buffer on the fast path;
    the layer and parameter are looked up only when something is. `views`: (view, parameter) pairs;
    `layer_of(parameter)`: (layer, name)."""
    if _all_finite(sums) or all(bool(torch.isfinite(flat).all()) for flat in sums):
        return None
    if loss is not None and not bool(torch.isfinite(loss).all()):
        return f"the loss is {float(loss.sum())}"
    for view, parameter in views:
        if not bool(torch.isfinite(view).all()):
            layer, name = layer_of(parameter)
            return f"the gradient of layer {layer} ({name}) is not finite"
    return "a gradient sum is not finite"
