"""Layered models: the planner's layers as an ordered list of `nn.Module` factories plus a loss.

A rank builds only the layers it holds, so a model is a *factory* of layers, not a built stack.
Layer i's initial weights are a pure function of (seed, i): every rank that builds layer i gets the
same tensors whatever the layout, which is what lets pipelines of different templates agree.

Contract of a `LayeredModel`:
- `build_layer(i)` returns layer i (deterministic, see `seeded_build`); layer i's output is layer
  i+1's only input (one tensor, batch dimension first).
- `example_input(batch)` is a tensor shaped like layer 0's input for `batch` samples.
- `loss(output, targets)` returns the loss of every sample (shape `[batch]`): the engine sums them,
  so splitting a microbatch across GPUs or pipelines does not change the mathematics.
"""

from __future__ import annotations

import importlib
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn


class LayeredModel(ABC):
    """An ordered list of layers (built on demand) and a per-sample loss."""

    name: str = "model"
    stochastic: bool = False
    """True when layers draw random numbers in forward (dropout): the engine then seeds torch's RNG
    from (seed, step, microbatch, layer) before every layer, so masks do not depend on the layout,
    a redone step draws the same masks, and no RNG state needs to move with a layer."""

    @property
    @abstractmethod
    def num_layers(self) -> int: ...

    @abstractmethod
    def build_layer(self, index: int) -> nn.Module:
        """Layer `index` with its initial weights (a pure function of the model's seed and `index`)."""

    @abstractmethod
    def example_input(self, batch: int) -> torch.Tensor:
        """A layer-0 input for `batch` samples (its shape and dtype are what matter)."""

    @abstractmethod
    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-sample loss, shape `[batch]`."""

    def layer_name(self, index: int) -> str:
        return f"layer{index}"

    def tied_parameters(self) -> list[tuple[tuple[int, str], ...]]:
        """Parameters shared between layers (GPT-2's embedding and head), each as its (layer, parameter
        name) copies. Every layer owns its copy, initialised identically; the engine gives all copies
        one gradient, summed over every holder of any of the layers, so they stay identical."""
        return []


# Module constructors draw from torch's global RNG: builds in several threads must not interleave.
_BUILD_LOCK = threading.Lock()


def seeded_build(seed: int, index: int, build: Callable[[], nn.Module]) -> nn.Module:
    """Run `build` with the global RNG seeded from (seed, index), leaving the caller's RNG untouched."""
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        # Distinct, stable seed per (seed, layer); 2**61-1 is prime, so the map is injective for small indices.
        torch.manual_seed((seed * 1_000_003 + index) % (2**61 - 1))
        return build()


# --- the built-in GPT-style decoder ---------------------------------------------------------------


class GPTSizes(BaseModel):
    """Sizes of the built-in decoder. Layers = 1 (embedding) + `blocks` + 1 (norm + head)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    blocks: int = Field(ge=1, description="transformer blocks")
    hidden: int = Field(ge=1, description="model width")
    heads: int = Field(ge=1, description="attention heads; must divide hidden")
    seq_len: int = Field(ge=1, description="tokens per sample")
    vocab: int = Field(ge=2, description="vocabulary size")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="residual dropout in every block")

    @model_validator(mode="after")
    def _heads_divide(self) -> GPTSizes:
        if self.hidden % self.heads:
            raise ValueError(f"heads: must divide hidden: {self.hidden} % {self.heads} = {self.hidden % self.heads}")
        return self


PRESETS: dict[str, GPTSizes] = {
    "tiny-gpt": GPTSizes(blocks=4, hidden=32, heads=2, seq_len=16, vocab=64),
    "small-gpt": GPTSizes(blocks=8, hidden=256, heads=4, seq_len=128, vocab=4096),
    "gpt2-small": GPTSizes(blocks=12, hidden=768, heads=12, seq_len=1024, vocab=50304),
}


class Embedding(nn.Module):
    """Token + learned position embedding."""

    def __init__(self, sizes: GPTSizes) -> None:
        super().__init__()
        self.tokens = nn.Embedding(sizes.vocab, sizes.hidden)
        self.positions = nn.Embedding(sizes.seq_len, sizes.hidden)
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tokens(tokens) + self.positions(positions)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP, optional residual dropout."""

    def __init__(self, sizes: GPTSizes) -> None:
        super().__init__()
        self.heads = sizes.heads
        self.head_dim = sizes.hidden // sizes.heads
        self.dropout = sizes.dropout
        self.norm1 = nn.LayerNorm(sizes.hidden)
        self.qkv = nn.Linear(sizes.hidden, 3 * sizes.hidden)
        self.proj = nn.Linear(sizes.hidden, sizes.hidden)
        self.norm2 = nn.LayerNorm(sizes.hidden)
        self.up = nn.Linear(sizes.hidden, 4 * sizes.hidden)
        self.down = nn.Linear(4 * sizes.hidden, sizes.hidden)
        for linear in (self.qkv, self.proj, self.up, self.down):
            nn.init.normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Head counts come from the shapes: a tensor-parallel rank holds a fraction of the heads.
        batch, seq, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=2)
        shape = (batch, seq, -1, self.head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.dropout(self.proj(attended.transpose(1, 2).reshape(batch, seq, -1)), self.dropout, self.training)
        return x + F.dropout(self.down(F.gelu(self.up(self.norm2(x)))), self.dropout, self.training)


class Head(nn.Module):
    """Final norm + LM head (untied: every layer owns its parameters)."""

    def __init__(self, sizes: GPTSizes) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(sizes.hidden)
        self.out = nn.Linear(sizes.hidden, sizes.vocab, bias=False)
        nn.init.normal_(self.out.weight, std=0.02 / math.sqrt(2 * sizes.blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class GPT(LayeredModel):
    """GPT-style decoder: layer 0 embeds, layers 1..blocks are blocks, the last is norm + head."""

    def __init__(self, sizes: GPTSizes, seed: int = 0, name: str = "gpt") -> None:
        self.sizes = sizes
        self.seed = seed
        self.name = name
        self.stochastic = sizes.dropout > 0

    @property
    def num_layers(self) -> int:
        return self.sizes.blocks + 2

    def build_layer(self, index: int) -> nn.Module:
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} out of range 0..{self.num_layers - 1}")
        if index == 0:
            return seeded_build(self.seed, index, lambda: Embedding(self.sizes))
        if index == self.num_layers - 1:
            return seeded_build(self.seed, index, lambda: Head(self.sizes))
        return seeded_build(self.seed, index, lambda: Block(self.sizes))

    def example_input(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, self.sizes.seq_len, dtype=torch.long)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        per_token = F.cross_entropy(output.flatten(0, 1), targets.flatten(), reduction="none")
        return per_token.view(targets.shape).mean(dim=1)

    def layer_name(self, index: int) -> str:
        if index == 0:
            return "embedding"
        if index == self.num_layers - 1:
            return "head"
        return f"block{index - 1}"


# --- registry and user entry points ---------------------------------------------------------------


def load_model(name: str, seed: int = 0, sizes: dict[str, float] | None = None) -> LayeredModel:
    """A model by registry name ("gpt" with `sizes`, or a preset such as "tiny-gpt") or by a
    `module:function` entry point; the function is called as `function(seed=seed, **sizes)`."""
    overrides = dict(sizes or {})
    if ":" in name:
        return _load_entry_point(name, seed, overrides)
    if name == "gpt":
        try:
            return GPT(GPTSizes(**cast(dict[str, Any], overrides)), seed=seed, name="gpt")
        except Exception as error:
            raise ValueError(f"model.sizes: invalid sizes for 'gpt': {error}") from error
    if name in PRESETS:
        merged = PRESETS[name].model_dump() | overrides
        try:
            return GPT(GPTSizes(**merged), seed=seed, name=name)
        except Exception as error:
            raise ValueError(f"model.sizes: invalid sizes for {name!r}: {error}") from error
    known = ", ".join(["gpt", *PRESETS])
    raise ValueError(f"model.name: unknown model {name!r}; known: {known}, or a 'module:function' entry point")


def _load_entry_point(entry: str, seed: int, kwargs: dict[str, float]) -> LayeredModel:
    module_name, _, attribute = entry.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"model.name: entry point {entry!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"model.name: entry point {entry!r}: cannot import {module_name!r}: {error}") from error
    factory = module
    for part in attribute.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError as error:
            raise ValueError(
                f"model.name: entry point {entry!r}: {module_name!r} has no attribute {attribute!r}"
            ) from error
    if not callable(factory):
        raise ValueError(f"model.name: entry point {entry!r} is not callable")
    model = factory(seed=seed, **kwargs)
    if not isinstance(model, LayeredModel):
        raise ValueError(
            f"model.name: entry point {entry!r} returned {type(model).__name__}, expected an "
            "oobleck.runtime.models.layered.LayeredModel"
        )
    return model


def layer_seed(seed: int, step: int, microbatch: int, layer: int) -> int:
    """The RNG seed of `layer`'s forward on global microbatch `microbatch` of step `step`."""
    from oobleck.runtime.train.data import mix

    return mix(seed, step, microbatch, layer, 0x5EED)


def output_spec(model: LayeredModel, layer: int, batch: int) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of layer `layer`'s output for `batch` samples, found on the meta device (no
    memory, no compute), so a stage knows what to receive before anything arrives."""
    with torch.device("meta"):
        x = model.example_input(batch).to("meta")
        for index in range(layer + 1):
            x = model.build_layer(index)(x)
    return tuple(x.shape), x.dtype
