"""The job's NetworkPolicy, enforced on a real node by a real network plugin (kube-router's firewall, built
from its Go module: oobleck_dev/kuberouter.py).

A job trains on the enforcing node (its coordinator and its worker); strangers, pods of the job's own
namespace that are not the job's, run on each node, and a scraper runs in the namespace the operator
admits to the metrics port. First without the plugin: the strangers reach every port the job's pods
listen on (the store, /metrics, the liveness responder, the snapshot server, gloo), so the probe is
able to see an open port. Then with it: every one of those connections is refused or times out, the
scraper reaches /metrics and nothing else, a stranger still reaches the scraper (its network works),
and the job's own pods open new connections to each other and go on training.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from oobleck.api.contract import PROGRESS_ANNOTATION, STORE_PORT, WORKER_PORT
from oobleck.api.resource import worker_selector
from oobleck_dev.operatorproc import OperatorProcess
from oobleck_dev.poll import wait_until
from tests.realnodes.marks import realnode_marks

pytestmark = realnode_marks(3600)
LEAVES_POLICY_ENFORCED = True
"""kube-router enforces on the shared node until the run's nodes go down: this module runs last (conftest)."""

JOB = "fenced"
EXAMPLE = Path(__file__).parents[2] / "examples" / "llama-tiny.yaml"
START_TIMEOUT_S = 600.0
"""Pods started from the node's own store, torch imported and the model profiled, on a loaded 2-core host."""
ENFORCED_TIMEOUT_S = 120.0
"""kube-router started, its caches synced and the job's policy written into iptables."""
CONNECT_TIMEOUT_S = 3.0
LISTENER_PORT = 8080
"""The scraper's own listener: what a stranger reaches to show that its network works."""

LISTENING = """
import json
ports = set()
for table in ('/proc/net/tcp', '/proc/net/tcp6'):
    for line in open(table).read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, port = local.split(':')
        # 127.0.0.0/8 (as IPv4, or IPv4-mapped in tcp6: its last 8 digits), or ::1.
        loopback = address[-2:] == '7F' and (len(address) == 8 or address[16:24] == 'FFFF0000') or (
            address == '00000000000000000000000001000000')
        if state == '0A' and not loopback:
            ports.add(int(port, 16))
print(json.dumps(sorted(ports)))
"""
"""Run in a pod: the TCP ports it listens on beyond loopback, IPv4 or IPv6 (the store listens on every address)."""

PROBE = """
import json, socket, sys, urllib.request
targets, timeout = json.loads(sys.argv[1]), float(sys.argv[2])
seen = {}
for host, port, path in targets:
    key = f'{host}:{port}{path}'
    try:
        if path:
            with urllib.request.urlopen(f'http://{host}:{port}{path}', timeout=timeout) as answer:
                seen[key] = f'http {answer.status}'
        else:
            with socket.create_connection((host, port), timeout=timeout):
                seen[key] = 'open'
    except ConnectionRefusedError:
        seen[key] = 'refused'
    except (socket.timeout, TimeoutError):
        seen[key] = 'timeout'
    except OSError as error:
        reason = getattr(error, 'reason', error)
        seen[key] = 'refused' if isinstance(reason, ConnectionRefusedError) else (
            'timeout' if isinstance(reason, (socket.timeout, TimeoutError)) else f'error {reason}')
print(json.dumps(seen))
"""
"""Run in a pod: for each (host, port, path) `open`, `http <status>` (a path: an HTTP GET), `refused`,
`timeout` or `error ...`."""

BLOCKED = ("refused", "timeout")


def wait_for(predicate: Callable[[], Any], what: str, timeout: float) -> Any:
    return wait_until(predicate, what, timeout, 1.0, tolerate=(Exception,))


def job_spec(image: str, node: str) -> dict[str, Any]:
    """examples/llama-tiny.yaml on one real node (its coordinator and one worker), with more steps than the
    test needs: it checks progress, not the end."""
    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    spec["image"] = image
    spec["nodes"] = {"min": 1, "max": 1}
    spec["f"] = 0
    spec["training"]["steps"] = 100_000
    spec["pod"] = {"nodeSelector": {"kubernetes.io/hostname": node}}
    spec["pendingTimeoutSeconds"] = 900
    return spec


def plain_pod(name: str, image: str, node: str, command: list[str], labels: dict[str, str]) -> dict[str, Any]:
    """A pod of the project image on `node`, as any user could run in the namespace."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65532},
            "containers": [{"name": "main", "image": image, "command": command}],
        },
    }


class Fence:
    """The cluster as the test sees it: the job's namespace, the scrapers' namespace, kubectl."""

    def __init__(self, cluster, nodes, namespace: str, scrape_namespace: str) -> None:
        self.cluster, self.nodes, self.ns, self.scrape_ns = cluster, nodes, namespace, scrape_namespace

    def pod(self, name: str, namespace: str | None = None) -> dict[str, Any]:
        return self.cluster.kubectl_json("get", "pod", name, "-n", namespace or self.ns)

    def running_ip(self, name: str, namespace: str | None = None) -> str:
        pod = self.pod(name, namespace)
        return pod["status"]["podIP"] if pod.get("status", {}).get("phase") == "Running" else ""

    def python(self, pod: str, namespace: str, container: str, script: str, *argv: str) -> Any:
        """Run `script` with `python -c` in a container of `pod`; its stdout's JSON."""
        result = self.cluster.kubectl(
            "exec", pod, "-n", namespace, "-c", container, "--", "python", "-c", script, *argv, timeout=120
        )
        return json.loads(result.stdout)

    def probe(self, pod: str, namespace: str, targets: list[tuple[str, int, str]]) -> dict[str, str]:
        return self.python(pod, namespace, "main", PROBE, json.dumps(targets), str(CONNECT_TIMEOUT_S))

    def worker(self) -> str:
        names = [
            p["metadata"]["name"]
            for p in self.cluster.kubectl_json("get", "pods", "-n", self.ns, "-l", worker_selector(JOB))["items"]
        ]
        assert len(names) == 1, names
        return names[0]

    def step(self) -> int:
        pod = self.pod(self.worker())
        report = (pod["metadata"].get("annotations") or {}).get(PROGRESS_ANNOTATION)
        return int(json.loads(report)["step"]) if report else -1

    def dump(self, operator: OperatorProcess) -> None:
        for namespace in (self.ns, self.scrape_ns):
            print(self.cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout)
        print(self.cluster.kubectl("get", "networkpolicy", "-n", self.ns, "-o", "yaml", check=False).stdout)
        for process in self.nodes.processes:
            if process.name == "kube-router":
                print(f"--- kube-router\n{process.log_tail(4000)}")
        print(f"--- operator\n{operator.log()[-3000:]}")


@pytest.fixture
def fence(real_cluster, tmp_path) -> Iterator[Fence]:
    cluster, nodes = real_cluster
    namespace = cluster.namespace("fenced")
    scrape_namespace = cluster.namespace("scrape")
    operator = OperatorProcess(
        cluster.kubeconfig,
        [namespace],
        tmp_path / "operator",
        "--resync",
        "2",
        "--metrics-scrape-namespace",
        scrape_namespace,
    ).start()
    state = Fence(cluster, nodes, namespace, scrape_namespace)
    try:
        yield state
    finally:
        state.dump(operator)
        cluster.kubectl("delete", "oobleckjob", JOB, "-n", namespace, "--ignore-not-found", "--wait=false", check=False)
        operator.kill()
        for ns in (namespace, scrape_namespace):
            cluster.kubectl(
                "delete", "pods", "--all", "-n", ns, "--grace-period=0", "--wait=true", check=False, timeout=120
            )


def test_the_jobs_network_policy_fences_its_pods_from_strangers(fence):
    f = fence
    enforcing, other = f.nodes.names[0], f.nodes.names[1]
    image = f.nodes.image
    manifest = {
        "apiVersion": "oobleck.dev/v1alpha1",
        "kind": "OobleckJob",
        "metadata": {"name": JOB},
        "spec": job_spec(image, enforcing),
    }
    f.cluster.kubectl("apply", "-n", f.ns, "-f", "-", input=yaml.safe_dump(manifest))
    sleep = ["python", "-c", "import time; time.sleep(86400)"]
    strangers = {"stranger-same-node": enforcing, "stranger-other-node": other}
    for name, node in strangers.items():
        f.cluster.kubectl(
            "apply", "-n", f.ns, "-f", "-", input=json.dumps(plain_pod(name, image, node, sleep, {"app": name}))
        )
    listener = ["python", "-m", "http.server", str(LISTENER_PORT), "--directory", "/tmp"]
    f.cluster.kubectl(
        "apply",
        "-n",
        f.scrape_ns,
        "-f",
        "-",
        input=json.dumps(plain_pod("scraper", image, other, listener, {"app": "scraper"})),
    )

    wait_for(lambda: f.step() >= 3, "the job's worker training", START_TIMEOUT_S)
    worker = f.worker()
    coordinator = f"{JOB}-coordinator"
    for name in [*strangers, "scraper"]:
        wait_for(
            lambda name=name: f.running_ip(name, f.scrape_ns if name == "scraper" else None),
            f"{name} Running",
            START_TIMEOUT_S,
        )
    scraper_ip = f.running_ip("scraper", f.scrape_ns)

    # Every port the job's pods listen on, as their own network namespaces list them.
    job_ports: list[tuple[str, int, str]] = []
    for pod, container in ((coordinator, "coordinator"), (worker, "worker")):
        ip = f.running_ip(pod)
        job_ports += [(ip, port, "") for port in f.python(pod, f.ns, container, LISTENING)]
    worker_ip, coordinator_ip = f.running_ip(worker), f.running_ip(coordinator)
    assert (coordinator_ip, STORE_PORT, "") in job_ports and (worker_ip, WORKER_PORT, "") in job_ports, job_ports
    # Beyond the store and /metrics: the liveness responder and the snapshot server (and gloo's listeners).
    assert len([p for p in job_ports if p[0] == worker_ip]) >= 3, job_ports
    control = (scraper_ip, LISTENER_PORT, "")
    metrics = (worker_ip, WORKER_PORT, "/metrics")
    store = (coordinator_ip, STORE_PORT, "")

    # Without a plugin nothing enforces the policy: the probe sees every port open.
    for stranger in strangers:
        seen = f.probe(stranger, f.ns, [*job_ports, control])
        assert set(seen.values()) == {"open"}, (stranger, seen)

    router = f.nodes.enforce_network_policy(enforcing)
    started = time.monotonic()

    def fenced(stranger: str) -> dict[str, str]:
        seen = f.probe(stranger, f.ns, job_ports)
        return seen if all(v in BLOCKED for v in seen.values()) else {}

    for stranger in strangers:
        seen = wait_for(lambda s=stranger: fenced(s), f"{stranger} fenced off the job's ports", ENFORCED_TIMEOUT_S)
        print(f"{stranger}: {seen} ({time.monotonic() - started:.1f} s after kube-router started)")
        # Its own network still works: it reaches a pod that no policy selects.
        assert f.probe(stranger, f.ns, [control]) == {f"{control[0]}:{control[1]}": "open"}

    # The scrapers' namespace reaches /metrics, and only the metrics ports.
    seen = f.probe("scraper", f.scrape_ns, [metrics, store])
    assert seen[f"{worker_ip}:{WORKER_PORT}/metrics"] == "http 200", seen
    assert seen[f"{coordinator_ip}:{STORE_PORT}"] in BLOCKED, seen

    # The job's own pods: a new connection from the worker to the store is admitted, and training goes on.
    admitted = f.python(worker, f.ns, "worker", PROBE, json.dumps([store]), str(CONNECT_TIMEOUT_S))
    assert admitted == {f"{coordinator_ip}:{STORE_PORT}": "open"}, admitted
    at_enforcement = f.step()
    wait_for(lambda: f.step() >= at_enforcement + 20, "20 more steps under the policy", 300)
    assert router.alive(), router.log_tail()
    print(f"trained from step {at_enforcement} to {f.step()} under the policy")
