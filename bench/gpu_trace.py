"""Where a GPU step's time goes: the elastic runtime and plain PyTorch, each traced by torch.profiler.

Each side runs in its own process as in bench/gpu_single.py (the runtime: one elastic worker against a
coordinator, snapshots on; plain: `nn.Sequential`, fused AdamW), with the profiler stepped after every
training step. Steps `--wait` .. `--wait + 1` warm the profiler up and the next `--active` steps are
recorded (clear of the snapshot steps, every 10). From each trace:

- wall: from the first kernel to the end of the last, per recorded step (the CPU side is not recorded:
  recording every operator slows the host enough to starve the GPU);
- busy: the union of the GPU's kernel, copy and memset intervals per step; idle = wall - busy;
- the largest idle gaps, each with the kernels on either side (where in the step the GPU waited for the
  host: e.g. between the last backward and the optimizer, or between the update and the next forward);
- kernel time by kernel name, and the names whose time differs most between the two sides.

usage: python3 bench/gpu_trace.py [--model gpt2-medium] [--out trace.json]   (needs a CUDA device)
       .venv/bin/python bench/gpu_trace.py --quick   (CPU smoke run: tiny-gpt, operators in place of kernels)
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_single
import overhead

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
CPU_CATEGORIES = ("cpu_op",)
"""--quick on a CPU: the operators stand in for kernels, so idle is the Python between them"""


def _profiler(trace: Path, wait: int, active: int):
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    # On a GPU the kernels alone: recording every CPU operator slows the host enough to starve the GPU.
    activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    return profile(
        activities=activities,
        schedule=schedule(wait=wait, warmup=2, active=active, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(trace)),
        record_shapes=False,
    ), torch


def _traced_worker(argv: list[str]) -> int:
    """An elastic worker (`oobleck.runtime.backends.local.worker`) whose engine steps the profiler."""
    trace, wait, active, worker_argv = Path(argv[0]), int(argv[1]), int(argv[2]), argv[3:]
    from oobleck.runtime.backends.local import worker
    from oobleck.runtime.train.engine import Engine

    profiler, _ = _profiler(trace, wait, active)
    train_step = Engine.train_step

    def traced(self, step):
        outcome = train_step(self, step)
        profiler.step()
        return outcome

    Engine.train_step = traced  # this process only: the bench's instrument, not a product switch
    profiler.start()
    try:
        return worker.main(worker_argv)
    finally:
        profiler.stop()


def _traced_plain(argv: list[str]) -> int:
    trace, wait, active, plain_argv = Path(argv[0]), int(argv[1]), int(argv[2]), argv[3:]
    profiler, _ = _profiler(trace, wait, active)
    profiler.start()
    try:
        return gpu_single._plain(plain_argv, on_step=profiler.step)
    finally:
        profiler.stop()


def _union_ms(intervals: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """Total covered time of (start, end) intervals (µs in, ms out), and the gaps between them (µs)."""
    covered, gaps, end = 0.0, [], None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            if end is not None:
                gaps.append((end, start))
            covered += stop - start
            end = stop
        elif stop > end:
            covered += stop - end
            end = stop
    return covered / 1e3, gaps


def _short(name: str) -> str:
    """A kernel's name without its template arguments and parameters."""
    return name.split("(")[0].split("<")[0].removeprefix("void ").strip()[:60] or name[:60]


def summarize(
    trace: Path, steps: int, work: tuple[str, ...] = GPU_CATEGORIES, gap_us: float = 100.0, top: int = 20
) -> dict:
    """The figures of one trace of `steps` steps (see the module docstring); `work`: the event categories
    that count as busy. The window runs from the first such event to the end of the last."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    busy_events = sorted((e for e in events if e.get("cat") in work), key=lambda e: e["ts"])
    begin = busy_events[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in busy_events)
    busy_ms, gaps = _union_ms([(e["ts"], e["ts"] + e["dur"]) for e in busy_events])
    wall_ms = (end - begin) / 1e3
    starts = [e["ts"] for e in busy_events]
    big = sorted((g for g in gaps if g[1] - g[0] >= gap_us), key=lambda g: g[0] - g[1])[:top]
    described = []
    for start, stop in big:
        after = bisect.bisect_left(starts, stop)
        before = [e for e in busy_events[max(0, after - 50) : after] if e["ts"] + e["dur"] <= start + 1]
        described.append(
            {
                "ms": round((stop - start) / 1e3, 3),
                "after": _short(str(before[-1]["name"])) if before else "?",
                "before": _short(str(busy_events[after]["name"])) if after < len(busy_events) else "?",
            }
        )
    by_name: collections.Counter = collections.Counter()
    for e in busy_events:
        by_name[str(e["name"])[:90]] += e["dur"] / 1e3 / steps
    return {
        "steps": steps,
        "wall_ms_per_step": round(wall_ms / steps, 3),
        "busy_ms_per_step": round(busy_ms / steps, 3),
        "idle_ms_per_step": round((wall_ms - busy_ms) / steps, 3),
        "events_per_step": round(len(busy_events) / steps, 1),
        "idle_in_gaps_over_0.1ms_per_step": round(sum(b - a for a, b in gaps if b - a >= gap_us) / 1e3 / steps, 3),
        "largest_gaps": described,
        "kernel_ms_per_step": {k: round(v, 3) for k, v in by_name.most_common()},
    }


def main() -> int:
    import torch

    from oobleck.runtime.train.config import WorkerConfig, build_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-medium")
    parser.add_argument("--microbatch-size", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--wait", type=int, default=20, help="steps before the profiler's warm-up")
    parser.add_argument("--active", type=int, default=4, help="steps recorded")
    parser.add_argument("--out", default=None, help="also write the figures here (JSON)")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny-gpt, a few steps")
    args = parser.parse_args()
    device = "cpu" if args.quick else "cuda"
    if args.quick:
        args.model, args.microbatch_size, args.microbatches, args.wait, args.active = "tiny-gpt", 2, 2, 1, 2
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark traces a GPU (use --quick for the CPU smoke run)")
    steps = args.wait + 2 + args.active + 2
    config = WorkerConfig(
        job="gpu-trace",
        model=gpu_single.model_config(args.model),
        microbatch_size=args.microbatch_size,
        steps=steps,
        device=device,
        precision="bf16",
        gradient_sum_dtype="float32",
    )
    model = build_model(config)
    plan = overhead.plan_of(model.num_layers, [[(0, model.num_layers)]], [args.microbatches], "gpu-trace")
    result: dict = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "model": args.model}
    with tempfile.TemporaryDirectory() as tmp:
        window = [str(args.wait), str(args.active)]
        runtime_trace, plain_trace = Path(tmp) / "runtime.json", Path(tmp) / "plain.json"
        folder = Path(tmp) / "runtime"
        folder.mkdir()
        entry = [sys.executable, __file__, "_traced_worker", str(runtime_trace), *window]
        overhead.run_variant("on", config, plan, folder, entry=entry)
        folder = Path(tmp) / "plain"
        folder.mkdir()
        gpu_single.run_plain(
            config,
            args.microbatches,
            folder,
            entry=[sys.executable, __file__, "_traced_plain", str(plain_trace), *window],
        )
        work = GPU_CATEGORIES if device == "cuda" else CPU_CATEGORIES
        result["runtime"] = summarize(runtime_trace, args.active, work)
        result["plain"] = summarize(plain_trace, args.active, work)
    kernels = {side: result[side]["kernel_ms_per_step"] for side in ("runtime", "plain")}
    names = set(kernels["runtime"]) | set(kernels["plain"])
    difference = {n: kernels["runtime"].get(n, 0.0) - kernels["plain"].get(n, 0.0) for n in names}
    result["kernel_ms_runtime_minus_plain"] = {
        n: round(d, 3) for n, d in sorted(difference.items(), key=lambda item: -abs(item[1]))[:25]
    }
    for side in ("runtime", "plain"):
        figures = result[side]
        print(
            f"{side:8s}: {figures['wall_ms_per_step']:8.2f} ms/step, busy {figures['busy_ms_per_step']:8.2f},"
            f" idle {figures['idle_ms_per_step']:7.2f} (in gaps >= 0.1 ms: {figures['idle_in_gaps_over_0.1ms_per_step']:.2f}),"
            f" {figures['events_per_step']:.0f} events/step"
        )
        for gap in figures["largest_gaps"][:10]:
            print(f"    gap {gap['ms']:7.3f} ms after {gap['after']} before {gap['before']}")
    print("kernel time, runtime - plain (ms/step):")
    for name, d in list(result["kernel_ms_runtime_minus_plain"].items())[:15]:
        print(f"  {d:+8.3f}  {name}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


CHILDREN = {"_traced_worker": _traced_worker, "_traced_plain": _traced_plain}
"""the traced processes this script starts of itself"""

if __name__ == "__main__":
    child = CHILDREN.get(sys.argv[1]) if len(sys.argv) > 1 else None
    sys.exit(child(sys.argv[2:]) if child is not None else main())
