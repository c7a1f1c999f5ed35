"""A trained TransformersModel written as a Hugging Face directory that `AutoModelForCausalLM.from_pretrained` loads.

Layout: `config.json`, one shard per planner layer (`model-00001-of-000NN.safetensors`, layer i in shard
i + 1) and `model.safetensors.index.json` (weight_map, total_size). One shard per layer lets every
worker write the layers it is the lowest-ranked holder of, with no gathering: the index and config
depend on the model alone (sizes from a meta-device build), so whoever holds layer 0 writes them.
Every file is written to a temporary name and renamed, so a reader never sees half a file; the
directory is complete when every shard named by the index exists (`is_complete`).

A tied head (GPT-2) stores no `lm_head.weight`: `transformers` ties it to the embedding on load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from oobleck.runtime.models.hf import TransformersModel

INDEX = "model.safetensors.index.json"


def shard_name(model: TransformersModel, layer: int) -> str:
    return f"model-{layer + 1:05d}-of-{model.num_layers:05d}.safetensors"


def _names(model: TransformersModel, layer: int, module: nn.Module) -> dict[str, str]:
    """local state name -> checkpoint name of layer `layer` (a tied head's matrix left out)."""
    names = {local: model.hf_name(layer, local) for local in module.state_dict()}
    return {local: name for local, name in names.items() if not (model.tied and name == "lm_head.weight")}


def layer_tensors(model: TransformersModel, layer: int, module: nn.Module) -> dict[str, torch.Tensor]:
    """Layer `layer`'s checkpoint tensors by Hugging Face name (CPU, contiguous)."""
    state = module.state_dict()
    return {name: state[local].detach().to("cpu").contiguous() for local, name in _names(model, layer, module).items()}


def _atomic(path: Path, write) -> None:
    temporary = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(temporary)
    os.replace(temporary, path)


def write_layer(model: TransformersModel, directory: str | Path, layer: int, module: nn.Module) -> Path:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / shard_name(model, layer)
    tensors = layer_tensors(model, layer, module)
    _atomic(path, lambda target: save_file(tensors, str(target), metadata={"format": "pt"}))
    return path


def write_metadata(model: TransformersModel, directory: str | Path) -> None:
    """config.json and the index: functions of the model alone."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for layer in range(model.num_layers):
        with torch.device("meta"):
            module = model.build_layer(layer)
        state = module.state_dict()
        for local, name in _names(model, layer, module).items():
            weight_map[name] = shard_name(model, layer)
            total += state[local].numel() * state[local].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _atomic(directory / INDEX, lambda target: target.write_text(json.dumps(index, indent=2) + "\n"))
    config = model.config.to_dict()
    config["architectures"] = [_architecture(model)]
    config["dtype"] = "float32"
    _atomic(directory / "config.json", lambda target: target.write_text(json.dumps(config, indent=2) + "\n"))


def _architecture(model: TransformersModel) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model.config.model_type]


def write_checkpoint(model: TransformersModel, directory: str | Path, layers: dict[int, nn.Module]) -> None:
    """Write `layers`' shards (and, with layer 0 among them, config.json and the index)."""
    for layer, module in sorted(layers.items()):
        write_layer(model, directory, layer, module)
    if 0 in layers:
        write_metadata(model, directory)


def is_complete(directory: str | Path) -> bool:
    """True when the index exists and every shard it names does."""
    directory = Path(directory)
    index = directory / INDEX
    if not index.is_file() or not (directory / "config.json").is_file():
        return False
    shards = set(json.loads(index.read_text())["weight_map"].values())
    return all((directory / shard).is_file() for shard in shards)


def state_from_flat(module: nn.Module, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """A layer's state_dict from its full-state bytes (runtime/train/layer_state.py `flatten`: per parameter the
    weights, two AdamW moments and the float32 step; then every buffer). `module` may be on the meta
    device: only its names, shapes and dtypes are read."""
    persistent = module.state_dict().keys()
    state, offset = {}, 0

    def take(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        nonlocal offset
        size = shape.numel() * dtype.itemsize
        tensor = flat[offset : offset + size].clone().view(dtype).view(shape)
        offset += size
        return tensor

    step = torch.zeros((), dtype=torch.float32)
    for name, parameter in module.named_parameters():
        state[name] = take(parameter.shape, parameter.dtype)
        offset += 2 * parameter.numel() * parameter.element_size() + step.element_size()  # moments, step
    for name, buffer in module.named_buffers():
        tensor = take(buffer.shape, buffer.dtype)
        if name in persistent:
            state[name] = tensor
    if offset != flat.numel():
        raise ValueError(f"layer state of {flat.numel()} bytes does not match the module's {offset}")
    return state


def step_directory(root: str | Path, step: int) -> Path:
    """Where `checkpoint.format: huggingface` writes the checkpoint of `step`."""
    return Path(root) / f"huggingface-step{step:08d}"


def write_flat_layers(model: TransformersModel, root: str | Path, step: int, flats: dict[int, torch.Tensor]) -> None:
    """Write checkpoint shards of `step` from captured full-state bytes (the snapshot agent's capture)."""
    from safetensors.torch import save_file

    directory = step_directory(root, step)
    directory.mkdir(parents=True, exist_ok=True)
    for layer, flat in sorted(flats.items()):
        with torch.device("meta"):
            module = model.build_layer(layer)
        state = state_from_flat(module, flat.cpu())
        tensors = {name: state[local].contiguous() for local, name in _names(model, layer, module).items()}
        path = directory / shard_name(model, layer)
        _atomic(path, lambda target, t=tensors: save_file(t, str(target), metadata={"format": "pt"}))
    if 0 in flats:
        write_metadata(model, directory)
