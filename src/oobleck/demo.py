"""`oobleck demo`: the main job on an embedded default cluster.

Today it starts the local control plane (etcd, kube-apiserver, scheduler, controller-manager, the CRDs
installed), applies the example tiny-GPT job, shows it the way a user sees it, and tears everything
down. Worker training through the operator and local nodes joins as those components land.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-gpt.yaml"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run the example job on a local control plane")
    parser.add_argument("--job", type=Path, default=EXAMPLE, help="OobleckJob manifest (default: %(default)s)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from oobleck.dev.controlplane import ControlPlane

    if not args.job.is_file():
        raise SystemExit(f"oobleck demo: --job {args.job}: no such file")
    step = _Steps()
    step("starting the local control plane (etcd, kube-apiserver, scheduler, controller-manager)")
    with ControlPlane() as cluster:
        step(f"control plane up in {cluster.started_in_s:.1f} s at {cluster.server}")
        namespace = "oobleck-demo"
        cluster.kubectl("create", "namespace", namespace)
        step(f"kubectl apply -f {args.job}")
        print(cluster.kubectl("apply", "-n", namespace, "-f", str(args.job)).stdout, end="")
        step("kubectl get oj")
        print(cluster.kubectl("get", "oj", "-n", namespace).stdout, end="")
        step("kubectl get oj -o wide")
        print(cluster.kubectl("get", "oj", "-n", namespace, "-o", "wide").stdout, end="")
        step("kubectl explain oj.spec.f")
        print(cluster.kubectl("explain", "oj.spec.f").stdout, end="")
        step("stopping the control plane")
    step("done: nothing left running")
    return 0


class _Steps:
    def __init__(self) -> None:
        self.began = time.monotonic()

    def __call__(self, text: str) -> None:
        print(f"\n[demo {time.monotonic() - self.began:6.1f} s] {text}", flush=True)
