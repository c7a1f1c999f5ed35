"""`oobleck simulate`: goodput of a job under a failure trace, for oobleck and three peers.

    oobleck simulate --model gpt3-2.7b --trace artifact-30n-10m --plot out.png
    oobleck simulate --model gpt3-6.7b --nodes 64 --mtbf 2d --repair 1h --duration 7d --seed 3 --json -
    oobleck simulate --profile profile.json --nodes 32 --spot-interval 2h --spot-fraction 0.25 --spot-return 30m
    oobleck simulate --model gpt3-1.3b --nodes 32 --mtbf 12h --repair 10m --duration 3d --recommend-f
    oobleck simulate --model bert-large --trace artifact-30n-10m --costs oobleck-artifact
    oobleck simulate --model gpt3-2.7b --spot-pattern gcp --seed 1 --min-nodes-per-pipeline 2
    oobleck simulate --model gpt3-2.7b --trace stragglers-32n-2h --spares 2

Durations take s, m, h or d (default seconds); bytes and bandwidths take k/M/G/T(i)B. Invalid input
(flags, trace files, a job the planner cannot place) exits 2 with a message naming the flag, file, line
or field.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping

from oobleck.planner.errors import PlanningError

_BYTES = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_SECONDS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


class InputError(Exception):
    """Bad command-line input; the message starts with the flag it concerns."""


def _number(text: str, flag: str, units: Mapping[str, float], pattern: str, example: str) -> float:
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
    """`oobleck simulate` and its flags, one argument group each."""
    p = subparsers.add_parser(
        "simulate",
        help="goodput under failure traces: oobleck vs checkpoint-restart, redundant computation, replica dropping",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _model_arguments(p)
    _cluster_and_job_arguments(p)
    _trace_arguments(p)
    _cost_arguments(p)
    out = p.add_argument_group("output")
    out.add_argument("--policies", default=",".join(_policies()), help="comma-separated subset")
    out.add_argument("--json", dest="json_path", help="write the results as JSON to this path ('-': stdout)")
    out.add_argument("--plot", help="write throughput and cumulative samples over time as a PNG")
    out.add_argument("--recommend-f", action="store_true", help="also find the f that maximises oobleck's goodput")
    p.set_defaults(func=run)


def _model_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_argument_group("model (a measured profile, or a synthetic GPT)")
    model.add_argument("--profile", help="a profile JSON file (`oobleck profile` writes one)")
    model.add_argument("--model", default="gpt3-350m", help="synthetic model preset (default gpt3-350m): " + _presets())
    model.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: the preset's)")
    model.add_argument("--microbatch-size", type=int, default=1, help="samples per microbatch (synthetic)")
    model.add_argument(
        "--gpu-flops", default="125e12", help="sustained FLOP/s of one GPU (default 125e12: an A100 at ~40 %% MFU)"
    )
    model.add_argument("--hbm-bandwidth", default="1.5TB", help="GPU memory bandwidth, bytes/s (default 1.5TB)")


def _cluster_and_job_arguments(p: argparse.ArgumentParser) -> None:
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
    job.add_argument(
        "--min-nodes-per-pipeline", type=int, default=1, help="no pipeline of fewer nodes (the artifact's n0)"
    )
    job.add_argument(
        "--max-tensor-parallel",
        type=int,
        default=1,
        help="the largest tensor-parallel degree t a stage may take (a power of two <= G; default 1: none)",
    )
    job.add_argument(
        "--start-plan",
        help="oobleck starts from this plan JSON (`oobleck plan --json`): its templates and pipelines, its "
        "nodes taken as the trace's first nodes in order",
    )


def _trace_arguments(p: argparse.ArgumentParser) -> None:
    from .traces import TRACES_DIR

    bundled = ", ".join(sorted(path.stem for path in TRACES_DIR.glob("*.csv")))
    trace = p.add_argument_group("availability trace (a file, or generated from a seed)")
    trace.add_argument(
        "--trace", help=f"TIME_MS,add|remove,NODE (and TIME_MS,slow,NODE,SPEED) file, or a bundled one: {bundled}"
    )
    trace.add_argument("--mtbf", help="independent failures: mean time between failures of one node")
    trace.add_argument("--repair", default="1h", help="with --mtbf: a failed node is back after this long")
    trace.add_argument("--spot-interval", help="preemption waves: mean time between waves")
    trace.add_argument("--spot-fraction", type=float, default=0.2, help="a wave takes up to this share of nodes")
    trace.add_argument("--spot-return", default="10m", help="preempted nodes are back after this long")
    trace.add_argument(
        "--spot-pattern", help="availability shaped like a spot trace of the artifact: " + ", ".join(_patterns())
    )
    trace.add_argument("--duration", help="simulated time (generated traces: default 1d; files: see README)")
    trace.add_argument("--seed", type=int, default=0)


def _cost_arguments(p: argparse.ArgumentParser) -> None:
    costs = p.add_argument_group(
        "costs (a named set, each value overridable; defaults and sources: README, Simulating goodput)"
    )
    costs.add_argument(
        "--costs",
        default="default",
        help="cost set: default (ours) or oobleck-artifact (the artifact's Varuna and Bamboo values, 45 s start-up)",
    )
    costs.add_argument("--detection", help="oobleck: failure -> known (s; default 0.04)")
    costs.add_argument("--plan-time", help="oobleck: known -> next plan published (s; default 0.11)")
    costs.add_argument("--rendezvous", help="oobleck: groups rebuilt + holdings exchanged (s; default 0.17)")
    costs.add_argument("--snapshot-every", type=int, help="oobleck: steps between in-memory snapshots (default 10)")
    costs.add_argument(
        "--checkpoint-interval", help="checkpoint-restart: training between checkpoints (default: Young's optimum)"
    )
    costs.add_argument("--checkpoint-every", type=int, help="checkpoint-restart: checkpoint every N iterations")
    costs.add_argument("--checkpoint-time", help="checkpoint-restart: fixed write time (s; 0: no checkpoint cost)")
    costs.add_argument("--storage-bandwidth", help="checkpoint write/read bytes/s per node (default 2GB)")
    costs.add_argument("--restart", help="checkpoint-restart: fixed restart cost (s; default 4.75)")
    costs.add_argument(
        "--bamboo-slowdown", type=float, default=None, help="redundant computation: steady-state slowdown"
    )
    costs.add_argument("--bamboo-failover", help="redundant computation: failover pause (s; default 1)")
    costs.add_argument("--quorum", help="replica dropping: quorum change pause (s; default 1)")
    costs.add_argument(
        "--replica-timeout",
        help="replica dropping: a replica this much later than the others is dropped (s; default 60)",
    )
    costs.add_argument(
        "--straggler-window", type=int, help="oobleck: steps before a speed change is known and acted on (default 20)"
    )
    costs.add_argument("--spares", type=int, help="every policy: warm spare nodes kept out of training (default 0)")
    costs.add_argument("--spare-join", help="every policy: a warm spare trains this long after a loss (s; default 5)")
    costs.add_argument("--node-startup", help="every policy: a node is usable this long after it joins (default 0)")


def _presets() -> str:
    from oobleck.planner.synthetic import PRESETS

    return ", ".join(PRESETS)


def _patterns() -> tuple[str, ...]:
    from .traces import SPOT_PATTERNS

    return tuple(SPOT_PATTERNS)


def _policies() -> tuple[str, ...]:
    from .engine import POLICIES

    return POLICIES


def _trace(args: argparse.Namespace):
    from . import traces

    duration = seconds(args.duration, "--duration") if args.duration else None
    sources = [
        flag
        for flag, value in (
            ("--trace", args.trace),
            ("--mtbf", args.mtbf),
            ("--spot-interval", args.spot_interval),
            ("--spot-pattern", args.spot_pattern),
        )
        if value
    ]
    if len(sources) > 1:
        raise InputError(f"{sources[1]}: give one trace source, got {' and '.join(sources)}")
    if args.trace:
        return traces.load(args.trace, duration)
    if args.spot_pattern:
        if args.spot_pattern not in traces.SPOT_PATTERNS:
            raise InputError(
                f"--spot-pattern: unknown {args.spot_pattern!r}; choose from {', '.join(traces.SPOT_PATTERNS)}"
            )
        return traces.spot_pattern(args.spot_pattern, args.seed)
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
    raise InputError("--trace: give a trace: --trace FILE, --mtbf TIME, --spot-interval TIME or --spot-pattern NAME")


def _job(args: argparse.Namespace):
    from oobleck.planner.profile_io import load_profile
    from oobleck.planner.synthetic import PRESETS, gpt_profile

    from .engine import Job

    if args.profile:
        profile = load_profile(args.profile)
    else:
        if args.model not in PRESETS:
            raise InputError(f"--model: unknown {args.model!r}; choose from {', '.join(PRESETS)}")
        shape = PRESETS[args.model]
        try:
            profile = gpt_profile(
                shape,
                seq_len=shape.seq_len if args.seq_len is None else args.seq_len,
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
    tp = args.max_tensor_parallel
    if tp < 1 or tp & (tp - 1) or tp > args.gpus_per_node:
        raise InputError(
            f"--max-tensor-parallel: must be a power of two <= --gpus-per-node ({args.gpus_per_node}), got {tp}"
        )
    least = args.min_nodes_per_pipeline
    if least < 1 or least > len(profile.layers):
        raise InputError(
            f"--min-nodes-per-pipeline: must be in 1..{len(profile.layers)} (the model's layers), got {least}"
        )
    start_plan = _start_plan(args.start_plan, profile, args) if args.start_plan else None
    return Job(
        start_plan=start_plan,
        profile=profile,
        gpus_per_node=args.gpus_per_node,
        gpu_memory_bytes=int(quantity(args.gpu_memory, "--gpu-memory")),
        intra_node_bandwidth=quantity(args.intra_bandwidth, "--intra-bandwidth"),
        inter_node_bandwidth=quantity(args.inter_bandwidth, "--inter-bandwidth"),
        f=args.f,
        global_batch=args.global_batch,
        m_ref=args.m_ref,
        min_nodes_per_pipeline=least,
        max_tensor_parallel=args.max_tensor_parallel,
    )


def _start_plan(path: str, profile, args: argparse.Namespace):
    from pydantic import ValidationError

    from oobleck.api.plan import Plan

    try:
        text = open(path).read()
    except OSError as error:
        raise InputError(f"--start-plan: cannot read {path}: {error.strerror or error}") from None
    try:
        plan = Plan.model_validate_json(text)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "plan"
        raise InputError(f"--start-plan: {path}: {field}: {first['msg']}") from None
    if plan.num_layers != len(profile.layers):
        raise InputError(
            f"--start-plan: {path}: num_layers: {plan.num_layers}, the model has {len(profile.layers)} layers"
        )
    if plan.gpus_per_node != args.gpus_per_node:
        raise InputError(
            f"--start-plan: {path}: gpus_per_node: {plan.gpus_per_node}, --gpus-per-node is {args.gpus_per_node}"
        )
    batch = plan.global_microbatches * profile.microbatch_size
    if batch != args.global_batch:
        raise InputError(f"--global-batch: {args.global_batch}, the start plan trains {batch} samples per iteration")
    return plan


def _costs(args: argparse.Namespace):
    from dataclasses import replace

    from .costs import named

    if args.profile and args.costs != "default":
        raise InputError(f"--costs: {args.costs} is per model: it needs --model (one of the presets), not --profile")
    try:
        base = named(args.costs, args.model)
    except ValueError as error:
        raise InputError("--" + str(error)) from None
    if args.snapshot_every is not None and args.snapshot_every < 1:
        raise InputError(f"--snapshot-every: must be >= 1, got {args.snapshot_every}")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise InputError(f"--checkpoint-every: must be >= 1, got {args.checkpoint_every}")
    if args.spares is not None and args.spares < 0:
        raise InputError(f"--spares: must be >= 0, got {args.spares}")
    if args.straggler_window is not None and args.straggler_window < 1:
        raise InputError(f"--straggler-window: must be >= 1, got {args.straggler_window}")
    if args.bamboo_slowdown is not None and not args.bamboo_slowdown >= 1:
        raise InputError(f"--bamboo-slowdown: must be >= 1, got {args.bamboo_slowdown}")

    def given(**values):  # the flags given on the command line override the set
        return {key: value for key, value in values.items() if value is not None}

    def time(flag: str, text: str | None, zero_ok: bool = False) -> float | None:
        if text is None:
            return None
        if zero_ok and text.strip() in ("0", "0s", "0.0"):
            return 0.0
        return seconds(text, flag)

    checkpoint = given(
        interval_s=time("--checkpoint-interval", args.checkpoint_interval),
        interval_steps=args.checkpoint_every,
        checkpoint_time_s=time("--checkpoint-time", args.checkpoint_time, zero_ok=True),
        storage_bandwidth=quantity(args.storage_bandwidth, "--storage-bandwidth") if args.storage_bandwidth else None,
        restart_s=time("--restart", args.restart, zero_ok=True),
    )
    if "interval_s" in checkpoint and "interval_steps" not in checkpoint:
        checkpoint["interval_steps"] = None  # a time interval given replaces the set's iteration count
    return replace(
        base,
        oobleck=replace(
            base.oobleck,
            **given(
                detection_s=time("--detection", args.detection, zero_ok=True),
                plan_s=time("--plan-time", args.plan_time, zero_ok=True),
                rendezvous_s=time("--rendezvous", args.rendezvous, zero_ok=True),
                snapshot_interval_steps=args.snapshot_every,
                straggler_window_steps=args.straggler_window,
            ),
        ),
        checkpoint=replace(base.checkpoint, **checkpoint),
        bamboo=replace(
            base.bamboo,
            **given(slowdown=args.bamboo_slowdown, failover_s=time("--bamboo-failover", args.bamboo_failover)),
        ),
        replicas=replace(
            base.replicas,
            **given(quorum_s=time("--quorum", args.quorum), timeout_s=time("--replica-timeout", args.replica_timeout)),
        ),
        nodes=replace(
            base.nodes,
            **given(
                startup_s=time("--node-startup", args.node_startup, zero_ok=True),
                spares=args.spares,
                spare_join_s=time("--spare-join", args.spare_join, zero_ok=True),
            ),
        ),
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
        costs = _costs(args)
        trace = _trace(args)
        if costs.nodes.spares and costs.nodes.spares >= trace.max_nodes():
            raise InputError(
                f"--spares: {costs.nodes.spares} leaves no node to train (the trace has {trace.max_nodes()} at most)"
            )
        job = _job(args)
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
