"""Models for fault tests: real models that fail the way a job can, at a chosen point.

- `nonfinite_gpt`: tiny-gpt whose loss turns NaN in the steps listed in NONFINITE_AT_STEPS (comma-separated
  global steps), for `training.onNonFinite`. Microbatch 0 of such a step runs its last layer's output
  times inf. The step is recognised from the RNG seed the engine sets before every layer of a
  stochastic model (runtime/models/layered.py layer_seed of seed, step, microbatch, layer), so the trigger
  follows the global step through any layout, replay or restart, and nothing else changes: the model
  draws no random numbers, so its losses equal tiny-gpt's.
- `huge_gpt`: a GPT whose layers hold HUGE_GPT_HIDDEN-wide weights (default 8192: ~1.6 GB of state per
  block with AdamW), far larger than a small pod's memory limit: its worker is OOM-killed.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from oobleck.runtime.models.layered import GPT, PRESETS, GPTSizes, layer_seed

MICROBATCHES_WATCHED = 64
"""the microbatch indices whose seeds are recognised (a global batch of more microbatches only fires on 0)"""


class _NonFiniteGPT(GPT):
    def __init__(self, sizes: GPTSizes, seed: int, steps: list[int]) -> None:
        super().__init__(sizes, seed=seed, name="nonfinite-gpt")
        self.stochastic = True  # the engine seeds torch's RNG per (step, microbatch, layer): the trigger
        last = self.num_layers - 1
        self._triggers = {layer_seed(seed, step, 0, last) for step in steps}

    def build_layer(self, index: int) -> nn.Module:
        layer = super().build_layer(index)
        if index == self.num_layers - 1 and self._triggers:
            layer.register_forward_hook(self._poison)
        return layer

    def _poison(self, _module: nn.Module, _inputs, output: torch.Tensor) -> torch.Tensor | None:
        if torch.initial_seed() in self._triggers:
            return output * float("inf")
        return None


def nonfinite_gpt(seed: int = 0) -> GPT:
    steps = [int(s) for s in os.environ.get("NONFINITE_AT_STEPS", "").split(",") if s.strip()]
    return _NonFiniteGPT(PRESETS["tiny-gpt"], seed, steps)


def huge_gpt(seed: int = 0) -> GPT:
    hidden = int(os.environ.get("HUGE_GPT_HIDDEN", "8192"))
    return GPT(GPTSizes(blocks=2, hidden=hidden, heads=8, seq_len=16, vocab=64), seed=seed, name="huge-gpt")
