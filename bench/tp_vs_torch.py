"""A tensor-parallel stage (t = 2, gloo, CPU): the runtime's split layers against torch's own tensor parallelism.

Both sides split the same Llama-family blocks the same way (Megatron's column/row pairs: Q, K, V, gate and up
by columns; the attention output and down projections by rows):
- runtime: `oobleck.runtime.train.tensor_parallel.split_layer` (plain tensors, hand-written autograd);
- torch: `torch.distributed.tensor.parallel.parallelize_module` with `ColwiseParallel` / `RowwiseParallel`
  on a CPU `DeviceMesh` (DTensor parameters, local outputs).

One iteration = a stage's forward and backward of one microbatch (random replicated input, a fixed upstream
gradient) followed by zeroing the gradients. The two sides alternate in pairs of runs; each run's figure is
its median iteration after a warm-up, and the result is the median of the per-pair ratios runtime / torch
with its interquartile range (the same method as bench/vs_torch.py).

usage: .venv/bin/python bench/tp_vs_torch.py [--hidden 512] [--blocks 2] [--repeats 7] [--quick] [--out F]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET = 1.10
"""The issue's bound: a TP = 2 stage at most 10 % slower than torch's own TP on the same model."""


def _llama_fields(hidden: int, blocks: int, seq: int) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": hidden,
        "intermediate_size": hidden * 8 // 3 // 64 * 64 or 64,
        "num_hidden_layers": blocks,
        "num_attention_heads": max(2, hidden // 64),
        "num_key_value_heads": max(2, hidden // 64),
        "max_position_embeddings": seq,
        "tie_word_embeddings": False,
    }


def _rank(args: argparse.Namespace) -> None:
    """One of the two ranks: build, split both ways, time the pairs; rank 0 prints the figures."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    from oobleck.runtime.models.hf import load_transformers
    from oobleck.runtime.train.tensor_parallel import TensorParallelGroup, split_layer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    model = load_transformers(None, _llama_fields(args.hidden, args.blocks, args.seq), seed=0)
    whole = [model.build_layer(i) for i in range(1, args.blocks + 1)]
    ours = [split_layer(copy.deepcopy(b), TensorParallelGroup(dist.group.WORLD, args.rank, 2)) for b in whole]
    # The attention and MLP inputs made replicated DTensors once (torchtitan's PrepareModuleInput), so each
    # region's input gradient is reduced once, not once per projection.
    plan = {
        "layer.self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Replicate()},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        ),
        "layer.mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
        **{f"layer.self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        "layer.self_attn.o_proj": RowwiseParallel(),
        "layer.mlp.gate_proj": ColwiseParallel(),
        "layer.mlp.up_proj": ColwiseParallel(),
        "layer.mlp.down_proj": RowwiseParallel(),
    }
    theirs = [parallelize_module(copy.deepcopy(b), mesh, plan) for b in whole]
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=generator)
    upstream = torch.randn(args.batch, args.seq, args.hidden, generator=generator)

    def forward(blocks: list) -> torch.Tensor:
        h = x
        for block in blocks:
            h = block(h)
        return h

    with torch.no_grad():  # the same model on both sides: equal outputs before any timing
        want, got = forward(ours), forward(theirs)
    error = ((got - want).abs().max() / want.abs().max()).item()
    if error > 1e-5:
        raise SystemExit(f"the two splits disagree: relative error {error:.2e}")

    def run(blocks: list) -> float:
        times = []
        for _ in range(args.iterations):
            dist.barrier()
            start = time.perf_counter()
            h = x.requires_grad_(True)
            for block in blocks:
                h = block(h)
            h.backward(upstream)
            for block in blocks:
                block.zero_grad(set_to_none=True)
            x.grad = None
            times.append(time.perf_counter() - start)
        return statistics.median(times[args.warmup :])

    pairs = [(run(ours), run(theirs)) for _ in range(args.repeats)]
    if args.rank == 0:
        ratios = sorted(a / b for a, b in pairs)
        if len(ratios) > 1:
            q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        else:
            q1 = q3 = ratios[0]
        figures = {
            "ratio": statistics.median(ratios),
            "iqr": [q1, q3],
            "runtime_ms": statistics.median(a for a, _ in pairs) * 1e3,
            "torch_ms": statistics.median(b for _, b in pairs) * 1e3,
            "target": TARGET,
            "output_error": error,
            "shape": {"hidden": args.hidden, "blocks": args.blocks, "seq": args.seq, "batch": args.batch},
        }
        print(json.dumps(figures))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=12, help="iterations per run")
    parser.add_argument("--warmup", type=int, default=3, help="iterations of a run left out of its median")
    parser.add_argument("--repeats", type=int, default=7, help="pairs (runtime, torch)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a small stage, one pair")
    parser.add_argument("--out", default=None, help="also write the figures here (JSON)")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.seq, args.iterations, args.warmup, args.repeats = 128, 32, 4, 1, 1
    if args.rank is not None:
        _rank(args)
        return 0
    port = _free_port()
    shape = ("hidden", "blocks", "seq", "batch", "iterations", "warmup", "repeats")
    child = [sys.executable, __file__, "--port", str(port)]
    child += [f for name in shape for f in (f"--{name}", str(getattr(args, name)))]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([*child, "--rank", str(r)], stdout=subprocess.PIPE, text=True, env=env) for r in range(2)]
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        print("a rank failed", file=sys.stderr)
        return 1
    figures = json.loads(outputs[0].strip().splitlines()[-1])
    print(
        f"TP = 2 stage, {args.blocks} Llama blocks of width {args.hidden}, {args.batch} x {args.seq} tokens, gloo on CPU:"
    )
    print(
        f"  runtime {figures['runtime_ms']:.2f} ms, torch parallelize_module {figures['torch_ms']:.2f} ms per iteration"
    )
    q1, q3 = figures["iqr"]
    verdict = "meets" if figures["ratio"] <= TARGET else "misses"
    print(f"  ratio runtime / torch: {figures['ratio']:.3f} (IQR {q1:.3f}-{q3:.3f}); {verdict} the target <= {TARGET}")
    if args.out:
        Path(args.out).write_text(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
