"""Steady-state step time of the elastic runtime against plain PyTorch on the same work (CPU, gloo).

Two comparisons, each on the same processes, model, global batch and accumulation, one torch thread
per process, run interleaved `--repeats` times:

- `ddp`: `--ranks` single-stage pipelines of the elastic runtime (what `oobleck launch` runs:
  `python -m oobleck.runtime.backends.local.worker` workers against a coordinator, failure detector, interruptible
  waits, step commit, progress, snapshots every 10 steps; float32 gradient sums by default) against
  `torch.nn.parallel.DistributedDataParallel` over gloo: each rank runs its share of the global
  microbatches under `no_sync()` but the last, then the stock `torch.optim.AdamW` (foreach=False, as
  the runtime's).
- `pipe`: one pipeline of two single-rank stages (the elastic runtime) against
  `torch.distributed.pipelining`'s `Schedule1F1B` on the same layer split.

Step time: the interval between consecutive step completions on the rank that logs the loss, over the
steps after `--warmup`; per run its median and its 10th percentile (the least disturbed steps, robust
on a shared, loaded machine); each figure is the median over runs, and the ratios are runtime / torch
of those. The machine's load average is printed beside them.

usage: .venv/bin/python bench/vs_torch.py [--model bench-gpt|PRESET] [--which ddp,pipe] [--repeats 5] [--quick]
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

BENCH_GPT = overhead.MODEL
"""The built-in GPT of bench/overhead.py (4 blocks, hidden 128, sequence 64): the issue's 'tiny GPT'."""


def model_config(name: str) -> dict:
    """`--model`: "bench-gpt", a `transformers` preset of runtime/models/hf.py (llama-tiny, gpt3-350m, ...), or any
    other model name the runtime knows (tiny-gpt, ...)."""
    from oobleck.api.hfpresets import PRESETS

    if name == "bench-gpt":
        return dict(BENCH_GPT)
    if name in PRESETS:
        return {"transformers": {"preset": name}}
    return {"name": name}


def plan_of(num_layers: int, pipelines: list[list[tuple[int, int]]], microbatches: list[int], job: str):
    """A plan of pipelines of single-rank stages on one-GPU nodes: pipelines[i] = its stages' layer ranges."""
    from oobleck.api.plan import Pipeline, Plan, Stage, Template, TemplateStage

    templates, built, node, offset = {}, [], 0, 0
    for index, (stages, count) in enumerate(zip(pipelines, microbatches)):
        n = len(stages)
        templates.setdefault(
            n,
            Template(
                nodes=n,
                stages=[
                    TemplateStage(start=a, end=b, node=i, gpus=1, gpu_offset=0, forward_ms=0, backward_ms=0)
                    for i, (a, b) in enumerate(stages)
                ],
                iteration_ms=0,
                m_ref=count,
            ),
        )
        nodes = [f"n{node + i}" for i in range(n)]
        built.append(
            Pipeline(
                index=index,
                template_nodes=n,
                nodes=nodes,
                microbatches=count,
                microbatch_offset=offset,
                stages=[
                    Stage(start=a, end=b, node=nodes[i], gpus=[0], ranks=[node + i]) for i, (a, b) in enumerate(stages)
                ],
                iteration_ms=0,
            )
        )
        node, offset = node + n, offset + count
    return Plan(
        job=job,
        generation=0,
        num_layers=num_layers,
        gpus_per_node=1,
        f=0,
        global_microbatches=offset,
        templates=list(templates.values()),
        pipelines=built,
        iteration_ms=0,
    )


# -- the torch baselines (run as `bench/vs_torch.py _ddp|_pipe ...` processes) ------------------------------


def _setup(argv: list[str]):
    import torch
    import torch.distributed as dist

    from oobleck.runtime.train.config import load_config

    config_path, rank, world, port, out = argv
    config = load_config(config_path)
    torch.set_num_threads(config.threads)
    store = dist.TCPStore("127.0.0.1", int(port), is_master=False, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=int(rank), world_size=int(world))
    return config, int(rank), int(world), Path(out)


def _ddp(argv: list[str]) -> int:
    """One DDP rank: microbatches rank, rank + world, ... of each step; gradients averaged by DDP."""
    import torch.distributed as dist
    from torch import nn

    from oobleck.runtime.train.config import build_dataset, build_model
    from oobleck.runtime.train.optim import learning_rate, torch_adamw

    config, rank, world, out, microbatches = *_setup(argv[:5]), int(argv[5])
    model = build_model(config)
    data = build_dataset(config, model)
    net = nn.parallel.DistributedDataParallel(nn.Sequential(*(model.build_layer(i) for i in range(model.num_layers))))
    optimizer = torch_adamw(list(net.parameters()), config.optim)
    mine = list(range(rank, microbatches, world))
    # DDP averages over ranks; the runtime divides the sum by the global sample count: same gradient.
    scale = world / (microbatches * config.microbatch_size)
    times = []
    for step in range(config.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config.optim, step)
        for number, index in enumerate(mine):
            inputs, targets = data.microbatch(step, index)
            last = number == len(mine) - 1
            with net.no_sync() if not last else _nothing():
                loss = model.loss(net(inputs), targets).sum() * scale
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.time())
    if rank == 0:
        out.write_text(json.dumps(times))
    dist.destroy_process_group()
    return 0


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _pipe(argv: list[str]) -> int:
    """One stage of a 2-stage torch.distributed.pipelining Schedule1F1B over layers [0, split), [split, L)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from oobleck.runtime.train.config import build_dataset, build_model
    from oobleck.runtime.train.optim import learning_rate, torch_adamw

    config, rank, world, out, microbatches, split = *_setup(argv[:5]), int(argv[5]), int(argv[6])
    model = build_model(config)
    data = build_dataset(config, model)
    layers = range(0, split) if rank == 0 else range(split, model.num_layers)
    module = nn.Sequential(*(model.build_layer(i) for i in layers))
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    # Mean per microbatch, averaged over microbatches by the schedule (scale_grads): the global mean.
    schedule = Schedule1F1B(stage, microbatches, loss_fn=lambda output, target: model.loss(output, target).mean())
    optimizer = torch_adamw(list(module.parameters()), config.optim)
    times = []
    for step in range(config.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config.optim, step)
        batches = [data.microbatch(step, i) for i in range(microbatches)]
        if rank == 0:
            schedule.step(torch.cat([b[0] for b in batches]))
        else:
            schedule.step(target=torch.cat([b[1] for b in batches]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.time())
    if rank == world - 1:
        out.write_text(json.dumps(times))
    dist.destroy_process_group()
    return 0


def run_torch(kind: str, config, world: int, extra: list[str], folder: Path) -> list[float]:
    """Step intervals of one run of a torch baseline (`_ddp` or `_pipe`) with `world` processes."""
    from torch.distributed import TCPStore

    (folder / "config.json").write_text(config.model_dump_json())
    out = folder / f"{kind}.json"
    out.unlink(missing_ok=True)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, OMP_NUM_THREADS=str(config.threads), TORCH_CPP_LOG_LEVEL="ERROR")
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, kind, str(folder / "config.json"), str(rank), str(world), str(store.port)]
            + [str(out)]
            + extra,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        for rank in range(world)
    ]
    overhead._communicate(processes)
    times = json.loads(out.read_text())
    return [b - a for a, b in zip(times, times[1:])]


def _stats_after(intervals: list[float], warmup: int) -> tuple[float, float]:
    """(median, 10th percentile) of the step intervals after `warmup`."""
    kept = sorted(intervals[warmup:] or intervals)
    return statistics.median(kept), kept[len(kept) // 10]


def main() -> int:
    from oobleck.runtime.train.config import WorkerConfig, build_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-gpt", help="bench-gpt (the built-in GPT) or a model preset name")
    parser.add_argument("--which", default="ddp,pipe", help="comparisons to run: ddp, pipe")
    parser.add_argument("--ranks", type=int, default=4, help="data-parallel ranks of the ddp comparison")
    parser.add_argument("--microbatches", type=int, default=8, help="global microbatches per step")
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="step intervals left out of the statistics")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of every variant, interleaved")
    parser.add_argument(
        "--gradient-sum-dtype", choices=["float32", "float64"], default="float32", help="the runtime's sums"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run in seconds: llama-tiny, few steps, one round")
    parser.add_argument("--out", default=None, help="also write the figures here (JSON)")
    args = parser.parse_args()
    if args.quick:
        args.model, args.steps, args.warmup, args.repeats, args.microbatches = "llama-tiny", 6, 2, 1, 4
        args.ranks = 2
    which = [w for w in args.which.split(",") if w]
    unknown = set(which) - {"ddp", "pipe"}
    if unknown:
        parser.error(f"--which: unknown comparison(s) {sorted(unknown)}; choose from ddp, pipe")
    if args.microbatches % args.ranks:
        parser.error(f"--microbatches ({args.microbatches}) must be a multiple of --ranks ({args.ranks})")

    config = WorkerConfig(
        job="vs-torch",
        model=model_config(args.model),
        microbatch_size=args.microbatch_size,
        steps=args.steps,
        device="cpu",
        gradient_sum_dtype=args.gradient_sum_dtype,
    )
    try:
        num_layers = build_model(config).num_layers
    except ValueError as error:  # an unknown --model: the runtime's message lists the known names
        parser.error(f"--model: {error} (also: bench-gpt and the transformers presets)")
    split = num_layers // 2
    variants = []
    if "ddp" in which:
        share = args.microbatches // args.ranks
        plan = plan_of(num_layers, [[(0, num_layers)]] * args.ranks, [share] * args.ranks, "vs-torch")
        variants += [
            ("ddp: runtime", lambda folder: overhead.run_variant("on", config, plan, folder)),
            ("ddp: torch DDP", lambda folder: run_torch("_ddp", config, args.ranks, [str(args.microbatches)], folder)),
        ]
    if "pipe" in which:
        plan2 = plan_of(num_layers, [[(0, split), (split, num_layers)]], [args.microbatches], "vs-torch")
        variants += [
            ("pipe: runtime", lambda folder: overhead.run_variant("on", config, plan2, folder)),
            (
                "pipe: torch Schedule1F1B",
                lambda folder: run_torch("_pipe", config, 2, [str(args.microbatches), str(split)], folder),
            ),
        ]
    medians: dict[str, list[float]] = {name: [] for name, _ in variants}
    lows: dict[str, list[float]] = {name: [] for name, _ in variants}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.repeats):
            for name, run in variants:
                folder = Path(tmp) / f"{name.replace(' ', '').replace(':', '-')}-{round_}"
                folder.mkdir()
                loads.append(os.getloadavg()[0])
                median, low = _stats_after(run(folder), args.warmup)
                medians[name].append(median)
                lows[name].append(low)
                print(
                    f"round {round_}: {name:26s} median {median * 1e3:8.2f}, p10 {low * 1e3:8.2f} ms/step", flush=True
                )
    figures = {name: statistics.median(values) for name, values in medians.items()}
    low_figures = {name: statistics.median(values) for name, values in lows.items()}
    print(
        f"\nmodel {args.model} ({num_layers} layers), global batch {args.microbatches} x {args.microbatch_size}, "
        f"runtime sums {args.gradient_sum_dtype}; load average during the runs: median {statistics.median(loads):.1f}, "
        f"range {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores"
    )
    result = {
        "model": args.model,
        "medians_ms": {k: v * 1e3 for k, v in figures.items()},
        "p10_ms": {k: v * 1e3 for k, v in low_figures.items()},
        "ratios": {},
        "p10_ratios": {},
        "load": statistics.median(loads),
    }
    for kind, baseline in (("ddp", "ddp: torch DDP"), ("pipe", "pipe: torch Schedule1F1B")):
        if kind in which:
            ours = figures[f"{kind}: runtime"]
            ratio = ours / figures[baseline]
            low_ratio = low_figures[f"{kind}: runtime"] / low_figures[baseline]
            result["ratios"][kind], result["p10_ratios"][kind] = ratio, low_ratio
            print(
                f"{kind:5s}: runtime {ours * 1e3:.2f} ms vs {baseline.split(': ')[1]} {figures[baseline] * 1e3:.2f} ms"
                f" per step (medians): {ratio:.3f}x; 10th percentiles: {low_ratio:.3f}x (target <= 1.10x)"
            )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("_ddp", "_pipe"):
        sys.exit({"_ddp": _ddp, "_pipe": _pipe}[sys.argv[1]](sys.argv[2:]))
    sys.exit(main())
