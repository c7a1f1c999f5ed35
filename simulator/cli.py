"""`oobleck simulate`: goodput of a job under a failure trace, for oobleck and three peers.

    oobleck simulate --model gpt3-2.7b --trace artifact-30n-10m --plot out.png
    oobleck simulate --model gpt3-6.7b --nodes 64 --mtbf 2d --repair 1h --duration 7d --seed 3 --json -
    oobleck simulate --profile profile.json --nodes 32 --spot-interval 2h --spot-fraction 0.25 --spot-return 30m
    oobleck simulate --model gpt3-1.3b --nodes 32 --mtbf 12h --repair 10m --duration 3d --recommend-f

Durations take s, m, h or d (default seconds); bytes and bandwidths take k/M/G/T(i)B. Invalid input
(flags, trace files, a job the planner cannot place) exits 2 with a message naming the flag, file, line
or field.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from oobleck.planner.errors import PlanningError

_BYTES = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_SECONDS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


class InputError(Exception):
    """Bad command-line input; the message starts with the flag it concerns."""


def _number(text: str, flag: str, units: dict[str, float], pattern: str, example: str) -> float:
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*" + pattern + r"\s*", text.lower())
    if match is None or match.group(2) not in units:
        raise InputError(f"{flag}: expected a number with an optional unit (e.g. {example}), got {text!r}")
    try:
        value = float(match.group(1)) * units[match.group(2)]
    except ValueError:
        raise InputError(f"{flag}: expected a number, got {text!r}") from None
    if not value > 0:
        raise InputError(f"{flag}: must be > 0, got {text!r}")
    return value


def seconds(text: str, flag: str) -> float:
    return _number(text, flag, _SECONDS, r"([a-z]*)", "90, 10m, 6h, 7d")


def quantity(text: str, flag: str) -> float:
    return _number(text, flag, _BYTES, r"([kmgt]?i?)b?(?:/s)?", "40GiB, 25GB, 1e9")


def register(subparsers: argparse._SubParsersAction) -> None:
    from .traces import TRACES_DIR

    bundled = ", ".join(sorted(p.stem for p in TRACES_DIR.glob("*.csv")))
    p = subparsers.add_parser(
        "simulate",
        help="goodput under failure traces: oobleck vs checkpoint-restart, redundant computation, replica dropping",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = p.add_argument_group("model (a measured profile, or a synthetic GPT)")
    model.add_argument("--profile", help="a profile JSON file (`oobleck profile` writes one)")
    model.add_argument("--model", default="gpt3-350m", help="synthetic GPT-3 size (default gpt3-350m)")
    model.add_argument("--seq-len", type=int, default=2048)
    model.add_argument("--microbatch-size", type=int, default=1, help="samples per microbatch (synthetic)")
    model.add_argument(
        "--gpu-flops", default="125e12", help="sustained FLOP/s of one GPU (default 125e12: an A100 at ~40 %% MFU)"
    )
    model.add_argument("--hbm-bandwidth", default="1.5TB", help="GPU memory bandwidth, bytes/s (default 1.5TB)")
    cluster = p.add_argument_group("cluster")
    cluster.add_argument("--nodes", type=int, default=30, help="nodes at start for generated traces (default 30)")
    cluster.add_argument("--gpus-per-node", type=int, default=1)
    cluster.add_argument("--gpu-memory", default="40GiB")
    cluster.add_argument("--intra-bandwidth", default="300GB", help="bytes/s between GPUs of a node")
    cluster.add_argument("--inter-bandwidth", default="6.25GB", help="bytes/s between nodes (default 50 Gb/s)")
    job = p.add_argument_group("job")
    job.add_argument("--f", type=int, default=1, help="pipeline losses oobleck tolerates without rollback")
    job.add_argument("--global-batch", type=int, default=512, help="samples per iteration")
    job.add_argument("--m-ref", type=int, default=None, help="microbatches the templates are optimised for")
    trace = p.add_argument_group("availability trace (a file, or generated from a seed)")
    trace.add_argument("--trace", help=f"TIME_MS,add|remove,NODE file, or a bundled one: {bundled}")
    trace.add_argument("--mtbf", help="independent failures: mean time between failures of one node")
    trace.add_argument("--repair", default="1h", help="with --mtbf: a failed node is back after this long")
    trace.add_argument("--spot-interval", help="preemption waves: mean time between waves")
    trace.add_argument("--spot-fraction", type=float, default=0.2, help="a wave takes up to this share of nodes")
    trace.add_argument("--spot-return", default="10m", help="preempted nodes are back after this long")
    trace.add_argument("--duration", help="simulated time (generated traces: default 1d; files: see README)")
    trace.add_argument("--seed", type=int, default=0)
    costs = p.add_argument_group("costs (defaults and their sources: README, Simulating goodput)")
    costs.add_argument("--detection", default="0.04", help="oobleck: failure -> known (s)")
    costs.add_argument("--plan-time", default="0.11", help="oobleck: known -> next plan published (s)")
    costs.add_argument("--rendezvous", default="0.17", help="oobleck: groups rebuilt + holdings exchanged (s)")
    costs.add_argument("--snapshot-every", type=int, default=10, help="oobleck: steps between in-memory snapshots")
    costs.add_argument(
        "--checkpoint-interval", help="checkpoint-restart: training between checkpoints (default: Young's optimum)"
    )
    costs.add_argument("--storage-bandwidth", default="2GB", help="checkpoint write/read bytes/s per node")
    costs.add_argument("--restart", default="4.75", help="checkpoint-restart: fixed restart cost (s)")
    costs.add_argument(
        "--bamboo-slowdown",
        type=float,
        default=None,
        help="redundant computation: steady-state slowdown (default: derived)",
    )
    costs.add_argument("--bamboo-failover", default="1", help="redundant computation: failover pause (s)")
    costs.add_argument("--quorum", default="1", help="replica dropping: quorum change pause (s)")
    out = p.add_argument_group("output")
    out.add_argument("--policies", default=",".join(_policies()), help="comma-separated subset")
    out.add_argument("--json", dest="json_path", help="write the results as JSON to this path ('-': stdout)")
    out.add_argument("--plot", help="write throughput and cumulative samples over time as a PNG")
    out.add_argument("--recommend-f", action="store_true", help="also find the f that maximises oobleck's goodput")
    p.set_defaults(func=run)


def _policies() -> tuple[str, ...]:
    from .engine import POLICIES

    return POLICIES


def _trace(args: argparse.Namespace):
    from . import traces

    duration = seconds(args.duration, "--duration") if args.duration else None
    sources = [
        flag
        for flag, value in (("--trace", args.trace), ("--mtbf", args.mtbf), ("--spot-interval", args.spot_interval))
        if value
    ]
    if len(sources) > 1:
        raise InputError(f"{sources[1]}: give one trace source, got {' and '.join(sources)}")
    if args.trace:
        return traces.load(args.trace, duration)
    if args.nodes < 1:
        raise InputError(f"--nodes: must be >= 1, got {args.nodes}")
    if args.mtbf:
        return traces.mtbf(
            args.nodes, seconds(args.mtbf, "--mtbf"), seconds(args.repair, "--repair"), duration or 86400.0, args.seed
        )
    if args.spot_interval:
        if not 0 < args.spot_fraction <= 1:
            raise InputError(f"--spot-fraction: must be in (0, 1], got {args.spot_fraction}")
        return traces.spot(
            args.nodes,
            seconds(args.spot_interval, "--spot-interval"),
            args.spot_fraction,
            seconds(args.spot_return, "--spot-return"),
            duration or 86400.0,
            args.seed,
        )
    raise InputError("--trace: give a trace: --trace FILE, --mtbf TIME or --spot-interval TIME")


def _job(args: argparse.Namespace):
    from oobleck.planner.profile_io import load_profile
    from oobleck.planner.synthetic import GPT3, gpt_profile

    from .engine import Job

    if args.profile:
        profile = load_profile(args.profile)
    else:
        if args.model not in GPT3:
            raise InputError(f"--model: unknown {args.model!r}; choose from {', '.join(GPT3)}")
        try:
            profile = gpt_profile(
                GPT3[args.model],
                seq_len=args.seq_len,
                microbatch_size=args.microbatch_size,
                gpu_flops=quantity(args.gpu_flops, "--gpu-flops"),
                hbm_bandwidth=quantity(args.hbm_bandwidth, "--hbm-bandwidth"),
                name=args.model,
            )
        except ValueError as error:
            raise InputError(f"--{str(error).split(':')[0].replace('_', '-')}: {error}") from None
    if args.f < 0:
        raise InputError(f"--f: must be >= 0, got {args.f}")
    if args.global_batch < 1 or args.global_batch % profile.microbatch_size:
        raise InputError(
            f"--global-batch: must be a positive multiple of the microbatch size ({profile.microbatch_size}), "
            f"got {args.global_batch}"
        )
    if args.gpus_per_node < 1 or args.gpus_per_node & (args.gpus_per_node - 1):
        raise InputError(f"--gpus-per-node: must be a power of two, got {args.gpus_per_node}")
    return Job(
        profile=profile,
        gpus_per_node=args.gpus_per_node,
        gpu_memory_bytes=int(quantity(args.gpu_memory, "--gpu-memory")),
        intra_node_bandwidth=quantity(args.intra_bandwidth, "--intra-bandwidth"),
        inter_node_bandwidth=quantity(args.inter_bandwidth, "--inter-bandwidth"),
        f=args.f,
        global_batch=args.global_batch,
        m_ref=args.m_ref,
    )


def _costs(args: argparse.Namespace):
    from .costs import BambooCosts, CheckpointCosts, Costs, OobleckCosts, ReplicaCosts

    if args.snapshot_every < 1:
        raise InputError(f"--snapshot-every: must be >= 1, got {args.snapshot_every}")
    if args.bamboo_slowdown is not None and not args.bamboo_slowdown >= 1:
        raise InputError(f"--bamboo-slowdown: must be >= 1, got {args.bamboo_slowdown}")
    return Costs(
        oobleck=OobleckCosts(
            detection_s=seconds(args.detection, "--detection"),
            plan_s=seconds(args.plan_time, "--plan-time"),
            rendezvous_s=seconds(args.rendezvous, "--rendezvous"),
            snapshot_interval_steps=args.snapshot_every,
        ),
        checkpoint=CheckpointCosts(
            interval_s=seconds(args.checkpoint_interval, "--checkpoint-interval") if args.checkpoint_interval else None,
            storage_bandwidth=quantity(args.storage_bandwidth, "--storage-bandwidth"),
            restart_s=seconds(args.restart, "--restart"),
        ),
        bamboo=BambooCosts(
            slowdown=args.bamboo_slowdown, failover_s=seconds(args.bamboo_failover, "--bamboo-failover")
        ),
        replicas=ReplicaCosts(quorum_s=seconds(args.quorum, "--quorum")),
    )


def run(args: argparse.Namespace) -> int:
    from oobleck.planner.profile_io import ProfileError

    from . import report
    from .engine import POLICIES, recommend_f, simulate
    from .planning import NoPipeline
    from .traces import TraceError

    try:
        policies = [name.strip() for name in args.policies.split(",") if name.strip()]
        unknown = [name for name in policies if name not in POLICIES]
        if unknown or not policies:
            raise InputError(f"--policies: unknown {unknown or policies}; choose from {', '.join(POLICIES)}")
        trace = _trace(args)
        job = _job(args)
        costs = _costs(args)
        result = simulate(trace, job, costs, policies)
        recommended = recommend_f(trace, job, costs) if args.recommend_f else None
    except (InputError, TraceError, ProfileError) as error:
        print(f"oobleck simulate: error: {error}", file=sys.stderr)
        return 2
    except (PlanningError, NoPipeline) as error:
        print(f"oobleck simulate: error: the job cannot be planned on this trace's cluster: {error}", file=sys.stderr)
        return 2
    document = report.document(result, recommended)
    if args.json_path == "-":
        json.dump(document, sys.stdout, indent=2)
        print()
    else:
        print(report.table(result))
        if recommended:
            print(
                "recommended f = "
                + f"{recommended[0][0]} (oobleck goodput by f: "
                + ", ".join(f"f={f}: {g * 100:.2f} %" for f, g in sorted(recommended))
                + ")"
            )
        if args.json_path:
            with open(args.json_path, "w") as handle:
                json.dump(document, handle, indent=2)
                handle.write("\n")
    if args.plot:
        report.plot(result, args.plot)
        if args.json_path != "-":
            print(f"plot: {args.plot}")
    return 0
