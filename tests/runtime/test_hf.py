"""Hugging Face models as the planner's layers: equivalence with the unsplit model, presets, checkpoints, bad input."""

from __future__ import annotations

import json

import pytest
import torch

from oobleck.runtime.errors import ModelLoadError
from oobleck.runtime.models.hf import PRESETS, TransformersModel, load_transformers
from oobleck.runtime.models.hf_checkpoint import INDEX, is_complete, write_checkpoint

SEQ = 16
TINY_GPT2 = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 4,
    "n_positions": 16,
    "vocab_size": 50,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}
FAMILIES = {
    "llama": PRESETS["llama-tiny"],
    "gpt2": TINY_GPT2,
    "mistral": {**PRESETS["llama-tiny"], "model_type": "mistral"},
    "qwen2": {**PRESETS["llama-tiny"], "model_type": "qwen2"},
    "llama-tied": {**PRESETS["llama-tiny"], "tie_word_embeddings": True},
}


def unsplit(model: TransformersModel, layers: list[torch.nn.Module], attn: str):
    """`AutoModelForCausalLM` with the split model's weights."""
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_config(model.config, attn_implementation=attn)
    state = {model.hf_name(i, k): v for i, layer in enumerate(layers) for k, v in layer.state_dict().items()}
    missing, unexpected = full.load_state_dict(state, strict=False)
    assert not unexpected and not missing
    return full


@pytest.mark.parametrize(
    ("family", "attn"),
    [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa"), ("gpt2", "eager"), ("mistral", "sdpa"), ("qwen2", "sdpa")]
    + [("llama-tied", "sdpa")],
)
def test_split_model_equals_the_unsplit_transformers_model(family, attn):
    torch.manual_seed(0)
    model = load_transformers(None, FAMILIES[family], attn_implementation=attn, sequence_length=SEQ, seed=3)
    layers = [model.build_layer(i) for i in range(model.num_layers)]
    assert model.num_layers == model.config.num_hidden_layers + 2
    full = unsplit(model, layers, attn)
    tokens = torch.randint(0, model.vocab_size, (3, SEQ))
    targets = torch.randint(0, model.vocab_size, (3, SEQ))

    hidden = tokens
    for layer in layers:
        hidden = layer(hidden)
    loss = model.loss(hidden, targets).sum()
    loss.backward()
    logits = full(input_ids=tokens).logits
    reference = model.loss(logits, targets).sum()
    reference.backward()
    # the unsplit model's own loss (labels shift inside transformers) agrees too
    shifted = full(input_ids=tokens, labels=tokens).loss
    assert torch.allclose(shifted, model.loss(logits[:, :-1], tokens[:, 1:]).mean(), rtol=1e-5)

    torch.testing.assert_close(hidden, logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=0)
    grads = dict(full.named_parameters())
    tied = dict(model.tied_parameters()[0]) if model.tied else {}
    for index, layer in enumerate(layers):
        for local, parameter in layer.named_parameters():
            name = model.hf_name(index, local)
            if model.tied and name == "lm_head.weight":
                continue  # one parameter in the unsplit model: compared as the sum below
            expected = grads[name].grad
            actual = parameter.grad
            if model.tied and tied.get(0) == local and index == 0:
                actual = actual + layers[-1].get_parameter("lm_head.weight").grad
            scale = expected.abs().max().clamp_min(1e-12)
            assert ((actual - expected).abs().max() / scale).item() < 1e-5, f"{name}"
    assert model.tied == (family in ("gpt2", "llama-tied"))


def test_layers_are_functions_of_seed_and_index_and_tied_copies_start_equal():
    model = load_transformers(None, TINY_GPT2, seed=5)
    torch.manual_seed(1)
    a = model.build_layer(1).state_dict()
    torch.randn(7)
    b = load_transformers(None, TINY_GPT2, seed=5).build_layer(1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = load_transformers(None, TINY_GPT2, seed=6).build_layer(1).state_dict()
    assert not torch.equal(a["layer.attn.c_attn.weight"], other["layer.attn.c_attn.weight"])
    head, embedding = model.build_layer(model.num_layers - 1), model.build_layer(0)
    assert torch.equal(head.lm_head.weight, embedding.wte.weight)
    assert model.tied_parameters() == [((0, "wte.weight"), (3, "lm_head.weight"))]
    assert [model.layer_name(i) for i in range(4)] == ["embedding", "block0", "block1", "head"]


@pytest.mark.parametrize(
    ("preset", "layers", "hidden"),
    [("gpt3-350m", 24, 1024), ("gpt3-1.3b", 24, 2048), ("gpt3-2.7b", 32, 2560), ("gpt3-6.7b", 32, 4096)],
)
def test_gpt3_presets_are_the_papers_sizes(preset, layers, hidden):
    model = load_transformers(None, preset=preset)
    assert (model.num_layers, model.config.hidden_size, model.seq_len) == (layers + 2, hidden, 2048)
    with torch.device("meta"):
        block = model.build_layer(1)
    # 12 h^2 + 13 h parameters per GPT block
    assert sum(p.numel() for p in block.parameters()) == 12 * hidden * hidden + 13 * hidden


@pytest.mark.parametrize(
    ("family", "fields", "match"),
    [
        ("bert", {}, "model.transformers.family: unknown architecture 'bert'"),
        (None, {"model_type": "t5"}, r"model.transformers.config.model_type: unknown architecture 't5'"),
        (None, {"n_layer": 2}, "model.transformers.config: has no model_type"),
        (None, {**TINY_GPT2, "n_head": 5}, "model.transformers.config: does not build a gpt2 model"),
        ("llama", {**PRESETS["llama-tiny"], "num_key_value_heads": 3}, "config: does not build a llama model"),
        ("llama", TINY_GPT2, "model_type 'gpt2' contradicts model.transformers.family 'llama'"),
    ],
)
def test_bad_configs_name_the_field(family, fields, match):
    with pytest.raises(ModelLoadError, match=match):
        load_transformers(family, fields)


def test_bad_sources_name_the_field(tmp_path):
    with pytest.raises(ModelLoadError, match="model.transformers.preset: unknown preset 'gpt-9'"):
        load_transformers(None, preset="gpt-9")
    with pytest.raises(ModelLoadError, match="model.transformers.sequenceLength: 64 tokens exceed"):
        load_transformers(None, preset="llama-tiny", sequence_length=64)
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    with pytest.raises(ModelLoadError, match=f"model.transformers.configMap: {broken}: not a readable config.json"):
        load_transformers(None, config_path=str(broken))
    with pytest.raises(ModelLoadError, match="exactly one of"):
        load_transformers(None, TINY_GPT2, preset="llama-tiny")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_checkpoint_loads_in_transformers_and_as_init_from(tmp_path, family):
    from transformers import AutoModelForCausalLM

    model = load_transformers(None, FAMILIES[family], sequence_length=SEQ, seed=1)
    layers = {i: model.build_layer(i) for i in range(model.num_layers)}
    with torch.no_grad():  # weights no seed draws: what a run would have trained
        for layer in layers.values():
            for parameter in layer.parameters():
                parameter.add_(0.01 * torch.randn_like(parameter))
        if model.tied:
            layers[model.num_layers - 1].lm_head.weight.copy_(layers[0].wte.weight)
    out = tmp_path / "hf"
    # two writers, as two workers would: the one holding layer 0 also writes config.json and the index
    write_checkpoint(model, out, {i: m for i, m in layers.items() if i >= 2})
    assert not is_complete(out)
    write_checkpoint(model, out, {i: m for i, m in layers.items() if i < 2})
    assert is_complete(out)
    index = json.loads((out / INDEX).read_text())
    assert ("lm_head.weight" in index["weight_map"]) == (not model.tied)

    loaded = AutoModelForCausalLM.from_pretrained(out)
    tokens = torch.randint(0, model.vocab_size, (2, SEQ))
    hidden = tokens
    for i in range(model.num_layers):
        hidden = layers[i](hidden)
    torch.testing.assert_close(loaded(input_ids=tokens).logits, hidden, rtol=1e-5, atol=1e-6)

    # a new model (another seed) initialised from the directory continues from those weights
    resumed = load_transformers(None, FAMILIES[family], sequence_length=SEQ, seed=99, init_from=str(out))
    for i in range(model.num_layers):
        mine = resumed.build_layer(i).state_dict()
        assert all(torch.equal(mine[k], v) for k, v in layers[i].state_dict().items())


def test_init_from_errors_name_the_tensor_and_path(tmp_path):
    from safetensors.torch import load_file, save_file

    model = load_transformers(None, PRESETS["llama-tiny"])
    out = tmp_path / "ckpt"
    write_checkpoint(model, out, {i: model.build_layer(i) for i in range(model.num_layers)})
    shard = out / "model-00002-of-00006.safetensors"
    tensors = load_file(shard)
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, shard)
    broken = load_transformers(None, PRESETS["llama-tiny"], init_from=str(out))
    broken.build_layer(0)  # other layers still load
    with pytest.raises(
        ModelLoadError, match=f"model.transformers.initFrom: {shard}: tensor 'model.layers.0.mlp.up_proj"
    ):
        broken.build_layer(1)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, shard)
    with pytest.raises(
        ModelLoadError, match=r"'model.layers.0.mlp.up_proj.weight' has shape \[3, 3\], the model needs"
    ):
        load_transformers(None, PRESETS["llama-tiny"], init_from=str(out)).build_layer(1)
    (out / INDEX).unlink()  # without an index the shards' headers are read
    for shard_file in out.glob("model-0000[3-6]*"):
        shard_file.unlink()
    with pytest.raises(ModelLoadError, match="tensor 'model.layers.1.self_attn.q_proj.weight' is missing"):
        load_transformers(None, PRESETS["llama-tiny"], init_from=str(out)).build_layer(2)
    with pytest.raises(ModelLoadError, match=f"model.transformers.initFrom: {tmp_path / 'nope'}: is not a directory"):
        load_transformers(None, PRESETS["llama-tiny"], init_from=str(tmp_path / "nope"))


def test_checkpoint_steps_in_huggingface_format_from_captured_layer_state(tmp_path):
    """`checkpoint.format: huggingface`: the snapshot agent's captured bytes (weights + AdamW state) become
    a loadable directory per checkpoint step."""
    from transformers import AutoModelForCausalLM

    from oobleck.runtime.models.hf_checkpoint import step_directory, write_flat_layers
    from oobleck.runtime.train.config import OptimConfig
    from oobleck.runtime.train.layer_state import flatten
    from oobleck.runtime.train.optim import LayerAdamW

    model = load_transformers(None, TINY_GPT2, seed=4)
    optimizer = LayerAdamW(OptimConfig())
    layers = {i: model.build_layer(i) for i in range(model.num_layers)}
    flats = {}
    for i, module in layers.items():
        optimizer.ensure_layer(i, module)
        flats[i] = flatten(i, module, optimizer)
    write_flat_layers(model, tmp_path, 30, {i: f for i, f in flats.items() if i % 2})
    write_flat_layers(model, tmp_path, 30, {i: f for i, f in flats.items() if not i % 2})
    directory = step_directory(tmp_path, 30)
    assert directory.name == "huggingface-step00000030" and is_complete(directory)
    tokens = torch.randint(0, model.vocab_size, (2, 8))
    hidden = tokens
    for i in range(model.num_layers):
        hidden = layers[i](hidden)
    loaded = AutoModelForCausalLM.from_pretrained(directory)
    torch.testing.assert_close(loaded(input_ids=tokens).logits, hidden, rtol=1e-5, atol=1e-6)
