"""Models and data: determinism, shapes, registry and entry-point errors."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest
import torch

from oobleck.runtime.models.layered import GPT, PRESETS, LayeredModel, load_model, output_spec
from oobleck.runtime.train.data import MAX_SYNTHETIC_VOCAB, StepBatches, SyntheticTokens, TokenFile, mix


def test_layer_weights_are_a_function_of_seed_and_index_only():
    model = load_model("tiny-gpt", seed=5)
    torch.manual_seed(123)  # the caller's RNG state must not matter ...
    a = model.build_layer(3).state_dict()
    torch.randn(10)
    b = load_model("tiny-gpt", seed=5).build_layer(3).state_dict()  # ... nor the build order
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = load_model("tiny-gpt", seed=6).build_layer(3).state_dict()
    assert not torch.equal(a["qkv.weight"], other["qkv.weight"])
    neighbour = model.build_layer(2).state_dict()
    assert not torch.equal(a["qkv.weight"], neighbour["qkv.weight"])
    # building layers must leave the caller's RNG where it was
    torch.manual_seed(9)
    expected = torch.rand(3)
    torch.manual_seed(9)
    model.build_layer(1)
    assert torch.equal(torch.rand(3), expected)


def test_gpt_layers_compose_to_logits_and_per_sample_loss():
    model = load_model("gpt", sizes={"blocks": 2, "hidden": 16, "heads": 4, "seq_len": 8, "vocab": 11})
    assert model.num_layers == 4
    assert [model.layer_name(i) for i in range(4)] == ["embedding", "block0", "block1", "head"]
    x = torch.randint(0, 11, (3, 8))
    for i in range(model.num_layers):
        x = model.build_layer(i)(x)
    assert x.shape == (3, 8, 11)
    loss = model.loss(x, torch.randint(0, 11, (3, 8)))
    assert loss.shape == (3,)
    assert output_spec(model, 0, 5) == ((5, 8, 16), torch.float32)
    assert output_spec(model, 3, 2) == ((2, 8, 11), torch.float32)


def test_causal_attention_ignores_future_tokens():
    model = load_model("tiny-gpt")
    layers = [model.build_layer(i) for i in range(model.num_layers)]
    x = torch.randint(0, 64, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 64

    def run(tokens):
        for layer in layers:
            tokens = layer(tokens)
        return tokens

    assert torch.allclose(run(x)[0, :10], run(y)[0, :10])
    assert not torch.allclose(run(x)[0, 10:], run(y)[0, 10:])


def test_registry_errors_name_the_field():
    with pytest.raises(ValueError, match="model.name: unknown model 'nope'"):
        load_model("nope")
    with pytest.raises(ValueError, match="heads: must divide hidden"):
        load_model("tiny-gpt", sizes={"hidden": 30, "heads": 4})
    with pytest.raises(ValueError, match="model.sizes"):
        load_model("gpt", sizes={"blocks": 2})


def test_entry_point_models(tmp_path, monkeypatch):
    (tmp_path / "usermodels.py").write_text(
        textwrap.dedent("""
        import torch
        from torch import nn
        from oobleck.runtime.models.layered import LayeredModel, seeded_build

        class MLP(LayeredModel):
            name = "mlp"

            def __init__(self, seed, width):
                self.seed, self.width = seed, width

            @property
            def num_layers(self):
                return 2

            def build_layer(self, index):
                shape = (4, self.width) if index == 0 else (self.width, 2)
                return seeded_build(self.seed, index, lambda: nn.Linear(*shape))

            def example_input(self, batch):
                return torch.zeros(batch, 4)

            def loss(self, out, target):
                return ((out - target) ** 2).mean(dim=1)

        def mlp(seed=0, width=8):
            return MLP(seed, width)

        def wrong(seed=0):
            return nn.Linear(2, 2)

        NOT_CALLABLE = 3
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model = load_model("usermodels:mlp", seed=1, sizes={"width": 5})
    assert isinstance(model, LayeredModel) and model.num_layers == 2
    assert model.build_layer(0).weight.shape == (5, 4)
    assert torch.equal(
        model.build_layer(1).weight, load_model("usermodels:mlp", seed=1, sizes={"width": 5}).build_layer(1).weight
    )
    with pytest.raises(ValueError, match="'missing_module_xyz:f': cannot import"):
        load_model("missing_module_xyz:f")
    with pytest.raises(ValueError, match="'usermodels:absent': 'usermodels' has no attribute 'absent'"):
        load_model("usermodels:absent")
    with pytest.raises(ValueError, match="'usermodels:wrong' returned Linear"):
        load_model("usermodels:wrong")
    with pytest.raises(ValueError, match="not callable"):
        load_model("usermodels:NOT_CALLABLE")
    sys.modules.pop("usermodels", None)


def test_synthetic_microbatches_are_pure_functions_of_seed_step_index():
    data = SyntheticTokens(vocab=64, seq_len=16, microbatch_size=4, seed=1)
    inputs, targets = data.microbatch(3, 5)
    assert inputs.shape == targets.shape == (4, 16) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the inputs shifted by one
    again = SyntheticTokens(vocab=64, seq_len=16, microbatch_size=4, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(again.microbatch(3, 5), (inputs, targets)))
    assert not torch.equal(data.microbatch(3, 6)[0], inputs)
    assert not torch.equal(data.microbatch(4, 5)[0], inputs)
    assert not torch.equal(SyntheticTokens(64, 16, 4, seed=2).microbatch(3, 5)[0], inputs)
    assert int(inputs.max()) < 64 and int(inputs.min()) >= 0


def _synthetic_by_recurrence(data: SyntheticTokens, step: int, index: int) -> torch.Tensor:
    """The language's definition, one position at a time (with the generator's draws in its order)."""
    rng = np.random.default_rng(mix(data.seed, step, index))
    tokens = np.empty((data.microbatch_size, data.seq_len + 1), dtype=np.int64)
    tokens[:, 0] = rng.integers(0, data.vocab, data.microbatch_size)
    noise = rng.random((data.microbatch_size, data.seq_len)) < data.noise
    random_tokens = rng.integers(0, data.vocab, (data.microbatch_size, data.seq_len))
    for t in range(data.seq_len):
        following = (data._a * tokens[:, t] + data._c) % data.vocab
        tokens[:, t + 1] = np.where(noise[:, t], random_tokens[:, t], following)
    return torch.from_numpy(tokens)


@pytest.mark.parametrize(
    ("vocab", "seq_len", "noise"),
    [(64, 16, 0.1), (50304, 1024, 0.1), (128256, 300, 0.0), (7, 50, 1.0), (MAX_SYNTHETIC_VOCAB, 40, 0.1)],
)
def test_synthetic_tokens_equal_their_recurrence_exactly(vocab, seq_len, noise):
    """Bit for bit, up to the largest vocabulary whose products fit int64."""
    data = SyntheticTokens(vocab, seq_len, microbatch_size=3, seed=5, noise=noise)
    for step, index in [(0, 0), (7, 2), (123, 9)]:
        whole = _synthetic_by_recurrence(data, step, index)
        inputs, targets = data.microbatch(step, index)
        assert torch.equal(inputs, whole[:, :-1]) and torch.equal(targets, whole[:, 1:])


def test_mix_is_stable_across_processes():
    # Fixed values: a change of the hash would silently change every job's data order.
    assert mix(1, 2) != mix(2, 1)
    assert mix(7, 3, 5) == 0x45FC8DDDBAD0B0CC
    assert mix(0) == 0x6E789E6AA1B965F4
    assert SyntheticTokens(64, 16, 4, seed=1).microbatch(0, 0)[0][0, :6].tolist() == [4, 6, 16, 2, 60, 30]


def test_token_files(tmp_path):
    ids = np.arange(1000, dtype=np.int64) % 50
    np.save(tmp_path / "tokens.npy", ids)
    data = TokenFile(tmp_path / "tokens.npy", seq_len=8, microbatch_size=3, seed=4, vocab=50)
    inputs, targets = data.microbatch(0, 1)
    assert inputs.shape == (3, 8)
    assert torch.equal((inputs + 1) % 50, targets)  # consecutive ids in the file
    assert torch.equal(TokenFile(tmp_path / "tokens.npy", 8, 3, seed=4).microbatch(0, 1)[0], inputs)
    (tmp_path / "text.txt").write_bytes(b"hello world, " * 20)
    text = TokenFile(tmp_path / "text.txt", seq_len=5, microbatch_size=2)
    assert int(text.microbatch(1, 0)[0].max()) < 256
    ids.astype(np.uint16).tofile(tmp_path / "tokens.bin")
    assert torch.equal(TokenFile(tmp_path / "tokens.bin", 8, 3, seed=4).microbatch(0, 1)[0], inputs)
    with pytest.raises(ValueError, match="outside the model's vocabulary of 10"):
        TokenFile(tmp_path / "tokens.npy", 8, 3, vocab=10)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        TokenFile(tmp_path / "text.txt", seq_len=1000, microbatch_size=1)
    with pytest.raises(ValueError, match="is not a file"):
        TokenFile(tmp_path / "absent.npy", 8, 1)


def test_presets_are_valid():
    for name, sizes in PRESETS.items():
        model = load_model(name)
        assert isinstance(model, GPT) and model.num_layers == sizes.blocks + 2


@pytest.mark.parametrize("vocab", [1, MAX_SYNTHETIC_VOCAB + 1])
def test_synthetic_tokens_refuse_a_vocabulary_they_cannot_compute_exactly(vocab):
    with pytest.raises(ValueError, match=rf"data.vocab: must be within \[2, {MAX_SYNTHETIC_VOCAB}\], got {vocab}"):
        SyntheticTokens(vocab, 16, 4)


def test_step_batches_are_the_datasets_made_when_asked_and_given_once():
    data = SyntheticTokens(vocab=1000, seq_len=8, microbatch_size=2, seed=3)
    waits = StepBatches(data, step=5, offset=4, count=4)  # a stage that waits for peers during the step
    first = waits.take(0, all_now=False)
    assert waits.next == 1  # only what the first forward needs before the wait
    waits.make_all()  # at the first wait: the rest at once
    assert waits.next == 4 and sorted(waits.made) == [1, 2, 3]
    for m, (inputs, targets) in enumerate([first] + [waits.take(m, all_now=False) for m in (1, 2, 3)]):
        expected = data.microbatch(5, 4 + m)
        assert torch.equal(inputs, expected[0]) and torch.equal(targets, expected[1])
    assert waits.made == {}  # each given once: nothing kept after its forward
    never_waits = StepBatches(data, step=5, offset=0, count=3)
    never_waits.take(0, all_now=True)
    assert never_waits.next == 3 and sorted(never_waits.made) == [1, 2]
    with pytest.raises(KeyError):
        never_waits.take(0, all_now=True)  # taken already
    middle = StepBatches(data, step=5, offset=0, count=0)
    middle.make_all()
    assert middle.made == {}
