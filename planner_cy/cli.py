"""`oobleck plan`: profile + cluster + job -> templates, instantiation and batch split; reconfiguration preview.

    oobleck plan profile.json --nodes 13 --gpus-per-node 4 --gpu-memory 40GiB --microbatches 64 --f 1
    oobleck plan profile.json ... --lost 3,7          # the plan after nodes "3" and "7" fail
    oobleck plan profile.json ... --json              # the plan document instead of the table
    oobleck plan --model bert-large --nodes 30 ...    # a synthetic preset's roofline profile instead of a file

Nodes are named "0".."N-1". Invalid input exits 2 with a message naming the flag or field; a
reconfiguration that lost every replica of a layer exits 1 (the job would restore a checkpoint).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

_UNITS = {
    "": 1,
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "t": 1e12,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


class InputError(Exception):
    """Bad command-line input; the message starts with the flag or field it concerns."""


def quantity(text: str, flag: str) -> float:
    """A number with an optional unit (80GiB, 25GB, 1e9): bytes or bytes/s."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)(?:/s)?\s*", text.lower())
    if match is None or match.group(2) not in _UNITS:
        raise InputError(f"{flag}: expected a number with an optional unit (e.g. 80GiB, 25GB), got {text!r}")
    try:
        value = float(match.group(1)) * _UNITS[match.group(2)]
    except ValueError:
        raise InputError(f"{flag}: expected a number, got {text!r}") from None
    if not value > 0:
        raise InputError(f"{flag}: must be > 0, got {text!r}")
    return value


def node_list(text: str, flag: str) -> list[str]:
    """Comma-separated node ids ("3,7")."""
    ids = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not part for part in ids):
        raise InputError(f"{flag}: expected comma-separated node ids such as 3,7, got {text!r}")
    return ids


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `plan` subcommand."""
    parser = subparsers.add_parser(
        "plan",
        help="plan a job: templates, pipelines, batch split (and preview a reconfiguration)",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("profile", type=Path, nargs="?", help="model profile JSON (oobleck.api.profile.ModelProfile)")
    parser.add_argument(
        "--model",
        default=None,
        help="instead of a profile: a synthetic preset (planner_cy/synthetic.py PRESETS, e.g. bert-large, "
        "gpt2-artifact, gpt3-medium, gpt3-2.7b, gpt3-6.7b, gpt3-175b, llama3-70b) at its context, 125 TFLOP/s and "
        "1.5 TB/s per GPU",
    )
    parser.add_argument("--nodes", type=int, required=True, help="N: nodes of the job")
    parser.add_argument("--gpus-per-node", type=int, required=True, help="G: GPUs per node (a power of two)")
    parser.add_argument("--gpu-memory", required=True, help="memory per GPU, bytes or with a unit (80GiB)")
    parser.add_argument("--microbatches", type=int, required=True, help="B: microbatches per iteration")
    parser.add_argument("--f", type=int, default=1, help="pipeline failures to tolerate (default 1)")
    parser.add_argument("--intra-bandwidth", default="100GB", help="bytes/s between GPUs of a node (default 100GB)")
    parser.add_argument("--inter-bandwidth", default="12.5GB", help="bytes/s between nodes (default 12.5GB)")
    parser.add_argument(
        "--m-ref",
        type=int,
        default=None,
        help="microbatches per pipeline the templates are optimised for (default: derived from the batch)",
    )
    parser.add_argument(
        "--microbatch-size",
        type=int,
        default=None,
        help="samples per microbatch: a stage uses only GPU counts that split it evenly (default: any)",
    )
    parser.add_argument(
        "--max-tensor-parallel",
        type=int,
        default=1,
        help="the largest tensor-parallel degree t a stage may take (a power of two <= G; default 1: none). "
        "Planning only: the runtime does not run t > 1 yet",
    )
    parser.add_argument(
        "--min-nodes-per-pipeline",
        type=int,
        default=1,
        help="no pipeline of fewer nodes, even where one fits (the Oobleck artifact's n0; default 1)",
    )
    parser.add_argument("--job", default="job", help="job name recorded in the plan")
    parser.add_argument("--lost", default=None, help="preview a reconfiguration: lost node ids, e.g. 3,7")
    parser.add_argument("--added", default=None, help="preview a reconfiguration: added node ids, e.g. 13,14")
    parser.add_argument("--horizon", type=int, default=None, help="iterations weighed against copy time")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    parser.set_defaults(func=run)


def _pydantic_message(error, prefix: str, flags: dict[str, str]) -> str:
    """The first problem of a ValidationError, named by its flag (or prefix.field)."""
    first = error.errors()[0]
    loc = ".".join(str(part) for part in first["loc"])
    field = flags.get(loc, f"{prefix}.{loc}" if loc else prefix)
    return f"{field}: {first['msg']}"


def run(args: argparse.Namespace) -> int:
    """Entry point of `oobleck plan`."""
    try:
        text = _plan_text(args)
    except InputError as error:
        print(f"oobleck plan: error: {error}", file=sys.stderr)
        return 2
    except _Lost as error:
        print(f"oobleck plan: {error}", file=sys.stderr)
        return 1
    print(text)
    return 0


class _Lost(Exception):
    pass


def _plan_text(args: argparse.Namespace) -> str:
    from .errors import PlanningError
    from .instantiate import instantiate
    from .profile_io import ProfileError, parse_profile
    from .reconfigure import DEFAULT_HORIZON, LostLayersError, next_layout, to_plan
    from .templates import generate_templates

    profile = _profile(args, parse_profile, ProfileError)
    _check_numbers(args)
    horizon = DEFAULT_HORIZON if args.horizon is None else args.horizon
    cluster = _cluster(args)
    lost = node_list(args.lost, "--lost") if args.lost is not None else []
    added = node_list(args.added, "--added") if args.added is not None else []
    try:
        templates = generate_templates(
            profile,
            cluster,
            args.f,
            args.m_ref,
            global_microbatches=args.microbatches,
            microbatch_size=args.microbatch_size,
            min_nodes_per_pipeline=args.min_nodes_per_pipeline,
            max_tp=args.max_tensor_parallel,
        )
        nodes = [str(i) for i in range(cluster.nodes)]
        plan = instantiate(templates, nodes, args.f, args.microbatches, args.job, gpus_per_node=cluster.gpus_per_node)
        after = chosen = None
        if lost or added:
            chosen = next_layout(
                plan,
                templates,
                profile,
                lost=lost,
                added=added,
                bandwidth=cluster.inter_node_bandwidth,
                horizon=horizon,
            )
            after = to_plan(plan, templates, chosen)
    except LostLayersError as error:
        raise _Lost(str(error)) from None
    except PlanningError as error:
        raise InputError(_flag_names(str(error))) from None
    if args.json:
        return (after or plan).to_json()
    parts = [describe(plan, profile)]
    if after is not None:
        assert chosen is not None
        parts += [describe(after, profile), _candidates_table(chosen, cluster.inter_node_bandwidth, horizon)]
    return "\n\n".join(parts)


def _check_numbers(args: argparse.Namespace) -> None:
    """The numeric flags' bounds, each error naming its flag."""
    if args.microbatches < 1:
        raise InputError(f"--microbatches: must be >= 1, got {args.microbatches}")
    if args.f < 0:
        raise InputError(f"--f: must be >= 0, got {args.f}")
    if args.m_ref is not None and args.m_ref < 1:
        raise InputError(f"--m-ref: must be >= 1, got {args.m_ref}")
    if args.microbatch_size is not None and args.microbatch_size < 1:
        raise InputError(f"--microbatch-size: must be >= 1, got {args.microbatch_size}")
    if not 1 <= args.min_nodes_per_pipeline <= max(args.nodes, 1):
        raise InputError(
            f"--min-nodes-per-pipeline: must be in 1..--nodes ({args.nodes}), got {args.min_nodes_per_pipeline}"
        )
    if args.horizon is not None and args.horizon < 0:
        raise InputError(f"--horizon: must be >= 0, got {args.horizon}")


_CLUSTER_FLAGS = {
    "nodes": "--nodes",
    "gpus_per_node": "--gpus-per-node",
    "gpu_memory_bytes": "--gpu-memory",
    "intra_node_bandwidth": "--intra-bandwidth",
    "inter_node_bandwidth": "--inter-bandwidth",
}


def _cluster(args: argparse.Namespace):
    """The ClusterShape of the flags; an invalid one names its flag."""
    from pydantic import ValidationError

    from oobleck.api.profile import ClusterShape

    try:
        return ClusterShape(
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            gpu_memory_bytes=int(quantity(args.gpu_memory, "--gpu-memory")),
            intra_node_bandwidth=quantity(args.intra_bandwidth, "--intra-bandwidth"),
            inter_node_bandwidth=quantity(args.inter_bandwidth, "--inter-bandwidth"),
        )
    except ValidationError as error:
        raise InputError(_pydantic_message(error, "cluster", _CLUSTER_FLAGS)) from None


def _candidates_table(chosen, bandwidth: float, horizon: int) -> str:
    """The reconfiguration candidates `next_layout` weighed, with the chosen one marked."""
    rows = [
        f"candidates (cost = busiest node's copy bytes / {bandwidth:.3g} B/s + {horizon} x iteration):",
        f"  {'reason':<22} {'pipelines':>9} {'copy GiB':>10} {'busiest GiB':>11} {'iteration ms':>12} {'cost ms':>12}",
    ]
    for index, c in enumerate(chosen.considered):
        mark = "  <- chosen" if index == chosen.chosen else ""
        rows.append(
            f"  {c.reason + (' (degraded)' if c.degraded else ''):<22} {c.pipelines:>9} "
            f"{c.copy_bytes / 2**30:>10.2f} {c.busiest_bytes / 2**30:>11.2f} {c.iteration_ms:>12.2f} "
            f"{c.cost_ms:>12.1f}{mark}"
        )
    return "\n".join(rows)


def _profile(args: argparse.Namespace, parse_profile, ProfileError):
    """The profile file, or the --model preset's synthetic profile (exactly one of them)."""
    if (args.profile is None) == (args.model is None):
        raise InputError("profile: give a profile JSON file or --model PRESET (one of them)")
    if args.model is not None:
        from .synthetic import PRESETS, gpt_profile

        if args.model not in PRESETS:
            raise InputError(f"--model: unknown {args.model!r}; choose from {', '.join(PRESETS)}")
        shape = PRESETS[args.model]
        return gpt_profile(
            shape,
            seq_len=shape.seq_len,
            microbatch_size=args.microbatch_size or 1,
            gpu_flops=125e12,
            hbm_bandwidth=1.5e12,
            name=args.model,
        )
    try:
        raw = args.profile.read_text()
    except OSError as error:
        raise InputError(f"profile: cannot read {args.profile}: {error.strerror}") from None
    try:
        return parse_profile(raw, "profile")
    except ProfileError as error:
        raise InputError(str(error)) from None


def _flag_names(message: str) -> str:
    """Planner messages start with a field name; show the matching flag too."""
    for field, flag in (
        ("global_microbatches", "--microbatches"),
        ("microbatch_size", "--microbatch-size"),
        ("m_ref", "--m-ref"),
        ("min_nodes_per_pipeline", "--min-nodes-per-pipeline"),
        ("max_tensor_parallel", "--max-tensor-parallel"),
        ("nodes", "--nodes"),
        ("f", "--f"),
        ("lost", "--lost"),
        ("added", "--added"),
    ):
        if message.startswith(field + ":") or message.startswith(field + " "):
            return f"{flag} ({message})"
    if message.startswith("N = "):
        return f"--nodes ({message})"
    if "gpu_memory_bytes" in message:
        return f"--gpu-memory ({message})"
    return message


def _ranges(sizes: list[int]) -> str:
    """Sorted integers as runs: 5-9,12."""
    runs: list[list[int]] = []
    for n in sorted(sizes):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _any_tensor_parallel(plan) -> bool:
    return any(s.tensor_parallel > 1 for t in plan.templates for s in t.stages)


def _stage_text(stage) -> str:
    """`layers(GPUs)`, or `layers(GPUs,tT)` for a stage of tensor-parallel degree T > 1."""
    degree = f",t{stage.tensor_parallel}" if stage.tensor_parallel > 1 else ""
    return f"{stage.end - stage.start}({stage.gpus}{degree})"


def describe(plan, profile) -> str:
    """The plan as readable tables: templates, pipelines with their batch split, copies."""
    from .instantiate import template_cost

    lines = [
        f"job {plan.job}  generation {plan.generation}  reason {plan.reason}"
        + ("  DEGRADED (fewer than f+1 pipelines)" if plan.degraded else ""),
        f"model {profile.model}: {plan.num_layers} layers; {len(plan.nodes)} nodes x {plan.gpus_per_node} GPUs; "
        f"f = {plan.f}; {plan.global_microbatches} microbatches; iteration {plan.iteration_ms:.2f} ms",
    ]
    if plan.lost_nodes or plan.added_nodes:
        lines.append(f"lost {','.join(plan.lost_nodes) or '-'}  added {','.join(plan.added_nodes) or '-'}")
    used: dict[int, int] = {}
    for p in plan.pipelines:
        used[p.template_nodes] = used.get(p.template_nodes, 0) + 1
    sizes = [t.nodes for t in plan.templates]
    lines += [
        "",
        f"template sizes considered: {_ranges(sizes)} nodes ({len(sizes)} sizes, m_ref = {plan.templates[0].m_ref}); "
        f"used: {', '.join(f'{n} nodes x {k}' for n, k in sorted(used.items(), reverse=True))}",
        "templates:",
        f"  {'nodes':>5} {'used':>4} {'stages':>6} {'T(1) ms':>10} {'slowest ms':>10} {'max mb':>6}  "
        "layers per stage (GPUs" + (", tensor-parallel degree t)" if _any_tensor_parallel(plan) else ")"),
    ]
    for template in plan.templates:
        cost = template_cost(template)
        layout = " ".join(_stage_text(s) for s in template.stages)
        if len(layout) > 70:
            layout = layout[:67] + "..."
        most = "any" if template.max_microbatches is None else str(template.max_microbatches)
        lines.append(
            f"  {template.nodes:>5} {used.get(template.nodes, 0):>4} {len(template.stages):>6} {cost.base_ms:>10.2f} "
            f"{cost.slope_ms:>10.2f} {most:>6}  {layout}"
        )
    lines += [
        "",
        f"pipelines ({len(plan.pipelines)}):",
        f"  {'#':>3} {'nodes':>5} {'microbatches':>12} {'offset':>6} {'iteration ms':>12}  node ids",
    ]
    for p in plan.pipelines:
        ids = ",".join(p.nodes)
        lines.append(
            f"  {p.index:>3} {p.template_nodes:>5} {p.microbatches:>12} {p.microbatch_offset:>6} "
            f"{p.iteration_ms:>12.2f}  {ids if len(ids) <= 60 else ids[:57] + '...'}"
        )
    if plan.generation > 0:
        total = sum(c.bytes for c in plan.copies)
        sources = {}
        for c in plan.copies:
            sources[c.src_rank] = sources.get(c.src_rank, 0) + c.bytes
        busiest = max(sources.values(), default=0)
        lines += [
            "",
            f"copies: {len(plan.copies)} layer copies, {total / 2**30:.2f} GiB from {len(sources)} source GPUs "
            f"(busiest sends {busiest / 2**30:.2f} GiB)",
        ]
    return "\n".join(lines)
