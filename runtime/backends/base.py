"""What every backend shares: assembling one elastic worker, and the order in which it finishes.

A backend decides where the coordinator is (an `elastic.store.Endpoint`), where plans come from (a
`PlanSource`) and where failures are reported (a `FailureReporter`); holdings, commits, heartbeats and
aborts go through the coordinator's store in every backend. `build_worker` wires the rest the same way
for the pod, `oobleck launch` and the benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from oobleck.api.addresses import worker_id
from oobleck.api.contract import ExitCode

WORKER_PRELOAD_BASE = (
    "torch",
    "torch.distributed",
    # A worker's first meta-device build (its layers' sizes) initialises weights through torch's Python meta
    # kernels, which import torch._dynamo (inductor, sympy, triton) on first use: 2.15 CPU-s per process.
    "torch._dynamo",
    "oobleck.runtime.elastic.worker",
    "oobleck.runtime.train.config",
)
"""What a worker of either backend imports before its first step: the start of each backend's preload for the
processes it forks (local/forkserver.py, pod/supervise.py)."""

if TYPE_CHECKING:
    from collections.abc import Callable

    from oobleck.runtime.elastic.health import FailureDetector
    from oobleck.runtime.elastic.loop import ElasticResult
    from oobleck.runtime.elastic.store import ControlStore, Endpoint, StoreTimeouts
    from oobleck.runtime.elastic.worker import Worker
    from oobleck.runtime.train.config import WorkerConfig


@dataclass
class ElasticWorker:
    """A worker and the control-plane handles `run_elastic` drives it with."""

    worker: Worker
    control: ControlStore
    detector: FailureDetector


def build_worker(
    config: WorkerConfig,
    node: str,
    gpu: int,
    endpoint: Endpoint,
    detector: FailureDetector,
    store_timeouts: StoreTimeouts,
    worker_class: type[Worker] | None = None,
    **worker_options: Any,
) -> ElasticWorker:
    """The worker of (`node`, `gpu`) on the main thread's store connection, with the store-decided step
    commit and the snapshot agent (its own connection, advertised on the address the store was reached at).
    `detector` is started by the caller (it carries the backend's reporter)."""
    import torch.distributed as dist

    from oobleck.runtime.elastic import keys
    from oobleck.runtime.elastic.commit import StepCommit
    from oobleck.runtime.elastic.store import ControlStore, connect_endpoint
    from oobleck.runtime.elastic.worker import Worker
    from oobleck.runtime.snapshot.agent import snapshotter_for

    me = worker_id(node, gpu)
    control = ControlStore(endpoint, store_timeouts)
    worker = (worker_class or Worker)(
        config,
        dist.PrefixStore(keys.epoch_prefix(control.epoch), control.store),
        node,
        gpu,
        failed=detector.failure,
        commit=StepCommit(control, detector.failure, worker=me),
        snapshots=snapshotter_for(
            config, me, lambda: connect_endpoint(endpoint, store_timeouts)[0], control.address[0]
        ),
        epoch=control.epoch,
        **worker_options,
    )
    return ElasticWorker(worker, control, detector)


def finish(
    worker: Worker,
    result: ElasticResult,
    report_final: Callable[[], None] | None = None,
    snapshot_wait_s: float = 30.0,
) -> None:
    """The one shutdown order of a worker that reached the job's last step: the Hugging Face export first
    (once the job is Succeeded the operator may delete running pods), then the final report, then the
    snapshot agent's last checkpoint files (completion must not wait on it; a push to a buddy that has
    finished already fails at once)."""
    if result.exit_code != ExitCode.DONE:
        return
    worker.final_export()
    if report_final is not None:
        report_final()
    if worker.snapshots is not None:
        worker.snapshots.wait_idle(snapshot_wait_s)
