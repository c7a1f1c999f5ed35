"""Steady-state step time of the elastic path (the fault-tolerance machinery on) against the same
pipelines without it, each piece's share, and pipeline efficiency against the 1F1B bound.

Variants, all on the same plan with the same worker processes, one torch thread each. The plan
(`--shape`): `pipeline` (default), one pipeline of two single-GPU stages; `ddp`, `--ranks` (4)
single-stage pipelines, i.e. data parallelism (the shape `bench/vs_torch.py --which ddp` compares with
torch's DDP; this model is its bench GPT):

- `on`: what `oobleck launch` runs: `python -m oobleck.runtime.backends.local.worker` workers against a
  coordinator (runtime/elastic/coordinator.py) and a plan file, with the launcher's detection settings
  (heartbeat period and dead-after of runtime/backends/local/config.py's LaunchOptions), the failure
  detector's threads (beats and watch, abort listener), the plan watcher, interruptible waits, the
  store-decided step commit (pipelines only: data-parallel steps skip it, runtime/elastic/commit.py), the
  per-step progress key and snapshots every `snapshot.interval_steps` (default 10) steps.
- `off`: the static worker (`python -m oobleck.runtime worker`) with plain `work.wait()`s: no
  coordinator, no detector, no commit, no progress, no snapshots.
- `on+poll` (with `--pieces`): `on` plus the store polling of `oobleck launch`'s supervisor loop
  (runtime/backends/local/launcher.py), which shares the machine with the workers there.
- `no-<piece>` (with `--pieces`): `on` with one piece taken out; `on - no-<piece>` is that piece's
  cost. The snapshot piece goes through the real worker entry point (config); the
  others through this script's copy of its assembly (`_worker`), which only leaves the piece out.

Step time: the interval between consecutive steps' completions on the rank that logs the loss
(wall clock, so it includes everything between steps: commit, progress, snapshot scheduling) over
the steps after `--warmup`; each variant runs `--repeats` times, interleaved. Per run: the median,
the 10th percentile (the least disturbed steps: robust on a shared, loaded machine) and the mean
(throughput: the only one that sees the snapshot steps); each figure is the median over runs.

`OVERHEAD_PROFILE=PATH` writes a cProfile of each `_worker`'s training loop to PATH.<node>
(variant `no-nothing` is that assembly with every piece on).

The 1F1B bound (`--shape pipeline`) for a pipeline of stages s with per-microbatch forward+backward t_s running M
microbatches is sum_s t_s + (M - 1) * max_s t_s (communication free); t_s comes from the profiler
run on this machine with the same thread count. Efficiency = bound / measured step time.

usage: .venv/bin/python bench/overhead.py [--steps 40] [--repeats 5] [--pieces] [--shape pipeline|ddp] [--out result.json]
       [--quick]
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
import threading
import time
from pathlib import Path

MODEL = {"name": "gpt", "sizes": {"blocks": 4, "hidden": 128, "heads": 4, "seq_len": 64, "vocab": 512}}
PIECES = ("detector", "commit", "snapshots")


def _launch_detection() -> list[str]:
    """The heartbeat period and dead-after that `oobleck launch` gives its workers (runtime/backends/local/children.py)."""
    from oobleck.runtime.backends.local.config import LaunchOptions

    return [
        "--heartbeat-period",
        str(LaunchOptions.heartbeat_period_s),
        "--dead-after",
        str(LaunchOptions.dead_after_s),
    ]


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


def step_intervals(losses: Path, rank: int) -> list[float]:
    """Seconds between consecutive step completions of `rank` (one record per step)."""
    records = [json.loads(line) for line in losses.read_text().splitlines()]
    times = {r["step"]: r["time"] for r in records if r["rank"] == rank}
    steps = sorted(times)
    return [times[b] - times[a] for a, b in zip(steps, steps[1:]) if b == a + 1]


def step_cpu(losses: Path, rank: int) -> list[float]:
    """CPU seconds (the process's, all threads) that `rank` spent between consecutive step completions."""
    records = [json.loads(line) for line in losses.read_text().splitlines()]
    cpu = {r["step"]: r["cpu"] for r in records if r["rank"] == rank}
    steps = sorted(cpu)
    return [cpu[b] - cpu[a] for a, b in zip(steps, steps[1:]) if b == a + 1]


class _ForkedWorker:
    """`command` (`python ...`) as a fork of an interpreter that imported torch once (oobleck_dev.preforked),
    with the `communicate`, `returncode` and `kill` of the `subprocess.Popen` it stands for; its output in `log`."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path) -> None:
        from oobleck_dev import preforked

        assert command[0] == sys.executable, command
        self.process, self.log, self.returncode = preforked.start(command[1:], log, env), log, None

    def communicate(self, timeout: float | None = None) -> tuple[None, str]:
        self.returncode = self.process.wait(timeout)
        return None, self.log.read_text(errors="replace")

    def kill(self) -> None:
        self.process.kill()


class _Worker:
    """`command` as a fresh interpreter, its stderr in `log`, with the `communicate`, `returncode` and `kill` of the
    `subprocess.Popen` it stands for.

    The output goes to a file, not a pipe: the workers are awaited one by one, and a later worker whose log
    filled its pipe (64 KiB: a few hundred steps' lines) would block while the earlier one waited for it."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path) -> None:
        with log.open("w") as output:
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=output, env=env)
        self.log = log

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def communicate(self, timeout: float | None = None) -> tuple[None, str]:
        self.process.wait(timeout)
        return None, self.log.read_text(errors="replace")

    def kill(self) -> None:
        self.process.kill()


def start_workers(commands: list[list[str]], env: dict[str, str], folder: Path, fork: bool = False) -> list:
    """Each command as a process, its output in `folder`/worker{i}.log: a fresh interpreter, or with `fork` the same
    entry point forked from one that imported torch already (the --quick runs: those imports, seconds of CPU per
    process, were most of their time; the full runs keep what `oobleck launch` does)."""
    worker = _ForkedWorker if fork else _Worker
    return [worker(c, env, folder / f"worker{i}.log") for i, c in enumerate(commands)]


def _kill_all(processes: list) -> None:
    for process in processes:
        process.kill()
    for process in processes:
        process.communicate()


def _communicate(processes: list, timeout: float = 600) -> None:
    """Wait for every worker (each within `timeout`); on a failure or a timeout kill and reap them all and raise
    with its log."""
    for process in processes:
        try:
            _, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_all(processes)
            _, err = process.communicate()
            raise RuntimeError(f"worker still running after {timeout:.0f} s:\n{err[-3000:]}") from None
        if process.returncode != 0:
            _kill_all(processes)
            raise RuntimeError(f"worker failed ({process.returncode}):\n{err[-3000:]}")


def run_variant(
    variant: str, config, plan, folder: Path, entry: list[str] | None = None, fork: bool = False
) -> list[float]:
    """Step intervals of one run of `variant` (see the module docstring) with real worker processes.
    `entry`: the command that starts each elastic worker instead of the module (its arguments follow);
    `fork`: the workers forked from a preloaded interpreter (start_workers)."""
    from torch.distributed import TCPStore

    from oobleck.runtime.backends.local.plan_file import write_plan
    from oobleck.runtime.elastic.coordinator import Coordinator

    without = variant.removeprefix("no-") if variant.startswith("no-") else None
    if without == "snapshots":
        config = config.model_copy(update={"snapshot": config.snapshot.model_copy(update={"interval_steps": 0})})
    (folder / "config.json").write_text(config.model_dump_json())
    losses = folder / "losses.jsonl"
    losses.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(config.threads), PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR")
    logger = plan.pipelines[0].stages[-1].ranks[0]
    if variant == "off":
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        (folder / "plan.json").write_text(plan.to_json())
        commands = [
            [
                sys.executable,
                "-m",
                "oobleck.runtime",
                "worker",
                "--config",
                str(folder / "config.json"),
                "--plan",
                str(folder / "plan.json"),
                "--store",
                f"127.0.0.1:{store.port}",
                "--node",
                a.node,
                "--gpu",
                "0",
                "--losses",
                str(losses),
            ]
            for a in plan.ranks
        ]
        processes = start_workers(commands, env, folder, fork)
        _communicate(processes)
        return step_intervals(losses, logger)
    coordinator = Coordinator("127.0.0.1").start()
    stop = threading.Event()
    if variant == "on+poll":
        threading.Thread(target=_supervisor_poll, args=(coordinator.store(), plan, stop), daemon=True).start()
    try:
        plan_path = folder / "plan.json"
        write_plan(plan_path, plan)
        if entry is None:
            entry = (
                [sys.executable, "-m", "oobleck.runtime.backends.local.worker"]
                if without in (None, "snapshots")
                else [sys.executable, __file__, "_worker", "--without", without]
            )
        commands = [
            entry
            + _launch_detection()
            + [
                "--config",
                str(folder / "config.json"),
                "--plan-file",
                str(plan_path),
                "--store",
                f"127.0.0.1:{coordinator.port}",
                "--node",
                a.node,
                "--gpu",
                "0",
                "--losses",
                str(losses),
            ]
            for a in plan.ranks
        ]
        processes = start_workers(commands, env, folder, fork)
        _communicate(processes)
    finally:
        stop.set()
        coordinator.stop()
    return step_intervals(losses, logger)


def _supervisor_poll(store, plan, stop, period_s: float = 0.005) -> None:
    """The store traffic of `oobleck launch`'s supervisor loop (runtime/backends/local/launcher.py, every 5 ms: each
    worker's progress, the failure queue, the abort key), beside the coordinator as in the launcher."""
    from oobleck.api.addresses import worker_id
    from oobleck.runtime.elastic import keys

    workers = sorted(worker_id(a.node, a.gpu) for a in plan.ranks)
    while not stop.is_set():
        try:
            keys.get_progress(store, workers)
            keys.pop_failures(store)
            keys.aborted(store, plan.generation)
        except RuntimeError:
            return  # the coordinator stopped
        time.sleep(period_s)


class _NoDetector:
    """The FailureDetector's interface with no threads and no store traffic (the `no-detector` variant)."""

    def __init__(self) -> None:
        import threading

        self.failure = threading.Event()

    def watch(self, generation, peers, epoch=None) -> None:
        self.failure.clear()

    def ready(self) -> None:
        pass

    def trigger(self, kind, dead, detail, generation=None) -> None:
        self.failure.set()

    def signal(self, error) -> bool:
        self.failure.set()
        return True

    def stop(self) -> None:
        pass


def _worker(argv: list[str]) -> int:
    """A local worker (backends/local/worker.py) assembled by the same `build_worker`, with one piece left out."""
    import logging

    from oobleck.api.addresses import parse_host_port, worker_id
    from oobleck.runtime.backends.base import build_worker, finish
    from oobleck.runtime.backends.local.plan_file import FilePlanSource
    from oobleck.runtime.elastic.health import FailureDetector, HealthTimeouts
    from oobleck.runtime.elastic.loop import run_elastic
    from oobleck.runtime.elastic.store import FixedEndpoint, StoreTimeouts
    from oobleck.runtime.train.config import load_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--without", choices=["nothing", "detector", "commit"], required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--plan-file", required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--losses", default=None)
    parser.add_argument("--heartbeat-period", type=float, default=HealthTimeouts.heartbeat_period_s)
    parser.add_argument("--dead-after", type=float, default=HealthTimeouts.dead_after_s)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    config = load_config(args.config)
    endpoint = FixedEndpoint(*parse_host_port(args.store))
    timeouts = StoreTimeouts()
    me = worker_id(args.node, args.gpu)
    detector = (
        _NoDetector()
        if args.without == "detector"
        else FailureDetector(
            config.job,
            me,
            endpoint,
            store_timeouts=timeouts,
            timeouts=HealthTimeouts(heartbeat_period_s=args.heartbeat_period, dead_after_s=args.dead_after),
        ).start()
    )
    built = build_worker(config, args.node, args.gpu, endpoint, detector, timeouts, losses_path=args.losses)  # type: ignore[arg-type]
    worker = built.worker
    if args.without == "commit":
        worker.optimizer = worker.optimizer._inner  # the CommittingOptimizer's inner optimizer: no store decision
    profiler = None
    if os.environ.get("OVERHEAD_PROFILE"):
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        result = run_elastic(worker, FilePlanSource(args.plan_file), detector, built.control, config.steps)  # type: ignore[arg-type]
    finally:
        detector.stop()
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(f"{os.environ['OVERHEAD_PROFILE']}.{args.node}")
    finish(worker, result, snapshot_wait_s=60.0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(result.exit_code)


def _two_stages(model, microbatch_size: int, microbatches: int) -> tuple[int, list[float], float]:
    """The 2-stage split whose stages' profiled costs are closest, the stages' ms, and its 1F1B bound (ms)."""
    import torch

    from oobleck.runtime.train.profiler import profile_model

    # Per layer, the fastest of three profiles: a busy machine only ever makes a layer look slower.
    profiles = [profile_model(model, microbatch_size, torch.device("cpu"), warmup=2, iterations=5) for _ in range(3)]
    costs = [min(p.layers[i].forward_ms + p.layers[i].backward_ms for p in profiles) for i in range(model.num_layers)]
    split = min(range(1, model.num_layers), key=lambda k: abs(sum(costs[:k]) - sum(costs[k:])))
    stage_ms = [sum(costs[:split]), sum(costs[split:])]
    return split, stage_ms, sum(stage_ms) + (microbatches - 1) * max(stage_ms)


def main() -> int:
    import torch

    from oobleck.runtime.train.config import WorkerConfig, build_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the statistics")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="rounds of every variant, interleaved")
    parser.add_argument("--pieces", action="store_true", help="also run `on` with each piece taken out")
    parser.add_argument("--variants", default=None, help="comma-separated variants to run (default: on,off)")
    parser.add_argument(
        "--shape",
        choices=["pipeline", "ddp"],
        default="pipeline",
        help="pipeline: one 2-stage pipeline; ddp: --ranks single-stage pipelines (data parallelism)",
    )
    parser.add_argument("--ranks", type=int, default=4, help="data-parallel ranks of --shape ddp")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--quick", action="store_true", help="a short run (8 steps, 1 repeat, workers forked) that the tests use"
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.repeats = 8, 2, 1
        args.ranks = 2
    if args.shape == "ddp" and args.microbatches % args.ranks:
        parser.error(f"--microbatches ({args.microbatches}) must be a multiple of --ranks ({args.ranks})")

    config = WorkerConfig(
        job="overhead", model=MODEL, microbatch_size=args.microbatch_size, steps=args.steps, device="cpu"
    )
    model = build_model(config)
    torch.set_num_threads(config.threads)
    n = model.num_layers
    if args.shape == "pipeline":
        split, stage_ms, bound_ms = _two_stages(model, args.microbatch_size, args.microbatches)
        plan = plan_of(n, [[(0, split), (split, n)]], [args.microbatches], "overhead")
    else:
        plan = plan_of(n, [[(0, n)]] * args.ranks, [args.microbatches // args.ranks] * args.ranks, "overhead")

    variants = (
        args.variants.split(",")
        if args.variants
        else ["on", "off"] + (["on+poll"] + [f"no-{p}" for p in PIECES] if args.pieces else [])
    )
    stats = ("median", "p10", "mean")
    runs: dict[str, dict[str, list[float]]] = {v: {k: [] for k in stats} for v in variants}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for variant in variants:
                seconds = sorted(run_variant(variant, config, plan, Path(tmp), fork=args.quick)[args.warmup :])
                runs[variant]["median"].append(statistics.median(seconds) * 1e3)
                runs[variant]["p10"].append(seconds[len(seconds) // 10] * 1e3)
                runs[variant]["mean"].append(statistics.mean(seconds) * 1e3)
                load.append(os.getloadavg()[0])
    # Per statistic: the median over runs of each run's figure.
    step_ms = {k: {v: statistics.median(runs[v][k]) for v in variants} for k in stats}
    result: dict = {
        "model": MODEL,
        "microbatch_size": args.microbatch_size,
        "microbatches": args.microbatches,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "snapshot_interval_steps": config.snapshot.interval_steps,
        "shape": args.shape,
        "step_ms": step_ms,
        "runs_ms": runs,
    }
    if args.shape == "pipeline":
        result |= {
            "stages": [[0, split], [split, n]],
            "stage_ms": stage_ms,
            "bound_1f1b_ms": bound_ms,
            "efficiency": {v: bound_ms / ms for v, ms in step_ms["median"].items()},
        }
    else:
        result["ranks"] = args.ranks
    if "on" in variants and "off" in variants:
        # median: the brief's figure; p10: the least disturbed steps (robust to a loaded machine);
        # mean: throughput, the only one that sees the snapshot steps (1 in interval_steps).
        result["overhead_on_vs_off"] = {k: step_ms[k]["on"] / step_ms[k]["off"] - 1 for k in stats}
    if "on" in variants:
        # A piece's cost: how much faster `on` runs without it.
        result["piece_cost_ms"] = {
            k: {v.removeprefix("no-"): step_ms[k]["on"] - ms for v, ms in step_ms[k].items() if v.startswith("no-")}
            for k in stats
        }
    if "on" in variants and "on+poll" in variants:
        result["launcher_poll_cost_ms"] = {k: step_ms[k]["on+poll"] - step_ms[k]["on"] for k in stats}
    result |= {
        "cpu_count": os.cpu_count(),
        "load_1min": {"min": min(load), "max": max(load)},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["_worker"]:
        sys.exit(_worker(sys.argv[2:]))
    sys.exit(main())
