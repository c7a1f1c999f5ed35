"""Worker metrics for Prometheus, all named `oobleck_worker_*`, on their own registry.

A private registry (not the process-global default) lets several workers live in one test process
and keeps the endpoint free of unrelated collectors.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

ITERATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)


class WorkerMetrics:
    """The worker's metrics; `serve(port)` exposes them over HTTP."""

    def __init__(self, job: str, node: str, gpu: int) -> None:
        self.registry = CollectorRegistry()
        labels = {"job": job, "node": node, "gpu": str(gpu)}
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"oobleck_worker_{name}", doc, names, registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"oobleck_worker_{name}", doc, names, registry=self.registry).labels(**labels)

        self.samples_per_second = gauge("samples_per_second", "Global samples per second of the last step")
        self.tokens_per_second = gauge("tokens_per_second", "Global tokens per second of the last step")
        self.iteration_seconds = Histogram(
            "oobleck_worker_iteration_seconds",
            "Seconds per global step",
            names,
            buckets=ITERATION_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.step = gauge("step", "Global steps completed")
        self.generation = gauge("plan_generation", "Plan generation being executed")
        self.pipelines = gauge("pipelines", "Pipelines in the current plan")
        self.rank = gauge("rank", "This worker's rank in the current plan")
        self.reconfigurations = counter("reconfigurations", "Plan generations adopted after the first")
        self.recovery_seconds = Histogram(
            "oobleck_worker_recovery_seconds",
            "Seconds from a failure to the first step completed after it",
            names,
            buckets=RECOVERY_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.bytes_copied = counter("bytes_copied", "Layer-state bytes sent and received by layer copies")
        self.loss = gauge("loss", "Global mean loss of the last step (ranks holding the last layer)")
        self.compute_seconds = gauge(
            "compute_seconds", "This rank's own forwards and backwards in the last step (no waits for peers)"
        )
        self.profile_ratio = gauge(
            "profile_ratio", "Compute time against the plan's profile, median of the last steps (1 = as profiled)"
        )
        self.slowdown = gauge(
            "slowdown", "Compute time against this rank's own calibrated pace on its stage (1 = as it started)"
        )
        self._rejected = Counter(
            "oobleck_worker_rejected_messages",
            "Messages refused for lacking a valid MAC under the job key (store values, snapshot pushes), by kind",
            [*names, "kind"],
            registry=self.registry,
        )
        self._labels = labels

    def count_rejected(self, kind: str) -> None:
        """One more refused message of `kind` (abort, held, holding, failure_report, commit_decision,
        snapshot_complete, liveness, snapshot_push)."""
        self._rejected.labels(**self._labels, kind=kind).inc()

    def observe_step(self, seconds: float, samples: int, tokens: int, step: int, loss: float | None) -> None:
        self.iteration_seconds.observe(seconds)
        if seconds > 0:
            self.samples_per_second.set(samples / seconds)
            self.tokens_per_second.set(tokens / seconds)
        self.step.set(step)
        if loss is not None:
            self.loss.set(loss)

    def observe_pace(self, compute_seconds: float, profile_ratio: float | None, slowdown: float | None) -> None:
        self.compute_seconds.set(compute_seconds)
        if profile_ratio is not None:
            self.profile_ratio.set(profile_ratio)
        if slowdown is not None:
            self.slowdown.set(slowdown)

    def serve(self, port: int, address: str = "0.0.0.0") -> int:
        """Start the HTTP endpoint in a daemon thread; returns the bound port (0 picks a free one)."""
        server, _ = start_http_server(port, addr=address, registry=self.registry)
        return server.server_port
