"""The runtime benchmarks' `--quick` modes run end to end and print their ratios (figures, not timed tests)."""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real worker processes
BENCH = Path(__file__).parents[1] / "bench"


def bench_module(name: str):
    """bench/<name>.py imported as a module (bench/ on sys.path only while it imports)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


def _run(script: str, tmp_path: Path) -> dict:
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_vs_torch_quick(tmp_path):
    figures = _run("vs_torch.py", tmp_path)
    assert set(figures["ratios"]) == {"ddp", "pipe", "pipe4"}
    assert all(math.isfinite(r) and r > 0 for r in figures["ratios"].values())
    for kind, (q1, q3) in figures["iqr"].items():
        assert q1 <= figures["ratios"][kind] <= q3, (kind, figures)
    assert all(set(sides) == {"runtime", "torch"} for sides in figures["medians_ms"].values())
    # CPU per step: both sides measured their own process's CPU time, which a step always costs.
    assert set(figures["cpu_ratios"]) == {"ddp", "pipe", "pipe4"}
    for kind, sides in figures["cpu_ms"].items():
        assert sides["runtime"] > 0 and sides["torch"] > 0, (kind, figures)
        q1, q3 = figures["cpu_iqr"][kind]
        assert q1 <= figures["cpu_ratios"][kind] <= q3, (kind, figures)


def test_gpu_single_quick_on_cpu(tmp_path):
    figures = _run("gpu_single.py", tmp_path)
    for side in ("runtime", "plain", "plain-pinned"):
        assert figures[side]["tokens_per_s"] > 0 and figures[side]["mfu"] is None  # no peak FLOP/s on a CPU
    for ratio in ("ratio", "ratio_pinned"):
        assert math.isfinite(figures[ratio]) and figures[ratio] > 0


def test_gpu_capture_quick_on_cpu(tmp_path):
    figures = _run("gpu_capture.py", tmp_path)
    assert figures["device"] == "cpu" and figures["bytes"] > 0
    assert figures["capture_s"] > 0 and figures["work_s"] > 0


def test_gpu_trace_quick_on_cpu(tmp_path):
    figures = _run("gpu_trace.py", tmp_path)
    for side in ("runtime", "plain"):
        trace = figures[side]
        assert trace["steps"] == 2, trace
        assert 0 < trace["busy_ms_per_step"] <= trace["wall_ms_per_step"], trace
        assert "aten::mm" in trace["kernel_ms_per_step"], sorted(trace["kernel_ms_per_step"])[:20]
    assert figures["kernel_ms_runtime_minus_plain"]


def test_tp_vs_torch_quick(tmp_path):
    figures = _run("tp_vs_torch.py", tmp_path)
    assert math.isfinite(figures["ratio"]) and figures["ratio"] > 0
    assert figures["iqr"][0] <= figures["ratio"] <= figures["iqr"][1]
    assert figures["runtime_ms"] > 0 and figures["torch_ms"] > 0 and figures["target"] == 1.10


def test_vs_torch_names_an_unknown_model():
    proc = subprocess.run(
        [sys.executable, str(BENCH / "vs_torch.py"), "--model", "nope"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "--model" in proc.stderr and "'nope'" in proc.stderr, proc.stderr[-2000:]


def test_gpu_single_counts_a_transformers_presets_flops_as_the_built_in_gpts():
    """`--model gpt3-350m` runs Hugging Face's GPT-2 at gpt2-medium's shape, its MFU from the same 6 N + 12 L H S
    per token. N differs only where the configs do: the preset's 2048 positions against 1024, and the vocabulary
    of the embedding and of the head (each layer holds its copy), 50257 rows against 50304."""
    gpu_single = bench_module("gpu_single")
    from oobleck.runtime.train.config import WorkerConfig, build_model

    built_in = build_model(WorkerConfig(job="f", model=gpu_single.model_config("gpt2-medium")))
    hf = build_model(WorkerConfig(job="f", model=gpu_single.model_config("gpt3-350m")))
    assert hf.seq_len == 1024
    hidden = 1024
    difference = (gpu_single.flops_per_token(hf) - gpu_single.flops_per_token(built_in)) / 6
    assert difference == (2048 - 1024) * hidden - 2 * (50304 - 50257) * hidden


def test_bench_workers_with_long_logs_do_not_wait_for_each_other(tmp_path):
    """A later worker that logs more than a pipe holds (64 KiB) must not block while an earlier one, awaited
    first, waits for it: the workers of a run of a few hundred steps did, until the 600 s timeout."""
    overhead = bench_module("overhead")

    flag = tmp_path / "second-done"
    first = f"import pathlib, time\nwhile not pathlib.Path({str(flag)!r}).exists(): time.sleep(0.05)"
    second = f"import pathlib, sys\nsys.stderr.write('x' * 300_000)\npathlib.Path({str(flag)!r}).touch()"
    commands = [[sys.executable, "-c", first], [sys.executable, "-c", second]]
    workers = overhead.start_workers(commands, dict(os.environ), tmp_path)
    overhead._communicate(workers, timeout=60)
    assert (tmp_path / "worker1.log").stat().st_size == 300_000


def test_bench_workers_are_killed_when_one_overruns(tmp_path):
    overhead = bench_module("overhead")

    commands = [
        [sys.executable, "-c", "import sys, time; sys.stderr.write('still here'); sys.stderr.flush(); time.sleep(600)"]
    ] * 2
    workers = overhead.start_workers(commands, dict(os.environ), tmp_path)
    with pytest.raises(RuntimeError, match="still running after 2 s:\nstill here"):
        overhead._communicate(workers, timeout=2)
    assert all(worker.returncode is not None for worker in workers)


def test_vs_torch_runs_a_failed_baseline_once_more(tmp_path):
    vs_torch = bench_module("vs_torch")

    folders = []

    def fails_once(folder):
        folders.append(folder)
        if len(folders) == 1:
            raise RuntimeError("worker failed (-6):\nterminate called without an active exception")
        return [0.1], [0.05]

    (tmp_path / "pipe-torch-0").mkdir()
    assert vs_torch._run_baseline_twice(fails_once, tmp_path / "pipe-torch-0") == ([0.1], [0.05])
    assert folders == [tmp_path / "pipe-torch-0", tmp_path / "pipe-torch-0-again"]

    def always_fails(folder):
        raise RuntimeError("worker failed (1):\nboom")

    (tmp_path / "ddp-torch-1").mkdir()
    with pytest.raises(RuntimeError, match="boom"):
        vs_torch._run_baseline_twice(always_fails, tmp_path / "ddp-torch-1")
