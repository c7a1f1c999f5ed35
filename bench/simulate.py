"""Benchmark: how long `oobleck simulate` takes for a week of independent node failures on a large cluster.

    .venv/bin/python bench/simulate.py [--nodes 1024] [--gpus-per-node 8] [--days 7] [--quick]

The trace: every node fails independently with a mean time between failures of 264 days (Llama 3's
pre-training: 419 unexpected interruptions in 54 days on 16,384 GPUs = 2,048 nodes of 8) and is back
an hour later; GPT-3 175B, f = 3, global batch one sample per node (1024 at 1024 nodes: with
bench/planner_plans.py's 1536 = 48 pipelines x m_ref 32 every pipeline is memory-capped, and any lost node
slows the whole job by 58 %). Prints the events, each policy's goodput and the wall time of each
policy, and the ratio of the whole simulation to the 10 s target; the baseline measured in the same run
is the planner's own first plan (instantiation) on the same cluster. --quick: 64 nodes, 1 day (seconds).
"""

from __future__ import annotations

import argparse
import time

from oobleck.planner.synthetic import GPT3, gpt_profile
from oobleck.simulate import Costs, Job, simulate, traces

LLAMA3_NODE_MTBF_S = 54 * 86400 * 2048 / 419
TARGET_S = 10.0


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1024)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--model", default="gpt3-175b", choices=sorted(GPT3))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="64 nodes, 1 day: seconds (the test suite runs it)")
    args = parser.parse_args(argv)
    if args.quick:
        args.nodes, args.days = 64, 1.0
    profile = gpt_profile(GPT3[args.model], seq_len=2048, microbatch_size=1, gpu_flops=400e12, hbm_bandwidth=3.35e12)
    job = Job(profile, args.gpus_per_node, 80 << 30, 450e9, 50e9, f=3, global_batch=max(64, args.nodes), m_ref=32)
    trace = traces.mtbf(args.nodes, LLAMA3_NODE_MTBF_S, 3600.0, args.days * 86400, args.seed)
    print(
        f"{args.model} on {args.nodes} x {args.gpus_per_node} GPUs, {args.days:g} days: {trace.losses()} failures, "
        f"{len(trace.events) - trace.losses()} returns (node MTBF {LLAMA3_NODE_MTBF_S / 86400:.0f} d, repair 1 h)"
    )
    start = time.perf_counter()
    simulate(trace, job, Costs(), policies=())
    setup = time.perf_counter() - start
    start, cpu = time.perf_counter(), time.process_time()
    result = simulate(trace, job, Costs())
    total, cpu = time.perf_counter() - start, time.process_time() - cpu
    for name, summary in result.summaries.items():
        print(f"  {name:24s} goodput {summary.goodput * 100:6.2f} %  {summary.note}")
    print(f"setup alone (templates + first plan, the baseline): {setup:.2f} s")
    print(
        f"whole simulation, 4 policies: {total:.2f} s wall ({cpu:.2f} s CPU) = {total / setup:.1f}x the setup; "
        f"{total / TARGET_S:.2f} of the {TARGET_S:.0f} s target"
    )
    times = {"setup": setup, "total": total, "cpu": cpu}
    return times


if __name__ == "__main__":
    main()
