"""The operator's Prometheus metrics (prefix `oobleck_operator_`), in a registry of their own."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from oobleck.api.status import Phase

PREFIX = "oobleck_operator_"
# Failure-to-patch targets 1 s for 1000 nodes: resolve well below and above it.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


class Metrics:
    """All operator metrics; one instance per operator process."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.jobs = Gauge(f"{PREFIX}jobs", "OobleckJobs by phase", ["phase"], registry=r)
        self.reconcile_seconds = Histogram(
            f"{PREFIX}reconcile_duration_seconds",
            "One reconcile pass of a job (observe, plan, apply)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.planner_seconds = Histogram(
            f"{PREFIX}planner_seconds", "Planner time per new plan generation", buckets=LATENCY_BUCKETS, registry=r
        )
        self.failure_to_patch_seconds = Histogram(
            f"{PREFIX}failure_to_patch_seconds",
            "From the operator observing a failure to every survivor patched with the new generation",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.pods_created = Counter(f"{PREFIX}pods_created_total", "Worker and coordinator pods created", registry=r)
        self.pods_lost = Counter(
            f"{PREFIX}pods_lost_total", "Worker pods lost (dropped from a plan by a failure)", registry=r
        )
        self.plan_generations = Counter(f"{PREFIX}plan_generations_total", "Plan generations written", registry=r)
        self.api_errors = Counter(f"{PREFIX}api_errors_total", "Failed Kubernetes API calls", ["verb"], registry=r)
        self.node_slowdown = Gauge(
            f"{PREFIX}node_slowdown",
            "A member node's compute against its profile, over its peers' median: the nodes on its layers, else all the others (1 = keeping pace)",
            ["namespace", "job", "node"],
            registry=r,
        )
        self.spares = Gauge(
            f"{PREFIX}spares",
            "Warm spare worker pods ready to replace a lost node (status.spares)",
            ["namespace", "job"],
            registry=r,
        )
        self._slowdown_nodes: dict[tuple[str, str], set[str]] = {}
        for phase in Phase:
            self.jobs.labels(phase=phase.value).set(0)

    def set_slowdowns(self, namespace: str, job: str, slowdowns: dict[str, float]) -> None:
        """The job's per-node slowdowns; nodes no longer measured lose their series."""
        for node in self._slowdown_nodes.get((namespace, job), set()) - set(slowdowns):
            self.node_slowdown.remove(namespace, job, node)
        for node, slowdown in slowdowns.items():
            self.node_slowdown.labels(namespace=namespace, job=job, node=node).set(slowdown)
        self._slowdown_nodes[(namespace, job)] = set(slowdowns)

    def forget_job(self, namespace: str, job: str) -> None:
        """A job no longer served (deleted, or the operator handing it off): its per-job series go, so that a
        dashboard does not show a deleted job's spares or slow nodes forever."""
        self.set_slowdowns(namespace, job, {})
        self._slowdown_nodes.pop((namespace, job), None)
        try:
            self.spares.remove(namespace, job)
        except KeyError:  # never set: the job ended before its first reconcile
            pass

    def set_phases(self, phases: Iterable[str]) -> None:
        """Set the jobs-by-phase gauge from the phases of every job served."""
        counts = {phase.value: 0 for phase in Phase}
        for phase in phases:
            counts[phase] = counts.get(phase, 0) + 1
        for phase, count in counts.items():
            self.jobs.labels(phase=phase).set(count)

    def serve(self, port: int) -> int:
        """Serve /metrics on `port` (0: any free port); returns the port."""
        server, _ = start_http_server(port, registry=self.registry)
        return server.server_port
