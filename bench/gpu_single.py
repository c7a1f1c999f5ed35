"""One GPU, bf16: the elastic runtime against plain PyTorch on the same model, back to back.

- runtime: the model is profiled on the GPU with the job's precision (`profile_model`, what
  `profile: measure` does), then trained by one `python -m oobleck.runtime.backends.local.worker` worker against a
  coordinator (failure detector, interruptible waits, step commit, progress, snapshots of the layers to
  host memory every `snapshot.interval_steps`): bf16 autocast, float32 master weights and AdamW state,
  float32 gradient sums. A one-rank plan has no peer, so the runtime builds no collective group (the
  NCCL path of its waits is exercised by tests/runtime/test_gpu.py).
- plain PyTorch: the same layers as one `nn.Sequential` on the GPU, the same microbatches, bf16
  autocast, `torch.optim.AdamW(fused=True)`; `.to(device)` of each microbatch's inputs and targets where
  they are used (each such copy from pageable memory synchronizes the stream).
- plain-pinned: the same, with both copied ahead of the forward from page-locked memory, asynchronously
  (the runtime's way): the stricter baseline.

Step time is the interval between consecutive step completions after `--warmup` steps (median per
run, median over `--repeats` interleaved runs). tokens/s = global batch tokens / step time. MFU =
training FLOPs per token x tokens/s / peak bf16 FLOP/s, with FLOPs per token = 6 N + 12 L H S (N
parameters, L blocks, H hidden, S sequence: PaLM's appendix B); peak from `--peak-tflops` or the device
name (H100/H200 SXM: 989 TFLOP/s dense bf16; A100: 312).

usage: .venv/bin/python bench/gpu_single.py [--model gpt2-medium] [--steps 30] [--repeats 3]
       .venv/bin/python bench/gpu_single.py --model gpt3-350m   (the same shape through Hugging Face's GPT-2)
       .venv/bin/python bench/gpu_single.py --quick [--model llama-tiny]   (CPU smoke run: tiny-gpt, bf16 autocast on CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # bench/overhead.py: the elastic runtime's launch, shared

GPT2_MEDIUM = {"name": "gpt", "sizes": {"blocks": 24, "hidden": 1024, "heads": 16, "seq_len": 1024, "vocab": 50304}}
"""GPT-2 medium (the paper's GPT-3 350M shape): 24 blocks, hidden 1024, 16 heads, 1024 tokens: ~355M parameters."""
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


HF_SEQUENCE = 1024
"""Tokens per sample of a `transformers` preset here (at most its positions): gpt2-medium's, so that the two
shapes compare."""


def model_config(name: str) -> dict:
    """`--model`: gpt2-medium (the built-in GPT), a `transformers` preset (gpt3-350m: the same shape through
    Hugging Face's GPT-2, at HF_SEQUENCE tokens), or another model name the runtime knows."""
    from oobleck.api.hfpresets import PRESETS, sizes

    if name == "gpt2-medium":
        return dict(GPT2_MEDIUM)
    if name in PRESETS:
        positions = sizes(PRESETS[name], PRESETS[name]["model_type"]).positions
        return {"transformers": {"preset": name, "sequence_length": min(HF_SEQUENCE, positions)}}
    return {"name": name}


def flops_per_token(model) -> float | None:
    """6 N + 12 L H S, or None when the model does not say its blocks, hidden size and sequence length."""
    import torch

    from oobleck.api.hfpresets import sizes as hf_sizes

    parameters = 0
    with torch.device("meta"):
        for index in range(model.num_layers):
            parameters += sum(p.numel() for p in model.build_layer(index).parameters())
    sizes = getattr(model, "sizes", None)
    if sizes is not None and all(hasattr(sizes, k) for k in ("blocks", "hidden", "seq_len")):
        return 6 * parameters + 12 * sizes.blocks * sizes.hidden * sizes.seq_len
    config = getattr(model, "config", None)  # a transformers model: its config.json's sizes
    if config is not None and hasattr(model, "seq_len"):
        found = hf_sizes(config.to_dict(), config.model_type)
        return 6 * parameters + 12 * found.blocks * found.hidden * model.seq_len
    return None


def _plain(argv: list[str], on_step=None) -> int:
    """Plain PyTorch training of the config's model on its device; writes step completion times.
    `on_step`: called after each step (bench/gpu_trace.py steps its profiler there)."""
    import torch
    from torch import nn

    from oobleck.runtime.train.compute import autocast, to_device
    from oobleck.runtime.train.config import build_dataset, build_model, load_config
    from oobleck.runtime.train.optim import decays, learning_rate

    config_path, microbatches, out = argv[0], int(argv[1]), Path(argv[2])
    pinned = argv[3:] == ["pinned"]
    config = load_config(config_path)
    torch.set_num_threads(config.threads)
    device = torch.device(config.device)
    model = build_model(config)
    data = build_dataset(config, model)
    net = nn.Sequential(*(model.build_layer(i) for i in range(model.num_layers))).to(device)
    c = config.optim
    params = list(net.parameters())
    groups = [
        {"params": [p for p in params if decays(p)], "weight_decay": c.weight_decay},
        {"params": [p for p in params if not decays(p)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(
        groups,
        lr=c.lr,
        betas=(c.beta1, c.beta2),
        eps=c.eps,
        fused=device.type == "cuda",
    )
    samples = microbatches * config.microbatch_size
    times = []
    for step in range(config.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(c, step)
        for index in range(microbatches):
            inputs, targets = data.microbatch(step, index)
            if pinned:  # both copied ahead, asynchronously from page-locked memory, as the runtime does
                inputs, targets = to_device(inputs, device), to_device(targets, device)
            with autocast(device, config.precision):
                loss = model.loss(net(inputs.to(device)), targets.to(device)).sum() / samples
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.time())
        if on_step is not None:
            on_step()
    out.write_text(json.dumps(times))
    return 0


def run_plain(
    config, microbatches: int, folder: Path, entry: list[str] | None = None, pinned: bool = False
) -> list[float]:
    """Step intervals of one plain run in its own process; `entry`: the command instead of this script's `_plain`;
    `pinned`: the inputs and targets copied ahead from page-locked memory (else `.to(device)` where used)."""
    (folder / "config.json").write_text(config.model_dump_json())
    out = folder / "plain.json"
    env = dict(os.environ, OMP_NUM_THREADS=str(config.threads))
    process = subprocess.Popen(
        [
            *(entry or [sys.executable, __file__, "_plain"]),
            str(folder / "config.json"),
            str(microbatches),
            str(out),
            *(["pinned"] if pinned else []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    overhead._communicate([process])
    times = json.loads(out.read_text())
    return [b - a for a, b in zip(times, times[1:])]


def main() -> int:
    import torch

    from oobleck.runtime.train.config import WorkerConfig, build_model
    from oobleck.runtime.train.profiler import profile_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="gpt2-medium (default; --quick: tiny-gpt), a transformers preset or a model name"
    )
    parser.add_argument("--microbatch-size", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches accumulated per step")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="step intervals left out of the statistics")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak bf16 TFLOP/s (default: by device)")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny-gpt, a few steps, one round")
    parser.add_argument(
        "--pieces",
        default="",
        help="also run these bench/overhead.py variants of the runtime, e.g. off,no-snapshots,no-commit,no-detector",
    )
    parser.add_argument("--out", default=None, help="also write the figures here (JSON)")
    args = parser.parse_args()
    device = "cpu" if args.quick else "cuda"
    if args.quick:
        args.model, args.microbatch_size, args.microbatches, args.steps, args.warmup, args.repeats = (
            args.model or "tiny-gpt",
            2,
            2,
            5,
            1,
            1,
        )
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark measures a GPU (use --quick for the CPU smoke run)")
    args.model = args.model or "gpt2-medium"
    config = WorkerConfig(
        job="gpu-single",
        model=model_config(args.model),
        microbatch_size=args.microbatch_size,
        steps=args.steps,
        device=device,
        precision="bf16",
        gradient_sum_dtype="float32",
    )
    model = build_model(config)
    torch.set_num_threads(config.threads)  # as the workers run
    profile = profile_model(
        model, config.microbatch_size, torch.device(device), warmup=1, iterations=2, precision="bf16"
    )
    step_ms = sum(layer.forward_ms + layer.backward_ms for layer in profile.layers) * args.microbatches
    print(f"profile ({profile.device}, bf16): {len(profile.layers)} layers, forward+backward {step_ms:.1f} ms per step")
    plan = overhead.plan_of(model.num_layers, [[(0, model.num_layers)]], [args.microbatches], "gpu-single")
    # `runtime` is the full elastic path (bench/overhead.py's `on`); the others take one piece out of it,
    # so that a gap can be attributed (`off`: the static worker, no coordinator or commit).
    pieces = [v for v in args.pieces.split(",") if v] if args.pieces else []
    names = ["runtime", "plain", "plain-pinned", *pieces]
    stats: dict[str, dict[str, list[float]]] = {name: {"median": [], "mean": []} for name in names}
    last_intervals: dict[str, list[float]] = {}  # each variant's last round, step by step (snapshot steps show)
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.repeats):
            for name in names:
                folder = Path(tmp) / f"{name}-{round_}"
                folder.mkdir()
                if name in ("plain", "plain-pinned"):
                    intervals = run_plain(config, args.microbatches, folder, pinned=name == "plain-pinned")
                else:
                    intervals = overhead.run_variant("on" if name == "runtime" else name, config, plan, folder)
                kept = intervals[args.warmup :] or intervals
                last_intervals[name] = [round(seconds * 1e3, 2) for seconds in intervals]
                stats[name]["median"].append(statistics.median(kept))
                stats[name]["mean"].append(statistics.mean(kept))
                print(
                    f"round {round_}: {name:12s} median {stats[name]['median'][-1] * 1e3:9.2f} ms/step,"
                    f" mean {stats[name]['mean'][-1] * 1e3:9.2f} ms/step",
                    flush=True,
                )
    tokens = args.microbatches * args.microbatch_size * int(model.example_input(1).numel())
    per_token = flops_per_token(model)
    peak = args.peak_tflops
    device_name = torch.cuda.get_device_name(0) if device == "cuda" else profile.device
    if peak is None and device == "cuda":
        peak = next((value for key, value in PEAK_TFLOPS.items() if key in device_name), None)
    result: dict = {"model": args.model, "device": device_name, "tokens_per_step": tokens, "repeats": args.repeats}
    for name, figures in stats.items():
        # The median step is the steady state; the mean is throughput (it sees the snapshot steps).
        seconds = statistics.median(figures["median"])
        mean_seconds = statistics.median(figures["mean"])
        rate = tokens / mean_seconds
        mfu = per_token * rate / (peak * 1e12) if per_token and peak else None
        result[name] = {
            "step_ms": seconds * 1e3,
            "mean_step_ms": mean_seconds * 1e3,
            "tokens_per_s": rate,
            "mfu": mfu,
            "last_round_intervals_ms": last_intervals[name],
        }
        shown = f"{mfu:.3f}" if mfu is not None else "n/a (no peak FLOP/s for this device)"
        print(
            f"{name:12s}: median {seconds * 1e3:9.2f} ms/step, mean {mean_seconds * 1e3:9.2f} ms/step,"
            f" {rate:12.1f} tokens/s, MFU {shown}"
        )
    for baseline in ("plain", "plain-pinned"):
        suffix = "" if baseline == "plain" else "_pinned"
        ratio = result["runtime"]["tokens_per_s"] / result[baseline]["tokens_per_s"]
        result["ratio" + suffix] = ratio
        result["ratio_of_median_steps" + suffix] = result[baseline]["step_ms"] / result["runtime"]["step_ms"]
        print(
            f"runtime / {baseline} tokens/s: {ratio:.3f} (target >= 0.95);"
            f" of median steps {result['ratio_of_median_steps' + suffix]:.3f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_plain":
        sys.exit(_plain(sys.argv[2:]))
    sys.exit(main())
