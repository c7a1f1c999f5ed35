"""Synthetic GPT profiles (planner_cy/synthetic.py) and profile files (planner_cy/profile_io.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck.api.profile import ClusterShape
from oobleck.planner import templates as T
from oobleck.planner.profile_io import ProfileError, dump_profile, load_profile, parse_profile, save_profile
from oobleck.planner.synthetic import GPT3, PRESETS, STATE_BYTES_PER_PARAM, GPTShape, gpt_profile

H100 = dict(gpu_flops=400e12, hbm_bandwidth=3.35e12)


def params(profile) -> int:
    return sum(layer.state_bytes for layer in profile.layers) // STATE_BYTES_PER_PARAM


@pytest.mark.parametrize(("name", "billions"), [("gpt3-13b", 13.0), ("gpt3-175b", 175.0)])
def test_parameter_counts_match_the_gpt3_paper(name, billions):
    profile = gpt_profile(GPT3[name], seq_len=2048, microbatch_size=1, **H100)
    assert len(profile.layers) == GPT3[name].blocks + 2
    assert [layer.name for layer in profile.layers[:2]] == ["embedding", "block0"] and profile.layers[-1].name == "head"
    assert params(profile) == pytest.approx(billions * 1e9, rel=0.02)  # untied head: a little above the paper


def test_block_figures_follow_the_formulas():
    b, s, h, a = 2, 1024, 2048, 16
    compute_bound = gpt_profile(
        GPTShape(blocks=1, hidden=h, heads=a), seq_len=s, microbatch_size=b, gpu_flops=1e12, hbm_bandwidth=1e18
    )
    block = compute_bound.layers[1]
    flops = 24 * b * s * h * h + 4 * b * s * s * h
    assert block.forward_ms == pytest.approx(flops / 1e12 * 1e3)
    assert block.backward_ms == pytest.approx(2 * block.forward_ms)
    assert block.activation_bytes == s * b * h * 34 + 5 * a * s * s * b
    assert block.output_bytes == 2 * b * s * h
    assert block.state_bytes == 16 * (12 * h * h + 13 * h)
    head = compute_bound.layers[-1]
    assert head.output_bytes == 0 and head.forward_ms == pytest.approx(2 * b * s * h * 50257 / 1e12 * 1e3)
    memory_bound = gpt_profile(
        GPTShape(blocks=1, hidden=h, heads=a), seq_len=s, microbatch_size=b, gpu_flops=1e18, hbm_bandwidth=1e9
    )
    block = memory_bound.layers[1]
    assert block.forward_ms == pytest.approx((2 * (12 * h * h + 13 * h) + block.activation_bytes) / 1e9 * 1e3)
    embedding = memory_bound.layers[0]
    assert embedding.forward_ms > 0 and embedding.activation_bytes == 8 * b * s


def test_llama3_70b_follows_the_llama3_paper():
    """Table 3 of "The Llama 3 Herd of Models": 80 layers, 8,192 wide, FFN 28,672, 64 heads, 8 KV heads: 70.6 B."""
    shape = PRESETS["llama3-70b"]
    profile = gpt_profile(shape, seq_len=shape.seq_len, microbatch_size=1, **H100)
    assert len(profile.layers) == 82 and shape.seq_len == 8192
    assert params(profile) == pytest.approx(70.55e9, rel=1e-3)
    b, s, h, f, h_kv = 1, 8192, 8192, 28672, 1024
    block = profile.layers[1]
    assert block.state_bytes == 16 * (2 * h * h + 2 * h * h_kv + 3 * h * f + 2 * h)
    # no s x s scores (FlashAttention); SwiGLU keeps gate, up, activation and product
    assert block.activation_bytes == 7 * s * b * h + 4 * s * b * h_kv + 3 * s * b * h + 8 * s * b * f + 4 * s * b * h
    assert block.replicated_activation_bytes == 10 * s * b * h


def test_tensor_parallelism_splits_all_but_the_replicated_activations():
    """Korthikanti et al. 2022, section 4.2: a GPT block keeps sbh(10 + 24/t + 5as/(ht)) with TP degree t."""
    b, s, h, a = 1, 2048, 4096, 32
    profile = gpt_profile(GPTShape(blocks=1, hidden=h, heads=a), seq_len=s, microbatch_size=b, **H100)
    block = profile.layers[1]
    for t in (1, 2, 4, 8):
        kept = block.replicated_activation_bytes + (block.activation_bytes - block.replicated_activation_bytes) / t
        assert kept == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(sorted(GPT3)), st.integers(1, 8), st.sampled_from([512, 1024, 2048]))
def test_larger_microbatches_cost_proportionally_more(name, b, s):
    one = gpt_profile(GPT3[name], seq_len=s, microbatch_size=b, gpu_flops=1e14, hbm_bandwidth=1e20)
    two = gpt_profile(GPT3[name], seq_len=s, microbatch_size=2 * b, gpu_flops=1e14, hbm_bandwidth=1e20)
    for x, y in zip(one.layers[1:], two.layers[1:]):  # compute bound: time, activations and outputs double
        assert y.forward_ms == pytest.approx(2 * x.forward_ms) and y.activation_bytes == 2 * x.activation_bytes
        assert y.output_bytes == 2 * x.output_bytes and y.state_bytes == x.state_bytes
    assert gpt_profile(GPT3[name], seq_len=s, microbatch_size=b, **H100) == gpt_profile(
        GPT3[name], seq_len=s, microbatch_size=b, **H100
    )


@pytest.mark.parametrize(
    ("shape", "kwargs", "field"),
    [
        (GPTShape(blocks=0, hidden=1024, heads=16), {}, "blocks"),
        (GPTShape(blocks=2, hidden=1000, heads=16), {}, "hidden: must be a multiple of heads"),
        (GPTShape(blocks=2, hidden=1024, heads=16), {"seq_len": 0}, "seq_len"),
        (GPTShape(blocks=2, hidden=1024, heads=16), {"microbatch_size": 1.5}, "microbatch_size"),
        (GPTShape(blocks=2, hidden=1024, heads=16), {"gpu_flops": 0}, "gpu_flops"),
        (GPTShape(blocks=2, hidden=1024, heads=16), {"hbm_bandwidth": -1.0}, "hbm_bandwidth"),
        (GPTShape(blocks=2, hidden=1024, heads=16, family="bert"), {}, "family: must be 'gpt' or 'llama'"),
        (GPTShape(blocks=2, hidden=1024, heads=16, kv_heads=3), {}, "kv_heads: must divide heads = 16"),
        (GPTShape(blocks=2, hidden=1024, heads=16, ffn=-1), {}, "ffn: must be an integer >= 0"),
    ],
)
def test_bad_arguments_name_the_field(shape, kwargs, field):
    arguments = dict(seq_len=1024, microbatch_size=1, **H100) | kwargs
    with pytest.raises(ValueError, match=field):
        gpt_profile(shape, **arguments)


def test_the_planner_plans_a_synthetic_model():
    profile = gpt_profile(GPT3["gpt3-6.7b"], seq_len=2048, microbatch_size=1, **H100)
    cluster = ClusterShape(
        nodes=13, gpus_per_node=1, gpu_memory_bytes=40 * 2**30, intra_node_bandwidth=450e9, inter_node_bandwidth=50e9
    )
    templates = T.generate_templates(profile, cluster, f=1)
    n0 = templates[0].nodes
    assert n0 > 1  # 107 GB of training state does not fit one 40 GiB GPU
    assert [t.nodes for t in templates] == list(range(n0, max(13 - n0, 2 * n0 - 1) + 1))
    assert all(
        a.iteration_ms >= b.iteration_ms for a, b in zip(templates, templates[1:])
    )  # more nodes, never slower here


# ---------------------------------------------------------------------------------------------
# Profile files.


def test_profile_files_round_trip(tmp_path):
    profile = gpt_profile(GPT3["gpt3-350m"], seq_len=1024, microbatch_size=4, **H100)
    path = tmp_path / "profile.json"
    save_profile(profile, path)
    assert load_profile(path) == profile
    assert path.read_text() == dump_profile(profile) and not (tmp_path / "profile.json.partial").exists()


def test_profile_file_errors_name_the_problem(tmp_path):
    with pytest.raises(ProfileError, match=r"missing\.json: cannot read"):
        load_profile(tmp_path / "missing.json")
    with pytest.raises(ProfileError, match=r"p\.json: not JSON"):
        parse_profile("{", "p.json")
    text = dump_profile(gpt_profile(GPT3["gpt3-350m"], seq_len=1024, microbatch_size=1, **H100))
    with pytest.raises(
        ProfileError,
        match=r"p\.json: layers\.0\.forward_ms: Input should be greater than or equal to 0; .*; layers\.3\.forward_ms",
    ):
        parse_profile(text.replace('"forward_ms": ', '"forward_ms": -', 4), "p.json")
    with pytest.raises(ProfileError, match=r"layers\.0\.flops: Extra inputs are not permitted"):
        parse_profile(text.replace('"name": "embedding"', '"flops": 1, "name": "embedding"'), "p.json")
