"""`oobleck launch`: its command line."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path

from oobleck.runtime.backends.local.config import DEFAULT_COPY_BANDWIDTH, Fault, LaunchOptions
from oobleck.runtime.backends.local.launcher import Launcher
from oobleck.runtime.backends.local.summary import format_summary


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("launch", help="run an elastic job locally: coordinator, plan controller, workers")
    parser.add_argument("--nodes", type=int, required=True, help="nodes to start with (one worker per GPU)")
    parser.add_argument("--gpus-per-node", type=int, default=1)
    parser.add_argument("--f", type=int, default=1, help="pipeline failures to tolerate")
    parser.add_argument("--steps", type=int, default=20, help="global steps to train")
    parser.add_argument("--model", default="tiny-gpt", help="model name or module:function")
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8, help="global microbatches per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu")
    parser.add_argument("--config", type=Path, default=None, help="base worker config (JSON or YAML)")
    parser.add_argument("--gpu-memory", type=int, default=80 << 30, help="bytes per GPU for the planner")
    parser.add_argument(
        "--max-tensor-parallel",
        type=int,
        default=1,
        help="the largest tensor-parallel degree a stage may take (a power of two <= --gpus-per-node)",
    )
    parser.add_argument(
        "--copy-bandwidth",
        type=float,
        default=DEFAULT_COPY_BANDWIDTH,
        help="bytes/s between nodes: prices layer copies when re-planning",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="model profile JSON (from `oobleck profile`); default: measure at start",
    )
    parser.add_argument("--kill-rank", type=int, action="append", default=[], help="SIGKILL this rank (repeatable)")
    parser.add_argument("--kill-node", action="append", default=[], help="SIGKILL this node's workers (repeatable)")
    parser.add_argument("--at-step", type=int, default=None, help="... when it starts this step (all kills at once)")
    parser.add_argument("--kill-delay", type=float, default=0.0, help="... this many seconds into the step")
    parser.add_argument("--add-node-at-step", type=int, action="append", default=[], help="add a node at this step")
    parser.add_argument(
        "--restart-coordinator-at-step",
        type=int,
        default=None,
        help="lose the coordinator (store) at this step and recreate it",
    )
    parser.add_argument("--workdir", type=Path, default=Path("oobleck-launch"), help="logs, plan, losses, dumps")
    parser.add_argument("--timeout", type=float, default=600.0, help="fail the job after this many seconds")
    parser.add_argument(
        "--dead-after",
        type=float,
        default=1.5,
        help="heartbeat silence that means dead, seconds (margin for a loaded machine)",
    )
    parser.add_argument(
        "--heartbeats-only",
        action="store_true",
        help="detect failures only through the workers' heartbeats, not process exits",
    )
    parser.add_argument(
        "--snapshot-interval",
        type=int,
        default=None,
        help="in-memory peer snapshots every this many steps (0: off; default: the config's)",
    )
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="write checkpoints to this directory")
    parser.add_argument("--checkpoint-interval", type=int, default=None, help="... every this many steps")
    parser.add_argument(
        "--gradient-sum-dtype",
        choices=["float32", "float64"],
        default=None,
        help="accumulator of the gradient sums (default: the config's, float32); float64 matches "
        "single-process training to rounding",
    )
    parser.add_argument(
        "--controller",
        choices=["reports", "layouts"],
        default="reports",
        help="base copies on the workers' reported holdings, or on plans alone as the operator "
        "does (the workers then settle the sources among themselves)",
    )
    parser.add_argument("--summary", type=Path, default=None, help="also write the summary here (JSON)")
    parser.set_defaults(func=run_launch)


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    faults: tuple[Fault, ...] = ()
    if args.kill_rank or args.kill_node:
        if args.at_step is None:
            raise ValueError("--at-step: required with --kill-rank / --kill-node")
        faults = (
            Fault(
                at_step=args.at_step, ranks=tuple(args.kill_rank), nodes=tuple(args.kill_node), delay_s=args.kill_delay
            ),
        )
    elif args.at_step is not None:
        raise ValueError("--at-step: given without --kill-rank or --kill-node")
    return LaunchOptions(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        f=args.f,
        steps=args.steps,
        model=args.model,
        microbatch_size=args.microbatch_size,
        microbatches=args.microbatches,
        seed=args.seed,
        device=args.device,
        config=args.config,
        profile=args.profile,
        gpu_memory=args.gpu_memory,
        max_tensor_parallel=args.max_tensor_parallel,
        copy_bandwidth=args.copy_bandwidth,
        faults=faults,
        add_node_at_step=tuple(args.add_node_at_step),
        restart_coordinator_at_step=args.restart_coordinator_at_step,
        workdir=args.workdir,
        timeout_s=args.timeout,
        dead_after_s=args.dead_after,
        controller=args.controller,
        detect_exits=not args.heartbeats_only,
        snapshot_interval=args.snapshot_interval,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_interval=args.checkpoint_interval,
        gradient_sum_dtype=args.gradient_sum_dtype,
    )


def run_launch(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(message)s", stream=sys.stderr)
    try:
        options = options_from_args(args)
    except ValueError as error:
        print(f"oobleck launch: {error}", file=sys.stderr)
        return 2
    # SIGTERM takes the Ctrl-C path: every child is killed before the launcher exits.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    summary = Launcher(options).run()
    print(format_summary(summary))
    if args.summary:
        args.summary.write_text(json.dumps(summary.as_dict(), indent=2))
    return 0 if summary.ok else 1


def register(subparsers) -> None:
    """Add `oobleck launch` to the command line."""
    add_parser(subparsers)
