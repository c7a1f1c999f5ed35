"""`oobleck operator`: run the operator in this process (kopf), with a liveness probe and metrics."""

from __future__ import annotations

import argparse
import logging
import sys

from oobleck.operator.planning import Tuning


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("operator", help="run the OobleckJob operator (kopf)")
    parser.add_argument("-n", "--namespace", action="append", default=[], help="namespace to serve (repeatable)")
    parser.add_argument("-A", "--all-namespaces", action="store_true", help="serve every namespace")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig path (default: in-cluster, else ~/.kube/config)")
    parser.add_argument("--image", default=None, help="default worker image for jobs without spec.image")
    parser.add_argument("--metrics-port", type=int, default=9090, help="Prometheus port (0: any, -1: off)")
    parser.add_argument(
        "--metrics-scrape-namespace",
        default=None,
        metavar="NAMESPACE",
        help="namespace (e.g. Prometheus') allowed through each job's NetworkPolicy to the workers' metrics ports",
    )
    parser.add_argument("--liveness-port", type=int, default=8080, help="liveness probe port, /healthz (-1: off)")
    parser.add_argument(
        "--peering", default=None, metavar="NAME", help="enable HA peering under this name (needs kopf's peering CRDs)"
    )
    parser.add_argument(
        "--priority",
        type=_priority,
        default=0,
        help="peering priority, the highest replica acts; 'auto': derived from the pod name (POD_ID), distinct per replica",
    )
    parser.add_argument(
        "--peering-lifetime", type=int, default=15, help="seconds a silent peer counts as alive (failover time)"
    )
    parser.add_argument("--write-concurrency", type=int, default=128, help="concurrent API writes per job")
    parser.add_argument("--batch-window", type=float, default=0.05, help="seconds to collect simultaneous events")
    parser.add_argument("--resync", type=float, default=10.0, help="seconds between reconciles without events")
    parser.add_argument(
        "--silent-node-grace",
        type=float,
        default=30.0,
        help="seconds a member's node may stay silent (Ready Unknown) before its worker counts as lost",
    )
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="GPU memory the planner assumes")
    parser.add_argument(
        "--measure-timeout",
        type=float,
        default=120.0,
        help="seconds the workers of a `profile: measure` job may take to report their measured "
        "profile before the first plan uses the synthetic estimate (0: do not wait)",
    )
    parser.add_argument(
        "--planner-workers", type=int, default=2, help="planner processes (jobs that can plan at the same time)"
    )
    parser.add_argument(
        "--planner-timeout",
        type=float,
        default=30.0,
        help="seconds one planning call may take; a spec over it fails InvalidSpec",
    )
    parser.add_argument(
        "--planner-memory-mib",
        type=int,
        default=2048,
        help="address space of a planner process (MiB); a spec that needs more fails InvalidSpec",
    )
    parser.add_argument("--inter-node-gbps", type=float, default=200.0, help="inter-node bandwidth (Gbit/s)")
    parser.add_argument("-v", "--verbose", action="store_true", help="also log every handler call")
    parser.set_defaults(func=run)


def _priority(value: str) -> int:
    """An integer, or 'auto': a stable number from this replica's identity (kopf's POD_ID, else the host
    name), so that replicas get distinct priorities (equal ones all pause)."""
    if value == "auto":
        import hashlib
        import os
        import socket

        identity = os.environ.get("POD_ID") or socket.gethostname()
        return int.from_bytes(hashlib.sha256(identity.encode()).digest()[:4], "big") % 1_000_000 + 1
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--priority: expected an integer or 'auto', got {value!r}") from None


def _positive(parser_error: str, value: float) -> None:
    if not value > 0:
        raise SystemExit(f"oobleck operator: {parser_error} must be > 0, got {value}")


def run(args: argparse.Namespace) -> int:
    import kopf

    from oobleck.operator import handlers  # noqa: F401  (registers the handlers)
    from oobleck.operator.planpool import PlannerLimits
    from oobleck.operator.settings import DEFAULT_IMAGE, OperatorConfig

    if not args.namespace and not args.all_namespaces:
        print("oobleck operator: give --namespace NS (repeatable) or --all-namespaces", file=sys.stderr)
        return 2
    if args.namespace and args.all_namespaces:
        print("oobleck operator: --namespace and --all-namespaces exclude each other", file=sys.stderr)
        return 2
    for flag, value in (
        ("--write-concurrency", args.write_concurrency),
        ("--resync", args.resync),
        ("--gpu-memory-gib", args.gpu_memory_gib),
        ("--inter-node-gbps", args.inter_node_gbps),
        ("--planner-workers", args.planner_workers),
        ("--planner-timeout", args.planner_timeout),
        ("--planner-memory-mib", args.planner_memory_mib),
    ):
        _positive(flag, value)
    _positive("--peering-lifetime", args.peering_lifetime)
    for flag, value in (
        ("--batch-window", args.batch_window),
        ("--measure-timeout", args.measure_timeout),
        ("--silent-node-grace", args.silent_node_grace),
    ):
        if value < 0:
            print(f"oobleck operator: {flag} must be >= 0, got {value}", file=sys.stderr)
            return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    tuning = Tuning(
        gpu_memory_bytes=int(args.gpu_memory_gib * (1 << 30)),
        inter_node_bandwidth=args.inter_node_gbps * 1e9 / 8,
        measure_timeout_s=args.measure_timeout,
    )
    config = OperatorConfig(
        namespaces=tuple(args.namespace),
        kubeconfig=args.kubeconfig,
        default_image=args.image or DEFAULT_IMAGE,
        tuning=tuning,
        write_concurrency=args.write_concurrency,
        batch_window_s=args.batch_window,
        resync_s=args.resync,
        silent_node_grace_s=args.silent_node_grace,
        metrics_port=args.metrics_port,
        metrics_scrape_namespace=args.metrics_scrape_namespace,
        liveness_port=args.liveness_port,
        standalone=args.peering is None,
        peering_name=args.peering or "oobleck-operator",
        priority=args.priority,
        peering_lifetime_s=args.peering_lifetime,
        planner=PlannerLimits(
            workers=args.planner_workers,
            timeout_s=args.planner_timeout,
            memory_bytes=args.planner_memory_mib << 20,
        ),
    )
    if not args.verbose:
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # one line per handler call otherwise
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port >= 0 else None
    kopf.run(
        clusterwide=args.all_namespaces,
        namespaces=config.namespaces,
        standalone=config.standalone,
        peering_name=config.peering_name if not config.standalone else None,
        priority=config.priority,
        liveness_endpoint=liveness,
        memo=kopf.Memo(config=config),
    )
    return 0
