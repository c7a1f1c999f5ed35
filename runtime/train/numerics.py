"""Finding NaN/Inf in a step's reduced gradients and loss (what to do about it is elastic/nonfinite.py)."""

from __future__ import annotations

import torch


def find_non_finite(sums: list[torch.Tensor], loss: torch.Tensor | None, views, layer_of) -> str | None:
    """What is not finite after the gradient sums, or None: one pass per flat buffer on the fast path;
    the layer and parameter are looked up only when something is. `views`: (view, parameter) pairs;
    `layer_of(parameter)`: (layer, name)."""
    if all(bool(torch.isfinite(flat).all()) for flat in sums):
        return None
    if loss is not None and not bool(torch.isfinite(loss).all()):
        return f"the loss is {float(loss.sum())}"
    for view, parameter in views:
        if not bool(torch.isfinite(view).all()):
            layer, name = layer_of(parameter)
            return f"the gradient of layer {layer} ({name}) is not finite"
    return "a gradient sum is not finite"
