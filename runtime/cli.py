"""Runtime subcommands: `oobleck worker` (one training process for a static plan), `oobleck profile`
and `oobleck launch` (the local elastic launcher).

`register()` adds every parser listed in `PARSERS`; a new subcommand is one function appended
there. Heavy imports (torch) stay inside the handlers so `oobleck --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Callable


def _store_address(value: str) -> tuple[str, int]:
    from oobleck.api.addresses import parse_host_port

    try:
        return parse_host_port(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def add_worker_parser(subparsers) -> None:
    parser = subparsers.add_parser("worker", help="run one training worker for a static plan")
    parser.add_argument(
        "--config",
        default=os.environ.get("OOBLECK_CONFIG"),
        help="worker config, JSON or YAML (env OOBLECK_CONFIG; default: the built-in defaults)",
    )
    parser.add_argument("--plan", default=os.environ.get("OOBLECK_PLAN"), help="plan JSON file (env OOBLECK_PLAN)")
    parser.add_argument(
        "--store",
        type=_store_address,
        default=os.environ.get("OOBLECK_STORE"),
        help="rendezvous TCPStore HOST:PORT (env OOBLECK_STORE)",
    )
    parser.add_argument(
        "--node",
        default=os.environ.get("OOBLECK_NODE", socket.gethostname()),
        help="this node's name (env OOBLECK_NODE)",
    )
    parser.add_argument(
        "--gpu", type=int, default=int(os.environ.get("OOBLECK_GPU", "0")), help="local GPU index (env OOBLECK_GPU)"
    )
    parser.add_argument("--steps", type=int, default=None, help="override config.steps")
    parser.add_argument("--losses", default=None, help="append per-step global losses here (JSON lines)")
    parser.add_argument("--dump", default=None, help="write the final parameters of held layers here (torch.save)")
    parser.add_argument("--metrics-port", type=int, default=-1, help="serve Prometheus metrics on this port (-1: off)")
    parser.set_defaults(func=run_worker)


def run_worker(args: argparse.Namespace) -> int:
    import torch
    from torch.distributed import TCPStore

    from oobleck.api.plan import Plan
    from oobleck.runtime.elastic.worker import Worker
    from oobleck.runtime.train.config import WorkerConfig, load_config

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.store is None:
        print("oobleck worker: --store HOST:PORT (or OOBLECK_STORE) is required", file=sys.stderr)
        return 2
    if args.plan is None:
        print(
            "oobleck worker: --plan FILE (or OOBLECK_PLAN) is required: this worker runs one static plan "
            "(the elastic loop is `python -m oobleck.runtime.backends.local.worker`)",
            file=sys.stderr,
        )
        return 2
    try:
        config = load_config(args.config) if args.config else WorkerConfig()
        with open(args.plan) as handle:
            plan = Plan.model_validate_json(handle.read())
    except (OSError, ValueError) as error:
        print(f"oobleck worker: {error}", file=sys.stderr)
        return 2
    host, port = args.store
    store = TCPStore(host, port, is_master=False, wait_for_workers=False)
    worker = Worker(config, store, args.node, args.gpu, losses_path=args.losses)
    if args.metrics_port >= 0:
        worker.metrics.serve(args.metrics_port)
    worker.run_static(plan, args.steps)
    worker.final_export()
    if args.dump:
        torch.save(worker.layer_state(), args.dump)
    return 0


def add_profile_parser(subparsers) -> None:
    parser = subparsers.add_parser("profile", help="measure every layer and write the planner's profile JSON")
    parser.add_argument("--config", default=None, help="worker config naming the model (default: tiny-gpt)")
    parser.add_argument(
        "--model", default=None, help="override config.model.name; a transformers preset (gpt3-2.7b, llama-tiny, ...)"
    )
    parser.add_argument(
        "--estimate",
        action="store_true",
        help="write the planner's roofline estimate from the preset's sizes instead of measuring (--model: a "
        "transformers preset or a planner preset such as gpt3-175b, llama3-70b; --gpu-flops, --hbm-bandwidth)",
    )
    parser.add_argument("--gpu-flops", type=float, default=300e12, help="sustained FLOP/s for --estimate")
    parser.add_argument("--hbm-bandwidth", type=float, default=2e12, help="bytes/s of GPU memory for --estimate")
    parser.add_argument("--microbatch-size", type=int, default=None, help="override config.microbatch_size")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None, help="override config.device")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default=None, help="override config.precision")
    parser.add_argument("--recompute", choices=["none", "full"], default=None, help="override config.recompute")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--out", default="-", help="output file ('-': stdout)")
    parser.set_defaults(func=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    import torch

    from oobleck.api.hfpresets import PRESETS
    from oobleck.runtime.elastic.worker import choose_device
    from oobleck.runtime.train.config import ModelConfig, WorkerConfig, build_model, load_config
    from oobleck.runtime.train.profiler import profile_model

    if args.estimate:
        return _estimate_profile(args)
    try:
        config = load_config(args.config) if args.config else WorkerConfig()
        updates = {}
        if args.model in PRESETS:
            updates["model"] = ModelConfig(transformers={"preset": args.model})
        elif args.model:
            updates["model"] = ModelConfig(name=args.model, sizes=config.model.sizes)
        if args.microbatch_size is not None:
            updates["microbatch_size"] = args.microbatch_size
        if args.device:
            updates["device"] = args.device
        for name in ("precision", "recompute"):
            if getattr(args, name) is not None:
                updates[name] = getattr(args, name)
        config = WorkerConfig.model_validate(
            config.model_dump()
            | {k: v for k, v in updates.items() if not isinstance(v, ModelConfig)}
            | ({"model": updates["model"].model_dump()} if "model" in updates else {})
        )
        model = build_model(config)
    except (OSError, ValueError) as error:
        print(f"oobleck profile: {error}", file=sys.stderr)
        return 2
    torch.set_num_threads(config.threads)
    profile = profile_model(
        model,
        config.microbatch_size,
        choose_device(config, 0),
        args.warmup,
        args.iterations,
        precision=config.precision,
        recompute=config.recompute,
    )
    text = profile.model_dump_json(indent=2)
    if args.out == "-":
        print(text)
    else:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    return 0


def _estimate_profile(args: argparse.Namespace) -> int:
    """`oobleck profile --estimate --model PRESET`: the roofline profile of a planner preset (gpt3-175b,
    llama3-70b, ...; planner_cy/synthetic.py) or of a transformers preset's sizes."""
    from oobleck.api.hfpresets import PRESETS, sizes
    from oobleck.planner.synthetic import PRESETS as SHAPES
    from oobleck.planner.synthetic import GPTShape, gpt_profile

    if args.model in SHAPES:
        shape = SHAPES[args.model]
    elif args.model in PRESETS:
        fields = PRESETS[args.model]
        size = sizes(fields, fields["model_type"])
        shape = GPTShape(
            blocks=size.blocks, hidden=size.hidden, heads=size.heads, vocab=size.vocab, seq_len=size.positions
        )
    else:
        known = ", ".join(dict.fromkeys([*PRESETS, *SHAPES]))
        print(f"oobleck profile: --estimate needs --model naming a preset: {known}", file=sys.stderr)
        return 2
    try:
        profile = gpt_profile(
            shape,
            seq_len=shape.seq_len,
            microbatch_size=args.microbatch_size or 1,
            gpu_flops=args.gpu_flops,
            hbm_bandwidth=args.hbm_bandwidth,
            name=args.model,
        )
    except ValueError as error:
        print(f"oobleck profile: {error}", file=sys.stderr)
        return 2
    _write(profile.model_dump_json(indent=2), args.out)
    return 0


def _write(text: str, out: str) -> None:
    if out == "-":
        print(text)
    else:
        with open(out, "w") as handle:
            handle.write(text + "\n")


def add_launch_parser(subparsers) -> None:
    """`oobleck launch`: the local elastic launcher (runtime/backends/local/launcher.py, its command line in launch_cli.py)."""
    from oobleck.runtime.backends.local.cli import add_parser

    add_parser(subparsers)


# Each entry adds one subcommand.
PARSERS: list[Callable] = [add_worker_parser, add_profile_parser, add_launch_parser]


def register(subparsers) -> None:
    """Add the runtime's subcommands to the `oobleck` parser."""
    for add in PARSERS:
        add(subparsers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oobleck.runtime")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)
