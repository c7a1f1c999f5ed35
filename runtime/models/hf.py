"""Hugging Face `transformers` causal LMs as the planner's layers: embeddings / each decoder block / norm + head.

A small adapter per family builds each layer from the family's own `transformers` modules (the
decoder layer, norm and rotary classes), so a split model computes what `AutoModelForCausalLM`
computes (tests/runtime/test_hf.py checks loss, logits and gradients). Nothing comes from a model
hub: the config is a dict of config.json fields (inline, a ConfigMap file, or a preset of
oobleck.api.hfpresets), and weights are drawn from (seed, layer) or read from a safetensors directory
(`init_from`), each layer reading only its own tensors (`safe_open` reads per tensor).

Layer i's local parameter names map to the Hugging Face names by prefix (`hf_name`), which is what
both `init_from` and the checkpoint export (runtime/models/hf_checkpoint.py) use.

Tied embeddings (GPT-2; Llamas with `tie_word_embeddings`): the embedding layer and the head each own
a copy of the shared matrix, initialised identically; `tied_parameters()` tells the engine to give
both copies one gradient, summed over every holder of either layer, so they stay identical.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from oobleck.api.hfpresets import PRESETS
from oobleck.runtime.errors import ModelLoadError
from oobleck.runtime.models.layered import LayeredModel, seeded_build

CONFIG_FIELD = "model.transformers.config"
INIT_FIELD = "model.transformers.initFrom"

# model_type (config.json) -> (adapter, class-name prefix in transformers.models.<type>.modeling_<type>)
FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "Llama"),
    "mistral": ("llama", "Mistral"),
    "qwen2": ("llama", "Qwen2"),
    "gpt2": ("gpt2", "GPT2"),
}


def build_config(family: str | None, fields: dict[str, Any], attn_implementation: str = "sdpa"):
    """A `transformers` config from config.json fields; `family` (the spec's) wins over `model_type`."""
    from transformers import AutoConfig

    model_type = family or fields.get("model_type")
    if model_type is None:
        raise ModelLoadError("has no model_type; set model.transformers.family", field=CONFIG_FIELD)
    if model_type not in FAMILIES:
        raise ModelLoadError(
            f"unknown architecture {model_type!r}; supported: {', '.join(sorted(FAMILIES))}",
            field="model.transformers.family" if family else f"{CONFIG_FIELD}.model_type",
        )
    if fields.get("model_type", model_type) != model_type:
        raise ModelLoadError(
            f"model_type {fields['model_type']!r} contradicts model.transformers.family {model_type!r}",
            field=f"{CONFIG_FIELD}.model_type",
        )
    kwargs = {k: v for k, v in fields.items() if k not in ("model_type", "architectures", "transformers_version")}
    try:
        config = AutoConfig.for_model(model_type, **kwargs)
        config._attn_implementation = attn_implementation
        # Build and run one block on the meta device (no memory, no compute): catches what the config
        # class accepts but the model cannot build or run with (heads not dividing the width, ...).
        with torch.device("meta"):
            _block_module(config, 0)(torch.zeros(1, 2, config.hidden_size))
    except ModelLoadError:
        raise
    except Exception as error:  # transformers raises ValueError, TypeError, AttributeError ... for bad configs
        raise ModelLoadError(f"does not build a {model_type} model: {error}", field=CONFIG_FIELD) from error
    return config


def _classes(model_type: str) -> dict[str, type]:
    prefix = FAMILIES[model_type][1]
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    names = {"block": "DecoderLayer", "norm": "RMSNorm", "rotary": "RotaryEmbedding"}
    if FAMILIES[model_type][0] == "gpt2":
        names = {"block": "Block"}
    return {key: getattr(module, prefix + suffix) for key, suffix in names.items()}


@functools.cache
def _no_cache() -> dict[str, None]:
    """The mask builders' "no KV cache" argument: `cache` since transformers 5.x (which warns on the old
    name), `past_key_values` before."""
    from transformers.masking_utils import create_causal_mask

    name = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
    return {name: None}


# --- layers ---------------------------------------------------------------------------------------


class LlamaEmbedding(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)


class LlamaBlock(nn.Module):
    """One decoder layer with its own rotary table (buffers only) and causal mask: input and output are
    the hidden states alone, as the pipeline needs."""

    def __init__(self, config, index: int) -> None:
        super().__init__()
        classes = _classes(config.model_type)
        self.config, self.index = config, index
        self.layer = classes["block"](config, index)
        self.rotary = classes["rotary"](config=config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # position_ids=None to the mask: positions are always 0..seq-1 (no packed sequences to detect,
        # which would also call .item() and so fail on the meta device that sizes layers).
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        kinds = getattr(self.config, "layer_types", None)
        masking = create_causal_mask
        if kinds and kinds[self.index] == "sliding_attention":
            masking = create_sliding_window_causal_mask
        mask = masking(config=self.config, inputs_embeds=hidden, attention_mask=None, position_ids=None, **_no_cache())
        return self.layer(
            hidden,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=self.rotary(hidden, positions),
        )


class LlamaHead(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.norm = _classes(config.model_type)["norm"](config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


class GPT2Embedding(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.drop = nn.Dropout(config.embd_pdrop)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        return self.drop(self.wte(tokens) + self.wpe(positions))


class GPT2Layer(nn.Module):
    def __init__(self, config, index: int) -> None:
        super().__init__()
        self.config = config
        self.layer = _classes("gpt2")["block"](config, layer_idx=index)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=None, position_ids=None, **_no_cache()
        )
        return self.layer(hidden, None, mask, position_ids=positions)


class GPT2Head(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


def _block_module(config, index: int) -> nn.Module:
    return GPT2Layer(config, index) if FAMILIES[config.model_type][0] == "gpt2" else LlamaBlock(config, index)


# (local prefix, Hugging Face prefix) per layer kind; "{i}" is the block's index.
_NAMES: dict[str, dict[str, list[tuple[str, str]]]] = {
    "llama": {
        "embedding": [("embed_tokens.", "model.embed_tokens.")],
        "block": [("layer.", "model.layers.{i}.")],
        "head": [("norm.", "model.norm."), ("lm_head.", "lm_head.")],
    },
    "gpt2": {
        "embedding": [("wte.", "transformer.wte."), ("wpe.", "transformer.wpe.")],
        "block": [("layer.", "transformer.h.{i}.")],
        "head": [("ln_f.", "transformer.ln_f."), ("lm_head.", "lm_head.")],
    },
}
_EMBEDDING = {"llama": "embed_tokens.weight", "gpt2": "wte.weight"}


@torch.no_grad()
def _init_weights(module: nn.Module, config) -> None:
    """The families' initialisation (transformers' `_init_weights`): normal(0, initializer_range) matrices
    and embeddings, zero biases, unit norms; GPT-2 scales the residual projections by 1/sqrt(2 * layers)."""
    from transformers.pytorch_utils import Conv1D

    std = getattr(config, "initializer_range", 0.02)
    for name, child in module.named_modules():
        if isinstance(child, (nn.Linear, Conv1D, nn.Embedding)):
            nn.init.normal_(child.weight, std=std)
            if getattr(child, "bias", None) is not None:
                nn.init.zeros_(child.bias)
            if isinstance(child, nn.Embedding) and child.padding_idx is not None:
                child.weight[child.padding_idx].zero_()
        elif isinstance(child, nn.LayerNorm) or "RMSNorm" in type(child).__name__:
            nn.init.ones_(child.weight)
            if getattr(child, "bias", None) is not None:
                nn.init.zeros_(child.bias)
        if config.model_type == "gpt2" and name.endswith("c_proj") and isinstance(child, Conv1D):
            nn.init.normal_(child.weight, std=std / math.sqrt(2 * config.num_hidden_layers))


class TransformersModel(LayeredModel):
    """A `transformers` causal LM split into 1 (embeddings) + num_hidden_layers (blocks) + 1 (norm + head)."""

    def __init__(
        self,
        config,
        seed: int = 0,
        sequence_length: int | None = None,
        init_from: str | None = None,
        name: str | None = None,
    ) -> None:
        self.config, self.seed = config, seed
        self.family = FAMILIES[config.model_type][0]
        self.name = name or config.model_type
        self.vocab_size = int(config.vocab_size)
        limit = int(config.max_position_embeddings)
        self.seq_len = sequence_length or limit
        if not 1 <= self.seq_len <= limit:
            raise ModelLoadError(
                f"{self.seq_len} tokens exceed the config's max_position_embeddings ({limit})",
                field="model.transformers.sequenceLength",
            )
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        pdrop = [getattr(config, key, 0.0) or 0.0 for key in ("embd_pdrop", "resid_pdrop", "attn_pdrop")]
        self.stochastic = any(p > 0 for p in pdrop) or (getattr(config, "attention_dropout", 0.0) or 0.0) > 0
        self.weights = SafetensorsDirectory(init_from) if init_from else None

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers + 2

    def kind(self, index: int) -> str:
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} out of range 0..{self.num_layers - 1}")
        return "embedding" if index == 0 else "head" if index == self.num_layers - 1 else "block"

    def _construct(self, index: int) -> nn.Module:
        kind = self.kind(index)
        if kind == "block":
            module = _block_module(self.config, index - 1)
        else:
            module = {"llama": {"embedding": LlamaEmbedding, "head": LlamaHead}, "gpt2": {}}[self.family].get(kind)
            if module is None:
                module = GPT2Embedding if kind == "embedding" else GPT2Head
            module = module(self.config)
        _init_weights(module, self.config)
        return module

    def build_layer(self, index: int) -> nn.Module:
        module = seeded_build(self.seed, index, lambda: self._construct(index))
        meta = next(module.parameters()).is_meta
        if self.tied and self.kind(index) == "head" and not meta:
            # The head's copy of the shared matrix starts as the embedding's (drawn from layer 0's seed).
            embedding = seeded_build(self.seed, 0, lambda: self._construct(0))
            with torch.no_grad():
                module.lm_head.weight.copy_(embedding.get_parameter(_EMBEDDING[self.family]))
        if self.weights is not None and not meta:
            names = {local: self.hf_name(index, local) for local in module.state_dict()}
            if self.tied and "lm_head.weight" in names and names["lm_head.weight"] not in self.weights.files:
                names["lm_head.weight"] = self.hf_tied_source()  # tied checkpoints store the matrix once
            self.weights.load_into(module, names)
        return module

    def example_input(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, self.seq_len, dtype=torch.long)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        per_token = F.cross_entropy(output.float().flatten(0, 1), targets.flatten(), reduction="none")
        return per_token.view(targets.shape).mean(dim=1)

    def layer_name(self, index: int) -> str:
        kind = self.kind(index)
        return f"block{index - 1}" if kind == "block" else kind

    def tied_parameters(self) -> list[tuple[tuple[int, str], ...]]:
        if not self.tied:
            return []
        return [((0, _EMBEDDING[self.family]), (self.num_layers - 1, "lm_head.weight"))]

    def hf_name(self, index: int, local: str) -> str:
        """The Hugging Face checkpoint name of layer `index`'s parameter or buffer `local`."""
        for prefix, target in _NAMES[self.family][self.kind(index)]:
            if local.startswith(prefix):
                return target.format(i=index - 1) + local[len(prefix) :]
        raise KeyError(f"layer {index} ({self.layer_name(index)}): no Hugging Face name for {local!r}")

    def hf_tied_source(self) -> str:
        """The name the head's tied matrix is stored under (checkpoints keep one copy)."""
        return self.hf_name(0, _EMBEDDING[self.family])


class SafetensorsDirectory:
    """A Hugging Face weights directory (model.safetensors, or shards with model.safetensors.index.json).
    Opening it reads the index (or the shards' headers) only; `load_into` reads just the named tensors."""

    def __init__(self, directory: str | Path) -> None:
        from safetensors import safe_open

        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ModelLoadError("is not a directory", field=INIT_FIELD, path=str(self.directory))
        index = self.directory / "model.safetensors.index.json"
        self.files: dict[str, Path] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as error:
                raise ModelLoadError(f"unreadable index: {error}", field=INIT_FIELD, path=str(index)) from error
            self.files = {name: self.directory / file for name, file in weight_map.items()}
        else:
            shards = sorted(self.directory.glob("*.safetensors"))
            if not shards:
                raise ModelLoadError("holds no *.safetensors file", field=INIT_FIELD, path=str(self.directory))
            for shard in shards:
                with safe_open(shard, "pt") as handle:
                    self.files.update(dict.fromkeys(handle.keys(), shard))

    @torch.no_grad()
    def load_into(self, module: nn.Module, names: dict[str, str]) -> None:
        """Copy tensor `names[local]` into each of `module`'s state entries (checking shapes)."""
        from safetensors import safe_open

        state = module.state_dict(keep_vars=True)
        by_file: dict[Path, list[tuple[str, str]]] = {}
        for local, name in names.items():
            file = self.files.get(name)
            if file is None:
                raise ModelLoadError(f"tensor {name!r} is missing", field=INIT_FIELD, path=str(self.directory))
            by_file.setdefault(file, []).append((local, name))
        for file, entries in by_file.items():
            if not file.is_file():
                raise ModelLoadError("shard named by the index does not exist", field=INIT_FIELD, path=str(file))
            with safe_open(file, "pt") as handle:
                present = set(handle.keys())
                for local, name in entries:
                    if name not in present:
                        raise ModelLoadError(f"tensor {name!r} is missing", field=INIT_FIELD, path=str(file))
                    tensor = handle.get_tensor(name)
                    target = state[local]
                    if tuple(tensor.shape) != tuple(target.shape):
                        raise ModelLoadError(
                            f"tensor {name!r} has shape {list(tensor.shape)}, the model needs {list(target.shape)}",
                            field=INIT_FIELD,
                            path=str(file),
                        )
                    target.copy_(tensor.to(target.dtype))


def load_transformers(
    family: str | None,
    fields: dict[str, Any] | None = None,
    *,
    preset: str | None = None,
    config_path: str | None = None,
    seed: int = 0,
    sequence_length: int | None = None,
    attn_implementation: str = "sdpa",
    init_from: str | None = None,
) -> TransformersModel:
    """The model from exactly one of: config.json fields, a preset name, a config.json file."""
    sources = [s for s in (fields is not None, preset is not None, config_path is not None) if s]
    if len(sources) != 1:
        raise ModelLoadError("give exactly one of config, preset and configMap", field="model.transformers")
    if preset is not None:
        if preset not in PRESETS:
            raise ModelLoadError(
                f"unknown preset {preset!r}; known: {', '.join(PRESETS)}", field="model.transformers.preset"
            )
        fields = PRESETS[preset]
    elif config_path is not None:
        try:
            fields = json.loads(Path(config_path).read_text())
        except (OSError, ValueError) as error:
            raise ModelLoadError(
                f"not a readable config.json: {error}", field="model.transformers.configMap", path=config_path
            ) from error
        if not isinstance(fields, dict):
            raise ModelLoadError(
                "config.json must hold an object", field="model.transformers.configMap", path=config_path
            )
    assert fields is not None  # exactly one source was given (checked above)
    config = build_config(family, dict(fields), attn_implementation)
    return TransformersModel(config, seed=seed, sequence_length=sequence_length, init_from=init_from, name=preset)
