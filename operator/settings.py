"""The operator's configuration: one typed object built from the command line, applied once at startup.

Nothing else reads environment variables or globals: `cli.py` builds `OperatorConfig`, passes it in
kopf's memo, and the startup hook calls `configure_kopf` with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import kopf

from oobleck.api.resource import GROUP, KIND
from oobleck.operator.planning import Tuning
from oobleck.operator.planpool import PlannerLimits

DEFAULT_IMAGE = "ghcr.io/oobleck-dev/oobleck:0.1.0"
# The elastic worker of a pod (runtime/backends/pod/main.py): reads the env contract of render.py and the plan ConfigMap.
DEFAULT_COMMAND = ("python", "-m", "oobleck.runtime.backends.pod")


@dataclass(frozen=True)
class OperatorConfig:
    """Everything the operator is told at startup. Every timeout is explicit and overridable."""

    namespaces: tuple[str, ...] = ()
    """Namespaces to serve; empty means all (cluster-wide watches of pods: costly on big clusters)."""
    kubeconfig: str | None = None
    """Kubeconfig path; None: in-cluster service account, else the default kubeconfig."""
    default_image: str = DEFAULT_IMAGE
    """Worker image when a job's spec has none."""
    default_command: tuple[str, ...] = DEFAULT_COMMAND
    """Worker command when a job's spec has none."""
    tuning: Tuning = field(default_factory=Tuning)
    """Planner inputs a spec does not carry (GPU memory, bandwidths, synthetic profile speeds)."""
    write_concurrency: int = 128
    """Concurrent API writes per job (pod patches fan out to every survivor at once)."""
    batch_window_s: float = 0.05
    """After the first event, wait this long for more before reconciling: f simultaneous losses
    become one plan generation. Counts against the failure-to-patch latency."""
    resync_s: float = 10.0
    """Reconcile each job at least this often (timeouts, e.g. pods pending too long, need no event)."""
    silent_node_grace_s: float = 30.0
    """How long a member's node may stay silent (Ready Unknown: its kubelet renewed no lease) before its worker
    counts as lost. After a control-plane outage the kubelets renew one by one, up to a renewal period (10 s)
    apart, and the node lifecycle controller can mark one Unknown after the others are back. A worker that
    really died is reported by its peers within a second whatever this is."""
    request_timeout_s: float = 15.0
    """Timeout of one API call (kopf's and ours)."""
    error_backoff_s: float = 1.0
    """Wait after a failed reconcile before the next try; it doubles with each failure in a row
    (an API server answering 5xx or 429), up to `max_error_backoff_s`."""
    max_error_backoff_s: float = 30.0
    planner: PlannerLimits = field(default_factory=PlannerLimits)
    """The planner processes and their per-call time and memory limits (operator/planpool.py)."""
    decide_threads: int = 32
    """Threads that run decide (so that a job waiting on a planner process never blocks the event loop)."""
    metrics_port: int = 9090
    """Prometheus metrics port (0: any free port, logged; -1: off)."""
    metrics_scrape_namespace: str | None = None
    """The namespace whose pods may scrape the workers' metrics ports (each job's NetworkPolicy admits
    nothing else from outside the job); None: only the job's own pods reach its pods."""
    liveness_port: int = 8080
    """Liveness probe port (http://0.0.0.0:PORT/healthz; -1: off)."""
    standalone: bool = True
    """No peering (one replica). False: kopf peering (leader election) under `peering_name`."""
    peering_name: str = "oobleck-operator"
    priority: int = 0
    """Peering priority: the highest runs, the others pause."""
    peering_lifetime_s: int = 15
    """How long a silent peer counts as alive (failover time after a crash)."""
    log_level: int = logging.INFO


class JobsOnlyDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's diff base, built for OobleckJobs only.

    kopf builds an object's "essence" (a deep copy) on every watch event of every watched kind, to
    detect changes for state-changing handlers. Pods and nodes have none here (indexes only), and
    at 1000 pods that copy was the operator's largest CPU cost: skip it for them.
    """

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        spec = body.get("spec") or {}
        if body.get("kind") not in (None, KIND) or "training" not in spec:
            return None
        return super().build(body=body, extra_fields=extra_fields)


def configure_kopf(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    """Apply `config` to kopf's settings (called once, from the startup hook)."""
    # Never change these on a live cluster: kopf would treat every object as new.
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = JobsOnlyDiffBaseStorage(prefix=GROUP, key="last-handled-configuration")
    # Indexes need unlimited workers (a limit can deadlock the initial indexing).
    settings.queueing.worker_limit = None
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 90
    settings.watching.connect_timeout = config.request_timeout_s
    settings.networking.request_timeout = config.request_timeout_s
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "oobleck-operator"
    settings.peering.name = config.peering_name
    settings.peering.priority = config.priority
    settings.peering.lifetime = config.peering_lifetime_s
    settings.peering.standalone = config.standalone
