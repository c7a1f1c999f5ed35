"""Benchmark: instantiation + batch distribution, and reconfiguration, for a large cluster.

    .venv/bin/python bench/planner_plans.py [--nodes 1024] [--microbatches 1536] [--f 3] [--model gpt3-175b]
    .venv/bin/python bench/planner_plans.py --quick      # 128 nodes, a few runs: seconds (what the tests run)

Prints, for N nodes: the time to choose the pipelines and split the batch (the planning itself) over every
usable template size, and over the sizes n0 .. 2*n0-1 only (the rule before: the baseline, same run), with
the iteration time each reaches; the time to materialise the validated Plan document; the time to choose the next layout (candidates, scoring, copy
plan) after losing 1 and 8 nodes, and to materialise that plan; each with the compiled core and with
the pure-Python reference, and the speed-up between them. Times are the median of --repeat runs, with the
fastest run in brackets (the figure least disturbed by other load on the machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from oobleck.api.profile import ClusterShape
from oobleck.planner.errors import PlanningError
from oobleck.planner.instantiate import choose, instantiate, split_batch, template_cost
from oobleck.planner.reconfigure import next_layout, reconfigure
from oobleck.planner.synthetic import GPT3, gpt_profile
from oobleck.planner.templates import generate_templates


@dataclass(frozen=True)
class Timing:
    median_ms: float
    fastest_ms: float  # the figure least disturbed by other load on the machine

    def __str__(self) -> str:
        return f"{self.median_ms:9.3f} ({self.fastest_ms:8.3f})"


def measure(action: Callable[[], object], repeat: int) -> Timing:
    """Wall time of `action` over `repeat` runs, after one warm-up run."""
    action()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        action()
        times.append((time.perf_counter() - start) * 1e3)
    return Timing(statistics.median(times), min(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1024)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=1536)
    parser.add_argument("--m-ref", type=int, default=32, help="microbatches the templates are optimised for")
    parser.add_argument("--f", type=int, default=3)
    parser.add_argument("--model", default="gpt3-175b", choices=sorted(GPT3))
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--reference-repeat", type=int, default=3)
    parser.add_argument(
        "--microbatch-size", type=int, default=None, help="limit stages to GPU counts dividing it (default: any)"
    )
    parser.add_argument("--quick", action="store_true", help="128 nodes, 192 microbatches, few runs: what tests run")
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.microbatches, args.repeat, args.reference_repeat = 128, 192, 3, 1

    profile = gpt_profile(GPT3[args.model], seq_len=2048, microbatch_size=1, gpu_flops=400e12, hbm_bandwidth=3.35e12)
    cluster = ClusterShape(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        gpu_memory_bytes=80 << 30,
        intra_node_bandwidth=450e9,
        inter_node_bandwidth=50e9,
    )
    start = time.perf_counter()
    templates = generate_templates(profile, cluster, args.f, args.m_ref, microbatch_size=args.microbatch_size)
    print(
        f"{args.model}: {len(profile.layers)} layers; N = {args.nodes} nodes x {args.gpus_per_node} GPUs; "
        f"f = {args.f}; B = {args.microbatches} microbatches"
    )
    print(
        f"templates of {[t.nodes for t in templates]} nodes ({(time.perf_counter() - start) * 1e3:.0f} ms, not timed below)"
    )

    nodes = [str(i) for i in range(args.nodes)]
    ordered = sorted(templates, key=lambda t: -t.nodes)
    costs = [template_cost(t) for t in ordered]
    n0 = min(t.nodes for t in templates)
    old_costs = [c for c in costs if c.nodes < 2 * n0]  # the rule before issue 12

    def planning(engine: str, costs: list = costs) -> Callable[[], object]:
        def run() -> object:
            choice = choose(costs, args.nodes, args.f, args.microbatches, allow_degraded=False, engine=engine)
            per_pipeline = [c for c, count in zip(costs, choice.counts) for _ in range(count)]
            return split_batch(per_pipeline, args.microbatches, engine=engine)

        return run

    plan = instantiate(templates, nodes, args.f, args.microbatches, "bench")
    used = sorted({p.template_nodes for p in plan.pipelines})
    print(
        f"plan: {len(plan.pipelines)} pipelines of {used} nodes, {plan.world_size} ranks, "
        f"iteration {plan.iteration_ms:.1f} ms"
    )
    try:
        old_z = f"{choose(old_costs, args.nodes, args.f, args.microbatches, allow_degraded=False, engine='compiled').iteration_ms:.1f} ms"
    except PlanningError as error:
        old_z = f"no plan ({error})"
    print(f"with sizes {n0}..{2 * n0 - 1} only (the rule before): iteration {old_z}")
    old_templates = [t for t in templates if t.nodes < 2 * n0]
    try:
        old_plan = instantiate(old_templates, nodes, args.f, args.microbatches, "bench")
    except PlanningError:
        old_plan = None
    print(f"load average (1 min) before timing: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    rows: list[tuple[str, Timing, Timing | None]] = [
        (
            "instantiation + batch distribution",
            measure(planning("compiled"), args.repeat),
            measure(planning("reference"), args.reference_repeat),
        ),
        (
            f"  the same over sizes {n0}..{2 * n0 - 1} only (before)",
            measure(planning("compiled", old_costs), args.repeat),
            None,
        ),
        (
            "  + Plan document (validated pydantic model)",
            measure(lambda: instantiate(templates, nodes, args.f, args.microbatches, "bench"), args.repeat),
            None,
        ),
    ]
    for count in (1, 8):
        if count <= len(plan.pipelines):  # the last node of `count` pipelines spread over the plan
            lost = [plan.pipelines[(k * len(plan.pipelines)) // count].nodes[-1] for k in range(count)]
        else:
            lost = [plan.nodes[(k * len(plan.nodes)) // count] for k in range(count)]
        layout = next_layout(plan, templates, profile, lost=lost, bandwidth=cluster.inter_node_bandwidth)
        chosen = layout.considered[layout.chosen]
        print(
            f"lose {count}: {chosen.reason}, {chosen.pipelines} pipelines, {len(layout.copies)} copies "
            f"({chosen.copy_bytes / 2**30:.1f} GiB, the busiest node {chosen.busiest_bytes / 2**30:.1f} GiB), "
            f"iteration {chosen.iteration_ms:.1f} ms; candidates (copy GiB, busiest GiB, iteration ms): "
            + ", ".join(
                f"{c.reason} ({c.copy_bytes / 2**30:.1f}, {c.busiest_bytes / 2**30:.1f}, {c.iteration_ms:.1f})"
                for c in layout.considered
            )
        )

        def again(engine: str, lost: list[str] = lost) -> Callable[[], object]:
            return lambda: next_layout(
                plan, templates, profile, lost=lost, bandwidth=cluster.inter_node_bandwidth, engine=engine
            )

        def whole(lost: list[str] = lost) -> object:
            return reconfigure(plan, templates, profile, lost=lost, bandwidth=cluster.inter_node_bandwidth)

        rows.append(
            (
                f"reconfiguration, {count} of {args.nodes} nodes lost",
                measure(again("compiled"), args.repeat),
                measure(again("reference"), args.reference_repeat),
            )
        )
        rows.append((f"  + Plan document ({count} lost)", measure(whole, args.repeat), None))
        if old_plan is not None:  # the same losses (by position) on the plan the sizes n0..2n0-1 give
            old_lost = [old_plan.nodes[(k * len(old_plan.nodes)) // count] for k in range(count)]
            rows.append(
                (
                    f"  sizes {n0}..{2 * n0 - 1} only (before), {count} lost",
                    measure(
                        lambda lost=old_lost: next_layout(
                            old_plan, old_templates, profile, lost=lost, bandwidth=cluster.inter_node_bandwidth
                        ),
                        args.repeat,
                    ),
                    None,
                )
            )

    print()
    print(f"milliseconds, median (fastest); load average (1 min) now {os.getloadavg()[0]:.1f}")
    print(f"{'':<46} {'compiled':>20} {'reference':>20} {'speed-up':>9}")
    for name, fast, slow in rows:
        line = f"{name:<46} {fast!s:>20}"
        if slow is not None:
            line += f" {slow!s:>20} {slow.median_ms / fast.median_ms:>8.1f}x"
        print(line)


if __name__ == "__main__":
    main()
