"""`oobleck profile` on transformers models (measured, and the preset's estimate that `oobleck plan` plans)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from oobleck.api.profile import ModelProfile
from oobleck.api.spec import parse_spec
from oobleck.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_profile_measures_a_transformers_preset(tmp_path):
    out = tmp_path / "profile.json"
    args = ["profile", "--model", "llama-tiny", "--microbatch-size", "2", "--warmup", "1", "--iterations", "1"]
    assert main([*args, "--out", str(out)]) == 0
    profile = ModelProfile.model_validate_json(out.read_text())
    assert [layer.name for layer in profile.layers] == ["embedding", "block0", "block1", "block2", "block3", "head"]
    assert all(layer.forward_ms > 0 and layer.state_bytes > 0 for layer in profile.layers)
    # the block's output is the hidden state: 2 samples x 32 tokens x 64 floats
    assert profile.layers[1].output_bytes == 2 * 32 * 64 * 4


def test_the_gpt3_example_plans_from_its_presets_estimate(tmp_path, capsys):
    spec = parse_spec(yaml.safe_load((EXAMPLES / "gpt3-2.7b-gpus.yaml").read_text())["spec"])
    preset, microbatch = spec.model.transformers.preset, spec.training.microbatch_size
    out = tmp_path / "profile.json"
    assert (
        main(["profile", "--estimate", "--model", preset, "--microbatch-size", str(microbatch), "--out", str(out)]) == 0
    )
    assert len(json.loads(out.read_text())["layers"]) == 34
    plan_args = ["--nodes", str(spec.nodes.max), "--gpus-per-node", str(spec.gpus_per_node), "--gpu-memory", "80GiB"]
    plan_args += ["--microbatches", str(spec.training.global_microbatches), "--f", str(spec.f)]
    capsys.readouterr()
    assert main(["plan", str(out), *plan_args]) == 0
    text = capsys.readouterr().out
    assert "model gpt3-2.7b: 34 layers; 16 nodes x 8 GPUs; f = 1; 128 microbatches" in text
    assert "pipelines (" in text
    assert main(["profile", "--estimate", "--model", "tiny-gpt"]) == 2


def test_large_presets_estimate_and_plan_with_tensor_parallelism(tmp_path, capsys):
    """llama3-70b (Llama 3 paper, table 3) and gpt3-175b: estimated, then planned on 8 x H100-80GB nodes with TP."""
    out = tmp_path / "llama.json"
    assert main(["profile", "--estimate", "--model", "llama3-70b", "--gpu-flops", "400e12", "--out", str(out)]) == 0
    profile = ModelProfile.model_validate_json(out.read_text())
    assert len(profile.layers) == 82 and profile.model == "llama3-70b"
    params = sum(layer.state_bytes for layer in profile.layers) / 16
    assert 70.5e9 < params < 70.6e9  # 70.55 B: 80 GQA + SwiGLU blocks and the untied 128,256-token embedding/head
    plan_args = ["--nodes", "16", "--gpus-per-node", "8", "--gpu-memory", "80GiB", "--microbatches", "64"]
    plan_args += ["--f", "1", "--microbatch-size", "1", "--intra-bandwidth", "450GB", "--inter-bandwidth", "50GB"]
    capsys.readouterr()
    assert main(["plan", str(out), *plan_args]) == 2  # one sample per microbatch, 1-GPU stages: 9 nodes at least
    assert "cannot hold f+1 = 2 pipelines of at least n0 = 9 nodes" in capsys.readouterr().err
    assert main(["plan", str(out), *plan_args, "--max-tensor-parallel", "8"]) == 0
    text = capsys.readouterr().out
    assert "(GPUs, tensor-parallel degree t)" in text and "(8,t8)" in text
    assert main(["plan", str(out), *plan_args, "--max-tensor-parallel", "3"]) == 2
    assert "--max-tensor-parallel (max_tensor_parallel: must be a power of two >= 1, got 3)" in capsys.readouterr().err
    assert main(["profile", "--estimate", "--model", "gpt3-175b", "--out", str(tmp_path / "gpt.json")]) == 0
