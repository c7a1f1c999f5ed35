"""Operator at scale: one job on ~1000 kwok GPU nodes (plus many small jobs), failures injected.

    .venv/bin/python bench/operator_scale.py                      # local control plane, 1000 nodes
    .venv/bin/python bench/operator_scale.py --kubeconfig K ...   # an existing cluster with kwok running
    .venv/bin/python bench/operator_scale.py --quick              # 8 nodes, 2 rounds (what the tests run)

Starts (or uses) a control plane, registers fake GPU nodes, runs `oobleck operator` in a
subprocess, creates the jobs and waits until every worker carries generation 0. Then, round after
round, it kills a member of the big job (alternating pod deletion, pod Failed, node NotReady and a
GPU allocatable drop; one round loses `--simultaneous` nodes at once) and a member of every small
job, and waits for the operator to report the generation. The failure-to-patch latency (event
observed -> every survivor whose ranks changed patched, planner included; with none to patch, the
plan written) is what the operator logs per generation. Prints p50/p99 of it, the pods patched per
failure, and the operator's CPU time and memory.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from oobleck.api import planmap
from oobleck.operator import render
from oobleck_dev.controlplane import Cluster, ControlPlane, free_port
from oobleck_dev.kwok import FAKE_NODE_LABEL
from oobleck_dev.tools import find_tools

POOL_LABEL = "oobleck-bench/pool"
LINE = re.compile(
    r"(?P<ns>[-a-z0-9]+)/(?P<job>[-a-z0-9]+): plan generation (?P<gen>\d+) \((?P<reason>[^)]+)\) on (?P<nodes>\d+) nodes; "
    r"lost (?P<lost>\d+) added (?P<added>\d+); planner (?P<planner>[0-9.]+) s; patched (?P<patched>\d+) pods"
    r"(; failure-to-patch (?P<latency>[0-9.]+) s)?"
)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def job_manifest(name: str, nodes: int, pool: str, *, big: bool) -> str:
    if big and nodes >= 100:  # a GPT-3 175B-like model on 8-GPU nodes, f = 2
        model = {"layers": 96, "hiddenSize": 12288, "heads": 96, "sequenceLength": 2048, "vocabSize": 50257}
        # One sample per microbatch: the planner only makes 1-GPU stages, which split it evenly. 336 microbatches
        # per step, the templates' reference count derived from them; pipelines hold what memory allows at the
        # count they run, on nodes.max and on nodes.min alike (the operator checks both before creating pods).
        spec = {"gpusPerNode": 8, "f": 2, "training": {"steps": 1000000, "globalBatchSize": 336, "microbatchSize": 1}}
    elif big:  # --quick: a handful of nodes, a 1.3B-like model that fits one node
        model = {"layers": 24, "hiddenSize": 2048, "heads": 16, "sequenceLength": 2048, "vocabSize": 50257}
        spec = {"gpusPerNode": 8, "f": 2, "training": {"steps": 1000000, "globalBatchSize": 48, "microbatchSize": 8}}
    else:
        model = {"layers": 4, "hiddenSize": 64, "heads": 4, "sequenceLength": 32, "vocabSize": 256}
        spec = {"gpusPerNode": 1, "f": 1, "training": {"steps": 1000000, "globalBatchSize": 16, "microbatchSize": 2}}
    body = {
        "apiVersion": "oobleck.dev/v1alpha1",
        "kind": "OobleckJob",
        "metadata": {"name": name},
        "spec": {
            "model": {"gpt": model},
            "nodes": {"min": max(2, nodes // 2), "max": nodes},
            "pod": {"nodeSelector": {POOL_LABEL: pool}},
            **spec,
        },
    }
    return yaml.safe_dump(body)


class OperatorLog:
    """Follows the operator's log file and parses its per-generation lines (kept in order)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.lines = path, 0, []

    def poll(self) -> None:
        with open(self.path) as handle:
            handle.seek(self.offset)
            text = handle.read()
        # Only whole lines: a line being written is read on the next poll.
        text = text[: text.rfind("\n") + 1]
        self.offset += len(text.encode())
        self.lines += [m.groupdict() for m in LINE.finditer(text)]

    def wait(self, predicate, what: str, timeout: float, since: int = 0) -> dict:
        """The first line from index `since` on that satisfies `predicate`."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            for line in self.lines[since:]:
                if predicate(line):
                    return line
            if time.monotonic() > deadline:
                raise TimeoutError(f"no operator line for {what} within {timeout} s")
            time.sleep(0.1)


def proc_usage(pid: int) -> tuple[float, int, int]:
    """(CPU seconds, RSS bytes, peak RSS bytes) of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return cpu, int(status["VmRSS"].split()[0]) * 1024, int(status["VmHWM"].split()[0]) * 1024


def members(cluster: Cluster, ns: str, job: str) -> list[str]:
    return planmap.read_plan(cluster.kubectl_json("get", "configmap", render.plan_name(job), "-n", ns)).nodes


def inject(cluster: Cluster, ns: str, pod: str, kind: str) -> None:
    if kind == "pod-deleted":
        cluster.kubectl("delete", "pod", pod, "-n", ns, "--wait=false")
        return
    if kind == "pod-failed":
        cluster.kubectl(
            "patch", "pod", pod, "-n", ns, "--subresource=status", "--type=merge", "-p", '{"status":{"phase":"Failed"}}'
        )
        return
    node = cluster.kubectl("get", "pod", pod, "-n", ns, "-o", "jsonpath={.spec.nodeName}").stdout.strip()
    cluster.kubectl("label", "node", node, f"{FAKE_NODE_LABEL}-")  # kwok would re-ready it
    status = (
        {"conditions": [{"type": "Ready", "status": "False", "reason": "Bench"}]}
        if kind == "node-not-ready"
        else {"allocatable": {"nvidia.com/gpu": "7"}}
    )
    cluster.kubectl("patch", "node", node, "--subresource=status", "-p", json.dumps({"status": status}))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run(args: argparse.Namespace, cluster: Cluster, workdir: Path) -> dict:
    rng = random.Random(args.seed)
    ns = cluster.namespace("bench")
    pool = "bench"
    total = args.nodes + args.small_jobs * args.small_nodes + args.spare
    began = time.monotonic()
    names = cluster.add_kwok_nodes(total, gpus=8, labels={POOL_LABEL: pool}, concurrency=64)
    print(f"registered {len(names)} kwok nodes in {time.monotonic() - began:.1f} s", flush=True)
    log_path = workdir / "operator.log"
    log_file = open(log_path, "w")
    metrics_port = free_port()
    operator = subprocess.Popen(
        [
            sys.executable,
            *(["-m", "cProfile", "-o", args.profile] if args.profile else []),
            "-m",
            "oobleck.cli",
            "operator",
            "-n",
            ns,
            "--kubeconfig",
            cluster.kubeconfig,
            "--metrics-port",
            str(metrics_port),
            "--liveness-port",
            str(free_port()),
            "--measure-timeout",
            "0",
        ],  # kwok pods run no runtime: plan with the synthetic estimate
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )
    follow = OperatorLog(log_path)
    try:
        jobs = {"big": (args.nodes, True)}
        jobs.update({f"small-{i}": (args.small_nodes, False) for i in range(args.small_jobs)})
        began = time.monotonic()
        for name, (nodes, big) in jobs.items():
            cluster.kubectl("apply", "-n", ns, "-f", "-", input=job_manifest(name, nodes, pool, big=big))
        pending = set(jobs)
        deadline = time.monotonic() + args.timeout
        while pending:
            try:
                line = follow.wait(lambda l: l["job"] in pending and l["gen"] == "0", "generation 0 of every job", 10)
            except TimeoutError:
                states = cluster.kubectl_json("get", "oobleckjobs", "-n", ns)["items"]
                failed = [j for j in states if j.get("status", {}).get("phase") == "Failed"]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"jobs not at generation 0: {[(j['metadata']['name'], j.get('status', {}).get('conditions')) for j in failed or states if j['metadata']['name'] in pending]}"
                    ) from None
                continue
            pending.discard(line["job"])
        startup_s = time.monotonic() - began
        print(
            f"all {len(jobs)} jobs at generation 0 in {startup_s:.1f} s (pods scheduled by kube-scheduler, run by kwok)",
            flush=True,
        )
        cpu0, _, _ = proc_usage(operator.pid)
        kinds = ["pod-deleted", "pod-failed", "node-not-ready", "gpu-allocatable"]
        results: list[dict] = []
        for round_ in range(args.rounds):
            kind = kinds[round_ % len(kinds)]
            count = args.simultaneous if round_ == args.rounds - 1 else 1
            big_members = members(cluster, ns, "big")
            victims = rng.sample(big_members, count)
            small_victims = (
                {f"small-{i}": rng.choice(members(cluster, ns, f"small-{i}")) for i in range(args.small_jobs)}
                if round_ == 0
                else {}
            )
            follow.poll()
            mark = len(follow.lines)
            if count > 1:  # one API client call after another, as fast as kubectl goes
                kind = "pod-deleted"
                cluster.kubectl("delete", "pod", *victims, "-n", ns, "--wait=false")
            else:
                inject(cluster, ns, victims[0], kind)
            for victim in small_victims.values():
                inject(cluster, ns, victim, "pod-deleted")
            line = follow.wait(
                lambda l: l["job"] == "big" and int(l["lost"]) > 0, f"round {round_} ({kind})", args.timeout, mark
            )
            results.append(
                {
                    "round": round_,
                    "kind": kind,
                    "lost": int(line["lost"]),
                    "latency_s": float(line["latency"] or "nan"),
                    "planner_s": float(line["planner"]),
                    "patched": int(line["patched"]),
                    "generation": int(line["gen"]),
                }
            )
            for job in small_victims:
                small = follow.wait(
                    lambda l, j=job: l["job"] == j and int(l["lost"]) > 0, f"{job} lost", args.timeout, mark
                )
                results.append(
                    {
                        "round": round_,
                        "kind": "small-pod-deleted",
                        "job": job,
                        "lost": 1,
                        "latency_s": float(small["latency"] or "nan"),
                        "planner_s": float(small["planner"]),
                        "patched": int(small["patched"]),
                        "generation": int(small["gen"]),
                    }
                )
            print(
                f"round {round_}: {kind} x{count}: generation {line['gen']}, failure-to-patch {line['latency']} s, "
                f"planner {line['planner']} s, {line['patched']} pods patched",
                flush=True,
            )
            # Let the replacement (if it can be scheduled) fold in before the next failure.
            time.sleep(args.pause)
        cpu1, rss, peak = proc_usage(operator.pid)
        big = [r["latency_s"] for r in results if r["kind"] != "small-pod-deleted"]
        small = [r["latency_s"] for r in results if r["kind"] == "small-pod-deleted"]
        summary = {
            "nodes": total,
            "big_job_nodes": args.nodes,
            "small_jobs": args.small_jobs,
            "startup_s": round(startup_s, 2),
            "big_p50_s": round(statistics.median(big), 4),
            "big_p99_s": round(percentile(big, 0.99), 4),
            "big_max_s": round(max(big), 4),
            "big_pods_patched_max": max(r["patched"] for r in results if r["kind"] != "small-pod-deleted"),
            "small_p50_s": round(statistics.median(small), 4) if small else None,
            "small_p99_s": round(percentile(small, 0.99), 4) if small else None,
            "operator_cpu_s_during_failures": round(cpu1 - cpu0, 2),
            "operator_cpu_s_total": round(cpu1, 2),
            "operator_rss_mib": round(rss / 2**20, 1),
            "operator_peak_rss_mib": round(peak / 2**20, 1),
            "rounds": results,
        }
        return summary
    finally:
        operator.send_signal(signal.SIGTERM)
        try:
            operator.wait(timeout=20)
        except subprocess.TimeoutExpired:
            operator.kill()
        log_file.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000, help="nodes of the big job")
    parser.add_argument("--small-jobs", type=int, default=20)
    parser.add_argument("--small-nodes", type=int, default=4)
    parser.add_argument("--spare", type=int, default=0, help="extra nodes for replacements")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--simultaneous", type=int, default=2, help="nodes lost at once in the last round (<= f = 2)")
    parser.add_argument("--pause", type=float, default=3.0, help="seconds between rounds")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kubeconfig", default=None, help="use this cluster (kwok must run) instead of starting one")
    parser.add_argument("--out", default=None, help="write the summary JSON here")
    parser.add_argument("--profile", default=None, help="run the operator under cProfile, writing the stats here")
    parser.add_argument("--quick", action="store_true", help="8 nodes, 1 small job of 4, 2 rounds (what the tests run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.nodes, args.small_jobs, args.rounds, args.simultaneous, args.pause = 8, 1, 2, 2, 0.5
        args.timeout = min(args.timeout, 180.0)
    # SIGTERM (e.g. from `timeout`) must still stop the control plane and the operator.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for name in ("nodes", "rounds", "small_nodes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1")
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"oobleck-bench-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    if args.kubeconfig:
        summary = run(args, Cluster.existing(args.kubeconfig, find_tools(), owner="bench"), workdir)
    else:
        with ControlPlane(find_tools()) as control_plane:
            cluster = Cluster.local(control_plane, owner="bench")
            try:
                summary = run(args, cluster, workdir)
            finally:
                cluster.close()
    rounds = summary.pop("rounds")
    print(json.dumps(summary, indent=2))
    print(f"operator log: {workdir / 'operator.log'}")
    if args.out:
        Path(args.out).write_text(json.dumps({**summary, "rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
