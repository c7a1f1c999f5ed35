"""Benchmark: pipeline templates for a 96-layer GPT-style model (planner_cy/templates.py).

Prints, pinned to one CPU core:
- G = 1: the best template of every size 1..64 nodes (total ms, target <= 100 ms);
- G = 8: every size 1..128 nodes (total ms, target <= 1000 ms; a node holds >= 1 layer, so 97..128 have none);
- the speed-up of the compiled core over the pure-Python reference, on the same inputs, after checking that
  both return the same layouts;
- tensor parallelism: the same G = 8 sizes with stages of tensor-parallel degree up to 8 against none (the
  baseline, same run), and GPT-3 175B's template generation for N = 1024 x 8 GPUs (f = 3, m_ref = 32) likewise.
"Total" is what a caller pays: quantising the profile, the search, and building the pydantic Templates.

Run: .venv/bin/python bench/planner_templates.py [--repeat N] [--m-ref M] [--quick]
(--quick: a 22-layer model, sizes 1..16 and 1..8, GPT-3 175B on 128 nodes, one run each: seconds, what the tests run)
"""

from __future__ import annotations

import argparse
import os
import time

from oobleck.api.profile import ClusterShape
from oobleck.planner import templates as T
from oobleck.planner.ref_templates import search_layouts_ref
from oobleck.planner.synthetic import GPTShape, gpt_profile

# 94 blocks + embedding + head = 96 planner layers; a GPT-3 6.7B-wide block (h = 4096, 32 heads), 2048 tokens.
SHAPE = GPTShape(blocks=94, hidden=4096, heads=32)
# An H100-class GPU: ~40% of the 989 TFLOP/s dense fp16 peak sustained, 3.35 TB/s HBM, 80 GiB;
# NVLink 450 GB/s inside a node, one 400 Gb/s NIC per GPU between nodes.
GPU_FLOPS, HBM, MEMORY, NVLINK, NETWORK = 400e12, 3.35e12, 80 * 2**30, 450e9, 50e9


def timed(fn, repeat: int) -> tuple[float, object]:
    """Best wall time of `repeat` runs in ms (the least disturbed by other processes) and the last result."""
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure; the best is printed")
    parser.add_argument(
        "--m-ref", type=int, default=T.DEFAULT_M_REF, help="microbatches the templates are optimised for"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, one run: what the tests run")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    shape = GPTShape(blocks=20, hidden=4096, heads=32) if args.quick else SHAPE
    if args.quick:
        args.repeat = 1
    profile = gpt_profile(shape, seq_len=2048, microbatch_size=1, gpu_flops=GPU_FLOPS, hbm_bandwidth=HBM)
    print(f"model: {len(profile.layers)} layers ({profile.model}), m_ref = {args.m_ref}, one core")

    def cluster(G: int, N: int) -> ClusterShape:
        return ClusterShape(
            nodes=N, gpus_per_node=G, gpu_memory_bytes=MEMORY, intra_node_bandwidth=NVLINK, inter_node_bandwidth=NETWORK
        )

    for G, N, target in ((1, 16, 100), (8, 8, 1000)) if args.quick else ((1, 64, 100), (8, 128, 1000)):
        shape = cluster(G, N)
        total_ms, templates = timed(lambda: T.all_templates(profile, shape, m_ref=args.m_ref), args.repeat)
        tables = T.cost_tables(profile, shape, args.m_ref)
        search_ms, _ = timed(lambda: T.search_layouts(tables, N), args.repeat)
        sizes = [t.nodes for t in templates]
        verdict = "ok" if total_ms <= target else "OVER TARGET"
        print(
            f"G={G}: sizes 1..{N}: {total_ms:.1f} ms total (search {search_ms:.1f} ms), target <= {target} ms: {verdict}; "
            f"{len(sizes)} templates ({min(sizes)}..{max(sizes)} nodes), T({args.m_ref}) at {max(sizes)} nodes: {templates[-1].iteration_ms:.1f} ms"
        )

    tensor_parallel(profile, cluster(8, 8 if args.quick else 128), args)
    gpt3_175b(128 if args.quick else 1024, args)

    # the reference needs ~10 s for G = 8 on 4 nodes
    for G, N in ((1, 8),) if args.quick else ((1, 64), (8, 4)):
        tables = T.cost_tables(profile, cluster(G, N), args.m_ref)
        compiled_ms, compiled = timed(lambda: T.search_layouts(tables, N), args.repeat)
        reference_ms, reference = timed(lambda: search_layouts_ref(tables, N), 1)
        if compiled != reference:
            print(f"G={G} N={N}: compiled and reference layouts DIFFER")
            return 1
        print(
            f"speed-up G={G}, sizes 1..{N}: compiled {compiled_ms:.2f} ms, reference {reference_ms:.0f} ms: "
            f"x{reference_ms / compiled_ms:.0f} (same layouts)"
        )
    return 0


def tensor_parallel(profile, shape: ClusterShape, args: argparse.Namespace) -> None:
    """Every size with stages of degree t <= 8 against t = 1 only, same profile and cluster."""
    plain_ms, plain = timed(lambda: T.all_templates(profile, shape, m_ref=args.m_ref), args.repeat)
    tp_ms, with_tp = timed(lambda: T.all_templates(profile, shape, m_ref=args.m_ref, max_tp=8), args.repeat)
    print(
        f"G=8 tensor-parallel (t <= 8) vs none, sizes 1..{shape.nodes}: {tp_ms:.1f} ms vs {plain_ms:.1f} ms: "
        f"x{tp_ms / plain_ms:.2f}; T({args.m_ref}) at {with_tp[-1].nodes} nodes: {with_tp[-1].iteration_ms:.1f} ms vs "
        f"{plain[-1].iteration_ms:.1f} ms"
    )


def gpt3_175b(nodes: int, args: argparse.Namespace) -> None:
    """generate_templates for GPT-3 175B (98 layers) on `nodes` x 8 GPUs, f = 3, m_ref = 32, t <= 8 vs t = 1."""
    profile = gpt_profile(
        GPTShape(blocks=96, hidden=12288, heads=96),
        seq_len=2048,
        microbatch_size=1,
        gpu_flops=GPU_FLOPS,
        hbm_bandwidth=HBM,
    )
    shape = ClusterShape(
        nodes=nodes, gpus_per_node=8, gpu_memory_bytes=MEMORY, intra_node_bandwidth=NVLINK, inter_node_bandwidth=NETWORK
    )
    plain_ms, plain = timed(lambda: T.generate_templates(profile, shape, 3, 32), args.repeat)
    tp_ms, with_tp = timed(lambda: T.generate_templates(profile, shape, 3, 32, max_tp=8), args.repeat)
    print(
        f"GPT-3 175B templates, N = {nodes} x 8 GPUs, f = 3: t <= 8 {tp_ms:.1f} ms ({len(with_tp)} sizes) vs none "
        f"{plain_ms:.1f} ms ({len(plain)} sizes): x{tp_ms / plain_ms:.2f}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
