"""Profiler, metrics endpoint and the runtime's command line."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest
import torch

from oobleck.api.profile import ModelProfile
from oobleck.runtime.models.layered import load_model
from oobleck.runtime.train.metrics import WorkerMetrics
from oobleck.runtime.train.profiler import profile_model


def test_profile_measures_every_layer():
    torch.set_num_threads(1)
    model = load_model("tiny-gpt")
    profile = profile_model(model, microbatch_size=4, device=torch.device("cpu"), warmup=1, iterations=3)
    assert [layer.name for layer in profile.layers] == ["embedding", "block0", "block1", "block2", "block3", "head"]
    assert all(layer.forward_ms > 0 and layer.backward_ms > 0 for layer in profile.layers)
    block = model.build_layer(1)
    assert profile.layers[1].state_bytes == 4 * sum(p.numel() * 4 for p in block.parameters())
    assert profile.layers[1].output_bytes == 4 * 16 * 32 * 4  # [mb, seq, hidden] float32
    assert profile.layers[-1].output_bytes == 4 * 16 * 64 * 4  # logits
    # a block keeps far more for its backward than its output (attention, MLP intermediates)
    assert profile.layers[1].activation_bytes > 4 * profile.layers[1].output_bytes
    assert ModelProfile.model_validate_json(profile.model_dump_json()) == profile


@pytest.mark.integration
def test_profile_command_writes_the_planner_profile(tmp_path):
    out = tmp_path / "profile.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "oobleck.cli",
            "profile",
            "--model",
            "gpt",
            "--microbatch-size",
            "2",
            "--device",
            "cpu",
            "--iterations",
            "1",
            "--warmup",
            "0",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "model.sizes" in done.stderr  # 'gpt' needs explicit sizes
    (tmp_path / "config.yaml").write_text(
        "model: {name: gpt, sizes: {blocks: 2, hidden: 16, heads: 2, seq_len: 8, vocab: 32}}\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "oobleck.cli",
            "profile",
            "--config",
            str(tmp_path / "config.yaml"),
            "--microbatch-size",
            "2",
            "--device",
            "cpu",
            "--iterations",
            "1",
            "--warmup",
            "0",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    profile = ModelProfile.model_validate_json(out.read_text())
    assert len(profile.layers) == 4 and profile.microbatch_size == 2 and profile.model == "gpt"


def test_metrics_are_served_over_http():
    metrics = WorkerMetrics("job1", "node-a", 0)
    metrics.observe_step(seconds=0.5, samples=32, tokens=512, step=3, loss=2.5)
    metrics.bytes_copied.inc(1024)
    metrics.recovery_seconds.observe(0.7)
    port = metrics.serve(0, "127.0.0.1")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    labels = 'gpu="0",job="job1",node="node-a"'
    assert f"oobleck_worker_samples_per_second{{{labels}}} 64.0" in text
    assert f"oobleck_worker_tokens_per_second{{{labels}}} 1024.0" in text
    assert f"oobleck_worker_step{{{labels}}} 3.0" in text
    assert f"oobleck_worker_bytes_copied_total{{{labels}}} 1024.0" in text
    assert 'oobleck_worker_iteration_seconds_bucket{gpu="0",job="job1",le="0.5",node="node-a"} 1.0' in text
    assert f"oobleck_worker_recovery_seconds_count{{{labels}}} 1.0" in text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert all(name.startswith("oobleck_worker_") for name in names)


@pytest.mark.integration
def test_worker_command_rejects_bad_input(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "plan.json").write_text('{"job": "x"}')
    base = [sys.executable, "-m", "oobleck.runtime", "worker", "--config", str(tmp_path / "config.json")]
    done = subprocess.run(
        base + ["--plan", str(tmp_path / "plan.json"), "--store", "nonsense"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--store: expected HOST:PORT" in done.stderr
    done = subprocess.run(
        base + ["--plan", str(tmp_path / "plan.json"), "--store", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "generation" in done.stderr  # the plan's missing fields are named
    done = subprocess.run(
        base + ["--plan", str(tmp_path / "absent.json"), "--store", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "absent.json" in done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_on_cuda():
    profile = profile_model(load_model("tiny-gpt"), 4, torch.device("cuda", 0), warmup=1, iterations=2)
    assert "cpu" not in profile.device
    assert all(layer.forward_ms > 0 for layer in profile.layers)
    assert profile.layers[1].activation_bytes > 0
