"""`python -m oobleck_dev demo` (`make demo`): the main job, for real, on an embedded default cluster.

It starts the local control plane (etcd, kube-apiserver, scheduler, controller-manager, CRDs), the
local node agent (N nodes whose pods run as processes of this machine) and the operator, applies the
example tiny-Llama job (a Hugging Face LlamaForCausalLM), and follows it the way a user would: phase, step, loss, throughput, plan
generation and pipelines. Midway it kills one worker's process (a node failure as the job sees it);
the job reconfigures in place and continues. It ends with a summary (steps, recovery seconds,
throughput before and after, how to scrape the metrics) and tears everything down.

With `--real-nodes` (root) the same story runs in containers: kubelet + containerd nodes
(oobleck_dev.realnodes) run the project image, the job is pinned to them with the image set, and the
worker's container is SIGKILLed through containerd.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from oobleck_dev.nodeconfig import MAX_NODES

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama-tiny.yaml"
NAMESPACE = "oobleck-demo"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="train the example job on a local cluster, kill a worker, show recovery"
    )
    parser.add_argument("--job", type=Path, default=EXAMPLE, help="OobleckJob manifest (default: %(default)s)")
    parser.add_argument("--nodes", type=int, default=4, help="local nodes to run the worker pods on")
    parser.add_argument(
        "--kill-at-step",
        type=int,
        default=None,
        help="kill a worker's process when the job reaches this step (default: a third of the steps)",
    )
    parser.add_argument("--no-kill", action="store_true", help="train without the failure")
    parser.add_argument(
        "--real-nodes",
        action="store_true",
        help="run the pods in containers of the project image on kubelet + containerd nodes (root; builds what it needs)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs here (default: a temporary folder)")
    parser.set_defaults(func=run)


@dataclass
class Observation:
    """One look at the job: what `kubectl get oj -o json` says, at a time."""

    at: float
    phase: str
    step: int
    generation: int | None
    pipelines: int | None
    nodes: int
    loss: float | None
    samples_per_second: float | None
    reason: str = ""


@dataclass
class Timeline:
    """What the demo saw, step by step: the raw material of the summary."""

    observations: list[Observation] = field(default_factory=list)
    step_times: dict[int, float] = field(default_factory=dict)
    kill_at: float | None = None
    kill_step: int | None = None
    killed_pod: str = ""

    def add(self, seen: Observation) -> None:
        self.observations.append(seen)
        self.step_times.setdefault(seen.step, seen.at)


def observe(job: dict) -> Observation:
    """The fields the demo shows, from an OobleckJob object (pure)."""
    status = job.get("status") or {}
    plan = status.get("plan") or {}
    progress = status.get("progress") or {}
    failed = [c for c in status.get("conditions") or [] if c.get("type") == "Failed" and c.get("status") == "True"]
    return Observation(
        at=time.monotonic(),
        phase=status.get("phase", "Pending"),
        step=int(progress.get("step") or 0),
        generation=plan.get("generation"),
        pipelines=plan.get("pipelines"),
        nodes=int(status.get("nodes") or 0),
        loss=progress.get("loss"),
        samples_per_second=progress.get("samplesPerSecond"),
        reason=failed[0].get("message", "") if failed else "",
    )


def steps_per_second(step_times: dict[int, float], first: int, last: int) -> float | None:
    """Steps per second between the first time the job was seen at step `first` and at `last` (pure)."""
    if first not in step_times or last not in step_times or last <= first:
        return None
    seconds = step_times[last] - step_times[first]
    return (last - first) / seconds if seconds > 0 else None


def summarize(timeline: Timeline, steps: int, batch: int) -> list[str]:
    """The closing summary's lines (pure): steps, generations, recovery, throughput before and after."""
    last = timeline.observations[-1] if timeline.observations else None
    lines = []
    if last is None:
        return ["no observation of the job"]
    lines.append(
        f"job {last.phase}: {last.step}/{steps} steps, plan generation {last.generation}, "
        f"{last.pipelines} pipelines on {last.nodes} nodes"
    )
    done = sorted(timeline.step_times)
    if timeline.kill_at is not None and timeline.kill_step is not None:
        after = [s for s in done if s > timeline.kill_step]
        regenerated = next(
            (o.at for o in timeline.observations if o.at >= timeline.kill_at and (o.generation or 0) > 0), None
        )
        lines.append(f"killed {timeline.killed_pod} at step {timeline.kill_step}")
        if regenerated is not None:
            lines.append(f"  new plan generation seen {regenerated - timeline.kill_at:.2f} s after the kill")
        if after:
            first_after = timeline.step_times[after[0]]
            lines.append(
                f"  training resumed (step {after[0]} completed) {first_after - timeline.kill_at:.2f} s after the kill"
            )
        started = next((s for s in done if s > 0), 0)  # from the first step: start-up is not throughput
        before = steps_per_second(timeline.step_times, started, timeline.kill_step)
        later = steps_per_second(timeline.step_times, after[0], after[-1]) if len(after) > 1 else None
        for name, rate in (("before the failure", before), ("after the failure", later)):
            if rate:
                lines.append(f"  throughput {name}: {rate:.2f} steps/s = {rate * batch:.0f} samples/s")
    else:
        started = next((s for s in done if s > 0), 0)
        rate = steps_per_second(timeline.step_times, started, done[-1]) if done else None
        if rate:
            lines.append(f"throughput: {rate:.2f} steps/s = {rate * batch:.0f} samples/s")
    return lines


def _worker_metrics_url(pod: dict) -> str | None:
    """Where a worker pod serves /metrics: its IP and the container port named `metrics`."""
    ip = (pod.get("status") or {}).get("podIP")
    for container in pod["spec"]["containers"]:
        for port in container.get("ports") or []:
            if port.get("name") == "metrics" and ip:
                return f"http://{ip}:{port['containerPort']}/metrics"
    return None


def _scrape(url: str) -> dict[str, float]:
    """Unlabelled-by-name samples of a Prometheus text page: metric name -> last value."""
    values: dict[str, float] = {}
    with urllib.request.urlopen(url, timeout=3) as response:
        for line in response.read().decode().splitlines():
            match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line)
            if match:
                try:
                    values[match.group(1)] = float(match.group(3))
                except ValueError:
                    pass
    return values


def run(args: argparse.Namespace) -> int:
    from oobleck_dev.controlplane import ControlPlane
    from oobleck_dev.operatorproc import OperatorProcess

    if not args.job.is_file():
        print(f"oobleck_dev demo: --job {args.job}: no such file", file=sys.stderr)
        return 2
    if args.nodes < 1:
        print(f"oobleck_dev demo: --nodes: must be >= 1, got {args.nodes}", file=sys.stderr)
        return 2
    if args.real_nodes and args.nodes > MAX_NODES:
        print(f"oobleck_dev demo: --nodes: at most {MAX_NODES} real nodes, got {args.nodes}", file=sys.stderr)
        return 2
    manifest = yaml.safe_load(args.job.read_text())
    name = manifest["metadata"]["name"]
    training = manifest["spec"]["training"]
    steps, batch = int(training["steps"]), int(training["globalBatchSize"])
    kill_at_step = (
        None if args.no_kill else (args.kill_at_step if args.kill_at_step is not None else max(1, steps // 3))
    )
    if kill_at_step is not None and not 0 < kill_at_step < steps:
        print(f"oobleck_dev demo: --kill-at-step: must be in 1..{steps - 1}, got {kill_at_step}", file=sys.stderr)
        return 2
    if args.real_nodes:
        from oobleck_dev import realnodes

        problem = realnodes.host_problem()
        if problem:
            print(f"oobleck_dev demo: --real-nodes: {problem}", file=sys.stderr)
            return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="oobleck-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    say = _Steps()
    say("starting the local control plane (etcd, kube-apiserver, scheduler, controller-manager)")
    advertise = realnodes.host_address() if args.real_nodes else None
    with ControlPlane(advertise_address=advertise) as cluster:
        say(f"control plane up in {cluster.started_in_s:.1f} s at {cluster.server}")
        start_nodes = _real_nodes if args.real_nodes else _local_nodes
        with start_nodes(cluster, args.nodes, workdir, say) as nodes:
            cluster.kubectl("create", "namespace", NAMESPACE)
            say("starting the operator")
            with OperatorProcess(cluster.kubeconfig, [NAMESPACE], workdir / "operator") as operator:
                say(f"kubectl apply -f {args.job}{nodes.adapted}")
                applied = cluster.kubectl(
                    "apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(nodes.adapt(manifest))
                )
                print(applied.stdout, end="")
                timeline = _follow(cluster, nodes.kill, name, steps, kill_at_step, args.timeout)
                say("kubectl get oj")
                print(cluster.kubectl("get", "oj", "-n", NAMESPACE).stdout, end="")
                say("summary")
                for line in summarize(timeline, steps, batch):
                    print(line)
                _print_metrics_help(cluster, name, operator)
                ok = bool(timeline.observations) and timeline.observations[-1].phase == "Succeeded"
                if not ok:
                    print(f"logs: {workdir}")
        say("stopping the nodes, the operator and the control plane")
    say("done: nothing left running")
    return 0 if ok else 1


@dataclass
class DemoNodes:
    """What the story needs of the nodes: how to fit the job to them, and how to kill a worker."""

    adapted: str  # what adapt() changes, as the demo says it
    adapt: Callable[[dict], dict]
    kill: Callable[[str], str]  # kills a worker pod's process, returns how (for the timeline)


@contextlib.contextmanager
def _local_nodes(cluster, count: int, workdir: Path, say: Callable[[str], None]) -> Iterator[DemoNodes]:
    from oobleck_dev.nodeagent import NodeAgent

    say(f"starting {count} local nodes (pods run as processes of this machine)")
    agent = NodeAgent(
        cluster.kubeconfig,
        nodes=count,
        gpus_per_node=1,
        cpu="4",
        memory="16Gi",
        name_prefix="demo-node-",
        workdir=workdir / "nodes",
    )

    def kill(pod: str) -> str:
        agent.kill_pod_process(NAMESPACE, pod)
        return f"killed the process of {pod} (SIGKILL)"

    with agent:
        yield DemoNodes("", lambda manifest: manifest, kill)


class VictimGone(RuntimeError):
    """The worker picked to be killed ended before the kill (its status lagged): the demo picks another."""


@contextlib.contextmanager
def _real_nodes(cluster, count: int, workdir: Path, say: Callable[[str], None]) -> Iterator[DemoNodes]:
    from oobleck_dev import realnodes

    say(f"starting {count} kubelet + containerd nodes (builds the image and imports it the first time: minutes)")
    nodes = realnodes.RealNodes(cluster, n=count)
    with nodes:
        say(f"real nodes up in {nodes.figures.get('up', 0):.1f} s, running {nodes.image}")

        def adapt(manifest: dict) -> dict:
            spec = {**manifest["spec"], "image": nodes.image}
            spec["pod"] = {**spec.get("pod", {}), "nodeSelector": dict(nodes.node_selector)}
            return {**manifest, "spec": spec}

        def kill(pod: str) -> str:
            status = _json(cluster, "get", "pod", pod, "-n", NAMESPACE)
            container = status["status"]["containerStatuses"][0]
            if "running" not in container.get("state", {}):
                raise VictimGone(f"{pod}'s container is not running")
            try:
                nodes.kill_container(status["spec"]["nodeName"], container["containerID"])
            except realnodes.RealNodesError as error:
                raise VictimGone(str(error)) from error
            return f"killed {pod}'s container through containerd (SIGKILL)"

        yield DemoNodes(" (spec.image: the project image; spec.pod.nodeSelector: the real nodes)", adapt, kill)


def _follow(
    cluster, kill: Callable[[str], str], name: str, steps: int, kill_at_step: int | None, timeout_s: float
) -> Timeline:
    """Print a line per change of the job until it ends; kill a worker at `kill_at_step`."""
    timeline = Timeline()
    deadline = time.monotonic() + timeout_s
    shown, last_step, last_line = None, -1, 0.0
    print(f"{'time':>7}  {'phase':<13} {'step':>9}  {'loss':>8}  {'samples/s':>9}  {'generation':>10}  pipelines")
    began = time.monotonic()
    while time.monotonic() < deadline:
        seen = observe(_json(cluster, "get", "oj", name, "-n", NAMESPACE))
        timeline.add(seen)
        # A line per change of phase or plan, else at most one a second.
        key = (seen.phase, seen.generation, seen.pipelines)
        if key != shown or (seen.step != last_step and seen.at - last_line >= 1.0):
            shown, last_step, last_line = key, seen.step, seen.at
            loss = f"{seen.loss:.4f}" if seen.loss is not None else "-"
            rate = f"{seen.samples_per_second:.0f}" if seen.samples_per_second is not None else "-"
            print(
                f"{seen.at - began:6.1f}s  {seen.phase:<13} {seen.step:>4}/{steps:<4}  {loss:>8}  {rate:>9}  "
                f"{seen.generation if seen.generation is not None else '-':>10}  "
                f"{seen.pipelines if seen.pipelines is not None else '-'}",
                flush=True,
            )
        if seen.phase in ("Succeeded", "Failed"):
            if seen.reason:
                print(f"reason: {seen.reason}")
            if kill_at_step is not None and timeline.kill_at is None:
                print(
                    f"no worker was killed: the job ended before its status showed step {kill_at_step} with a "
                    "worker still running (the status trails the workers by seconds on a busy host; give the "
                    "job more steps or an earlier --kill-at-step)"
                )
            return timeline
        if kill_at_step is not None and timeline.kill_at is None and seen.step >= kill_at_step:
            pod = _a_training_worker(cluster, name)
            try:
                how = kill(pod)
            except VictimGone as gone:
                print(f"{time.monotonic() - began:6.1f}s  ({gone}: picking a worker again)", flush=True)
                time.sleep(0.2)
                continue
            timeline.kill_at, timeline.kill_step, timeline.killed_pod = time.monotonic(), seen.step, pod
            print(f"{timeline.kill_at - began:6.1f}s  >>> {how}: a node failure as the job sees it", flush=True)
        time.sleep(0.2)
    print(f"timeout: the job did not finish within {timeout_s:.0f} s")
    return timeline


def _a_training_worker(cluster, job: str) -> str:
    from oobleck.api.resource import worker_selector

    return victim(_json(cluster, "get", "pods", "-n", NAMESPACE, "-l", worker_selector(job))["items"])


def victim(worker_pods: list[dict]) -> str:
    """The pod the demo kills: the second by index (worker-1 when the job's first pods all started) among those
    Running that have reported a step. A pod that failed to start was replaced under a new index."""
    from oobleck.api.contract import PROGRESS_ANNOTATION

    training = sorted(
        (int(pod["metadata"]["name"].rsplit("-", 1)[1]), pod["metadata"]["name"])
        for pod in worker_pods
        if pod.get("status", {}).get("phase") == "Running"
        and PROGRESS_ANNOTATION in (pod["metadata"].get("annotations") or {})
    )
    if not training:
        raise RuntimeError("no worker pod is Running with a reported step")
    return training[min(1, len(training) - 1)][1]


def _json(cluster, *args: str) -> dict:
    return json.loads(cluster.kubectl(*args, "-o", "json").stdout)


def _print_metrics_help(cluster, name: str, operator) -> None:
    print(f"operator metrics: curl -s http://127.0.0.1:{operator.metrics_port}/metrics | grep oobleck_operator_")
    try:
        interesting = ("oobleck_operator_pods_lost_total", "oobleck_operator_failure_to_patch_seconds_count")
        values = _scrape(f"http://127.0.0.1:{operator.metrics_port}/metrics")
        for metric in interesting:
            if metric in values:
                print(f"  {metric} {values[metric]:g}")
    except OSError:
        pass
    pods = _json(cluster, "get", "pods", "-n", NAMESPACE, "-l", f"oobleck.dev/job={name},oobleck.dev/role=worker")
    for pod in pods.get("items", []):
        url = _worker_metrics_url(pod)
        if url is None:
            continue
        print(f"worker metrics ({pod['metadata']['name']}): curl -s {url}")
        try:
            values = _scrape(url)
        except OSError:
            continue  # a finished worker no longer serves
        for metric in ("oobleck_worker_step", "oobleck_worker_plan_generation", "oobleck_worker_samples_per_second"):
            if metric in values:
                print(f"  {metric} {values[metric]:g}")
        break


class _Steps:
    def __init__(self) -> None:
        self.began = time.monotonic()

    def __call__(self, text: str) -> None:
        print(f"\n[demo {time.monotonic() - self.began:6.1f} s] {text}", flush=True)
