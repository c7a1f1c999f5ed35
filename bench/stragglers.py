"""Throughput with one slow node of 4, without mitigation, with the batch re-split and with layers moved,
against the ideal (issue 22).

Four real worker processes (tiny GPT, gloo, CPU; each the worker CLI forked from an interpreter that
imported torch once: oobleck_dev.preforked) run a static plan of two 2-node pipelines from the
real planner. Every node's process is held by its own CFS quota (the cgroup v1 cpu controller,
oobleck_dev.cpulimit) to `--node-cpus` CPUs, together under the host's cores: each node computes at
its own quota's pace whatever the others do, as on four machines (with only the slow node held, the
others took the CPU it left and sped up, so its slowdown was not a node's slowdown). In one run:

1. every node at `--node-cpus`, the profile's split: the reference throughput;
then for each `--shares` level:
2. node `c` held to `--node-cpus` x that share, the same split: what the job does without mitigation;
3. the same, the plan re-split by its measured slowdown (oobleck.planner.resplit: no layer moves);
4. the same, with the slow node's pipeline's layers moved by its measured slowdown and the batch
   re-split (oobleck.planner.rebalance). The runs are static, so the new bounds need no copies: every
   rank starts from the same seeded step-0 state.

The slow node's speed is measured, not assumed: its median compute per step (the engine's own timing)
unthrottled over throttled, over the other nodes' same ratio. It is not the share: a quota slows a
process more than in proportion (its communication threads wait for the same quota, a period at a
time); on this 2-core host shares 0.75 and 0.5 measured speeds of about 1/2 and 1/4, the issue's. The
ideal is the reference throughput x (sum of node speeds / nodes). Steady state: the steps after the
first `--warmup`. The losses of every run must equal the reference's (the re-split and the move keep
them exact). Needs root and a v1 cpu hierarchy at /sys/fs/cgroup/cpu (it says so and exits 0
otherwise).

    .venv/bin/python bench/stragglers.py [--steps 80] [--node-cpus 0.4] [--shares 0.75,0.5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

NODES = ["a", "b", "c", "d"]
SLOW = "c"


def plan_and_config(microbatches: int):
    from oobleck.api.profile import ClusterShape
    from oobleck.planner import instantiate
    from oobleck.planner.templates import generate_templates
    from oobleck.runtime.train.config import WorkerConfig, build_model
    from oobleck.runtime.train.profiler import profile_model

    config = WorkerConfig(job="bench", microbatch_size=2, gradient_sum_dtype="float64", device="cpu")
    profile = profile_model(build_model(config), config.microbatch_size, __import__("torch").device("cpu"))
    cluster = ClusterShape(
        nodes=4, gpus_per_node=1, gpu_memory_bytes=1 << 34, intra_node_bandwidth=1e11, inter_node_bandwidth=1e10
    )
    templates = generate_templates(profile, cluster, f=1, global_microbatches=microbatches, min_nodes_per_pipeline=2)
    plan = instantiate([t for t in templates if t.nodes == 2], NODES, 1, microbatches, "bench")
    return plan, config, profile


def run(workdir: Path, config, plan, steps: int, cpus: dict[str, float]) -> dict:
    """Every rank of `plan` as a worker process, node n's held to `cpus[n]` CPUs."""
    from torch.distributed import TCPStore

    from oobleck_dev import cpulimit, preforked

    workdir.mkdir(parents=True)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    (workdir / "config.json").write_text(config.model_copy(update={"steps": steps}).model_dump_json())
    (workdir / "plan.json").write_text(plan.to_json())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    processes: dict = {}
    quotas: list = []
    for a in plan.ranks:
        command = ["-m", "oobleck.runtime", "worker", "--config", str(workdir / "config.json")]
        command += ["--plan", str(workdir / "plan.json"), "--store", f"127.0.0.1:{store.port}"]
        command += ["--node", a.node, "--gpu", str(a.gpu), "--losses", str(workdir / "losses.jsonl")]
        # The worker's own CLI entry in a fork of an interpreter that imported torch once (oobleck_dev.preforked):
        # the figures are steady-state steps, and a fresh import per rank and round was most of the run's time
        # (the throttled rank's import alone took seconds at its quota).
        processes[a.node] = preforked.start(command, workdir / f"{a.node}.log", env, new_session=True)
    try:
        for node, process in processes.items():
            quota = cpulimit.CpuQuota.create(f"bench-{node}-{uuid.uuid4().hex[:8]}")
            assert quota is not None, cpulimit.available()
            quotas.append(quota)
            assert process.pid is not None and quota.throttle([process.pid], cpus[node]), f"node {node} not held"
        for node, process in processes.items():
            if (code := process.wait(timeout=900)) != 0:
                raise SystemExit(f"worker {node} exited {code}: {(workdir / f'{node}.log').read_text()[-2000:]}")
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
        time.sleep(0.2)
        for quota in quotas:
            quota.release()
    losses = [json.loads(line) for line in (workdir / "losses.jsonl").read_text().splitlines()]
    compute = {}
    for node in NODES:
        records = [
            json.loads(line) for line in (workdir / f"{node}.log").read_text().splitlines() if line.startswith("{")
        ]
        compute[node] = [r["compute"] for r in records if r.get("event") == "step"]
    return {"losses": losses, "compute": compute}


def throughput(result: dict, warmup: int, samples: int) -> float:
    """Samples per second over the steps after `warmup` (the logging rank's step times)."""
    times = sorted((r["step"], r["time"]) for r in result["losses"])
    (first, began), (last, ended) = times[warmup], times[-1]
    return (last - first) * samples / (ended - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument(
        "--node-cpus",
        type=float,
        default=0.4,
        help="CPUs each node's process may use: 4 nodes at 0.4 leave room on 2 cores, so no node waits for another's CPU",
    )
    parser.add_argument(
        "--shares",
        default="0.75,0.5",
        help="comma-separated shares of --node-cpus the slow node gets, one level per round",
    )
    parser.add_argument("--quick", action="store_true", help="a short run at one level (the suite's smoke test)")
    parser.add_argument("--out", default=None, help="also write the figures here (JSON)")
    args = parser.parse_args()
    if not 0 < args.node_cpus <= 1:
        parser.error(f"--node-cpus: must be in (0, 1] (four nodes share the host's cores), got {args.node_cpus}")
    try:
        shares = [float(c) for c in args.shares.split(",")]
    except ValueError:
        parser.error(f"--shares: comma-separated numbers, got {args.shares!r}")
    if not all(0 < c <= 1 for c in shares):
        parser.error(f"--shares: each must be in (0, 1], got {args.shares!r}")
    if args.steps <= args.warmup + 1:
        parser.error(f"--steps: must exceed --warmup + 1 ({args.warmup + 1}), got {args.steps}")
    if args.quick:
        args.steps, args.warmup, shares = 14, 4, shares[:1]
    from oobleck.planner.rebalance import rebalance
    from oobleck.planner.resplit import resplit
    from oobleck_dev import cpulimit

    if (why := cpulimit.available()) is not None:
        print(f"skipped: {why}")
        return
    plan, config, profile = plan_and_config(args.microbatches)
    samples = args.microbatches * config.microbatch_size
    print(
        f"plan: pipelines {[p.nodes for p in plan.pipelines]}, {args.microbatches} microbatches of {config.microbatch_size}"
    )
    figures: dict = {"node_cpus": args.node_cpus, "levels": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        held = dict.fromkeys(NODES, args.node_cpus)
        even = run(root / "even", config, plan, args.steps, held)
        base = throughput(even, args.warmup, samples)
        before = [r["loss"] for r in sorted(even["losses"], key=lambda r: r["step"])]
        print(f"unthrottled        {base:8.1f} samples/s  (every node at {args.node_cpus} CPUs)")
        for share in shares:
            cpus = {**held, SLOW: args.node_cpus * share}
            slow = run(root / f"slow-{share}", config, plan, args.steps, cpus)
            slowdown = statistics.median(slow["compute"][SLOW][args.warmup :]) / statistics.median(
                even["compute"][SLOW][args.warmup :]
            )
            others = [
                statistics.median(slow["compute"][n][args.warmup :])
                / statistics.median(even["compute"][n][args.warmup :])
                for n in NODES
                if n != SLOW
            ]
            relative = slowdown / statistics.median(others)
            split = resplit(plan, {SLOW: relative}) or plan
            moved = rebalance(plan, profile, {SLOW: relative}) or plan
            moved = moved.model_copy(update={"copies": []})  # static runs: every rank starts from step 0's state
            resplit_run = run(root / f"resplit-{share}", config, split, args.steps, cpus)
            moved_run = run(root / f"moved-{share}", config, moved, args.steps, cpus)
            speeds = [1.0 / relative if n == SLOW else 1.0 for n in NODES]
            ideal = base * sum(speeds) / len(NODES)
            without = throughput(slow, args.warmup, samples)
            with_resplit = throughput(resplit_run, args.warmup, samples)
            with_moved = throughput(moved_run, args.warmup, samples)
            same = all(
                len(before) == len(after) == args.steps
                and all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(before, after))
                for after in (
                    [r["loss"] for r in sorted(result["losses"], key=lambda r: r["step"])]
                    for result in (resplit_run, moved_run)
                )
            )
            stages = [(s.start, s.end) for s in moved.pipelines[1].stages]
            print(
                f"node {SLOW} held to {cpus[SLOW]:.3f} CPUs: slowdown {relative:.2f} against the other nodes"
                f" (speed {1 / relative:.2f})"
            )
            print(f"  ideal              {ideal:8.1f} samples/s  (unthrottled x {sum(speeds):.2f} / {len(NODES)})")
            print(f"  without mitigation {without:8.1f} samples/s  {without / ideal:6.1%} of ideal")
            print(
                f"  with re-split      {with_resplit:8.1f} samples/s  {with_resplit / ideal:6.1%} of ideal"
                f"  ({[p.microbatches for p in split.pipelines]} microbatches)"
            )
            print(
                f"  with layers moved  {with_moved:8.1f} samples/s  {with_moved / ideal:6.1%} of ideal"
                f"  (c, d stages {stages}, {[p.microbatches for p in moved.pipelines]} microbatches)"
            )
            print(f"  losses equal to the unthrottled run's: {same} ({args.steps} steps, rtol 1e-5)")
            figures["levels"].append(
                {
                    "share": share,
                    "cpus": cpus[SLOW],
                    "slowdown": relative,
                    "of_ideal": {
                        "none": without / ideal,
                        "resplit": with_resplit / ideal,
                        "moved": with_moved / ideal,
                    },
                    "losses_equal": same,
                }
            )
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
