"""Steady-state step time with the runtime's fault-tolerance machinery on vs off, and pipeline
efficiency against the 1F1B bound.

"On" is what a worker runs by default: every send/receive/all-reduce wait is interruptible (watched
in a helper thread against the failure event). "Off" blocks in plain `work.wait()`. The heartbeat
side of the machinery (runtime/coordinator.py) is not part of this measurement.

The 1F1B bound for a pipeline of stages s with per-microbatch forward+backward t_s running M
microbatches is sum_s t_s + (M - 1) * max_s t_s (communication free); t_s comes from the profiler
run on this machine with the same thread count. Efficiency = bound / measured step time.

usage: .venv/bin/python bench/overhead.py [--steps 30] [--repeats 2] [--out result.json]
Runs real worker processes (gloo, CPU); on a shared machine, compare runs made back to back.
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

import torch
from torch.distributed import TCPStore

from oobleck.api.plan import Pipeline, Plan, RankAssignment, Stage, Template, TemplateStage
from oobleck.runtime.config import WorkerConfig, build_model
from oobleck.runtime.profiler import profile_model

MODEL = {"name": "gpt", "sizes": {"blocks": 4, "hidden": 128, "heads": 4, "seq_len": 64, "vocab": 512}}


def two_stage_plan(num_layers: int, microbatches: int, split: int) -> Plan:
    """One pipeline of two single-GPU nodes: layers [0, split) and [split, num_layers)."""
    stages = [(0, split), (split, num_layers)]
    return Plan(
        job="overhead", generation=0, num_layers=num_layers, gpus_per_node=1, f=0,
        global_microbatches=microbatches,
        templates=[Template(nodes=2, stages=[TemplateStage(start=a, end=b, node=i, gpus=1, gpu_offset=0, forward_ms=0,
                                                           backward_ms=0) for i, (a, b) in enumerate(stages)],
                            iteration_ms=0, m_ref=microbatches)],
        pipelines=[Pipeline(index=0, template_nodes=2, nodes=["n0", "n1"], microbatches=microbatches, microbatch_offset=0,
                            stages=[Stage(start=a, end=b, ranks=[i]) for i, (a, b) in enumerate(stages)], iteration_ms=0)],
        ranks=[RankAssignment(rank=i, node=f"n{i}", gpu=0, pipeline=0, stage=i, start=a, end=b)
               for i, (a, b) in enumerate(stages)],
        iteration_ms=0,
    )


def run(config: WorkerConfig, plan: Plan, folder: Path) -> list[float]:
    """Step seconds (as logged by the last stage) of one run of real worker processes."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    (folder / "config.json").write_text(config.model_dump_json())
    (folder / "plan.json").write_text(plan.to_json())
    losses = folder / "losses.jsonl"
    losses.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(config.threads))
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "oobleck.runtime", "worker", "--config", str(folder / "config.json"), "--plan",
             str(folder / "plan.json"), "--store", f"127.0.0.1:{store.port}", "--node", a.node, "--gpu", "0",
             "--losses", str(losses)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True,
        )
        for a in plan.ranks
    ]
    for process in processes:
        _, err = process.communicate(timeout=600)
        if process.returncode != 0:
            raise RuntimeError(f"worker failed:\n{err[-2000:]}")
    return [json.loads(line)["seconds"] for line in losses.read_text().splitlines()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the statistics")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="on/off pairs, interleaved")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    config = WorkerConfig(job="overhead", model=MODEL, microbatch_size=args.microbatch_size, steps=args.steps, device="cpu")
    model = build_model(config)
    torch.set_num_threads(config.threads)
    profile = profile_model(model, args.microbatch_size, torch.device("cpu"), warmup=2, iterations=5)
    costs = [layer.forward_ms + layer.backward_ms for layer in profile.layers]
    # Split where the two stages' costs are closest.
    split = min(range(1, model.num_layers), key=lambda k: abs(sum(costs[:k]) - sum(costs[k:])))
    plan = two_stage_plan(model.num_layers, args.microbatches, split)
    stage_ms = [sum(costs[:split]), sum(costs[split:])]
    bound_ms = sum(stage_ms) + (args.microbatches - 1) * max(stage_ms)

    medians: dict[str, list[float]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for mode in ("on", "off"):
                cfg = config.model_copy(update={"interruptible_waits": mode == "on"})
                seconds = run(cfg, plan, Path(tmp))[args.warmup:]
                medians[mode].append(statistics.median(seconds) * 1e3)
    on, off = statistics.median(medians["on"]), statistics.median(medians["off"])
    result = {
        "model": MODEL, "microbatch_size": args.microbatch_size, "microbatches": args.microbatches,
        "stages": [[0, split], [split, model.num_layers]], "stage_ms": stage_ms,
        "step_ms_on": on, "step_ms_off": off, "runs_on": medians["on"], "runs_off": medians["off"],
        "overhead": on / off - 1, "bound_1f1b_ms": bound_ms, "efficiency_on": bound_ms / on, "efficiency_off": bound_ms / off,
        "cpu_count": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
